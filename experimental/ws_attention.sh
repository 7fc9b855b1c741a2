#!/usr/bin/env bash
# Builds and runs the warp-specialised wgmma prototype (experimental/cuda/ws_attention.cu: forward, dq and dk/dv,
# self-attention, bf16, D 64), checked against float64 in every run. --once: single launches of the smallest
# configuration (for compute-sanitizer); --tiny: the small grids its emulated test runs; --build-only: compile
# into $TMPDIR (any machine with nvcc) and stop.
# Usage (on a machine with an sm_90a GPU, from the repository root): bash experimental/ws_attention.sh [--once]
set -euo pipefail
cd "$(dirname "$0")/.."
binary="${TMPDIR:-/tmp}/ws_attention"
nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I cuda -I experimental/cuda -o "$binary" \
  experimental/cuda/ws_attention.cu
[[ "${1:-}" == --build-only ]] || "$binary" "$@"
