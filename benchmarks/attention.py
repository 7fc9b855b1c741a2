"""Neighbourhood-attention benchmark: native kernels vs the pure-JAX reference (and torch-harmonics).

Op-level timings (the attention op alone, no projections) of the torch-harmonics benchmark
configurations plus quarter-degree ones, in float32 and bfloat16:

* forward and forward+backward time: device time per call, the median over ``--reps`` samples
  after warm-up of (a burst of calls enqueued back to back minus one call alone) per extra call
  (``timing.median_ms``: the host's dispatch and the final wait cancel), cycling through several
  input sets so small problems are not served from L2;
* the native kernel families side by side, each as the op runs it (its custom VJP): the arc kernels
  (``ffi_arc_*``, every row) and the scheduled tensor-core kernels (``ffi_scheduled_*``, sm_90 rows with 16-bit
  inputs and head dims 32/64/128, with the stencil kernels on rows of short arcs where the op runs them), the
  ratio ``arc_over_scheduled_*``, and as ``ffi_*`` the one that ``implementation="ffi"`` picks (``ffi_kernel``);
* the floor: max(bytes / copy bandwidth, FLOPs / peak) with each input read and each output
  written once (forward: q, k, v, out; backward adds out, dout, dq, dk, dv) and the useful
  FLOPs (below), at the ceilings measured on the H200 (4.3 TB/s copy, 790 TFLOP/s bf16
  matrix, 67 TFLOP/s fp32);
* FLOPs, counted as 2 per multiply-add of the attention's matrix products, with ``d`` the
  head dim and pairs summed over batch and heads. *Useful*: per (query, neighbour) pair
  ``4d`` forward (S = QK^T, O = PV) and ``10d`` backward (S again, dP, dV, dQ, dK), so
  ``14d`` for forward+backward; ``ffi_*_useful_tflops_*`` = useful FLOPs / measured time. *Computed*
  (padding and masked entries included): the pairs of the scheduled kernels' block schedules,
  ``sched_util_*`` = useful / computed pairs per walk, and ``ffi_scheduled_eta_<target>`` = computed TFLOP/s of
  each target alone over 790 (4d, 6d and 8d per computed pair for the forward, dQ and dK/dV walks: S, O; S, dP,
  dQ; S, dP, dV, dK), the kernels' own efficiency, tile waste aside; none where the scheduled targets run
  beside the stencil ones (their time is then not all wgmma);
* each native kernel family's targets alone (``ffi_<kernel>_{forward,dq,dkv,delta}_target_ms``:
  the forward, dQ, dK/dV and delta custom calls on their own, fed with the forward's lse and a
  delta from the same inputs; the scheduled family also ``dq_delta``, the dQ that forms delta, which the op
  runs in place of delta and dQ; each with the stencil targets beside it where the op runs them), so a change
  can be placed in one walk; forward+backward is the op's targets' sum plus XLA's glue;
* the pure-JAX reference measured in the same run (where it fits in time and memory);
* torch-harmonics' CUDA module (module level: projections included) when importable;
* the same attention written with PyTorch FlexAttention (``flex_attention.py``: a block mask built from the
  plan on a 2-D patch order, the quadrature weights as a score_mod), op level, compiled, inputs already in
  its layout: ``flex_{fwd,fwdbwd}_ms``, ``flex_over_ffi_*`` and ``flex_device_bytes``, torch's peak allocated
  memory over the forward+backward (inputs, the block mask's tables and their transposes, ``[query blocks,
  key blocks]`` int32 each, included), ``flex_kernel_options`` the kernel tiles that compiled (``--no-flex``
  leaves it out). The torch rows are timed like the JAX ones
  (``timing.median_ms``: bursts, the same number of input sets).

Run: ``python benchmarks/attention.py [--quick] [--configs NAME ...]``; writes
``benchmarks/results/attention-<gpu>-<date>-<time>.csv`` (or under ``--out``) and prints a table.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import json
import math
import os
import pathlib
import subprocess
import sys

# The torch peers share the GPU with jax in this process: jax allocates what it uses instead of taking 75 % of the
# device's memory at start (torch-harmonics' backward at 721x1440 with C 256 needs more than an 80 GB card's
# remaining quarter). Timings are taken after warm-up, when jax's pool has grown.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax_s2attn  # noqa: E402
from jax_s2attn.ops import _ffi  # noqa: E402  (which native kernels can run a row, and which one "ffi" picks)
from jax_s2attn.ops.local import full_window  # noqa: E402
from jax_s2attn.ops.neighborhood import _native_attention, uses_stencil_rows  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling modules, also under -P
from ceilings import PEAK_FLOPS, floor_ms  # noqa: E402
from timing import median_ms  # noqa: E402

from flex_attention import flex_runs  # noqa: E402  (the same attention in PyTorch FlexAttention)


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
    Config("1deg_default", (180, 360), (180, 360), None),
    Config("hdeg_default", (360, 720), (360, 720), None),
    Config("qdeg_default", (721, 1440), (721, 1440), None),
    Config("qdeg_tc0017", (721, 1440), (721, 1440), 0.017),
    Config("qdeg_tc003", (721, 1440), (721, 1440), 0.03),
    Config("qdeg_tc003_C256_H4", (721, 1440), (721, 1440), 0.03, channels=256, heads=4),
    Config("qdeg_default_C256_H4", (721, 1440), (721, 1440), None, channels=256, heads=4),
    Config("hdeg_tc003_H2", (360, 720), (360, 720), 0.03, channels=64, heads=2),  # head dim 32
    Config("hdeg_tc003_C128", (360, 720), (360, 720), 0.03, channels=128),  # head dim 128
]
QUICK = ["1deg_tc003", "hdeg_tc003", "h1deg_down_tc003", "1hdeg_up_tc003", "qdeg_default"]


def _pairs(cfg: Config, pairs_per_item: int) -> int:
    """Pairs over the batch and the heads."""
    return pairs_per_item * cfg.batch * cfg.heads


def _useful_flops(cfg: Config, plan, backward: bool) -> float:
    """Matrix FLOPs of the neighbourhood's pairs: 4d forward, 10d more for the backward."""
    d = cfg.channels // cfg.heads
    return (14 if backward else 4) * d * _pairs(cfg, plan.num_pairs)


