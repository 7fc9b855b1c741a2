#!/usr/bin/env bash
# Builds the schedule-driven prototype (experimental/cuda/scheduled_attention.cu: forward and dq) and runs its checked,
# timed configurations (experimental/scheduled_attention.py, which builds the plans and their schedules).
# Arguments are passed to the Python driver (e.g. --configs qdeg_tc003 --baseline); --build-only: compile into
# $TMPDIR (any machine with nvcc) and stop. NVCC_FLAGS adds defines (e.g. -DSF_MIN_BLOCKS=3 -DSF_STAGES=6).
# Usage (on a machine with an sm_90a GPU, from the repository root): bash experimental/scheduled_attention.sh [...]
set -euo pipefail
cd "$(dirname "$0")/.."
binary="${TMPDIR:-/tmp}/scheduled_attention"
nvcc -O3 -std=c++17 ${NVCC_FLAGS:-} -gencode=arch=compute_90a,code=sm_90a -I cuda -I experimental/cuda -o "$binary" \
  experimental/cuda/scheduled_attention.cu
[[ "${1:-}" == --build-only ]] || python experimental/scheduled_attention.py --binary "$binary" "$@"
