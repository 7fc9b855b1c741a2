"""Gradients of the native op (custom VJP over the dQ and dK/dV targets) against float64."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_s2attn import NeighborhoodPlan, neighborhood_attention
from jax_s2attn.ops import _ffi

pytestmark = pytest.mark.skipif(not _ffi.HAS_CPU_EXT, reason="native CPU module not built")

EQ, LG, LOB, TRAP = "equiangular", "legendre-gauss", "lobatto", "equiangular-trapezoidal"

# (in_shape, out_shape, grid_in, grid_out, theta_cutoff) and (batch dims, heads, Dk, Dv).
CASES = [
    (((8, 16), (8, 16), EQ, EQ, None), ((3,), 4, 32, 16)),
    (((7, 12), (7, 12), LG, LG, 0.6), ((3,), 1, 5, 7)),
    (((8, 12), (8, 12), LOB, LOB, 0.5), ((2,), 4, 64, 64)),
    (((7, 10), (7, 10), TRAP, TRAP, None), ((), 1, 130, 32)),
    (((12, 24), (6, 8), LG, LG, 0.6), ((3,), 1, 32, 5)),  # downsample, pscale 3
    (((7, 12), (5, 6), EQ, LOB, 0.7), ((3,), 4, 5, 130)),  # odd latitudes
    (((6, 24), (12, 12), EQ, EQ, None), ((3,), 1, 64, 16)),  # more latitudes, fewer longitudes
    (((6, 12), (12, 24), EQ, EQ, None), ((3,), 4, 32, 32)),  # upsample, pscale 2
    (((6, 12), (12, 12), EQ, EQ, None), ((2, 1), 1, 5, 5)),  # latitude-only upsample
]
# The fast tier: every grid, self, down and up, Dk = 130 without batch dims; the slow tier also the odd geometries.
TIERED_CASES = [pytest.param(c, marks=pytest.mark.slow) if i in (1, 5, 6, 8) else c for i, c in enumerate(CASES)]

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _case_id(case):
    (in_shape, out_shape, grid_in, grid_out, cutoff), _ = case
    return f"{in_shape}->{out_shape}-{grid_in}-{grid_out}-{cutoff}"


def _vjp(plan, implementation, primals, cotangents):
    """``(out, lse, dq, dk, dv)`` of the op, pulled back through both outputs."""

    def attention(q, k, v):
        return neighborhood_attention(q, k, v, plan, implementation=implementation, return_residual=True)

    (out, lse), pullback = jax.vjp(attention, *primals)
    dout, dlse = cotangents
    return (out, lse, *pullback((dout.astype(out.dtype), dlse.astype(lse.dtype))))


def _setup(case, exact_random):
    geometry, (batch, heads, dk, dv) = case
    plan = NeighborhoodPlan(*geometry)
    primals = (
        exact_random(*batch, *plan.out_shape, heads, dk),
        exact_random(*batch, *plan.in_shape, heads, dk),
        exact_random(*batch, *plan.in_shape, heads, dv),
    )
    cotangents = (exact_random(*batch, *plan.out_shape, heads, dv), exact_random(*batch, *plan.out_shape, heads))
    return plan, primals, cotangents


@pytest.mark.parametrize("case", TIERED_CASES, ids=_case_id)
def test_gradients_match_float64_oracle(platform, case, exact_random, dense_attention, rel_error, tolerance):
    plan, primals, cotangents = _setup(case, exact_random)
    scale = 1.0 / np.sqrt(primals[0].shape[-1])
    # The dense oracle takes one batch axis; it is written in jax.numpy, so jax.vjp differentiates it.
    flat = [jnp.asarray(np.reshape(x, (-1, *x.shape[-4:]))) for x in primals]
    (want_out, want_lse), pullback = jax.vjp(lambda q, k, v: dense_attention(q, k, v, plan, scale), *flat)
    grads = pullback((jnp.reshape(cotangents[0], want_out.shape), jnp.reshape(cotangents[1], want_lse.shape)))
    want = [want_out, want_lse, *grads]
    native = jax.jit(lambda p, c: _vjp(plan, "ffi", p, c))
    for dtype in DTYPES:
        got = native(tuple(jnp.asarray(x, dtype) for x in primals), tuple(jnp.asarray(x, dtype) for x in cotangents))
        for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
            assert g.dtype == (jnp.float32 if name == "lse" else dtype), name
            bound = 1e-5 if name == "lse" else tolerance(dtype)
            assert rel_error(np.reshape(g, w.shape), w) <= bound, (name, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_is_bitwise_deterministic(platform, dtype, exact_random):
    """Two backward runs give identical bits (no atomics, order fixed per element)."""
    plan, primals, cotangents = _setup(CASES[7], exact_random)
    primals = tuple(jnp.asarray(x, dtype) for x in primals)
    cotangents = tuple(jnp.asarray(x, dtype) for x in cotangents)
    first = jax.jit(lambda p, c: _vjp(plan, "ffi", p, c)[2:])(primals, cotangents)
    # A separately compiled program (different jit wrapper) over fresh copies of the inputs.
    second = jax.jit(lambda p, c: _vjp(plan, "ffi", p, c))(
        tuple(jnp.array(x, copy=True) for x in primals), cotangents
    )[2:]
    for a, b in zip(first, second):
        assert not np.isnan(np.asarray(a, np.float32)).any()
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
