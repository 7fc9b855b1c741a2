"""The prototypes of ``experimental/`` build for their GPU and, under the host emulation of
``tests/cuda_emulation``, compute what their own float64 reference says.

``ws_attention`` (warp-specialised forward, dq, dk/dv) runs its ``--tiny`` grids, which cross longitude 0,
touch the poles, see whole rings and have fewer longitudes than two chunks; the program checks out within
1e-4 and lse, dq, dk, dv within bf16 tolerance, and that every result was written. ``scheduled_attention``
(forward, dq and dk/dv driven by the plan's block schedules) runs the small grids of its driver
(``experimental/scheduled_attention.py --configs tiny``: whole rings, windows across longitude 0, a longitude
count that is not a multiple of the tile, downsampling by 3 and by 128, upsampling by 2), checked against
float64 by the driver, in the default build, with 64-column chunks and with two stages. On an H200 the same
programs run their large configurations (``bash experimental/<program>.sh``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from emulation_build import ROOT, build_emulated_program  # noqa: E402

SOURCES = ROOT / "experimental" / "cuda"


@pytest.mark.slow
def test_ws_attention_matches_float64_under_emulation(tmp_path):
    binary = build_emulated_program(tmp_path, SOURCES / "ws_attention.cu")
    result = subprocess.run([str(binary), "--tiny"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("tiny_")]
    passed = [line for line in lines if line.endswith(" ok") and "unwritten 0" in line]
    assert len(lines) == len(passed) == 3, result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("chunk_cols, defines", [(32, []), (64, ["SF_CHUNK=64"]), (32, ["SF_STAGES=2"])])
def test_scheduled_attention_matches_float64_under_emulation(tmp_path, chunk_cols, defines):
    binary = build_emulated_program(tmp_path, SOURCES / "scheduled_attention.cu", defines)
    driver = ROOT / "experimental" / "scheduled_attention.py"
    command = [sys.executable, str(driver), "--binary", str(binary), "--chunk-cols", str(chunk_cols), "--configs",
               "tiny", "--reps", "0"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("tiny_")]
    passed = [line for line in lines if line.endswith(" ok") and "unwritten 0" in line]
    assert len(lines) == len(passed) == 6, result.stdout


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CI has it)")
@pytest.mark.parametrize("program", ["staging_bandwidth", "ws_attention", "scheduled_attention"])
def test_program_builds(tmp_path, program):
    # Each runs only on an sm_90 GPU; its script must at least compile it for its target and link it against the
    # CUDA runtime.
    script = ROOT / "experimental" / f"{program}.sh"
    result = subprocess.run(["bash", str(script), "--build-only"], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "TMPDIR": str(tmp_path)})  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / program).stat().st_size > 0