def _floor_ms(cfg: Config, plan, dtype: str, backward: bool) -> float:
    q_points, k_points = cfg.batch * math.prod(cfg.out_shape), cfg.batch * math.prod(cfg.in_shape)
    return floor_ms(q_points, k_points, cfg.channels, _useful_flops(cfg, plan, backward), dtype, backward)


def _compiled_bytes(fn, *args) -> int:
    analysis = fn.lower(*args).compile().memory_analysis()
    if analysis is None:
        return -1
    return int(analysis.temp_size_in_bytes + analysis.output_size_in_bytes + analysis.argument_size_in_bytes)


def _jax_runs(plan, cfg: Config, dtype: str, kernel: str, reps: int, input_sets):
    """Forward and forward+backward ms and compiled bytes of the op on ``kernel`` (a native family as the op's
    custom VJP runs it, or "reference")."""
    if kernel == "reference":
        attend = lambda q, k, v, p: jax_s2attn.neighborhood_attention(q, k, v, p, implementation="reference")
    else:
        scale = float(input_sets[0][0].shape[-1]) ** -0.5
        attend = lambda q, k, v, p: _native_attention(q, k, v, p, scale, kernel)[0]
    forward = jax.jit(attend)
    loss = lambda q, k, v, p, g: jnp.vdot(attend(q, k, v, p).astype(jnp.float32), g)
    both = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    fwd_ms = median_ms(forward, [(q, k, v, plan) for q, k, v, _ in input_sets], reps)
    both_ms = median_ms(both, [(q, k, v, plan, g) for q, k, v, g in input_sets], reps)
    q, k, v, g = input_sets[0]
    memory = _compiled_bytes(both, q, k, v, plan, g)
    return fwd_ms, both_ms, memory


