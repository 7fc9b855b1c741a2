"""Runs the native kernels once per configuration (a forward, then a forward+backward) for a profiler.

Meant to run under Nsight Compute, which selects the kernels by name; ``run_h200.sh profile``
does that and keeps the reports. Per configuration the kernels run as a forward (one launch per kernel), then
as a forward+backward (forward, dq, dk/dv); ``ncu -k regex:ScheduledAttention --launch-skip 1 --launch-count 3``
takes the three scheduled kernels of the second, one configuration per ncu call (``regex:Stencil`` the stencil
kernels beside them on rows of short arcs, ``regex:"ScheduledAttention|Stencil" --launch-skip 2 --launch-count 6``
both families where the op runs both). ``--implementation`` picks the kernels as ``neighborhood_attention`` does
(default ``ffi-tiled``: the tensor-core path, the scheduled kernels with the stencil ones where the op runs them;
``ffi-arc`` the arc kernels); ``--family scheduled`` or ``arc`` runs that family's forward and backward as the
native op does (the stencil kernels beside the scheduled ones where the op runs them) whatever the op's dispatch
would pick, for a per-kernel timeline (``ncu --metrics gpu__time_duration.sum``).

Run: ``python benchmarks/profile_kernels.py --grid 721 1440 --theta-cutoff 0.03 [--grid ...]``.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jax_s2attn import NeighborhoodPlan, neighborhood_attention
from jax_s2attn.ops.neighborhood import _native_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", type=int, nargs=2, action="append", required=True, metavar=("NLAT", "NLON"))
    parser.add_argument("--theta-cutoff", type=float, action="append",
                        help="one per --grid; omit for the default cutoff of every grid")
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--implementation", default="ffi-tiled")
    parser.add_argument("--family", choices=("scheduled", "arc"),
                        help="run this native kernel family as the native op does, in place of --implementation")
    args = parser.parse_args()
    cutoffs = args.theta_cutoff or [None] * len(args.grid)
    if len(cutoffs) != len(args.grid):
        parser.error("give one --theta-cutoff per --grid, or none")
    if args.family is not None and jax.default_backend() != "gpu":
        parser.error(f"--family runs the CUDA kernels; this machine's jax backend is {jax.default_backend()!r}")

    if args.family is None:
        def forward(q, k, v, plan):
            return neighborhood_attention(q, k, v, plan, implementation=args.implementation)
    else:  # the op's native path with its dispatch bypassed: the family's forward, and its backward under grad
        def forward(q, k, v, plan):
            return _native_attention(q, k, v, plan, q.shape[-1] ** -0.5, args.family)[0]

    forward = jax.jit(forward)

    def loss(q, k, v, plan, cotangent):
        return jnp.sum(forward(q, k, v, plan).astype(jnp.float32) * cotangent.astype(jnp.float32))

    gradients = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    rng = np.random.default_rng(0)
    for shape, cutoff in zip(map(tuple, args.grid), cutoffs):
        plan = NeighborhoodPlan(shape, shape, theta_cutoff=cutoff)
        q, k, v, cotangent = (
            jnp.asarray(rng.standard_normal((1, *shape, 1, args.channels), dtype=np.float32), args.dtype)
            for _ in range(4)
        )
        jax.block_until_ready(forward(q, k, v, plan))
        jax.block_until_ready(gradients(q, k, v, plan, cotangent))
        print(f"{shape} theta_cutoff={plan.theta_cutoff:.4g}: forward and forward+backward ran", flush=True)


if __name__ == "__main__":
    main()
