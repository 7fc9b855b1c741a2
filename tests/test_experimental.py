"""The measuring programs of ``experimental/`` compile for their GPU: each runs only on an sm_90 GPU
(``bash experimental/<program>.sh``), so CI checks that its script builds it and links it against the CUDA
runtime. mainloop_primitives also needs the CUTLASS headers of nvidia-cutlass (``make test`` installs them); its
script finds them through this interpreter ($PYTHON)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CI has it)")
@pytest.mark.parametrize("program", ["staging_bandwidth", "mainloop_primitives"])
def test_program_builds(tmp_path, program):
    script = ROOT / "experimental" / f"{program}.sh"
    result = subprocess.run(["bash", str(script), "--build-only"], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "TMPDIR": str(tmp_path), "PYTHON": sys.executable})  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / program).stat().st_size > 0
