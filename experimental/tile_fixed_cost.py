"""What a tile of the scheduled kernels costs once, apart from its chunks.

A block of the scheduled kernels owns one tile: it enters, sets up its barriers, stages its own points (q; q and
dout for dk/dv), waits for its first chunk, walks its chunks and writes its results. Per target this times the
custom call (``benchmarks/attention.py``'s targets alone: the forward as differentiated, the dq that forms
delta, dk/dv) on the plan's schedules as they are and with every tile's chunks walked two and three times in a row
(the same chunks again: the results are wrong, the arithmetic per chunk is the same, and the walked-again chunks'
K and V come from the L2), and fits ``t = intercept + slope *
factor``. ``slope / chunks`` is what a chunk costs, ``intercept / tiles`` what a tile costs once (with the
launch's few microseconds), and their ratio the tile's cost in chunks' time: what blocks that walk several tiles,
overlapping one tile's fixed cost with another's chunks, could hide (docs/performance.md, "What the next rounds are
expected to move").

Usage (on an sm_90 GPU with the CUDA build, from the repository root):
``python -P experimental/tile_fixed_cost.py [--grid NLAT NLON ...] [--theta-cutoff 0.03] [--reps 15]``.
Configs with stencil rows are refused (their schedules leave rows to the stencil kernels, whose time would
count in the intercept).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

import jax_s2attn
from jax_s2attn.ops import _ffi
from jax_s2attn.ops.neighborhood import uses_stencil_rows
from jax_s2attn.schedule import BlockSchedule

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from attention import scheduled_target_runs  # noqa: E402

FACTORS = (1, 2, 3)
HEAD_DIM = 64
TARGETS = {"forward": "forward", "dq_delta": "forward", "dkv": "backward"}  # target: the walk whose schedule it takes


def repeated(schedule: BlockSchedule, factor: int) -> BlockSchedule:
    """``schedule`` with every tile's chunks walked ``factor`` times in a row. Chunks name their staging, whose
    records stay as they are."""
    offsets = schedule.tile_offsets.astype(np.int64)
    counts = np.diff(offsets)
    # Chunk i of a tile with n chunks at `first` appears at positions first * factor + r * n + i, r < factor.
    index = np.concatenate([np.tile(np.arange(offsets[t], offsets[t + 1]), factor) for t in range(len(counts))])
    tile_offsets = np.concatenate([[0], np.cumsum(counts * factor)]).astype(np.int32)
    return schedule._replace(chunks=schedule.chunks[index], tile_offsets=tile_offsets)


@contextlib.contextmanager
def chunks_walked(factor: int) -> Iterator[None]:
    """Plans' block schedules with every tile's chunks walked ``factor`` times, for the ops traced inside (jax's
    caches cleared at both ends: the schedules are read when the targets are traced)."""
    original = jax_s2attn.NeighborhoodPlan.block_schedule

    def block_schedule(plan, walk, **shape):
        return repeated(original(plan, walk, **shape), factor)

    try:
        jax_s2attn.NeighborhoodPlan.block_schedule = block_schedule
        jax.clear_caches()
        yield
    finally:
        jax_s2attn.NeighborhoodPlan.block_schedule = original
        jax.clear_caches()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", type=int, nargs=2, action="append", metavar=("NLAT", "NLON"),
                        help="a grid (self-attention); repeat for several (default: 360 720 and 721 1440)")
    parser.add_argument("--theta-cutoff", type=float, default=0.03)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    grids = args.grid or [(360, 720), (721, 1440)]
    if jax.default_backend() != "gpu":
        parser.error(f"needs a CUDA GPU; jax's default backend is {jax.default_backend()}")
    reason = _ffi.scheduled_unavailable_reason("cuda", "bfloat16", HEAD_DIM, HEAD_DIM)
    if reason is not None:
        parser.error(f"needs a GPU the scheduled kernels run on: {reason}")

    print(f"{'grid':>10} {'target':>9} {'tiles':>7} {'chunks':>8} " + " ".join(f"{f'x{f} ms':>9}" for f in FACTORS)
          + f" {'ns/chunk':>9} {'ns/tile':>8} {'tile/chunk':>10} {'resid ms':>9}")  # fmt: skip
    rng = np.random.default_rng(0)
    for nlat, nlon in grids:
        plan = jax_s2attn.NeighborhoodPlan((nlat, nlon), (nlat, nlon), theta_cutoff=args.theta_cutoff)
        shape = (nlat, nlon, 1, HEAD_DIM)
        input_sets = [tuple(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(4)) for _ in range(2)]
        if any(uses_stencil_rows(plan, input_sets[0][0], "scheduled", walk) for walk in ("forward", "backward")):
            parser.error(f"{nlat}x{nlon} at theta_cutoff {args.theta_cutoff} runs stencil rows: take a wider cutoff")
        times = {}
        for factor in FACTORS:
            with chunks_walked(factor):
                times[factor] = scheduled_target_runs(plan, args.reps, input_sets)
        for target, walk in TARGETS.items():
            tile_rows, tile_cols, chunk_cols = _ffi.kernel_limits().scheduled_shape
            schedule = plan.block_schedule(walk, tile_rows=tile_rows, tile_cols=tile_cols, chunk_cols=chunk_cols)
            tiles, chunks = len(schedule.tile_offsets) - 1, int(schedule.tile_offsets[-1])
            ms = np.array([times[factor][target] for factor in FACTORS])
            slope, intercept = np.polyfit(FACTORS, ms, 1)
            residual = float(np.abs(np.polyval((slope, intercept), FACTORS) - ms).max())  # ms
            per_chunk, per_tile = slope / chunks * 1e6, intercept / tiles * 1e6  # ns
            print(f"{nlat}x{nlon:<6} {target:>9} {tiles:>7} {chunks:>8} " + " ".join(f"{value:>9.4f}" for value in ms)
                  + f" {per_chunk:>9.3f} {per_tile:>8.2f} {per_tile / per_chunk:>10.1f} {residual:>9.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