def _arc_target_runs(plan, reps: int, input_sets) -> dict[str, float]:
    """Median ms of the arc forward, dq, dkv and delta targets, each alone: the backward targets read the lse and
    a delta of the out of a forward of the same inputs."""
    window, scale = full_window(plan), float(input_sets[0][0].shape[-1]) ** -0.5
    forward_rows, backward_rows = plan.tables.forward_row_order, plan.tables.backward_row_order
    forward = jax.jit(lambda q, k, v, p: _ffi.ffi_forward(q, k, v, p, window, forward_rows, scale=scale))
    dq = jax.jit(lambda q, k, v, g, lse, delta, p: _ffi.ffi_backward_dq(
        q, k, v, g, lse, delta, p, window, forward_rows, scale=scale))  # fmt: skip
    dkv = jax.jit(lambda q, k, v, g, lse, delta, p: _ffi.ffi_backward_dkv(
        q, k, v, g, lse, delta, p, window, backward_rows, scale=scale))  # fmt: skip
    delta = jax.jit(_ffi.ffi_delta)
    delta_sets, backward_sets = [], []
    for q, k, v, g in input_sets:
        out, lse = forward(q, k, v, plan)
        delta_sets.append((g, out))
        backward_sets.append((q, k, v, g, lse, delta(g, out), plan))
    return {
        "forward": median_ms(forward, [(q, k, v, plan) for q, k, v, _ in input_sets], reps),
        "dq": median_ms(dq, backward_sets, reps),
        "dkv": median_ms(dkv, backward_sets, reps),
        "delta": median_ms(delta, delta_sets, reps),
    }


def scheduled_target_runs(plan, reps: int, input_sets) -> dict[str, float]:
    """Median ms of the scheduled forward (out in the activations' dtype and in float32, as differentiated), dq, dkv
    and delta targets, each alone, the backward ones fed with the forward's lse and a delta of a float32 out of
    every row, and the dq that forms delta (``dq_delta``, what the op runs in place of dq and delta, fed as the op
    feeds it); each with the stencil targets on the plan's tile stencil pairs where the op runs them."""
    q0 = input_sets[0][0]
    scale = float(q0.shape[-1]) ** -0.5
    stencil = {walk: uses_stencil_rows(plan, q0, "scheduled", walk) for walk in ("forward", "backward")}
    gradients = dict(scale=scale, gradient_dtype=q0.dtype)
    forward = jax.jit(lambda q, k, v, p: _ffi.ffi_scheduled_forward(
        q, k, v, p, scale=scale, out_dtype=q.dtype, float32_out=True, stencil=stencil["forward"]))  # fmt: skip
    # A float32 out of every row (beside the stencil rows the op's float32 out holds the scheduled rows only).
    full_out = jax.jit(lambda q, k, v, p: _ffi.ffi_scheduled_forward(q, k, v, p, scale=scale,
                                                                     stencil=stencil["forward"])[0])  # fmt: skip
    dq = jax.jit(lambda q, k, v, g, lse, delta, p: _ffi.ffi_scheduled_dq(q, k, v, g, lse, delta, p, **gradients,
                                                                         stencil=stencil["forward"]))  # fmt: skip
    dkv = jax.jit(lambda q, k, v, g, lse, delta, p: _ffi.ffi_scheduled_dkv(q, k, v, g, lse, delta, p, **gradients,
                                                                           stencil=stencil["backward"]))  # fmt: skip
    delta = jax.jit(_ffi.ffi_delta)
    delta_sets, backward_sets, forming_sets = [], [], []
    for q, k, v, g in input_sets:
        _, lse, out32 = forward(q, k, v, plan)
        out = full_out(q, k, v, plan)
        delta_sets.append((g, out))
        backward_sets.append((q, k, v, g, lse, delta(g, out), plan))
        forming_sets.append((q, k, v, g, lse, out32, jnp.zeros_like(lse), plan))
    times = {
        "forward": median_ms(forward, [(q, k, v, plan) for q, k, v, _ in input_sets], reps),
        "dq": median_ms(dq, backward_sets, reps),
        "dkv": median_ms(dkv, backward_sets, reps),
        "delta": median_ms(delta, delta_sets, reps),
    }
    dq_delta = jax.jit(lambda q, k, v, g, lse, out, dlse, p: _ffi.ffi_scheduled_dq_delta(
        q, k, v, g, lse, out, dlse, p, **gradients, stencil=stencil["forward"]))  # fmt: skip
    times["dq_delta"] = median_ms(dq_delta, forming_sets, reps)
    return times


