#!/usr/bin/env bash
# Builds and runs the staging-bandwidth microbenchmark (experimental/cuda/staging_bandwidth.cu): L2 -> shared and
# HBM -> shared by cp.async and by tensor-map boxes.
# --build-only: compile into $TMPDIR (any machine with nvcc) and stop.
# Usage (on a machine with an sm_90 GPU, from the repository root): bash experimental/staging_bandwidth.sh
set -euo pipefail
cd "$(dirname "$0")/.."
binary="${TMPDIR:-/tmp}/staging_bandwidth"
nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -I cuda -o "$binary" \
  experimental/cuda/staging_bandwidth.cu
[[ "${1:-}" == --build-only ]] || "$binary"
