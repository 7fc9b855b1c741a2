"""Pure-JAX reference op against an independent dense float64 masked softmax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jax_s2attn import NeighborhoodPlan, neighborhood_attention
from jax_s2attn.ops import _ffi
from jax_s2attn.ops.reference import reference_attention


def slow(*case):
    """A case of the slow tier only; the fast tier keeps self, down, up and global."""
    return pytest.param(case, marks=pytest.mark.slow)


CASES = [
    # in_shape, out_shape, grid_in, grid_out, cutoff, heads, dk, dv
    ((9, 16), (9, 16), "equiangular", "equiangular", 0.5, 1, 4, 4),
    slow((8, 16), (8, 16), "legendre-gauss", "legendre-gauss", None, 3, 5, 3),
    slow((10, 12), (10, 12), "lobatto", "lobatto", 0.6, 1, 3, 6),
    slow((9, 12), (9, 12), "equiangular-trapezoidal", "equiangular-trapezoidal", None, 3, 4, 2),
    ((12, 24), (6, 12), "equiangular", "equiangular", None, 3, 4, 5),  # down pscale 2
    slow((12, 24), (7, 8), "legendre-gauss", "lobatto", 0.6, 1, 3, 3),  # down pscale 3, odd
    slow((12, 12), (6, 12), "equiangular", "equiangular", None, 1, 2, 3),  # latitude-only
    slow((6, 24), (12, 12), "equiangular", "equiangular", None, 3, 3, 4),  # more latitudes, fewer longitudes
    ((6, 12), (12, 24), "equiangular", "equiangular", None, 1, 4, 4),  # up pscale 2
    slow((5, 8), (11, 24), "lobatto", "legendre-gauss", 0.7, 3, 3, 5),  # up pscale 3, odd
    ((9, 16), (9, 16), "equiangular", "equiangular", 4.0, 1, 3, 3),  # global neighbourhood
]


def _inputs(rng, plan, batch, heads, dk, dv, dtype=np.float64):
    q = rng.standard_normal((*batch, *plan.out_shape, heads, dk))
    k = rng.standard_normal((*batch, *plan.in_shape, heads, dk))
    v = rng.standard_normal((*batch, *plan.in_shape, heads, dv))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}->{c[1]}-{c[2]}-{c[3]}-{c[4]}-H{c[5]}")
def test_matches_dense_float64(case, rng, dense_attention, rel_error):
    in_shape, out_shape, grid_in, grid_out, cutoff, heads, dk, dv = case
    plan = NeighborhoodPlan(in_shape, out_shape, grid_in, grid_out, cutoff)
    q, k, v = _inputs(rng, plan, (2,), heads, dk, dv)
    scale = 0.8
    out, lse = neighborhood_attention(q, k, v, plan, scale=scale, implementation="reference", return_residual=True)
    expected_out, expected_lse = dense_attention(q, k, v, plan, scale)
    assert out.dtype == jnp.float64 and out.shape == expected_out.shape
    assert rel_error(out, expected_out) < 1e-13
    assert rel_error(lse, expected_lse) < 1e-13


def test_default_scale_and_leading_batch_dims(rng, dense_attention, rel_error):
    plan = NeighborhoodPlan((8, 16), (8, 16), theta_cutoff=0.6)
    q, k, v = _inputs(rng, plan, (2, 3), 2, 4, 3)
    out = neighborhood_attention(q, k, v, plan)
    expected, _ = dense_attention(q.reshape(6, *q.shape[2:]), k.reshape(6, *k.shape[2:]), v.reshape(6, *v.shape[2:]), plan, 0.5)
    assert out.shape == (2, 3, 8, 16, 2, 3)
    assert rel_error(out.reshape(expected.shape), expected) < 1e-13


def test_small_chunks_agree(rng):
    # Many chunks per bucket (and a ragged last chunk) give the same answer as one.
    plan = NeighborhoodPlan((9, 16), (9, 16), theta_cutoff=0.7)
    q, k, v = _inputs(rng, plan, (2,), 2, 3, 3)
    one, lse_one = reference_attention(q, k, v, plan, 0.6)
    many, lse_many = reference_attention(q, k, v, plan, 0.6, chunk_elements=7 * 2 * 2 * 6 * 64)
    np.testing.assert_allclose(many, one, rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose(lse_many, lse_one, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2), (jnp.float16, 1e-2)])
def test_low_precision(dtype, tol, rng, dense_attention, rel_error):
    plan = NeighborhoodPlan((12, 24), (6, 12))
    q, k, v = _inputs(rng, plan, (2,), 2, 8, 8, np.float32)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    out, lse = neighborhood_attention(q, k, v, plan, implementation="reference", return_residual=True)
    assert out.dtype == dtype and lse.dtype == jnp.float32
    expected, _ = dense_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), plan, 1 / np.sqrt(8))
    assert rel_error(out, expected) < tol


@pytest.mark.parametrize(
    "shapes",
    [((8, 12), (8, 12)), pytest.param(((8, 24), (6, 12)), marks=pytest.mark.slow),
     pytest.param(((5, 6), (7, 12)), marks=pytest.mark.slow)],
)
def test_gradients_float64(shapes, rng):
    plan = NeighborhoodPlan(*shapes, theta_cutoff=0.7)
    q, k, v = _inputs(rng, plan, (1,), 2, 3, 2)
    check_grads(
        jax.jit(lambda q, k, v: neighborhood_attention(q, k, v, plan, implementation="reference")),
        (q, k, v),
        order=1,
        modes=("rev",),
        atol=1e-6,
        rtol=1e-6,
    )


def test_gradients_match_dense(rng, rel_error, dense_attention):
    plan = NeighborhoodPlan((8, 16), (4, 8), theta_cutoff=0.8)
    q, k, v = _inputs(rng, plan, (2,), 2, 3, 4)
    g = jnp.asarray(rng.standard_normal((2, 4, 8, 2, 4)))
    ours = jax.grad(lambda *a: jnp.sum(neighborhood_attention(*a, plan) * g), (0, 1, 2))(q, k, v)
    theirs = jax.grad(lambda *a: jnp.sum(dense_attention(*a, plan, 1 / np.sqrt(3))[0] * g), (0, 1, 2))(q, k, v)
    for a, b in zip(ours, theirs):
        assert rel_error(a, b) < 1e-12


def test_jit_grad_vmap(rng):
    plan = NeighborhoodPlan((8, 16), (8, 16), theta_cutoff=0.5)
    q, k, v = _inputs(rng, plan, (3,), 1, 3, 3)
    eager = neighborhood_attention(q, k, v, plan)
    as_argument = jax.jit(neighborhood_attention)(q, k, v, plan)
    mapped = jax.vmap(lambda q, k, v: neighborhood_attention(q[None], k[None], v[None], plan)[0])(q, k, v)
    for result in (as_argument, mapped):
        np.testing.assert_allclose(result, eager, rtol=1e-13, atol=1e-13)
    loss = lambda q, k, v, p: jnp.sum(neighborhood_attention(q, k, v, p) ** 2)
    grads = jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v, plan)
    per_example = jax.jit(jax.vmap(jax.grad(lambda q, k, v: loss(q[None], k[None], v[None], plan), (0, 1, 2))))(q, k, v)
    for a, b in zip(grads, per_example):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_memory_is_bounded_at_quarter_degree():
    # 721x1440 with the default cutoff: 24 M pairs, ~12 GB if all gathered keys/values
    # existed at once. The compiled program's temporaries must stay near the chunk budget.
    plan = NeighborhoodPlan((721, 1440), (721, 1440))
    shape = jax.ShapeDtypeStruct((1, 721, 1440, 1, 64), jnp.float32)
    fn = jax.jit(lambda q, k, v: neighborhood_attention(q, k, v, plan, implementation="reference"))
    memory = fn.lower(shape, shape, shape).compile().memory_analysis()
    assert memory.temp_size_in_bytes < 2 * 1024**3, memory.temp_size_in_bytes


# ----------------------------------------------------------------------------- NaN, empty inputs

NAN_PLANS = {
    "self": lambda: NeighborhoodPlan((12, 24), (12, 24), theta_cutoff=0.4),
    "down": lambda: NeighborhoodPlan((12, 24), (6, 12)),
    "up": lambda: NeighborhoodPlan((6, 12), (12, 24)),
}


def _with_nan(x, index):
    return x.at[index].set(jnp.nan)


@pytest.mark.parametrize("plan_name", sorted(NAN_PLANS))
@pytest.mark.parametrize("operand", ["key", "value"])
def test_nan_in_one_key_reaches_exactly_the_outputs_that_have_it_as_a_neighbour(plan_name, operand, rng,
                                                                                 dense_membership):  # fmt: skip
    plan = NAN_PLANS[plan_name]()
    q, k, v = _inputs(rng, plan, (2,), 2, 4, 3, np.float32)
    point = (1, plan.nlat_in // 2, 3)  # batch 1, a mid latitude, longitude 3
    k, v = (_with_nan(x, point) if name == operand else x for name, x in (("key", k), ("value", v)))
    out = neighborhood_attention(q, k, v, plan, implementation="reference")
    has_it = dense_membership(plan)[:, point[1] * plan.nlon_in + point[2]].reshape(plan.out_shape)
    nan = np.isnan(np.asarray(out))
    assert nan[1].any() and not nan[0].any()
    np.testing.assert_array_equal(nan[1], np.broadcast_to(has_it[:, :, None, None], nan[1].shape))


@pytest.mark.skipif(not _ffi.HAS_CPU_EXT, reason="needs the native CPU module (CI has it)")
@pytest.mark.parametrize("plan_name", sorted(NAN_PLANS))
def test_nan_and_inf_in_inputs_land_where_the_native_kernels_put_them(plan_name, rng):
    """Outputs and all three gradients: the reference and the native kernels agree on every non-finite element."""
    plan = NAN_PLANS[plan_name]()
    q, k, v = _inputs(rng, plan, (2,), 2, 4, 3, np.float32)
    q = q.at[0, 2, 5, 1, 0].set(jnp.inf)
    k = k.at[0, plan.nlat_in - 2, 1, 0, 2].set(jnp.nan)
    v = v.at[1, 1, 7, 1, 1].set(jnp.nan)

    def grads(implementation):
        def loss(q, k, v):
            out = neighborhood_attention(q, k, v, plan, implementation=implementation)
            return jnp.sum(out * jnp.arange(out.shape[-1], dtype=out.dtype)), out

        (_, out), g = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
        return [np.asarray(x) for x in (out, *g)]

    for name, ours, native in zip(("out", "dq", "dk", "dv"), grads("reference"), grads("ffi-arc")):
        assert (~np.isfinite(native)).any() and np.isfinite(native).any(), name  # both kinds present
        np.testing.assert_array_equal(np.isnan(ours), np.isnan(native), err_msg=name)
        np.testing.assert_array_equal(np.isinf(ours), np.isinf(native), err_msg=name)


@pytest.mark.parametrize("implementation", [None, "reference"])
@pytest.mark.parametrize("shape", [(0, 2), (2, 0)], ids=["empty-batch", "no-heads"])
def test_empty_batches_and_heads(implementation, shape, rng):
    plan = NeighborhoodPlan((8, 16), (4, 8), theta_cutoff=0.8)
    batch, heads = shape
    q, k, v = _inputs(rng, plan, (batch,), heads, 3, 5, np.float32)
    out, lse = neighborhood_attention(q, k, v, plan, implementation=implementation, return_residual=True)
    assert out.shape == (batch, 4, 8, heads, 5) and out.dtype == jnp.float32
    assert lse.shape == (batch, 4, 8, heads)
    grads = jax.grad(lambda *a: jnp.sum(neighborhood_attention(*a, plan, implementation=implementation)), (0, 1, 2))(
        q, k, v
    )
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


@pytest.mark.parametrize("plan_name", sorted(NAN_PLANS))
def test_float64_is_float64_end_to_end(plan_name, rng, dense_attention, rel_error):
    """The host's exact weights, not their float32 rounding (which is 3e-8 off), outputs and gradients."""
    plan = NAN_PLANS[plan_name]()
    q, k, v = _inputs(rng, plan, (1,), 2, 3, 4)
    g = jnp.asarray(rng.standard_normal((1, *plan.out_shape, 2, 4)))
    ours = jax.value_and_grad(lambda *a: jnp.sum(neighborhood_attention(*a, plan, scale=0.7) * g), (0, 1, 2))(q, k, v)
    dense = jax.value_and_grad(lambda *a: jnp.sum(dense_attention(*a, plan, 0.7)[0] * g), (0, 1, 2))(q, k, v)
    assert rel_error(ours[0], dense[0]) < 1e-12
    for a, b in zip(ours[1], dense[1]):
        assert a.dtype == jnp.float64 and rel_error(a, b) < 1e-12