def _cuda_wait(_result) -> None:
    """``median_ms``'s wait for torch calls: the device has finished what the host enqueued."""
    import torch

    torch.cuda.synchronize()


def _torch_median_ms(fn, input_sets, reps: int) -> float:
    """``median_ms`` of a torch callable on CUDA: the same bursts and input cycling as the JAX rows."""
    return median_ms(fn, input_sets, reps, wait=_cuda_wait)


def _torch_harmonics_runs(cfg: Config, dtype: str, reps: int, num_sets: int):
    """Module-level forward and forward+backward of torch-harmonics' CUDA layer, or None."""
    try:
        import torch
        from torch_harmonics import NeighborhoodAttentionS2
    except ImportError as e:  # said once a run: a built package that fails to import must not pass for "absent"
        if not getattr(_torch_harmonics_runs, "reported", False):
            print(f"torch-harmonics: absent ({type(e).__name__}: {e})")
            _torch_harmonics_runs.reported = True
        return None
    if not torch.cuda.is_available():
        return None
    layer = NeighborhoodAttentionS2(
        cfg.channels, cfg.in_shape, cfg.out_shape, num_heads=cfg.heads, theta_cutoff=cfg.theta_cutoff
    ).cuda()
    autocast = dict(device_type="cuda", dtype=torch.bfloat16, enabled=dtype == "bfloat16")
    input_sets = [
        tuple(torch.randn(cfg.batch, cfg.channels, *shape, device="cuda", requires_grad=True)
              for shape in (cfg.out_shape, cfg.in_shape))
        for _ in range(num_sets)
    ]  # fmt: skip

    def forward(x_out, x_in):
        with torch.autocast(**autocast):
            return layer(x_out, x_in, x_in)

    def both(x_out, x_in):
        forward(x_out, x_in).float().sum().backward()

    return _torch_median_ms(forward, input_sets, reps), _torch_median_ms(both, input_sets, reps)


def _tflops(flops: float, ms: float) -> float:
    return flops / ms / 1e9


def _kernel_metrics(cfg: Config, plan, row: dict) -> dict:
    """Useful TFLOP/s and arc/scheduled time ratios of the timed native kernels, and the scheduled kernels' schedule
    utilization and η (formulas in the module docstring)."""
    metrics = {}
    for step, backward in (("fwd", False), ("fwdbwd", True)):
        for kernel in ("arc", "scheduled"):
            if f"ffi_{kernel}_{step}_ms" in row:
                useful = _tflops(_useful_flops(cfg, plan, backward), row[f"ffi_{kernel}_{step}_ms"])
                metrics[f"ffi_{kernel}_useful_tflops_{step}"] = useful
        if f"ffi_arc_{step}_ms" in row and f"ffi_scheduled_{step}_ms" in row:
            metrics[f"arc_over_scheduled_{step}"] = row[f"ffi_arc_{step}_ms"] / row[f"ffi_scheduled_{step}_ms"]
    d = cfg.channels // cfg.heads
    query = jax.ShapeDtypeStruct((cfg.batch, *cfg.out_shape, cfg.heads, d), jnp.bfloat16)
    timed = "ffi_scheduled_forward_target_ms" in row
    beside_stencil = timed and any(uses_stencil_rows(plan, query, "scheduled", w) for w in ("forward", "backward"))
    if timed and not beside_stencil:  # beside the stencil targets, the targets' time is not all wgmma
        shape = dict(zip(("tile_rows", "tile_cols", "chunk_cols"), _ffi.kernel_limits().scheduled_shape, strict=True))
        walks = {walk: plan.block_schedule(walk, **shape) for walk in ("forward", "backward")}
        metrics.update(sched_util_fwd=plan.num_pairs / walks["forward"].computed_pairs,
                       sched_util_bwd=plan.num_pairs / walks["backward"].computed_pairs)  # fmt: skip
        for target, per_pair, walk in (("forward", 4, "forward"), ("dq", 6, "forward"), ("dkv", 8, "backward")):
            flops = per_pair * d * walks[walk].computed_pairs * cfg.batch * cfg.heads
            tflops = _tflops(flops, row[f"ffi_scheduled_{target}_target_ms"])
            metrics[f"ffi_scheduled_eta_{target}"] = tflops * 1e12 / PEAK_FLOPS["bfloat16"]
    return metrics


