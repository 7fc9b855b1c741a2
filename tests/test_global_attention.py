"""Global attention on the sphere (`attention_s2`): accuracy of both paths, weights, validation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_s2attn import GRIDS, NeighborhoodPlan, neighborhood_attention
from jax_s2attn.ops import global_attention
from jax_s2attn.ops.global_attention import attention_s2, quadrature_weights

# (in_shape, out_shape): self, downsampling, upsampling.
SHAPES = {"self": ((6, 12), (6, 12)), "down": ((8, 16), (5, 8)), "up": ((4, 6), (7, 12))}
HEADS, DK, DV = 2, 3, 5


def rel_error(actual, expected) -> float:
    actual = np.asarray(actual, np.float64)
    assert np.all(np.isfinite(actual)), "non-finite values"
    return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


def dense_reference(q, k, v, weights, scale):
    """Softmax over all keys of ``scale*q.k + log w`` in float64 (zero weights drop the key)."""
    q, k, v = (jnp.asarray(x, jnp.float64) for x in (q, k, v))
    batch = q.shape[:-4]
    q = q.reshape(*batch, -1, *q.shape[-2:])
    k = k.reshape(*batch, -1, *k.shape[-2:])
    v = v.reshape(*batch, -1, *v.shape[-2:])
    w = np.repeat(np.asarray(weights, np.float64), k.shape[-3] // len(weights))
    logits = scale * jnp.einsum("...thd,...shd->...hts", q, k) + np.where(w > 0, np.log(np.where(w > 0, w, 1)), -np.inf)
    return jnp.einsum("...hts,...shd->...thd", jax.nn.softmax(logits, axis=-1), v)


def random_inputs(rng, in_shape, out_shape, batch=(2,), dtype=np.float32):
    q = rng.standard_normal((*batch, *out_shape, HEADS, DK))
    k = rng.standard_normal((*batch, *in_shape, HEADS, DK))
    v = rng.standard_normal((*batch, *in_shape, HEADS, DV))
    return [jnp.asarray(x, dtype) for x in (q, k, v)]


def values_and_grads(fn, args, cotangent):
    @jax.jit
    def run(args, cotangent):
        out, vjp = jax.vjp(fn, *args)
        return [out, *vjp(cotangent.astype(out.dtype))]

    return run(args, cotangent)


@pytest.mark.parametrize("grid", GRIDS)
def test_quadrature_weights_equal_the_plans(grid):
    plan = NeighborhoodPlan((9, 18), (9, 18), grid, grid)
    weights = quadrature_weights((9, 18), grid)
    assert weights.dtype == np.float32
    np.testing.assert_array_equal(weights, plan.quad_weights)


@pytest.mark.parametrize("direction", list(SHAPES))
def test_xla_path_matches_dense_float64_reference(direction, rng):
    in_shape, out_shape = SHAPES[direction]
    weights = quadrature_weights(in_shape, "legendre-gauss")
    args = random_inputs(rng, in_shape, out_shape, batch=(2, 1))
    cotangent = jnp.asarray(rng.standard_normal((2, 1, *out_shape, HEADS, DV)))
    scale = 0.7
    ours = values_and_grads(lambda *a: attention_s2(*a, weights, scale=scale, implementation="xla"), args, cotangent)
    expected = values_and_grads(
        lambda *a: dense_reference(*a, weights, scale).reshape(2, 1, *out_shape, HEADS, DV),
        [x.astype(jnp.float64) for x in args],
        cotangent,
    )
    for name, a, e in zip(("out", "dq", "dk", "dv"), ours, expected):
        assert a.dtype == jnp.float32
        assert rel_error(a, e) <= 1e-5, name


@pytest.mark.parametrize("direction", ["self", "up"])
def test_equals_neighborhood_attention_with_full_cutoff(direction, rng):
    in_shape, out_shape = SHAPES[direction]
    plan = NeighborhoodPlan(in_shape, out_shape, "lobatto", "lobatto", theta_cutoff=np.pi)
    assert plan.max_neighbors == in_shape[0] * in_shape[1]
    args = random_inputs(rng, in_shape, out_shape, dtype=np.float64)
    expected = neighborhood_attention(*args, plan)
    ours = jax.jit(attention_s2)(*(x.astype(jnp.float32) for x in args), plan)  # plan as a jit argument
    assert rel_error(ours, expected) <= 1e-5


def test_zero_weight_removes_the_key(rng):
    in_shape, out_shape = SHAPES["self"]
    weights = quadrature_weights(in_shape).copy()
    weights[[0, 3]] = 0.0
    q, k, v = random_inputs(rng, in_shape, out_shape)
    ours = attention_s2(q, k, v, weights)
    # Huge values on the removed rows would dominate if they leaked into the output.
    v_poisoned = v.at[:, [0, 3]].set(1e6)
    ours_poisoned = attention_s2(q, k, v_poisoned, weights)
    expected = dense_reference(q, k, v, weights, 1 / np.sqrt(DK)).reshape(ours.shape)
    assert rel_error(ours, expected) <= 1e-5
    assert rel_error(ours_poisoned, expected) <= 1e-5


@pytest.mark.parametrize("dtype, tolerance", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_cudnn_weight_folding_is_exact(dtype, tolerance, rng):
    """The folded q'/k' reproduce the log-weight bias (checked through the XLA path on any backend)."""
    in_shape, out_shape = (7, 12), (7, 12)
    weights = quadrature_weights(in_shape)  # equiangular: tiny pole weights
    weights[1] = 0.0
    q, k, v = random_inputs(rng, in_shape, out_shape, dtype=dtype)
    scale = 1 / np.sqrt(DK)
    flat = [x.reshape(2, -1, *x.shape[-2:]) for x in (q, k, v)]
    folded = global_attention._fold_log_weights(*flat, global_attention._log_weights(weights, in_shape[1]), scale, 8)
    assert [x.shape[-1] for x in folded] == [8, 8, 8]
    out = jax.nn.dot_product_attention(*folded, scale=scale, implementation="xla")[..., :DV]
    expected = dense_reference(q, k, v, weights, scale).reshape(out.shape)
    assert rel_error(out.astype(jnp.float32), expected) <= tolerance


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["cudnn", None])
def test_cudnn_path_on_gpu(implementation, rng):
    in_shape, out_shape = (12, 24), (12, 24)
    weights = quadrature_weights(in_shape)
    args = random_inputs(rng, in_shape, out_shape, dtype=jnp.bfloat16)
    cotangent = jnp.asarray(rng.standard_normal((2, *out_shape, HEADS, DV)))
    fn = jax.jit(lambda *a: attention_s2(*a, weights, implementation=implementation))
    assert "cudnn" in fn.lower(*args).as_text().lower()
    ours = values_and_grads(fn, args, cotangent)
    expected = values_and_grads(
        lambda *a: dense_reference(*a, weights, 1 / np.sqrt(DK)).reshape(2, *out_shape, HEADS, DV),
        [x.astype(jnp.float64) for x in args],
        cotangent,
    )
    for name, a, e in zip(("out", "dq", "dk", "dv"), ours, expected):
        assert a.dtype == jnp.bfloat16
        assert rel_error(a.astype(jnp.float32), e) <= 1e-2, name


def test_invalid_arguments_raise(rng):
    q, k, v = random_inputs(rng, (6, 12), (6, 12))
    weights = quadrature_weights((6, 12))
    with pytest.raises(ValueError, match="implementation='flash'"):
        attention_s2(q, k, v, weights, implementation="flash")
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        attention_s2(q, k, v, weights, implementation="cudnn")
    with pytest.raises(ValueError, match="value has shape"):
        attention_s2(q, k, v[..., :4, :, :], weights)
    with pytest.raises(ValueError, match="quad_weights has shape"):
        attention_s2(q, k, v, weights[:5])
    with pytest.raises(TypeError, match="share one dtype"):
        attention_s2(q, k.astype(jnp.float64), v, weights)
    with pytest.raises(ValueError, match="rank >= 4"):
        attention_s2(q[0, 0], k, v, weights)
