"""Soak test of training: many optimizer steps of two neighbourhood-attention layers, loss by loss.

The model is two residual ``jax_s2attn.nnx.NeighborhoodAttentionS2`` layers on one grid,
``h = x + layer1(x)``, ``y = h + layer2(h)`` (computation in bfloat16, parameters in float32),
trained with ``optax.adam(1e-3)`` on a float32 mean squared error against a fixed smooth target
field. Input and target are built once from ``--seed``: low-degree products of cosines and sines
of colatitude and longitude with a phase per channel, the input with a little seeded noise. It
measures:

* the loss of every step (float32, kept on the device and fetched after the last step), the
  sha256 of their float32 bytes, and whether any loss or final parameter is non-finite;
* the allocator's bytes in use and peak after step 100 and after the last step
  (``jax.Device.memory_stats()``; null where the backend reports none, as on the CPU, and at
  step 100 for runs shorter than that);
* wall time per step, each step waited for: the first, and the median over the steps after the
  first 10 (over every step for runs of 10 steps or fewer); and the time to trace and lower the
  step, and to compile it (ahead of the first step).

``--compare OTHER.json`` also says whether this run's losses are bitwise those of another run
(same sha256) and, where not, the first step that differs. On a GPU two processes give the same bits
only with XLA's choice of GEMM algorithms for the projections pinned,
``XLA_FLAGS=--xla_gpu_deterministic_ops=true``: by default XLA autotunes them by timing in each
process (the attention kernels themselves are deterministic; ``docs/reliability.md``). The exit
status is 1 when the losses differ or any loss or parameter is non-finite, 0 otherwise.

Run: ``python benchmarks/soak.py [--steps 2000] [--grid 181 360] [--channels 128] [--heads 4]
[--theta-cutoff 0.05] [--batch 1] [--seed 0] [--out out/soak.json] [--compare OTHER.json]``;
on a CPU, e.g. ``--grid 16 32 --channels 16 --heads 2 --steps 5 --theta-cutoff 0.3``. Writes the
JSON to ``--out`` and prints a summary.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import optax
from flax import nnx

import jax_s2attn
from jax_s2attn.nnx import NeighborhoodAttentionS2

MEMORY_STEP = 100  # memory is read after this step and after the last
WARMUP_STEPS = 10  # steps left out of the median step time


class TwoLayers(nnx.Module):
    """``x -> h = x + layer1(x) -> h + layer2(h)`` on one grid."""

    def __init__(self, grid: tuple[int, int], channels: int, *, heads: int, theta_cutoff: float,
                 implementation: str | None, rngs: nnx.Rngs):  # fmt: skip
        layer = dict(num_heads=heads, theta_cutoff=theta_cutoff, dtype=jnp.bfloat16, param_dtype=jnp.float32,
                     implementation=implementation, rngs=rngs)  # fmt: skip
        self.layer1 = NeighborhoodAttentionS2(channels, grid, grid, **layer)
        self.layer2 = NeighborhoodAttentionS2(channels, grid, grid, **layer)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x + self.layer1(x)
        return h + self.layer2(h)


def fields(grid: tuple[int, int], channels: int, batch: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Input ``[batch, nlat, nlon, channels]`` (its noise drawn per batch element) and target
    ``[1, nlat, nlon, channels]``, float32."""
    nlat, nlon = grid
    theta, _ = jax_s2attn.precompute_latitudes(nlat)
    lon = 2 * np.pi * np.arange(nlon) / nlon
    t, p = theta[:, None, None], lon[None, :, None]
    phase = 2 * np.pi * np.arange(channels) / channels
    sin, cos = np.sin(t), np.cos(t)
    target = cos + 0.5 * sin**2 * np.cos(2 * p + phase) + 0.8 * sin * cos * np.sin(p + 2 * phase)
    inputs = sin * np.cos(p + phase) + 0.4 * (3 * cos**2 - 1) + 0.3 * sin**3 * np.sin(3 * p - phase)
    noise = np.random.default_rng(seed).standard_normal((batch, nlat, nlon, channels))
    return (inputs + 0.05 * noise).astype(np.float32), target[None].astype(np.float32)


@nnx.jit
def train_step(model: TwoLayers, optimizer: nnx.Optimizer, inputs: jax.Array, target: jax.Array) -> jax.Array:
    def loss_fn(model: TwoLayers) -> jax.Array:
        return jnp.mean(jnp.square(model(inputs).astype(jnp.float32) - target))

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def memory(device: jax.Device) -> dict | None:
    stats = device.memory_stats()
    if stats is None:
        return None
    return {key: stats.get(key) for key in ("bytes_in_use", "peak_bytes_in_use")}


