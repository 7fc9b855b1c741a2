"""How a plan's pairs split between walking rows of short arcs and rows of long ones (NOTES, session 13).

The tiled kernels stage whole chunks of K/V (or Q/dout) columns for 64-point units, so a walking row
whose arcs are a few columns wide multiplies mostly masked pairs, while rows of long arcs (near the
poles, or any row at a wide cutoff) keep the tensor cores busy. A stencil path on CUDA cores for the
short-arc rows would leave the tiled kernels only the others. Per walk (forward: query rows, which the
forward and dq walk; backward: key rows, which dk/dv walk) and per bound W on a row's longest arc, this
prints how many rows have all arcs within W, their share of the pairs and their pairs per point, and
the same for the remaining rows.

Usage: ``python benchmarks/row_widths.py [--grid NLAT NLON [--theta-cutoff TC]] ...`` (default: the
benchmark's 721x1440 default cutoff, 721x1440 tc 0.03 and 360x720 tc 0.03, self-attention).
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

from jax_s2attn import NeighborhoodPlan

WIDTHS = (8, 16, 32, 64)


@dataclasses.dataclass(frozen=True)
class RowSplit:
    narrow_rows: int  # walking rows whose every arc has at most `width` columns
    rows: int
    narrow_pairs: int
    pairs: int
    points_per_row: int


def row_split(plan: NeighborhoodPlan, walk: str, width: int) -> RowSplit:
    """The split of ``plan``'s ``walk`` ("forward" or "backward") at arcs of ``width`` columns."""
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
    per_row = np.zeros(rows, np.int64)
    np.add.at(per_row, row_of_segment, lengths.sum(axis=1) * (points_per_row // residues))
    narrow = longest <= width
    return RowSplit(int(narrow.sum()), rows, int(per_row[narrow].sum()), int(per_row.sum()), points_per_row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", type=int, nargs=2, action="append", metavar=("NLAT", "NLON"))
    parser.add_argument("--theta-cutoff", type=float, action="append", help="one per --grid; omit for the default")
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
        for walk in ("forward", "backward"):
            for width in WIDTHS:
                s = row_split(plan, walk, width)
                wide_rows = s.rows - s.narrow_rows
                narrow_per_point = s.narrow_pairs / max(1, s.narrow_rows * s.points_per_row)
                wide_per_point = (s.pairs - s.narrow_pairs) / max(1, wide_rows * s.points_per_row)
                print(f"  {walk:8s} arcs <= {width:2d}: rows {s.narrow_rows:4d} ({s.narrow_rows / s.rows:6.1%}), "
                      f"pairs {s.narrow_pairs / s.pairs:6.1%}, {narrow_per_point:6.1f} per point; "
                      f"the other {wide_rows:4d} rows {wide_per_point:7.1f} per point")


if __name__ == "__main__":
    main()
