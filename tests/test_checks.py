"""Trace-time validation of the public op: every bad input names the argument and the fix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_s2attn import NeighborhoodPlan, neighborhood_attention

PLAN = NeighborhoodPlan((8, 16), (4, 8), theta_cutoff=0.8)


def _arrays(q_shape=(2, 4, 8, 2, 3), k_shape=(2, 8, 16, 2, 3), v_shape=(2, 8, 16, 2, 5), dtypes=(jnp.float32,) * 3):
    return tuple(jnp.ones(s, d) for s, d in zip((q_shape, k_shape, v_shape), dtypes))


@pytest.mark.parametrize(
    "arrays, error, match",
    [
        (_arrays(q_shape=(2, 4, 9, 2, 3)), ValueError, r"query has shape \(2, 4, 9, 2, 3\).*output grid \(4, 8\)"),
        (_arrays(k_shape=(2, 8, 16, 2, 4)), ValueError, r"key has shape .*, expected \(2, 8, 16, 2, 3\)"),
        (_arrays(v_shape=(2, 8, 16, 3, 5)), ValueError, r"value has shape .*, expected \(2, 8, 16, 2, 5\)"),
        (_arrays(k_shape=(3, 8, 16, 2, 3)), ValueError, r"key has shape \(3, 8, 16, 2, 3\)"),
        (_arrays(q_shape=(4, 8, 3)), ValueError, r"query must have shape \[..., nlat, nlon, heads, head_dim\]"),
        (_arrays(dtypes=(jnp.float32, jnp.bfloat16, jnp.float32)), TypeError, "must share one dtype.*key=bfloat16"),
        (_arrays(dtypes=(jnp.int32,) * 3), TypeError, "query has dtype int32"),
    ],
)
def test_bad_inputs(arrays, error, match):
    with pytest.raises(error, match=match):
        neighborhood_attention(*arrays, PLAN)


def test_errors_are_raised_at_trace_time():
    q, k, v = _arrays(q_shape=(2, 4, 9, 2, 3))
    with pytest.raises(ValueError, match="query has shape"):
        jax.jit(neighborhood_attention).lower(q, k, v, PLAN)


def test_bad_plan_and_options():
    q, k, v = _arrays()
    with pytest.raises(TypeError, match="plan must be a jax_s2attn.NeighborhoodPlan"):
        neighborhood_attention(q, k, v, (8, 16))
    with pytest.raises(ValueError, match="implementation='triton' is not supported"):
        neighborhood_attention(q, k, v, PLAN, implementation="triton")
    with pytest.raises(TypeError, match="query must be an array"):
        neighborhood_attention([[1.0]], k, v, PLAN)
    with pytest.raises(TypeError, match="scale must be a real number"):
        neighborhood_attention(q, k, v, PLAN, scale=object())


def test_accepts_numpy_and_scalar_scale():
    q, k, v = (np.asarray(x) for x in _arrays())
    out = neighborhood_attention(q, k, v, PLAN, scale=np.float32(0.3))
    assert out.shape == (2, 4, 8, 2, 5) and out.dtype == jnp.float32
