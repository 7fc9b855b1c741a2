"""The warp-specialised prototype (``cuda/bench/ws_attention.cu``: forward, dq, dk/dv) under the host
emulation of ``tests/cuda_emulation``: small grids that cross longitude 0, touch the poles, see whole
rings and have fewer longitudes than two chunks, each checked by the program itself against its
float64 reference (every result written; out within 1e-4, lse, dq, dk, dv within bf16 tolerance). The H200 runs its
large configurations (``bash benchmarks/ws_attention.sh``); this checks the kernels' logic anywhere."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from emulation_build import ROOT, build_emulated_program  # noqa: E402


def test_ws_prototype_matches_float64_under_emulation(tmp_path):
    program = build_emulated_program(tmp_path, ROOT / "cuda" / "bench" / "ws_attention.cu")
    result = subprocess.run([str(program), "--tiny"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("tiny_")]
    assert len(lines) == 3 and all(line.endswith(" ok") and "unwritten 0" in line for line in lines), result.stdout
