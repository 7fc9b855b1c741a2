"""The measuring programs of ``experimental/`` compile for their GPU: each runs only on an sm_90 GPU
(``bash experimental/<program>.sh``), so CI checks that its script builds it and links it against the CUDA
runtime. mainloop_primitives also needs the CUTLASS headers of nvidia-cutlass (``make test`` installs them); its
script finds them through this interpreter ($PYTHON). tile_fixed_cost.py times the scheduled targets on
doctored schedules: its doctoring is checked here, on the host."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_s2attn
from jax_s2attn.ops import _ffi

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


def _tile_fixed_cost():
    """experimental/tile_fixed_cost.py as a module; it puts benchmarks/ on sys.path (for attention.py), which is
    restored after."""
    path = list(sys.path)
    try:
        spec = importlib.util.spec_from_file_location("tile_fixed_cost", ROOT / "experimental" / "tile_fixed_cost.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path
    return module


def test_tile_fixed_cost_walks_each_tiles_chunks_again():
    experiment = _tile_fixed_cost()
    plan = jax_s2attn.NeighborhoodPlan((17, 36), (17, 36), theta_cutoff=0.3)
    for walk in ("forward", "backward"):
        schedule = plan.block_schedule(walk)
        walked = experiment.repeated(schedule, 3)
        offsets, walked_offsets = schedule.tile_offsets, walked.tile_offsets
        assert len(walked_offsets) == len(offsets) and walked_offsets[-1] == 3 * offsets[-1]
        for tile in range(len(offsets) - 1):
            chunks = schedule.chunks[offsets[tile] : offsets[tile + 1]]
            assert (walked.chunks[walked_offsets[tile] : walked_offsets[tile + 1]] == np.tile(chunks, (3, 1))).all()
        assert (walked.records == schedule.records).all() and (walked.tiles == schedule.tiles).all()


@pytest.mark.skipif(not jax_s2attn.native_backends().get("cuda"), reason="needs the CUDA module (CI builds it)")
def test_tile_fixed_cost_lowers_the_walked_schedules():
    # The targets read the schedules when traced: each factor must lower to its own chunk table, and after the
    # context the plan's own schedule again.
    experiment = _tile_fixed_cost()
    plan = jax_s2attn.NeighborhoodPlan((17, 36), (17, 36), theta_cutoff=0.3)
    chunks = len(plan.block_schedule("forward").chunks)
    q = jnp.zeros((17, 36, 1, 64), jnp.bfloat16)
    forward = lambda q, k, v, p: _ffi.ffi_scheduled_forward(q, k, v, p, scale=0.125)

    def lowered_chunks() -> set[str]:
        text = jax.jit(forward).trace(q, q, q, plan).lower(lowering_platforms=("cuda",)).as_text()
        return set(re.findall(r"tensor<(\d+)x6xi32>", text))

    for factor in (2, 3):
        with experiment.chunks_walked(factor):
            assert lowered_chunks() == {str(factor * chunks)}, factor
        assert lowered_chunks() == {str(chunks)}, factor
