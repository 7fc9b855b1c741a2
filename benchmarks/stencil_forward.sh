#!/usr/bin/env bash
# Stencil forward prototype (cuda/bench/stencil_forward.cu: the query rows of short arcs on CUDA cores, key and
# value rows staged once per block in shared memory; benchmarks/NOTES.md, session 13). Pass --tiny for the small
# grids the host emulation runs.
# Usage (on a machine with an sm_90 GPU, from the repository root): bash benchmarks/stencil_forward.sh [--tiny]
set -euo pipefail
cd "$(dirname "$0")/.."
binary="${TMPDIR:-/tmp}/stencil_forward"
nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -I cuda -o "$binary" cuda/bench/stencil_forward.cu
"$binary" "$@"
