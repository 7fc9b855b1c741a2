"""Neighbourhood-attention benchmark: native kernels vs the pure-JAX reference (and torch-harmonics).

Op-level timings (the attention op alone, no projections) of the torch-harmonics benchmark
configurations (spec 7.1) plus quarter-degree ones, in float32 and bfloat16:

* forward and forward+backward time: median of ``--reps`` device-synchronised calls after
  warm-up, cycling through several input sets so small problems are not served from L2;
* the floor: max(bytes / copy bandwidth, FLOPs / peak) with each input read and each output
  written once (forward: q, k, v, out; backward adds out, dout, dq, dk, dv) and 2*(Dk+Dv)
  FLOPs per pair forward, 2*(3*Dk+2*Dv) backward, at the ceilings measured on the H200
  (4.3 TB/s copy, 790 TFLOP/s bf16 matrix, 67 TFLOP/s fp32);
* the pure-JAX reference measured in the same run (where it fits in time and memory);
* torch-harmonics' CUDA module (module level: projections included) when importable.

Run: ``python benchmarks/attention.py [--quick] [--configs NAME ...]``; writes
``benchmarks/results/attention-<gpu>-<date>.csv`` and prints a table.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import math
import os
import pathlib
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_s2attn

COPY_BANDWIDTH = 4.3e12  # bytes/s, device-to-device copy measured on the H200 (read + write)
PEAK_FLOPS = {"bfloat16": 790e12, "float16": 790e12, "float32": 67e12}  # matrix bf16 measured; fp32 datasheet


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    in_shape: tuple[int, int]
    out_shape: tuple[int, int]
    theta_cutoff: float | None
    channels: int = 64
    heads: int = 1
    batch: int = 1


CONFIGS = [
    Config("1deg_tc0017", (180, 360), (180, 360), 0.017),
    Config("1deg_tc003", (180, 360), (180, 360), 0.03),
    Config("hdeg_tc0017", (360, 720), (360, 720), 0.017),
    Config("hdeg_tc003", (360, 720), (360, 720), 0.03),
    Config("h1deg_down_tc0017", (360, 720), (180, 360), 0.017),
    Config("h1deg_down_tc003", (360, 720), (180, 360), 0.03),
    Config("1hdeg_up_tc0017", (180, 360), (360, 720), 0.017),
    Config("1hdeg_up_tc003", (180, 360), (360, 720), 0.03),
    Config("qdeg_default", (721, 1440), (721, 1440), None),
    Config("qdeg_tc0017", (721, 1440), (721, 1440), 0.017),
    Config("qdeg_tc003", (721, 1440), (721, 1440), 0.03),
    Config("qdeg_tc003_C256_H4", (721, 1440), (721, 1440), 0.03, channels=256, heads=4),
]
QUICK = ["1deg_tc003", "hdeg_tc003", "h1deg_down_tc003", "1hdeg_up_tc003", "qdeg_default"]


def _floor_ms(cfg: Config, plan, dtype: str, backward: bool) -> float:
    size = jnp.dtype(dtype).itemsize
    d = cfg.channels // cfg.heads
    q_points = cfg.batch * math.prod(cfg.out_shape) * cfg.channels
    k_points = cfg.batch * math.prod(cfg.in_shape) * cfg.channels
    pairs = plan.num_pairs * cfg.batch * cfg.heads
    tensors = (2 * q_points + 2 * k_points) * size  # q, out; k, v
    flops = 2 * pairs * 2 * d
    if backward:
        tensors += (3 * q_points + 4 * k_points) * size  # out, dout, dq; k, v, dk, dv
        flops += 2 * pairs * 5 * d
    return 1e3 * max(tensors / COPY_BANDWIDTH, flops / PEAK_FLOPS[dtype])


def _median_ms(fn, input_sets, reps: int) -> float:
    for args in input_sets:  # compile and warm up
        jax.block_until_ready(fn(*args))
    times = []
    for i in range(reps):
        args = input_sets[i % len(input_sets)]
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def _compiled_bytes(fn, *args) -> int:
    analysis = fn.lower(*args).compile().memory_analysis()
    if analysis is None:
        return -1
    return int(analysis.temp_size_in_bytes + analysis.output_size_in_bytes + analysis.argument_size_in_bytes)


def _jax_runs(plan, cfg: Config, dtype: str, implementation: str, reps: int, input_sets):
    attend = lambda q, k, v, p: jax_s2attn.neighborhood_attention(q, k, v, p, implementation=implementation)
    forward = jax.jit(attend)
    loss = lambda q, k, v, p, g: jnp.vdot(attend(q, k, v, p).astype(jnp.float32), g)
    both = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    fwd_ms = _median_ms(forward, [(q, k, v, plan) for q, k, v, _ in input_sets], reps)
    both_ms = _median_ms(both, [(q, k, v, plan, g) for q, k, v, g in input_sets], reps)
    q, k, v, g = input_sets[0]
    memory = _compiled_bytes(both, q, k, v, plan, g)
    return fwd_ms, both_ms, memory


def _torch_harmonics_runs(cfg: Config, dtype: str, reps: int):
    """Module-level forward and forward+backward of torch-harmonics' CUDA layer, or None."""
    try:
        import torch
        from torch_harmonics import NeighborhoodAttentionS2
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    layer = NeighborhoodAttentionS2(
        cfg.channels, cfg.in_shape, cfg.out_shape, num_heads=cfg.heads, theta_cutoff=cfg.theta_cutoff
    ).cuda()
    autocast = dict(device_type="cuda", dtype=torch.bfloat16, enabled=dtype == "bfloat16")
    x_in = torch.randn(cfg.batch, cfg.channels, *cfg.in_shape, device="cuda", requires_grad=True)
    x_out = torch.randn(cfg.batch, cfg.channels, *cfg.out_shape, device="cuda", requires_grad=True)

    def forward():
        with torch.autocast(**autocast):
            return layer(x_out, x_in, x_in)

    def both():
        forward().float().sum().backward()

    result = []
    for fn in (forward, both):
        for _ in range(3):
            fn()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(reps):
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop))
        result.append(float(np.median(times)))
    return tuple(result)


