"""One small end-to-end run of the CUDA targets, for compute-sanitizer (needs a CUDA GPU).

Runs the forward, dQ and dK/dV kernels once per case through the public API
(``neighborhood_attention(..., implementation="ffi")`` and ``jax.grad``) and compares output
and gradients with the float64 reference. Exits 0 when everything matches, 1 on a mismatch,
2 when no CUDA device or no CUDA module is available. Cases cover the vector path (Dk = Dv =
64) and the general path (Dk = 5, Dv = 7), float32 and bfloat16, self-attention,
downsampling and upsampling, with longitude counts that leave partial blocks.

Usage (from the repository root, with jax_s2attn installed with its CUDA module)::

    python tests/gpu_sanitizer.py
    compute-sanitizer --tool memcheck  --error-exitcode 3 --kernel-name kns=NbhdAttn python tests/gpu_sanitizer.py
    compute-sanitizer --tool racecheck --error-exitcode 3 --kernel-name kns=NbhdAttn python tests/gpu_sanitizer.py
    compute-sanitizer --tool synccheck --error-exitcode 3 --kernel-name kns=NbhdAttn python tests/gpu_sanitizer.py
    compute-sanitizer --tool initcheck --error-exitcode 3 --kernel-name kns=NbhdAttn python tests/gpu_sanitizer.py

``--kernel-name kns=NbhdAttn`` (a kernel-name substring) limits the checks to this
project's kernels (XLA's own are not ours to fix); if the installed compute-sanitizer does
not know the option, drop it. The script makes XLA allocate every buffer separately
(``XLA_PYTHON_CLIENT_ALLOCATOR=platform``) so memcheck sees real allocation bounds for the
operands rather than one preallocated pool.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_s2attn import NeighborhoodPlan, native_backends, neighborhood_attention  # noqa: E402

# (in_shape, out_shape, theta_cutoff): 18/36 longitudes leave partial blocks of queries.
PLANS = [((9, 18), (9, 18), 0.6), ((10, 36), (5, 18), 0.7), ((5, 18), (10, 36), 0.7)]
HEAD_DIMS = [(64, 64), (5, 7)]  # vector path, general path
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def relative_error(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-30))


def loss_and_grads(q, k, v, plan, implementation):
    """Output and the gradients of <out, cotangent> with respect to q, k and v."""

    def loss(q, k, v, cotangent):
        out = neighborhood_attention(q, k, v, plan, implementation=implementation)
        return jnp.sum(out.astype(cotangent.dtype) * cotangent), out

    cotangent = jnp.asarray(np.cos(np.arange(np.prod(q.shape[:-1]) * v.shape[-1])).reshape(*q.shape[:-1], -1))
    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    (_, out), grads = fn(q, k, v, cotangent.astype(jnp.float64 if q.dtype == jnp.float64 else jnp.float32))
    return out, grads


def main() -> int:
    if not any(d.platform == "gpu" for d in jax.devices()) or not native_backends()["cuda"]:
        print("gpu_sanitizer: needs a CUDA device and the CUDA module (jax_s2attn.native_status())", file=sys.stderr)
        return 2
    rng = np.random.default_rng(20261129)
    failures = 0
    for in_shape, out_shape, cutoff in PLANS:
        plan = NeighborhoodPlan(in_shape, out_shape, theta_cutoff=cutoff)
        for dk, dv in HEAD_DIMS:
            shapes = [(2, *out_shape, 2, dk), (2, *in_shape, 2, dk), (2, *in_shape, 2, dv)]
            inputs = [rng.standard_normal(s) for s in shapes]
            for dtype, tolerance in TOLERANCE.items():
                q, k, v = (jnp.asarray(x, dtype) for x in inputs)
                out, grads = loss_and_grads(q, k, v, plan, "ffi")
                want_out, want_grads = loss_and_grads(*(x.astype(jnp.float64) for x in (q, k, v)), plan, "reference")
                errors = {"out": relative_error(out, want_out)}
                errors.update({f"d{n}": relative_error(g, w) for n, g, w in zip("qkv", grads, want_grads)})
                ok = all(np.isfinite(e) and e <= tolerance for e in errors.values())
                failures += not ok
                print(
                    f"{'ok  ' if ok else 'FAIL'} {in_shape}->{out_shape} Dk={dk} Dv={dv} {jnp.dtype(dtype).name}: "
                    + " ".join(f"{n}={e:.1e}" for n, e in errors.items())
                )
    print(f"gpu_sanitizer: {failures} failing case(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