def _write_csv(path: pathlib.Path, rows: list[dict]) -> None:
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerows(rows)


def _commit() -> str:
    # JAX_S2ATTN_COMMIT first: a work tree copied to a GPU machine without network can carry a stale .git.
    if os.environ.get("JAX_S2ATTN_COMMIT"):
        return os.environ["JAX_S2ATTN_COMMIT"]
    try:
        root = pathlib.Path(__file__).resolve().parent.parent
        return subprocess.check_output(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], text=True, stderr=subprocess.DEVNULL
        ).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="*", help="config names (default: all)")
    parser.add_argument("--quick", action="store_true", help="a representative subset")
    parser.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--input-sets", type=int, default=3, help="inputs cycled through to defeat the L2")
    parser.add_argument("--reference-max-pairs", type=float, default=5e7, help="skip the reference above this")
    parser.add_argument("--reference-reps", type=int, default=5)
    parser.add_argument("--no-flex", action="store_true", help="leave out the FlexAttention peer")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"))
    args = parser.parse_args()

    names = args.configs or (QUICK if args.quick else [c.name for c in CONFIGS])
    configs = [c for c in CONFIGS if c.name in names]
    device = jax.devices()[0]
    gpu = getattr(device, "device_kind", device.platform)
    platform = _ffi.ffi_platform(device.platform)
    native = jax_s2attn.native_backends().get(platform, False)
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
        # The kernel implementation="ffi" runs for this row; the arc kernels are timed on every row, the scheduled
        # ones on the rows they can run.
        ffi_kernel = _ffi.choose_kernel(platform, dtype, d, d) if native else None
        kernels = []
        if native:
            kernels = ["arc"]
            if _ffi.scheduled_unavailable_reason(platform, dtype, d, d) is None:
                kernels.append("scheduled")
        if _pairs(cfg, plan.num_pairs) <= args.reference_max_pairs:
            kernels.append("reference")
        for kernel in kernels:
            reps = args.reference_reps if kernel == "reference" else args.reps
            try:
                fwd, both, memory = _jax_runs(plan, cfg, dtype, kernel, reps, input_sets)
            except Exception as e:  # e.g. the reference running out of device memory
                print(f"{cfg.name} {dtype} {kernel}: failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            column = "reference" if kernel == "reference" else f"ffi_{kernel}"
            row.update({f"{column}_fwd_ms": fwd, f"{column}_fwdbwd_ms": both, f"{column}_device_bytes": memory})
            if kernel != "reference":
                runs = scheduled_target_runs if kernel == "scheduled" else _arc_target_runs
                targets = runs(plan, reps, input_sets)
                row.update({f"{column}_{target}_target_ms": ms for target, ms in targets.items()})
        if f"ffi_{ffi_kernel}_fwd_ms" in row:
            row["ffi_kernel"] = ffi_kernel
            row.update({f"ffi_{m}": row[f"ffi_{ffi_kernel}_{m}"] for m in ("fwd_ms", "fwdbwd_ms", "device_bytes")})
        try:
            th = _torch_harmonics_runs(cfg, dtype, args.reps, args.input_sets)
        except Exception as e:  # e.g. out of memory: said, and the run goes on
            print(f"{cfg.name} {dtype} torch-harmonics: failed: {type(e).__name__}: {str(e)[:200]}")
            th = None
        th_fwd, th_both = th if th else ("absent", "absent")
        row.update(torch_harmonics_fwd_ms=th_fwd, torch_harmonics_fwdbwd_ms=th_both)
        flex = None
        if not args.no_flex:
            try:
                flex = flex_runs(plan, cfg.batch, cfg.heads, d, dtype, args.reps, args.input_sets, _torch_median_ms)
            except Exception as e:  # e.g. out of memory, or a compilation FlexAttention refuses
                print(f"{cfg.name} {dtype} flex: failed: {type(e).__name__}: {str(e)[:200]}")
        row.update(flex_fwd_ms=flex[0] if flex else "absent", flex_fwdbwd_ms=flex[1] if flex else "absent")
        if flex:
            row["flex_device_bytes"] = flex[2]
            row["flex_kernel_options"] = "inductor" if flex[3] is None else json.dumps(flex[3], sort_keys=True)
        if "ffi_fwd_ms" in row:
            row["ffi_gpairs_per_s"] = _pairs(cfg, plan.num_pairs) / row["ffi_fwd_ms"] / 1e6
            row["ffi_fwd_over_floor"] = row["ffi_fwd_ms"] / row["floor_fwd_ms"]
            row["ffi_fwdbwd_over_floor"] = row["ffi_fwdbwd_ms"] / row["floor_fwdbwd_ms"]
            if flex:
                row["flex_over_ffi_fwd"] = flex[0] / row["ffi_fwd_ms"]
                row["flex_over_ffi_fwdbwd"] = flex[1] / row["ffi_fwdbwd_ms"]
            if "reference_fwd_ms" in row:
                row["speedup_fwd_vs_reference"] = row["reference_fwd_ms"] / row["ffi_fwd_ms"]
                row["speedup_fwdbwd_vs_reference"] = row["reference_fwdbwd_ms"] / row["ffi_fwdbwd_ms"]
        row.update(_kernel_metrics(cfg, plan, row))
        rows.append(row)
        _write_csv(path, rows)  # after every job, so an interrupted run keeps what it measured

    def fmt(x):
        return f"{x:9.3f}" if isinstance(x, float) else f"{str(x):>9}"

    columns = {  # printed label -> CSV column
        "arc fwd": "ffi_arc_fwd_ms", "sched fwd": "ffi_scheduled_fwd_ms",
        "arc f+b": "ffi_arc_fwdbwd_ms", "sched f+b": "ffi_scheduled_fwdbwd_ms",
        "eta fwd": "ffi_scheduled_eta_forward", "eta dq": "ffi_scheduled_eta_dq", "eta dkv": "ffi_scheduled_eta_dkv",
        "s dq+dlt": "ffi_scheduled_dq_delta_target_ms", "s dkv": "ffi_scheduled_dkv_target_ms",
        "arc/sched": "arc_over_scheduled_fwdbwd", "floor f+b": "floor_fwdbwd_ms",
        "ffi/floor": "ffi_fwdbwd_over_floor", "util fwd": "sched_util_fwd", "util bwd": "sched_util_bwd",
        "TF/s f+b": "ffi_scheduled_useful_tflops_fwdbwd",
        "ref f+b": "reference_fwdbwd_ms", "ffi/ref": "speedup_fwdbwd_vs_reference",
        "flex f+b": "flex_fwdbwd_ms", "flex/ffi": "flex_over_ffi_fwdbwd",
    }
    print(f"\n{'config':<22}{'dtype':<10}" + "".join(f"{label:>10}" for label in columns))
    for r in rows:
        print(f"{r['config']:<22}{r['dtype']:<10}" + "".join(" " + fmt(r.get(c, "-")) for c in columns.values()))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
