"""How a plan's pairs split between walking rows of short arcs and rows of long ones.

The scheduled tensor-core kernels stage whole chunks of K/V (or Q/dout) columns for tiles of 64 walking points,
so a walking row whose arcs are a few columns wide multiplies mostly masked pairs, while rows of long arcs (near the
poles, or any row at a wide cutoff) keep the tensor cores busy; the stencil kernels
(``cuda/gpu/stencil_attn_*.cu``) take pairs of short-arc rows on CUDA cores. Per walk (forward: query rows, which the
forward and dq walk; backward: key rows, which dk/dv walk) and per bound W on a row's longest arc, this
prints how many rows have all arcs within W, their share of the pairs and their pairs per point, and
the same for the remaining rows.

With ``--time KERNEL ...`` ("scheduled" on an sm_90 GPU, "arc" anywhere a native module runs), it
also times, per kernel, the forward target (bf16, C 64, one head) on every row and, per split of the forward
walk, on the band of query rows from its first to its last short-arc row (a window of those rows; the
short-arc rows of a self-attention plan are one band around the equator, and the count of rows in the band
says whether others lie inside): what that kernel spends on the rows a stencil kernel could take. Where the
plan has stencil rows, it times the forward target on the query rows outside the forward walk's stencil
pairs and the dk/dv target on the key rows outside the backward walk's, one window per band of such rows
(the polar rows at the default cutoff): what the kernel beside the stencil kernels costs. These are the plan's
stencil pairs; the op beside the scheduled kernels leaves the stencil kernels those of whole tiles
(``jax_s2attn.ops._ffi.stencil_schedule``), which may be fewer rows.

Usage: ``python benchmarks/row_widths.py [--grid NLAT NLON [--theta-cutoff TC]] ... [--time KERNEL ...]``
(default: the benchmark's 721x1440 default cutoff, 721x1440 tc 0.03 and 360x720 tc 0.03, self-attention).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import numpy as np

from jax_s2attn import NeighborhoodPlan

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling timing module, also under -P
from timing import median_ms  # noqa: E402

WIDTHS = (8, 16, 32, 64)


@dataclasses.dataclass(frozen=True)
class RowSplit:
    narrow_rows: int  # walking rows whose every arc has at most `width` columns
    rows: int
    narrow_pairs: int
    pairs: int
    points_per_row: int


def _rows(plan: NeighborhoodPlan, walk: str) -> tuple[np.ndarray, np.ndarray, int]:
    """Per walking row of ``walk`` ("forward" or "backward"): its longest arc and its pairs; and its points."""
    table = plan.forward_segments if walk == "forward" else plan.backward_segments
    offsets, segments = np.asarray(table.offsets), np.asarray(table.segments)
    residues = table.residues
    lengths = segments[:, 1 + residues :]  # [segment, residue]
    rows = len(offsets) - 1
    row_of_segment = np.repeat(np.arange(rows), np.diff(offsets))
    longest = np.zeros(rows, np.int64)
    np.maximum.at(longest, row_of_segment, lengths.max(axis=1))
    # Point (h, w) reads len_r columns per segment, r = w % R: a row's pairs are nlon / R times the sum.
    points_per_row = (plan.out_shape if walk == "forward" else plan.in_shape)[1]
    pairs = np.zeros(rows, np.int64)
    np.add.at(pairs, row_of_segment, lengths.sum(axis=1) * (points_per_row // residues))
    return longest, pairs, points_per_row


def narrow_rows(plan: NeighborhoodPlan, walk: str, width: int) -> np.ndarray:
    """The walking rows of ``walk`` whose every arc has at most ``width`` columns, ascending."""
    return np.flatnonzero(_rows(plan, walk)[0] <= width)


def row_split(plan: NeighborhoodPlan, walk: str, width: int) -> RowSplit:
    """The split of ``plan``'s ``walk`` ("forward" or "backward") at arcs of ``width`` columns."""
    longest, pairs, points_per_row = _rows(plan, walk)
    narrow = longest <= width
    return RowSplit(int(narrow.sum()), len(longest), int(pairs[narrow].sum()), int(pairs.sum()), points_per_row)


def _activations(shapes, sets: int = 3) -> list[tuple]:
    """``sets`` tuples of bf16 normal arrays of ``shapes`` (timing rotates among them)."""
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    return [tuple(jnp.asarray(rng.standard_normal(s, np.float32), jnp.bfloat16) for s in shapes) for _ in range(sets)]


def _band_schedules(plan: NeighborhoodPlan, window: np.ndarray):
    """The scheduled kernels' :class:`~jax_s2attn.ops._ffi.WindowSchedules` of one ``window`` (int32 ``[8]``) on
    arrays of its blocks alone."""
    from jax_s2attn import _native
    from jax_s2attn.ops import _ffi
    from jax_s2attn.parallel.layout import schedules_of_window
    from jax_s2attn.schedule import join_schedules

    blocks = (int(window[2]), int(window[3])), (int(window[6]), int(window[7]))
    walks = schedules_of_window(plan, window, *blocks, *_native.kernel_limits().scheduled_shape)
    return _ffi.WindowSchedules(*(join_schedules([s]) for s in walks), np.int32(0))


