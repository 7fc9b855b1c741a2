#!/usr/bin/env bash
# On an H200 (or any sm_90 GPU) with jax, nvcc and the build tools installed and no network: builds the
# package against the local jax, then runs the GPU tests, the sanitizers and the benchmark.
# Usage (from the repository root): bash benchmarks/run_h200.sh [tests|sanitize|bench|profile|all] ...
# Logs and CSVs go to $OUT (default ./out). "profile" (not part of "all") writes ncu's reports and raw metrics
# (stall reasons included) of each scheduled kernel at tc 0.03, and of the scheduled and stencil kernels together at
# the default cutoff. TORCH_HARMONICS_SRC (an unpacked
# torch-harmonics 0.9.3 wheel or sdist) builds it in the background while the tests run, for the benchmark's
# torch-harmonics column (about 4 minutes) and, after the benchmark, the parity tests against it. BENCH_ARGS are passed to benchmarks/attention.py. GPU_TESTS (default:
# tests) picks the test files or node ids of "tests", so that the suite can run in parts; TEST_TIMEOUT bounds each
# part; the tests run in GPU_TEST_WORKERS pytest-xdist processes (default 6; 1 runs them in this process), which
# share the GPU without preallocating its memory. The CSVs' commit column reads JAX_S2ATTN_COMMIT when set: a
# copied tree's .git can be stale.
set -uo pipefail
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
steps="${*:-all}"
has() { [[ " $steps " == *" all "* || " $steps " == *" $1 "* ]]; }

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
  python3 -c "import jax, jaxlib, nanobind, scikit_build_core; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'nanobind', nanobind.__version__, 'skbuild', scikit_build_core.__version__)"
  nvcc --version | tail -2
} 2>&1 | tee "$OUT/versions.txt"

# Build in /tmp, not in the source tree's build/ (which may hold a build copied from another machine).
start=$(date +%s)
JAX_S2ATTN_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -q --no-build-isolation --no-deps --no-index \
  -Cbuild-dir=/tmp/s2attn-build . > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
(cd / && python3 -c "import jax, jax_s2attn; print(jax.devices()); print(jax_s2attn.native_status())")

th_build=""
if [[ -n "${TORCH_HARMONICS_SRC:-}" ]] && has bench; then
  nice -n 19 python3 benchmarks/build_torch_harmonics.py "$TORCH_HARMONICS_SRC" /tmp/thsite > "$OUT/th-build.log" 2>&1 &
  th_build=$!
fi
# Every step after the tests waits for that build: it takes every core.
wait_for_torch_harmonics() {
  [[ -n "$th_build" ]] || return 0
  wait "$th_build"
  local rc=$?
  echo "torch-harmonics build: exit $rc"; th_build=""
  status=$(( status | rc ))
  if [[ $rc -eq 0 ]]; then export PYTHONPATH="/tmp/thsite${PYTHONPATH:+:$PYTHONPATH}"; fi
}

status=0
if has tests; then
  workers=${GPU_TEST_WORKERS:-6}
  parallel=(); [[ $workers -gt 1 ]] && parallel=(-n "$workers")
  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 timeout ${TEST_TIMEOUT:-360} python3 -P -m pytest -q \
    -p no:cacheprovider "${parallel[@]}" -m gpu ${GPU_TESTS:-tests} -k "not handler_rejects" 2>&1 \
    | tee "$OUT/gpu-tests.log" | tail -25
  status=$(( status | ${PIPESTATUS[0]} ))
  # Handler error paths in their own process: a crash there must not hide the results above.
  timeout 90 python3 -P -m pytest -q -p no:cacheprovider -m gpu tests/test_nbhd_errors.py -k handler_rejects \
    > "$OUT/gpu-error-tests.log" 2>&1
  echo "GPU handler error tests: exit $?"; tail -3 "$OUT/gpu-error-tests.log"
fi
if has sanitize; then
  wait_for_torch_harmonics
  # Our kernels alone (no XLA in the process: XLA's own compilation crashes under the sanitizer).
  for tool in memcheck racecheck synccheck; do
    timeout ${SANITIZER_TIMEOUT:-240} compute-sanitizer --tool "$tool" --error-exitcode 9 python3 tests/gpu_kernel_sanitizer.py \
      > "$OUT/sanitizer-$tool.log" 2>&1
    rc=$?; echo "compute-sanitizer $tool: exit $rc"; tail -3 "$OUT/sanitizer-$tool.log"
    status=$(( status | rc ))
  done
fi
if [[ " $steps " == *" profile "* ]]; then
  wait_for_torch_harmonics
  # --clock-control none: ncu leaves the GPU's clock settings as they are. One kernel per ncu call (its replay of
  # a 2 ms kernel takes a minute or more), each report exported whole, then its raw metrics (stall reasons
  # included) as CSV. profile_kernels.py runs a forward, then a forward+backward. Kernels are picked by their
  # demangled names: a scheduled kernel by its kind (ScheduledAttention<T, (...::Kind)k, (int)D>: k 0 forward,
  # 1 dq, 2 dk/dv, whatever order XLA launches dq and dk/dv in; the forward's launch 1 is the differentiated one)
  # at tc 0.03; at the default cutoff, where the stencil kernels (Stencil{Fwd,Dq,Dkv}Kernel) take the rows of short
  # arcs beside them, both families' forward, dq and dk/dv of the forward+backward in one report (launches 2 to 7:
  # the undifferentiated forward launches one kernel of each).
  sections=(--section LaunchStats --section Occupancy --section SchedulerStats --section WarpStateStats
            --section InstructionStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis
            --section SourceCounters)
  tc003="--theta-cutoff 0.03 --implementation ffi"
  for spec in "sched-fwd:ScheduledAttention<[^,]+, [^,]*Kind\)0,:1:1:$tc003" \
              "sched-dq:ScheduledAttention<[^,]+, [^,]*Kind\)1,:0:1:$tc003" \
              "sched-dkv:ScheduledAttention<[^,]+, [^,]*Kind\)2,:0:1:$tc003" \
              "sched-stencil-default:ScheduledAttention|Stencil:2:6:--implementation ffi"; do
    IFS=: read -r name regex skip count arguments <<< "$spec"
    report="$OUT/ncu-$name"
    timeout ${PROFILE_TIMEOUT:-400} ncu --clock-control none --kernel-name-base demangled -k "regex:$regex" \
      --launch-skip "$skip" --launch-count "$count" "${sections[@]}" --export "$report" --force-overwrite \
      python3 -P benchmarks/profile_kernels.py --grid 721 1440 $arguments \
      > "$report.log" 2>&1 && ncu --import "$report.ncu-rep" --page raw --csv > "$report.csv"
    rc=$?; echo "ncu $name: exit $rc"
    status=$(( status | rc ))
  done
fi
if has bench; then
  wait_for_torch_harmonics
  PYTHONUNBUFFERED=1 timeout ${BENCH_TIMEOUT:-3000} python3 benchmarks/attention.py ${BENCH_ARGS:-} --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -40
fi
# The torch-harmonics parity tests, which the suite above skipped while torch-harmonics was still building.
if has tests && [[ -n "${TORCH_HARMONICS_SRC:-}" ]] && has bench; then
  timeout 300 python3 -P -m pytest -q -p no:cacheprovider tests/test_torch_parity.py > "$OUT/torch-parity.log" 2>&1
  rc=$?; echo "torch-harmonics parity tests: exit $rc"; tail -3 "$OUT/torch-parity.log"
  status=$(( status | rc ))
fi
exit "$status"
