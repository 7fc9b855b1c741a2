"""Scaling of the sharded neighbourhood attention (latitude halo + longitude ring) over device meshes.

For every mesh ``LATxLON`` (devices taken in order from ``jax.devices()``) it measures the
op alone, forward and forward+backward (device time per call, ``timing.median_ms``), and the
per-device memory of the compiled forward+backward (arguments + outputs + temporaries, from
XLA's memory analysis; on GPUs also the allocator's peak).

* strong scaling: one global grid (``--grid``) on every mesh;
  efficiency = (t_base * n_base) / (t * n).
* weak scaling: ``--grid`` per device; a ``LATxLON`` mesh runs a grid LAT times taller and
  LON times wider (default cutoff, i.e. one grid spacing: neighbourhoods keep their size
  in points); efficiency = t_base / t.

Grids that a mesh does not divide are passed end-padded (``padded_grid_shapes``), as a
model keeps them between layers.

The base is the first mesh of ``--meshes`` (normally 1x1). On multi-GPU machines consider
``XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true`` so ring transfers overlap
the kernels.

Run: ``python benchmarks/distributed.py --grid 721x1440 --meshes 1x1 1x2 2x2 2x4``;
writes ``benchmarks/results/distributed-<device>-<date>.csv``. ``--smoke`` runs a tiny
grid on 8 virtual CPU devices (when no accelerator is present) and writes nothing.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import pathlib
import sys


def _parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["strong", "weak", "both"], default="both")
    parser.add_argument("--grid", default="181x360", help="NLATxNLON: global (strong) or per-device (weak) grid")
    parser.add_argument("--meshes", nargs="*", default=["1x1", "1x2", "2x2", "2x4"], help="LATxLON mesh shapes")
    parser.add_argument("--theta-cutoff", type=float, default=None, help="strong scaling only (default: grid spacing)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--channels", type=int, default=64, help="channels over all heads (Dk = Dv)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--implementation", default=None, choices=["reference", "ffi", "ffi-arc", "ffi-tiled"])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"))
    parser.add_argument("--smoke", action="store_true", help="tiny grid, few reps, virtual CPU devices, no CSV")
    args = parser.parse_args(argv)
    if args.smoke:
        args.grid, args.meshes, args.reps, args.channels, args.heads = "16x32", ["1x1", "2x1", "2x2", "2x4"], 2, 8, 2
        args.out = None
        # Must precede the first use of jax; harmless where real accelerators exist.
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    return args


def _shape(text: str) -> tuple[int, int]:
    a, b = (int(s) for s in text.lower().split("x"))
    return a, b


def main(argv=None) -> None:
    args = _parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_s2attn
    from jax_s2attn.parallel import padded_grid_shapes, sharded_neighborhood_attention

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling timing module, also under -P
    from timing import median_ms

    spec = P(None, "lat", "lon")

    def make_mesh(shape):
        devices = np.asarray(jax.devices()[: shape[0] * shape[1]]).reshape(shape)
        return Mesh(devices, ("lat", "lon"), axis_types=(AxisType.Explicit,) * 2)

    def measure(grid, theta_cutoff, mesh_shape, rng):
        mesh = make_mesh(mesh_shape)
        plan = jax_s2attn.NeighborhoodPlan(grid, grid, theta_cutoff=theta_cutoff)
        # Grids the mesh does not divide are passed padded at the end, as a model would keep
        # them between layers, so every array is evenly sharded and nothing is re-laid out.
        padded, _ = padded_grid_shapes(plan, mesh)
        shape = (args.batch, *padded, args.heads, args.channels // args.heads)
        sharding = NamedSharding(mesh, spec)
        q, k, v, g = (jax.device_put(jnp.asarray(rng.standard_normal(shape, np.float32), args.dtype), sharding)
                      for _ in range(4))
        attend = lambda q, k, v, plan: sharded_neighborhood_attention(  # noqa: E731
            q, k, v, plan, mesh=mesh, implementation=args.implementation
        )
        loss = lambda q, k, v, plan, g: jnp.sum(attend(q, k, v, plan).astype(jnp.float32) * g)  # noqa: E731
        forward = jax.jit(attend)
        both = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        memory = both.lower(q, k, v, plan, g).compile().memory_analysis()
        row = dict(
            grid="x".join(map(str, grid)), padded="x".join(map(str, padded)),
            mesh="x".join(map(str, mesh_shape)), devices=mesh.size,
            theta_cutoff=f"{plan.theta_cutoff:.6g}", pairs=plan.num_pairs,
            fwd_ms=median_ms(forward, [(q, k, v, plan)], args.reps),
            fwdbwd_ms=median_ms(both, [(q, k, v, plan, g)], args.reps),
        )
        if memory is not None:
            row["compiled_bytes_per_device"] = int(
                memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
            )
        stats = [d.memory_stats() for d in mesh.devices.flat]
        if all(stats):
            row["allocator_peak_bytes_max"] = max(s.get("peak_bytes_in_use", 0) for s in stats)
        return row

    device = jax.devices()[0]
    kind = getattr(device, "device_kind", device.platform)
    print(f"jax {jax.__version__}, {jax.device_count()} x {kind}; native: {jax_s2attn.native_backends()}")
    meshes = [_shape(m) for m in args.meshes]
    too_big = [m for m in meshes if m[0] * m[1] > jax.device_count()]
    if too_big:
        sys.exit(f"meshes {too_big} need more than the {jax.device_count()} devices present")
    grid = _shape(args.grid)
    modes = ["strong", "weak"] if args.mode == "both" else [args.mode]
    rng = np.random.default_rng(0)
    rows = []
    for mode in modes:
        base = None
        for mesh_shape in meshes:
            if mode == "strong":
                row = measure(grid, args.theta_cutoff, mesh_shape, rng)
            else:
                row = measure((grid[0] * mesh_shape[0], grid[1] * mesh_shape[1]), None, mesh_shape, rng)
            base = base or row
            work = 1 if mode == "weak" else row["devices"] / base["devices"]
            for key in ("fwd", "fwdbwd"):
                row[f"{key}_efficiency"] = base[f"{key}_ms"] / (row[f"{key}_ms"] * work)
            rows.append(dict(mode=mode, device=kind, dtype=args.dtype, batch=args.batch, heads=args.heads,
                             channels=args.channels, **row))

    columns = ["fwd_ms", "fwdbwd_ms", "fwd_efficiency", "fwdbwd_efficiency", "compiled_bytes_per_device"]
    cell = lambda x, w: f"{x:>{w}.4g}" if isinstance(x, float) else f"{x:>{w}}"  # noqa: E731
    print(f"\n{'mode':<8}{'grid':>11}{'mesh':>6}" + "".join(f"{c:>{len(c) + 2}}" for c in columns))
    for r in rows:
        cells = "".join(cell(r.get(c, "-"), len(c) + 2) for c in columns)
        print(f"{r['mode']:<8}{r['grid']:>11}{r['mesh']:>6}" + cells)
    if args.out:
        out_dir = pathlib.Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        path = out_dir / f"distributed-{kind.replace(' ', '_')}-{stamp}.csv"
        fields = list(dict.fromkeys(k for r in rows for k in r))
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields, restval="")
            writer.writeheader()
            writer.writerows(rows)
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