def _write_csv(path: pathlib.Path, rows: list[dict]) -> None:
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerows(rows)


def _commit() -> str:
    try:
        root = pathlib.Path(__file__).resolve().parent.parent
        return subprocess.check_output(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], text=True, stderr=subprocess.DEVNULL
        ).strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("JAX_S2ATTN_COMMIT", "unknown")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="*", help="config names (default: all)")
    parser.add_argument("--quick", action="store_true", help="a representative subset")
    parser.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--input-sets", type=int, default=3, help="inputs cycled through to defeat the L2")
    parser.add_argument("--reference-max-pairs", type=float, default=5e7, help="skip the reference above this")
    parser.add_argument("--reference-reps", type=int, default=5)
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"))
    args = parser.parse_args()

    names = args.configs or (QUICK if args.quick else [c.name for c in CONFIGS])
    configs = [c for c in CONFIGS if c.name in names]
    device = jax.devices()[0]
    gpu = getattr(device, "device_kind", device.platform)
    print(f"jax {jax.__version__}, device {gpu}; native: {jax_s2attn.native_backends()}")
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = lambda it, **_: it
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = out_dir / f"attention-{gpu.replace(' ', '_')}-{stamp}.csv"
    rows = []
    rng = np.random.default_rng(0)
    jobs = [(c, d) for c in configs for d in args.dtypes]
    for cfg, dtype in tqdm(jobs, desc="benchmark", unit="config"):
        plan = jax_s2attn.NeighborhoodPlan(cfg.in_shape, cfg.out_shape, theta_cutoff=cfg.theta_cutoff)
        d = cfg.channels // cfg.heads
        shapes = [(cfg.batch, *cfg.out_shape, cfg.heads, d), (cfg.batch, *cfg.in_shape, cfg.heads, d)]
        input_sets = [
            tuple(
                jnp.asarray(rng.standard_normal(s, dtype=np.float32), dtype)
                for s in (shapes[0], shapes[1], shapes[1], shapes[0])
            )
            for _ in range(args.input_sets)
        ]
        row = dict(
            gpu=gpu, commit=_commit(), date=datetime.date.today().isoformat(), jax=jax.__version__,
            config=cfg.name, in_shape="x".join(map(str, cfg.in_shape)), out_shape="x".join(map(str, cfg.out_shape)),
            theta_cutoff=f"{plan.theta_cutoff:.6g}", channels=cfg.channels, heads=cfg.heads, dtype=dtype,
            pairs=plan.num_pairs,
            floor_fwd_ms=_floor_ms(cfg, plan, dtype, False), floor_fwdbwd_ms=_floor_ms(cfg, plan, dtype, True),
        )
        implementations = ["ffi"] if jax_s2attn.native_backends()[device.platform if device.platform != "gpu" else "cuda"] else []
        if plan.num_pairs * cfg.heads * cfg.batch <= args.reference_max_pairs:
            implementations.append("reference")
        for impl in implementations:
            reps = args.reps if impl == "ffi" else args.reference_reps
            try:
                fwd, both, memory = _jax_runs(plan, cfg, dtype, impl, reps, input_sets)
            except Exception as e:  # e.g. the reference running out of device memory
                print(f"{cfg.name} {dtype} {impl}: failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            row.update({f"{impl}_fwd_ms": fwd, f"{impl}_fwdbwd_ms": both, f"{impl}_device_bytes": memory})
        th = _torch_harmonics_runs(cfg, dtype, args.reps)
        row.update(torch_harmonics_fwd_ms=th[0] if th else "absent", torch_harmonics_fwdbwd_ms=th[1] if th else "absent")
        if "ffi_fwd_ms" in row:
            row["ffi_gpairs_per_s"] = plan.num_pairs * cfg.heads * cfg.batch / row["ffi_fwd_ms"] / 1e6
            row["ffi_fwd_over_floor"] = row["ffi_fwd_ms"] / row["floor_fwd_ms"]
            row["ffi_fwdbwd_over_floor"] = row["ffi_fwdbwd_ms"] / row["floor_fwdbwd_ms"]
            if "reference_fwd_ms" in row:
                row["speedup_fwd_vs_reference"] = row["reference_fwd_ms"] / row["ffi_fwd_ms"]
                row["speedup_fwdbwd_vs_reference"] = row["reference_fwdbwd_ms"] / row["ffi_fwdbwd_ms"]
        rows.append(row)
        _write_csv(path, rows)  # after every job, so an interrupted run keeps what it measured

    def fmt(x):
        return f"{x:9.3f}" if isinstance(x, float) else f"{str(x):>9}"

    columns = ["ffi_fwd_ms", "ffi_fwdbwd_ms", "floor_fwdbwd_ms", "ffi_fwdbwd_over_floor", "reference_fwdbwd_ms",
               "speedup_fwdbwd_vs_reference", "ffi_gpairs_per_s"]
    print(f"\n{'config':<22}{'dtype':<10}" + "".join(f"{c[:9]:>10}" for c in columns))
    for r in rows:
        print(f"{r['config']:<22}{r['dtype']:<10}" + "".join(" " + fmt(r.get(c, "-")) for c in columns))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
