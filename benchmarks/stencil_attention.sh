#!/usr/bin/env bash
# Stencil prototype (cuda/bench/stencil_attention.cu: forward, dq and dk/dv of the rows of short arcs on CUDA cores,
# the other grid's rows staged once per block in shared memory; benchmarks/NOTES.md, session 13). Pass --tiny for
# the small grids the host emulation runs.
# Usage (on a machine with an sm_90 GPU, from the repository root): bash benchmarks/stencil_attention.sh [--tiny]
set -euo pipefail
cd "$(dirname "$0")/.."
binary="${TMPDIR:-/tmp}/stencil_attention"
nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -I cuda -o "$binary" cuda/bench/stencil_attention.cu
"$binary" "$@"
