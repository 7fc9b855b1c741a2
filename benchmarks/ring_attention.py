"""Ring-grid benchmark: neighbourhood attention between ring grids against the regular grids' fast path.

Op-level forward and forward+backward (``value_and_grad`` of a ``vdot`` loss) device times (``timing.median_ms``)
of ``neighborhood_attention`` on a :class:`~jax_s2attn.RingPlan`, the way the op runs it (on an H100/H200 the
scheduled tensor-core kernels on the plan's ring block schedules; ``--implementation``), the ``_arc`` rows on the
ring arc kernels, and, in the same run, the regular-grid configurations the ring configurations are judged against,
on the kernels ``implementation=None`` picks (the scheduled kernels on the regular grids' block schedules):

* ``healpix256_tc0055``: HEALPix nside 256 (786,432 points) self-attention at theta_cutoff 0.055, about the
  neighbours per point of 721x1440 at 0.03; judged per useful pair against ``qdeg_tc003``;
* ``qdeg_to_480x960_tc003``: 721x1440 -> 480x960 (a 3:2 longitude ratio) at 0.03; judged against
  ``qdeg_to_hdeg_tc003`` (721x1440 -> 360x720, the same cutoff), per pair and in time;
* ``qdeg_tc003_rings``: 721x1440 at 0.03 as ring grids (``RingGrid.latlon``): the same pairs as ``qdeg_tc003``,
  so what the ring schedules cost against the regular grids' shows.

Each row has the floor (max of bytes over 4.3 TB/s and useful FLOPs over 790 TFLOP/s bf16; ``ceilings.py``), the
time per pair in picoseconds and its ratio to the row's baseline. Run: ``python benchmarks/ring_attention.py
[--configs NAME ...] [--dtype bfloat16] [--reps N]``; writes ``benchmarks/results/ring-attention-<gpu>-<stamp>.csv``
and prints a table.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import math
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_s2attn
from jax_s2attn import NeighborhoodPlan, RingGrid, RingPlan
from jax_s2attn.ring_schedule import ring_block_schedule

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling modules, also under -P
from ceilings import floor_ms  # noqa: E402
from timing import median_ms  # noqa: E402


@dataclasses.dataclass(frozen=True)
class RingConfig:
    name: str
    plan: callable  # () -> RingPlan or NeighborhoodPlan
    baseline: str | None = None  # the config this one is judged against (per pair)
    implementation: str | None = None


CONFIGS = [
    RingConfig("qdeg_tc003", lambda: NeighborhoodPlan((721, 1440), (721, 1440), theta_cutoff=0.03)),
    RingConfig("qdeg_to_hdeg_tc003", lambda: NeighborhoodPlan((721, 1440), (360, 720), theta_cutoff=0.03)),
    RingConfig("healpix256_tc0055", lambda: RingPlan(RingGrid.healpix(256), RingGrid.healpix(256), 0.055),
               "qdeg_tc003"),  # fmt: skip
    RingConfig("healpix256_tc0055_arc", lambda: RingPlan(RingGrid.healpix(256), RingGrid.healpix(256), 0.055),
               "qdeg_tc003", "ffi-arc"),  # fmt: skip
    RingConfig("qdeg_to_480x960_tc003", lambda: RingPlan(RingGrid.latlon(721, 1440), RingGrid.latlon(480, 960), 0.03),
               "qdeg_to_hdeg_tc003"),  # fmt: skip
    RingConfig("qdeg_to_480x960_tc003_arc",
               lambda: RingPlan(RingGrid.latlon(721, 1440), RingGrid.latlon(480, 960), 0.03), "qdeg_to_hdeg_tc003",
               "ffi-arc"),  # fmt: skip
    RingConfig("qdeg_tc003_rings", lambda: RingPlan(RingGrid.latlon(721, 1440), RingGrid.latlon(721, 1440), 0.03),
               "qdeg_tc003"),  # fmt: skip
]


def _points(plan) -> tuple[int, int]:
    """(output points, input points)."""
    if isinstance(plan, RingPlan):
        return plan.npoints_out, plan.npoints_in
    return math.prod(plan.out_shape), math.prod(plan.in_shape)


def _field_shape(plan, points_axis: str, heads: int, d: int) -> tuple[int, ...]:
    if isinstance(plan, RingPlan):
        return (1, _points(plan)[points_axis == "in"], heads, d)
    return (1, *(plan.in_shape if points_axis == "in" else plan.out_shape), heads, d)


def _runs(plan, implementation, dtype: str, channels: int, heads: int, reps: int, input_sets: int, rng):
    """Forward and forward+backward median ms of the op on ``plan``."""
    d = channels // heads
    shapes = [_field_shape(plan, "out", heads, d), _field_shape(plan, "in", heads, d)]
    sets = [tuple(jnp.asarray(rng.standard_normal(s, dtype=np.float32), dtype) for s in (*shapes, shapes[1], shapes[0]))
            for _ in range(input_sets)]  # fmt: skip

    def attend(q, k, v):
        return jax_s2attn.neighborhood_attention(q, k, v, plan, implementation=implementation)

    forward = jax.jit(attend)
    both = jax.jit(jax.value_and_grad(lambda q, k, v, g: jnp.vdot(attend(q, k, v).astype(jnp.float32), g),
                                      argnums=(0, 1, 2)))  # fmt: skip
    fwd = median_ms(forward, [s[:3] for s in sets], reps)
    fwdbwd = median_ms(both, [(q, k, v, g.astype(jnp.float32)) for q, k, v, g in sets], reps)
    return fwd, fwdbwd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="*", help="config names (default: all); baselines are added")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--input-sets", type=int, default=2, help="inputs cycled through to defeat the L2")
    parser.add_argument("--implementation", default=None, help="of the ring configs (default: the op's choice)")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"))
    args = parser.parse_args()

    by_name = {c.name: c for c in CONFIGS}
    names = list(args.configs or by_name)
    for name in list(names):  # every baseline runs in the same process
        while by_name[name].baseline and by_name[name].baseline not in names:
            names.insert(0, by_name[name].baseline)
            name = by_name[name].baseline
    device = jax.devices()[0]
    gpu = getattr(device, "device_kind", device.platform)
    print(f"jax {jax.__version__}, device {gpu}; native: {jax_s2attn.native_backends()}")
    rng = np.random.default_rng(0)
    limits = jax_s2attn.ops._ffi.kernel_limits()
    runs, run_points = limits.scheduled_runs
    chunk_cols = limits.scheduled_shape[2]
    rows = {}
    for cfg in (by_name[n] for n in sorted(set(names), key=names.index)):
        plan = cfg.plan()
        implementation = cfg.implementation
        if isinstance(plan, RingPlan) and args.implementation is not None:
            implementation = args.implementation
        build = time.perf_counter()
        for walk in ("forward", "backward") if isinstance(plan, RingPlan) and implementation != "ffi-arc" else ():
            ring_block_schedule(plan, walk, runs=runs, run_points=run_points, chunk_cols=chunk_cols)
        build = time.perf_counter() - build
        fwd, fwdbwd = _runs(plan, implementation, args.dtype, args.channels, args.heads, args.reps,
                            args.input_sets, rng)  # fmt: skip
        q_points, k_points = _points(plan)
        pairs = plan.num_pairs * args.heads
        d = args.channels // args.heads
        row = dict(
            gpu=gpu, date=datetime.date.today().isoformat(), jax=jax.__version__, config=cfg.name,
            grids=type(plan).__name__, implementation=implementation or "default", dtype=args.dtype,
            channels=args.channels, heads=args.heads, pairs=plan.num_pairs, fwd_ms=fwd, fwdbwd_ms=fwdbwd,
            floor_fwd_ms=floor_ms(q_points, k_points, args.channels, 4 * d * pairs, args.dtype, backward=False),
            floor_fwdbwd_ms=floor_ms(q_points, k_points, args.channels, 14 * d * pairs, args.dtype, backward=True),
            ps_per_pair_fwd=1e9 * fwd / pairs, ps_per_pair_fwdbwd=1e9 * fwdbwd / pairs, baseline=cfg.baseline or "",
            schedule_build_s=build,
        )  # fmt: skip
        if cfg.baseline in rows:
            base = rows[cfg.baseline]
            for m in ("fwd", "fwdbwd"):
                row[f"per_pair_over_baseline_{m}"] = row[f"ps_per_pair_{m}"] / base[f"ps_per_pair_{m}"]
                row[f"time_over_baseline_{m}"] = row[f"{m}_ms"] / base[f"{m}_ms"]
        rows[cfg.name] = row
        print(f"{cfg.name:24s} pairs {plan.num_pairs:>12,d}  fwd {fwd:9.3f} ms  f+b {fwdbwd:9.3f} ms  "
              f"floor {row['floor_fwd_ms']:.3f}/{row['floor_fwdbwd_ms']:.3f}  ps/pair f+b {row['ps_per_pair_fwdbwd']:.2f}"
              + (f"  x{row['per_pair_over_baseline_fwdbwd']:.2f} of {cfg.baseline} per pair" if cfg.baseline in rows
                 else ""), flush=True)  # fmt: skip
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"ring-attention-{gpu.replace(' ', '_')}-{datetime.datetime.now():%Y%m%d-%H%M%S}.csv"
    fields = list(dict.fromkeys(k for r in rows.values() for k in r))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows.values())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
