"""Where the stencil kernels beside the scheduled ones start to pay: the measurement behind ``STENCIL_MIN_POINTS``.

At the default cutoff the op on the scheduled (tensor-core) kernels leaves the rows of short arcs to the stencil
kernels once their points per batch entry (rows x longitudes x heads of the pairs the stencil schedule leaves them)
reach ``jax_s2attn.ops.neighborhood.STENCIL_MIN_POINTS``; below it the scheduled kernels take every row. The stencil
kernels run after the scheduled ones, so on small problems their time adds almost whole. Per grid and head count this
times the op (bf16, 64 channels a head, batch 1) forward and forward+backward with the gate at 1 (stencil rows
wherever the plan has them) and out of reach (no stencil rows), in one process, after checking that the two settings
lower to programs with and without the stencil targets, and prints the points the gate compares and the ratio: the
gate belongs between the largest point count that lost and the smallest that gained.

Usage (on an sm_90 GPU with the CUDA build): ``python -P benchmarks/stencil_gate.py [--grids 180x360 360x720 ...]
[--heads 1 2 3 4] [--reps 15] [--csv PATH]``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import re
import sys
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

import jax_s2attn
from jax_s2attn.ops import _ffi, neighborhood

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling timing module, also under -P
from timing import median_ms  # noqa: E402

HEAD_DIM = 64
NEVER = 1 << 62  # a gate no problem reaches


def _grid(text: str) -> tuple[int, int]:
    """``--grids``' ``NLATxNLON``."""
    try:
        nlat, nlon = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a grid is NLATxNLON, e.g. 360x720; got {text!r}") from None
    return nlat, nlon


def gate_points(plan: jax_s2attn.NeighborhoodPlan, heads: int, walk: str) -> int:
    """The points per batch entry of ``walk``'s stencil pairs that ``uses_stencil_rows`` compares with the gate."""
    nlon = plan.nlon_out if walk == "forward" else plan.nlon_in
    return 2 * len(_ffi.stencil_schedule(plan, walk).pairs) * nlon * heads


@contextlib.contextmanager
def gate_at(points: int) -> Iterator[None]:
    """Sets ``STENCIL_MIN_POINTS`` for the ops traced inside, and restores it after. The op reads the gate when it
    is traced, and jax reuses traces of the op's inner functions across ``jit`` objects: both ends clear jax's
    caches."""
    saved = neighborhood.STENCIL_MIN_POINTS
    try:
        neighborhood.STENCIL_MIN_POINTS = points
        jax.clear_caches()
        yield
    finally:
        neighborhood.STENCIL_MIN_POINTS = saved
        jax.clear_caches()


def _op_functions():
    """The op on ``implementation="ffi"`` jitted: forward, and forward+backward (``value_and_grad`` of a vdot)."""
    attend = lambda q, k, v, p: jax_s2attn.neighborhood_attention(q, k, v, p, implementation="ffi")
    loss = lambda q, k, v, p, g: jnp.vdot(attend(q, k, v, p).astype(jnp.float32), g)
    return jax.jit(attend), jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def _inputs(plan: jax_s2attn.NeighborhoodPlan, heads: int, count: int) -> list[tuple]:
    """``count`` sets of (q, k, v, dout), bf16 standard normal, ``heads`` heads of ``HEAD_DIM`` channels."""
    rng = np.random.default_rng(0)
    shape = (plan.nlat_in, plan.nlon_in, heads, HEAD_DIM)
    return [tuple(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(4)) for _ in range(count)]


def stencil_targets(plan: jax_s2attn.NeighborhoodPlan, heads: int, points: int) -> list[str]:
    """The stencil custom calls of the op's forward+backward for CUDA with the gate at ``points`` (lowered, not
    run: any host can say it), so that a run checks it timed what it meant to."""
    with gate_at(points):
        q, k, v, g = _inputs(plan, heads, 1)[0]
        both = _op_functions()[1]
        text = both.trace(q, k, v, plan, g).lower(lowering_platforms=("cuda",)).as_text()
    return sorted(set(re.findall(r"jax_s2attn_stencil_[a-z_]+", text)))


def _times(plan: jax_s2attn.NeighborhoodPlan, heads: int, points: int, reps: int) -> tuple[float, float]:
    """Forward and forward+backward ms of the op on ``implementation="ffi"`` with the gate at ``points``."""
    with gate_at(points):
        forward, both = _op_functions()
        sets = _inputs(plan, heads, 2)
        fwd = median_ms(forward, [(q, k, v, plan) for q, k, v, _ in sets], reps)
        fb = median_ms(both, [(q, k, v, plan, g) for q, k, v, g in sets], reps)
    return fwd, fb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grids", nargs="+", type=_grid, default=[(180, 360), (360, 720)])
    parser.add_argument("--heads", nargs="+", type=int, default=[1, 2, 3, 4])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--csv", help="also write the rows to this CSV file")
    args = parser.parse_args()
    if any(h < 1 for h in args.heads):
        parser.error(f"--heads must be positive; got {args.heads}")
    if jax.default_backend() != "gpu":
        parser.error(f"needs a CUDA GPU; jax's default backend is {jax.default_backend()}")
    reason = _ffi.scheduled_unavailable_reason("cuda", "bfloat16", HEAD_DIM, HEAD_DIM)
    if reason is not None:
        parser.error(f"needs a GPU the scheduled kernels run on: {reason}")

    rows = []
    header = ("grid", "heads", "gate_points_fwd", "gate_points_bwd", "fwd_ms_no_stencil", "fwd_ms_stencil",
              "fb_ms_no_stencil", "fb_ms_stencil", "fb_stencil_over_none")  # fmt: skip
    print(" ".join(f"{name:>20}" for name in header))
    for nlat, nlon in args.grids:
        plan = jax_s2attn.NeighborhoodPlan((nlat, nlon), (nlat, nlon))
        for heads in args.heads:
            points = gate_points(plan, heads, "forward"), gate_points(plan, heads, "backward")
            if max(points) == 0:
                print(f"{nlat}x{nlon} has no stencil rows; skipped")
                break
            for points_gate, expected in ((NEVER, False), (1, True)):
                targets = stencil_targets(plan, heads, points_gate)
                if bool(targets) != expected:
                    sys.exit(f"{nlat}x{nlon}, {heads} heads, gate {points_gate}: stencil targets {targets}")
            fwd_none, fb_none = _times(plan, heads, NEVER, args.reps)
            fwd_stencil, fb_stencil = _times(plan, heads, 1, args.reps)
            row = (f"{nlat}x{nlon}", heads, *points, fwd_none, fwd_stencil, fb_none, fb_stencil, fb_stencil / fb_none)
            rows.append(row)
            print(" ".join(f"{value:>20.4f}" if isinstance(value, float) else f"{value:>20}" for value in row))
    print(f"current gate: STENCIL_MIN_POINTS = {neighborhood.STENCIL_MIN_POINTS} points per batch entry")
    if args.csv:
        with open(args.csv, "w", newline="") as file:
            writer = csv.writer(file)
            writer.writerow(header)
            writer.writerows(rows)


if __name__ == "__main__":
    main()
