#!/usr/bin/env bash
# Warp-specialised forward, dq and dk/dv prototype (cuda/bench/ws_attention.cu: tensor-map producer warp, wgmma
# consumer warpgroups; benchmarks/NOTES.md, sessions 9 and 10, has the H200's numbers). Pass --once for single
# launches of the smallest config (for compute-sanitizer).
# Usage (on a machine with an sm_90a GPU, from the repository root): bash benchmarks/ws_attention.sh [--once]
set -euo pipefail
cd "$(dirname "$0")/.."
binary="${TMPDIR:-/tmp}/ws_attention"
nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I cuda -o "$binary" cuda/bench/ws_attention.cu
"$binary" "$@"
