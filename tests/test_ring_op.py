"""neighborhood_attention on ring-grid plans: flat fields with batch axes against a dense float64 evaluation
(outputs and gradients in float32 within 1e-5, bfloat16 within 1e-2), under jit with the plan as an argument,
empty batches, and what bad input gets at trace time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_s2attn import RingGrid, RingPlan, neighborhood_attention

PLAN = RingPlan(RingGrid.latlon(13, 24), RingGrid.healpix(4), 0.3)  # lat-lon -> HEALPix, 24 vs 16 longitudes


def _dense(q, k, v, plan, scale):
    """out of a dense masked softmax over every pair (jnp, differentiable; float64 under enable_x64), batch axes
    [B..., points, H, D]."""

    def unit(grid):
        theta, phi = grid.point_colatitudes(), grid.point_longitudes()
        return np.stack([np.sin(theta) * np.cos(phi), np.sin(theta) * np.sin(phi), np.cos(theta)], axis=1)

    mask = np.arccos(np.clip(unit(plan.grid_out) @ unit(plan.grid_in).T, -1, 1)) <= (1 + 1e-3) * plan.theta_cutoff
    logits = jnp.einsum("...ohd,...ihd->...hoi", q, k) * scale + np.log(plan.grid_in.point_weights())
    weights = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
    return jnp.einsum("...hoi,...ihd->...ohd", weights, v)


def _dense64(q, k, v, plan, scale):
    """:func:`_dense` in float64, as numpy."""
    with jax.enable_x64(True):
        return np.asarray(_dense(*(jnp.asarray(x, jnp.float64) for x in (q, k, v)), plan, scale))


def _inputs(seed, batch=(2, 3), dtype=np.float32):
    rng = np.random.default_rng(seed)
    shapes = [(*batch, PLAN.npoints_out, 2, 8), (*batch, PLAN.npoints_in, 2, 8), (*batch, PLAN.npoints_in, 2, 5)]
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


def test_float32_outputs_and_gradients_match_float64():
    q, k, v = _inputs(0)
    scale = 0.35
    out = neighborhood_attention(q, k, v, PLAN, scale=scale)
    expected = _dense64(q, k, v, PLAN, scale)
    assert out.shape == (2, 3, PLAN.npoints_out, 2, 5) and out.dtype == jnp.float32
    assert np.linalg.norm(out - expected) / np.linalg.norm(expected) <= 1e-5
    g = np.random.default_rng(1).standard_normal(out.shape).astype(np.float32)
    grads = jax.grad(lambda q, k, v: jnp.vdot(neighborhood_attention(q, k, v, PLAN, scale=scale), g),
                     argnums=(0, 1, 2))(q, k, v)  # fmt: skip
    with jax.enable_x64(True):
        q64, k64, v64, g64 = (jnp.asarray(x, jnp.float64) for x in (q, k, v, g))
        expected_grads = jax.grad(lambda q, k, v: jnp.vdot(_dense(q, k, v, PLAN, scale), g64),
                                  argnums=(0, 1, 2))(q64, k64, v64)  # fmt: skip
    for name, a, b in zip("qkv", grads, expected_grads):
        assert np.linalg.norm(a - b) / np.linalg.norm(b) <= 1e-5, name


def test_bfloat16_within_1e_2_and_lse():
    q, k, v = _inputs(2)
    out, lse = neighborhood_attention(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), PLAN, return_residual=True)
    expected = _dense64(q, k, v, PLAN, 1 / np.sqrt(8))
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32 and lse.shape == (2, 3, PLAN.npoints_out, 2)
    assert np.linalg.norm(np.asarray(out, np.float64) - expected) / np.linalg.norm(expected) <= 1e-2


def test_the_plan_is_an_ordinary_jit_argument_and_batches_may_be_empty():
    q, k, v = _inputs(3, batch=(2,))
    jitted = jax.jit(lambda q, k, v, plan: neighborhood_attention(q, k, v, plan))
    np.testing.assert_allclose(jitted(q, k, v, PLAN), neighborhood_attention(q, k, v, PLAN), rtol=1e-6, atol=1e-6)
    empty = [x[:0] for x in (q, k, v)]
    out, lse = neighborhood_attention(*empty, PLAN, return_residual=True)
    assert out.shape == (0, PLAN.npoints_out, 2, 5) and lse.shape == (0, PLAN.npoints_out, 2)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda q, k, v: (q[..., :5, :, :], k, v), ValueError, r"query has shape .* must hold the plan's 192 output"),
        (lambda q, k, v: (q, k[..., :7, :, :], v), ValueError, r"key has shape .* lies on the plan's input grid"),
        (lambda q, k, v: (q, k, v[:1]), ValueError, r"value has shape"),
        (lambda q, k, v: (q, k.astype(np.float16), v), TypeError, r"must share one dtype"),
        (lambda q, k, v: (q[0, 0, 0], k, v), ValueError, r"query must have shape \[\.\.\., npoints, heads, head_dim\]"),
    ],
)
def test_bad_fields_are_refused_at_trace_time(change, error, match):
    with pytest.raises(error, match=match):
        neighborhood_attention(*change(*_inputs(4, batch=(2,))), PLAN)


def test_the_tensor_core_kernels_where_they_cannot_run_are_refused_with_the_fix():
    """On the CPU (and for float32 anywhere) "ffi-tiled" names why the scheduled kernels cannot run."""
    with pytest.raises(ValueError, match=r"'ffi-tiled' cannot run a RingPlan on cpu: the scheduled kernels cannot "
                                         r"run.*Use implementation=None"):
        neighborhood_attention(*_inputs(5, batch=(1,)), PLAN, implementation="ffi-tiled")
