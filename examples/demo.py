"""Neighbourhood attention on a random spherical field: build a plan, run, time, check.

Runs on whatever device jax picks (CPU here). Usage: python examples/demo.py [--nlat 91 --nlon 180]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_s2attn


def _time(fn, *args, reps: int = 5) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nlat", type=int, default=91)
    parser.add_argument("--nlon", type=int, default=180)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--theta-cutoff", type=float, default=None, help="radians; default one latitude spacing")
    args = parser.parse_args()
    jax.config.update("jax_enable_x64", True)  # for the float64 check; the run itself is float32

    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; native kernels:")
    print("  " + jax_s2attn.native_status().replace("\n", "\n  "))
    shape = (args.nlat, args.nlon)
    start = time.perf_counter()
    plan = jax_s2attn.NeighborhoodPlan(shape, shape, theta_cutoff=args.theta_cutoff)
    print(f"plan: {plan} built in {time.perf_counter() - start:.3f} s")

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, *shape, args.heads, args.head_dim)), jnp.float32) for _ in range(3))
    results = {}
    for implementation in ["reference", "ffi"]:
        try:
            fn = jax.jit(lambda q, k, v, p, impl=implementation: jax_s2attn.neighborhood_attention(q, k, v, p, implementation=impl))
            results[implementation] = fn(q, k, v, plan)
        except ValueError as e:  # implementation not available in this build
            print(f"{implementation:>9}: skipped ({e})")
            continue
        seconds = _time(fn, q, k, v, plan)
        print(f"{implementation:>9}: {seconds * 1e3:8.2f} ms  ({plan.num_pairs * args.heads / seconds / 1e6:.1f} M pairs/s)")

    # Check against float64 on the reference path.
    expected = jax_s2attn.neighborhood_attention(*(x.astype(jnp.float64) for x in (q, k, v)), plan, implementation="reference")
    for implementation, out in results.items():
        error = float(jnp.max(jnp.abs(out - expected)) / jnp.max(jnp.abs(expected)))
        print(f"{implementation:>9}: max relative error vs float64 = {error:.2e}")
        assert error < 1e-5, f"{implementation} is wrong"


if __name__ == "__main__":
    main()