def train(args: argparse.Namespace) -> dict:
    """Runs the soak and returns the record written to ``--out`` (``compare`` aside)."""
    device = jax.devices()[0]
    grid = tuple(args.grid)
    model = TwoLayers(grid, args.channels, heads=args.heads, theta_cutoff=args.theta_cutoff,
                      implementation=args.implementation, rngs=nnx.Rngs(args.seed))  # fmt: skip
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    inputs, target = (jnp.asarray(a) for a in fields(grid, args.channels, args.batch, args.seed))

    start = time.perf_counter()
    lowered = train_step.lower(model, optimizer, inputs, target)
    lowered_at = time.perf_counter()
    step = lowered.compile()
    compiled_at = time.perf_counter()

    losses, seconds, memory_at_step = [], [], None
    for i in range(1, args.steps + 1):
        begin = time.perf_counter()
        losses.append(jax.block_until_ready(step(model, optimizer, inputs, target)))
        seconds.append(time.perf_counter() - begin)
        if i == MEMORY_STEP:
            memory_at_step = memory(device)
    memory_at_end = memory(device)  # before the checks below allocate anything
    losses = np.asarray(jax.device_get(losses), np.float32)
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    finite = bool(np.isfinite(losses).all()) and all(bool(jnp.isfinite(p).all()) for p in params)
    timed = seconds[WARMUP_STEPS:] if args.steps > WARMUP_STEPS else seconds

    return dict(
        config=dict(grid=list(args.grid), channels=args.channels, heads=args.heads, theta_cutoff=args.theta_cutoff,
                    batch=args.batch, seed=args.seed, implementation=args.implementation, dtype="bfloat16",
                    param_dtype="float32", optimizer="adam(1e-3)"),  # fmt: skip
        steps=args.steps,
        losses=losses.tolist(),
        losses_sha256=hashlib.sha256(losses.astype("<f4").tobytes()).hexdigest(),
        any_nan=not finite,
        memory={f"step_{MEMORY_STEP}": memory_at_step, "end": memory_at_end},
        timing=dict(lower_s=lowered_at - start, compile_s=compiled_at - lowered_at,
                    first_step_s=seconds[0], median_step_s=float(np.median(timed)), timed_steps=len(timed),
                    total_steps_s=float(np.sum(seconds))),  # fmt: skip
        jax=jax.__version__,
        jaxlib=jaxlib.__version__,
        platform=device.platform,
        device_kind=device.device_kind,
        native=jax_s2attn.native_backends(),
    )


def compare(record: dict, path: pathlib.Path) -> dict:
    """Whether ``record``'s losses are bitwise those of the run saved at ``path``, and where they first differ."""
    other = json.loads(path.read_text())
    mine = np.asarray(record["losses"], np.float32).view(np.uint32)
    theirs = np.asarray(other["losses"], np.float32).view(np.uint32)
    n = min(mine.size, theirs.size)
    differing = np.flatnonzero(mine[:n] != theirs[:n])
    first = int(differing[0]) + 1 if differing.size else (n + 1 if mine.size != theirs.size else None)
    return dict(
        other=str(path),
        identical=other["losses_sha256"] == record["losses_sha256"],
        first_differing_step=first,
        other_any_nan=bool(other["any_nan"]),
        config_differences=sorted(k for k in record["config"] if record["config"][k] != other["config"].get(k)),
    )


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:.1f} MiB"


def summary(record: dict) -> str:
    cfg, timing, losses = record["config"], record["timing"], record["losses"]
    lines = [
        f"jax {record['jax']} (jaxlib {record['jaxlib']}), {record['device_kind']}; native: {record['native']}",
        f"2 x NeighborhoodAttentionS2 on {cfg['grid'][0]}x{cfg['grid'][1]}, C {cfg['channels']}, "
        f"{cfg['heads']} heads, theta_cutoff {cfg['theta_cutoff']}, bf16, batch {cfg['batch']}: "
        f"{record['steps']} steps of adam(1e-3), seed {cfg['seed']}",
        f"trace and lower {timing['lower_s']:.2f} s, compile {timing['compile_s']:.2f} s; "
        f"first step {1e3 * timing['first_step_s']:.1f} ms, then {1e3 * timing['median_step_s']:.3f} ms "
        f"(median of {timing['timed_steps']}); "
        f"steps in all {timing['total_steps_s']:.1f} s",
        f"loss: first {losses[0]:.6e}, last {losses[-1]:.6e}, min {min(losses):.6e}; "
        f"non-finite loss or parameter: {'YES' if record['any_nan'] else 'none'}",
    ]
    for mark, stats in record["memory"].items():
        if stats is None:
            lines.append(f"memory at {mark}: n/a")
        else:
            lines.append(f"memory at {mark}: in use {_mib(stats['bytes_in_use'])}, "
                         f"peak {_mib(stats['peak_bytes_in_use'])}")  # fmt: skip
    in_use = [stats and stats["bytes_in_use"] for stats in record["memory"].values()]
    if None not in in_use:
        lines.append(f"bytes in use, end minus step {MEMORY_STEP}: {in_use[1] - in_use[0]:+d}")
    lines.append(f"losses sha256 {record['losses_sha256']}")
    if "compare" in record:
        result = record["compare"]
        verdict = "identical" if result["identical"] else f"DIFFERENT (first at step {result['first_differing_step']})"
        lines.append(f"vs {result['other']}: {verdict}")
        if result["config_differences"]:
            lines.append(f"  configs differ in: {', '.join(result['config_differences'])}")
        if result["other_any_nan"]:
            lines.append("  the other run has a non-finite loss or parameter")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--grid", type=int, nargs=2, default=[181, 360], metavar=("NLAT", "NLON"))
    parser.add_argument("--channels", type=int, default=128, help="in_features of both layers")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--theta-cutoff", type=float, default=0.05)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="parameters, input noise")
    parser.add_argument("--implementation", default=None, choices=["reference", "ffi", "ffi-arc", "ffi-tiled"],
                        help="default: the fastest available")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("out/soak.json"))
    parser.add_argument("--compare", type=pathlib.Path, metavar="OTHER.json", help="a run to compare losses with")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")

    record = train(args)
    if args.compare is not None:
        record["compare"] = compare(record, args.compare)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(summary(record))
    print(f"wrote {args.out}")
    failed = record["any_nan"] or ("compare" in record and not record["compare"]["identical"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
