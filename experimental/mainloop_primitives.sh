#!/usr/bin/env bash
# Builds and runs the main-loop primitives comparison (experimental/cuda/mainloop_primitives.cu): the same streaming
# attention main loop on the project's own PTX wrappers (mainloop_own.cu) and on CuTe/CUTLASS (mainloop_cute.cu),
# checked against a host reference and against each other, then timed alternately.
# Each version is a translation unit of its own; the build prints how long each took and ptxas's registers and spills.
# The CUTLASS headers come from $CUTLASS_INCLUDE, else from the cutlass_library Python package (nvidia-cutlass, which
# `make test` installs) of $PYTHON, python3 or .venv/bin/python.
# --build-only: compile into $TMPDIR (default /tmp; any machine with nvcc) and stop; other arguments go to the program
# (--waves, --chunks, --total-chunks, --stride, --warmup, --reps, --check-blocks).
# Usage (on a machine with an sm_90 GPU, from the repository root): bash experimental/mainloop_primitives.sh
set -euo pipefail
cd "$(dirname "$0")/.."

cutlass_include="${CUTLASS_INCLUDE:-}"
if [[ -z "$cutlass_include" ]]; then
  for python in "${PYTHON:-}" python3 .venv/bin/python; do
    [[ -n "$python" ]] && command -v "$python" >/dev/null 2>&1 || continue
    # find_spec locates the package without importing it (its Python modules are not needed).
    if found="$("$python" -c 'import importlib.util, os
spec = importlib.util.find_spec("cutlass_library")
print(os.path.join(spec.submodule_search_locations[0], "source", "include"))' 2>/dev/null)"; then
      cutlass_include="$found"
      break
    fi
  done
fi
if [[ ! -f "$cutlass_include/cute/tensor.hpp" || ! -f "$cutlass_include/cutlass/pipeline/sm90_pipeline.hpp" ]]; then
  echo "mainloop_primitives: no CUTLASS headers found${cutlass_include:+ in $cutlass_include}: set CUTLASS_INCLUDE" \
    "to a CUTLASS include directory (the one holding cute/ and cutlass/), or pip install nvidia-cutlass (make" \
    "test installs it)" >&2
  exit 1
fi

# Seconds since `start` (date +%s%N), to a tenth.
seconds_since() {
  local ms=$((($(date +%s%N) - $1) / 1000000))
  printf '%d.%d s' $((ms / 1000)) $((ms % 1000 / 100))
}

out="${TMPDIR:-/tmp}"
binary="$out/mainloop_primitives"
# NDEBUG: CUTLASS's pipeline checks its roles with a branch and brkpt per call unless it is defined (release builds).
flags=(-O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I cuda -I "$cutlass_include" --expt-relaxed-constexpr
  -DNDEBUG)
for version in own cute; do
  start=$(date +%s%N)
  nvcc "${flags[@]}" -Xptxas -v -c "experimental/cuda/mainloop_$version.cu" \
    -o "$out/mainloop_primitives_$version.o" 2>"$out/mainloop_primitives_$version.log" ||
    { cat "$out/mainloop_primitives_$version.log" >&2; exit 1; }
  # ptxas's report (registers, spills) and anything else the compiler said (warnings); the kernel's mangled name
  # is left out.
  grep -v -e "Compiling entry function" -e "Function properties for" "$out/mainloop_primitives_$version.log" |
    sed "s/^/  /" || true
  echo "mainloop_primitives: $version compiled in $(seconds_since "$start")"
done
start=$(date +%s%N)
nvcc "${flags[@]}" -o "$binary" experimental/cuda/mainloop_primitives.cu "$out/mainloop_primitives_own.o" \
  "$out/mainloop_primitives_cute.o"
echo "mainloop_primitives: driver compiled and linked in $(seconds_since "$start")"
[[ "${1:-}" == --build-only ]] || "$binary" "$@"
