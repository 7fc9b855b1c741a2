#!/usr/bin/env bash
# L2 -> shared and HBM -> shared staging bandwidth by cp.async and by tensor-map boxes
# (cuda/bench/staging_bandwidth.cu; benchmarks/NOTES.md, session 7, has the H200's numbers).
# Usage (on a machine with an sm_90 GPU, from the repository root): bash benchmarks/staging_bandwidth.sh
set -euo pipefail
cd "$(dirname "$0")/.."
binary="${TMPDIR:-/tmp}/staging_bandwidth"
nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 -I cuda -o "$binary" cuda/bench/staging_bandwidth.cu
"$binary"
