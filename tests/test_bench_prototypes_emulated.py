"""The standalone prototypes of ``cuda/bench`` under the host emulation of ``tests/cuda_emulation``, each on
its ``--tiny`` grids and checked by the program itself against its float64 reference (every result
written). The H200 runs their large configurations (``bash benchmarks/<program>.sh``); this checks the
kernels' logic anywhere.

* ``ws_attention`` (warp-specialised forward, dq, dk/dv): grids that cross longitude 0, touch the poles,
  see whole rings and have fewer longitudes than two chunks; out within 1e-4, lse, dq, dk, dv within bf16
  tolerance.
* ``stencil_attention`` (forward, dq, dk/dv of the rows of short arcs on CUDA cores): a longitude tail (nlon
  not a multiple of the block's 32), arcs crossing longitude 0, blocks of four other rows, key rows seen by
  query rows outside the processed ones; out and lse within 1e-4, the bf16 dq, dk, dv within one rounding.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from emulation_build import ROOT, build_emulated_program  # noqa: E402


@pytest.mark.parametrize(("program", "configs"), [("ws_attention", 3), ("stencil_attention", 2)])
def test_prototype_matches_float64_under_emulation(tmp_path, program, configs):
    binary = build_emulated_program(tmp_path, ROOT / "cuda" / "bench" / f"{program}.cu")
    result = subprocess.run([str(binary), "--tiny"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("tiny_")]
    passed = [line for line in lines if line.endswith(" ok") and "unwritten 0" in line]
    assert len(lines) == len(passed) == configs, result.stdout
