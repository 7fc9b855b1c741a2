#!/usr/bin/env bash
# A/B comparison of two or more source trees of jax_s2attn on one GPU machine, in one call: builds each against
# the local jax into its own site directory, then runs this tree's benchmarks/attention.py (the same measuring
# code for all) on each build in turn, ROUNDS times (A B C A B C ...), and prints per config and column the
# median of each build's rounds and its ratio to A's. A difference smaller than the spread of one build's rounds
# is noise.
#
# Usage (from the repository root):
#   bash benchmarks/compare_builds.sh --export REV DIR   # on a machine with the git history: REV's tree into DIR
#   bash benchmarks/compare_builds.sh DIR_A DIR_B [DIR_C ...] [attention.py arguments]
# e.g. DIR_A the tree before an optimisation, DIR_B after it, DIR_C a variant of it (export them into an ignored
# folder and carry it to a GPU machine without git history); the leading arguments that are directories are the
# trees. ROUNDS (default 2) sets the alternation; CSVs and logs go to $OUT/ab
# (default ./out/ab, emptied first); JAX_S2ATTN_CUDA=OFF builds the CPU module only; PYTHON names the interpreter (default python3).
set -euo pipefail

if [[ "${1:-}" == "--export" ]]; then
  [[ $# -eq 3 ]] || { echo "usage: $0 --export REV DIR" >&2; exit 2; }
  mkdir -p "$3" && git archive "$2" | tar -x -C "$3"
  echo "$2 -> $3"
  exit 0
fi
trees=()
while [[ $# -gt 0 && -d "$1" ]]; do trees+=("$(cd "$1" && pwd)"); shift; done
[[ ${#trees[@]} -ge 2 && ${#trees[@]} -le 26 ]] \
  || { echo "usage: $0 DIR_A DIR_B [DIR_C ...] [attention.py arguments]" >&2; exit 2; }
letters=({A..Z})
names=("${letters[@]:0:${#trees[@]}}")
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-$PWD/out}/ab"
work="${TMPDIR:-/tmp}/s2attn-ab"
python="${PYTHON:-python3}"
rm -rf "$out"  # the medians must be this call's rounds alone
mkdir -p "$out" "$work"

for i in "${!trees[@]}"; do
  name=${names[$i]} src=${trees[$i]}
  start=$(date +%s)
  JAX_S2ATTN_CUDA="${JAX_S2ATTN_CUDA:-ON}" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$python" -m pip install -q --no-build-isolation --no-deps \
    --no-index --upgrade --target "$work/site-$name" -Cbuild-dir="$work/build-$name" "$src" > "$out/build-$name.log" 2>&1 \
    || { tail -30 "$out/build-$name.log"; exit 1; }
  echo "build $name ($src): $(( $(date +%s) - start )) s"
done

for round in $(seq "${ROUNDS:-2}"); do
  for name in "${names[@]}"; do
    mkdir -p "$out/$name-$round"
    PYTHONPATH="$work/site-$name${PYTHONPATH:+:$PYTHONPATH}" "$python" -P "$here/attention.py" "$@" --out "$out/$name-$round" \
      > "$out/$name-$round.log" 2>&1 || { tail -30 "$out/$name-$round.log"; exit 1; }
    echo "round $round, build $name: done"
  done
done

"$python" - "$out" "${names[@]}" <<'PY'
import csv, pathlib, statistics, sys

def number(text):
    try:
        return float(text)
    except (TypeError, ValueError):  # empty, or "absent" (torch-harmonics not importable)
        return None


out, names = pathlib.Path(sys.argv[1]), sys.argv[2:]
runs = {name: [row for path in sorted(out.glob(f"{name}-*/attention-*.csv")) for row in csv.DictReader(open(path))]
        for name in names}
if not all(runs.values()):
    sys.exit(f"no results in {out}: see the round logs there")
columns = [c for c in runs["A"][0] if c.endswith("_ms") and not c.startswith(("floor", "reference"))]
print(f"{'config':24} {'dtype':9} {'column':36}" + "".join(f" {n + ' ms':>9}" for n in names)
      + "".join(f" {n + '/A':>6}" for n in names[1:]))
for config, dtype in dict.fromkeys((r["config"], r["dtype"]) for r in runs["A"]):
    for column in columns:
        values = {name: [number(r.get(column)) for r in rows if (r["config"], r["dtype"]) == (config, dtype)]
                  for name, rows in runs.items()}
        values = {name: [v for v in vs if v is not None] for name, vs in values.items()}
        if all(values.values()):
            medians = [statistics.median(values[n]) for n in names]
            print(f"{config:24} {dtype:9} {column:36}" + "".join(f" {m:9.4f}" for m in medians)
                  + "".join(f" {m / medians[0]:6.3f}" for m in medians[1:]))
PY
