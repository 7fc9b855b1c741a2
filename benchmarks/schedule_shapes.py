"""What the block-sparse schedule of a plan costs for several tile and chunk shapes (host only, numpy).

Per configuration of ``benchmarks/attention.py`` and shape (tile rows x tile longitudes, chunk columns): the
chunks and stagings of the forward walk, the useful fraction of the pairs the kernels multiply
(``plan.num_pairs / schedule.computed_pairs``), the fractions of chunks that need no mask (FULL) and that
take the ring test (RING), the tables' size and the time to build them.
Usage: ``python benchmarks/schedule_shapes.py [--configs hdeg_tc003 qdeg_tc003 ...]``.
"""

from __future__ import annotations

import argparse
import time

from jax_s2attn.plan import NeighborhoodPlan
from jax_s2attn.schedule import RING, build_schedule

CONFIGS = {
    "hdeg_tc003": ((360, 720), 0.03),
    "qdeg_default": ((721, 1440), None),
    "qdeg_tc003": ((721, 1440), 0.03),
}
SHAPES = [(4, 16, 32), (4, 16, 16), (4, 16, 64), (2, 32, 16), (8, 8, 16), (8, 8, 32)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    args = parser.parse_args()
    print("config        shape      chunks  stagings  useful  full  ring     MB  build s")
    for name in args.configs:
        shape, cutoff = CONFIGS[name]
        plan = NeighborhoodPlan(shape, shape, theta_cutoff=cutoff)
        for rows, cols, chunk in SHAPES:
            start = time.perf_counter()
            s = build_schedule(plan.forward_segments, *shape, tile_rows=rows, tile_cols=cols, chunk_cols=chunk)
            seconds = time.perf_counter() - start
            megabytes = sum(t.nbytes for t in s[:4]) / 1e6
            ring = float((s.chunks[:, 4] & RING).astype(bool).mean())
            print(f"{name:13s} {rows}x{cols} W{chunk:<3d} {s.chunks.shape[0]:8d} {s.records.shape[0]:9d}  "
                  f"{plan.num_pairs / s.computed_pairs:.3f}  {s.full_fraction:.2f}  {ring:.2f}  {megabytes:5.1f}  "
                  f"{seconds:7.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