def band_ms(plan: NeighborhoodPlan, kernel: str, walk: str, lat0: int, nrows: int, reps: int = 20) -> float:
    """Median ms of ``kernel``'s forward target on the query rows ``lat0 .. lat0 + nrows - 1`` (``walk``
    "forward") or its dk/dv target on those key rows (``walk`` "backward"), alone: a window of those rows over
    every point of the other grid (bf16, C 64, one head; dk/dv with normal lse and delta)."""
    import jax
    import jax.numpy as jnp

    from jax_s2attn.ops import local

    nlat_q, nlon_q = plan.out_shape
    nlat_k, nlon_k = plan.in_shape
    if walk == "forward":
        q_rows, k_rows, window = nrows, nlat_k, [lat0, 0, nrows, nlon_q, 0, 0, nlat_k, nlon_k]
    else:
        q_rows, k_rows, window = nlat_q, nrows, [0, 0, nlat_q, nlon_q, lat0, 0, nrows, nlon_k]
    window = np.array(window, np.int32)
    schedules = _band_schedules(plan, window) if kernel == "scheduled" else None
    options = dict(scale=0.125, kernel=kernel, schedules=schedules)
    queries, keys = (1, q_rows, nlon_q, 1, 64), (1, k_rows, nlon_k, 1, 64)
    if walk == "forward":
        order = local.local_row_order(plan, "forward", lat0, nrows)
        fn = jax.jit(lambda q, k, v: local.local_forward(q, k, v, plan, window, order, **options))
        return median_ms(fn, _activations([queries, keys, keys]), reps)
    order = local.local_row_order(plan, "backward", lat0, nrows)
    rng = np.random.default_rng(1)
    lse, delta = (jnp.asarray(rng.standard_normal(queries[:-1], np.float32)) for _ in range(2))
    fn = jax.jit(lambda q, k, v, g: local.local_backward_dkv(q, k, v, g, lse, delta, plan, window, order, **options))
    return median_ms(fn, _activations([queries, keys, keys, queries]), reps)


def bands_outside(rows: int, pairs: np.ndarray) -> list[tuple[int, int]]:
    """``(first row, rows)`` of each run of consecutive rows of ``0 .. rows - 1`` outside the row pairs
    ``pairs`` (int ``[n, 2]``, a stencil table's)."""
    inside = np.zeros(rows + 2, bool)  # padded by one row each side
    inside[[0, -1]] = True
    inside[np.asarray(pairs, np.int64).reshape(-1) + 1] = True
    starts = np.flatnonzero(inside[:-1] & ~inside[1:])
    stops = np.flatnonzero(~inside[:-1] & inside[1:])
    return [(int(a), int(b - a)) for a, b in zip(starts, stops, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", type=int, nargs=2, action="append", metavar=("NLAT", "NLON"))
    parser.add_argument("--theta-cutoff", type=float, action="append", help="one per --grid; omit for the default")
    parser.add_argument("--time", metavar="KERNEL", nargs="+", default=[],
                        help="time these kernels' targets on each split's rows")  # fmt: skip
    args = parser.parse_args()
    if args.grid:
        cutoffs = args.theta_cutoff or [None] * len(args.grid)
        configs = list(zip(map(tuple, args.grid), cutoffs, strict=True))
    else:
        configs = [((721, 1440), None), ((721, 1440), 0.03), ((360, 720), 0.03)]
    for shape, cutoff in configs:
        plan = NeighborhoodPlan(shape, shape, theta_cutoff=cutoff)
        per_point = plan.num_pairs / np.prod(shape)
        print(f"{shape[0]}x{shape[1]}, theta_cutoff {plan.theta_cutoff:.4g}: {per_point:.1f} pairs/point")
        for kernel in args.time:
            print(f"  {kernel} forward, every row: {band_ms(plan, kernel, "forward", 0, shape[0]):.4f} ms")
        for walk in ("forward", "backward"):
            for width in WIDTHS:
                s = row_split(plan, walk, width)
                wide_rows = s.rows - s.narrow_rows
                narrow_per_point = s.narrow_pairs / max(1, s.narrow_rows * s.points_per_row)
                wide_per_point = (s.pairs - s.narrow_pairs) / max(1, wide_rows * s.points_per_row)
                line = (f"  {walk:8s} arcs <= {width:2d}: rows {s.narrow_rows:4d} ({s.narrow_rows / s.rows:6.1%}), "
                        f"pairs {s.narrow_pairs / s.pairs:6.1%}, {narrow_per_point:6.1f} per point; "
                        f"the other {wide_rows:4d} rows {wide_per_point:7.1f} per point")
                if walk == "forward" and s.narrow_rows:
                    rows = narrow_rows(plan, walk, width)
                    band = rows[-1] - rows[0] + 1
                    for kernel in args.time:
                        line += f"; {kernel} forward on rows {rows[0]}..{rows[-1]} ({band} rows): "
                        line += f"{band_ms(plan, kernel, "forward", int(rows[0]), int(band)):.4f} ms"
                print(line)
        for walk, target in (("forward", "forward"), ("backward", "dk/dv")):
            pairs = plan.forward_stencil_pairs if walk == "forward" else plan.backward_stencil_pairs
            if not args.time or len(pairs) == 0:
                continue
            bands = bands_outside(plan.out_shape[0] if walk == "forward" else plan.in_shape[0], pairs)
            names = ", ".join(f"{a}..{a + n - 1}" for a, n in bands)
            for kernel in args.time:
                ms = sum(band_ms(plan, kernel, walk, a, n) for a, n in bands)
                rows = sum(n for _, n in bands)
                print(f"  {kernel} {target} outside the {walk} stencil pairs ({rows} rows: {names}): {ms:.4f} ms")


if __name__ == "__main__":
    main()
