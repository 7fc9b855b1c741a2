"""Bad and edge inputs through the public API: every case asserts the exact outcome.

The rules under test (``jax_s2attn/_validate.py``): every public entry point validates when it is
called (at trace time under ``jit``) and raises ``ValueError`` (a value out of range) or ``TypeError``
(a value of the wrong kind) naming the argument and what was given. Sizes are integers
(``numbers.Integral``: numpy ints are fine; floats, strings and bools are not) of at least a minimum;
``scale`` and ``theta_cutoff`` are finite real numbers greater than 0. Layers check every argument
when they are constructed (NNX: ``__init__``; Linen: the dataclass construction, ``__post_init__``).
Edge inputs that are legal (an empty batch, no heads, numpy integers) must work.

Expected values never come from the code under test: regexes are written out, shapes are literal,
and the torch-harmonics parameter names and shapes of the state-dict cases are spelled out here.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_s2attn
from jax_s2attn import (
    NeighborhoodPlan,
    attention_s2,
    latitude_spacing,
    neighborhood_attention,
    precompute_latitudes,
    precompute_longitudes,
    sharded_neighborhood_attention,
)
from jax_s2attn.parallel import padded_grid_shapes

pytest.importorskip("flax")
from flax import nnx  # noqa: E402

import jax_s2attn.linen as linen_layers  # noqa: E402
import jax_s2attn.nnx as nnx_layers  # noqa: E402

NAN, INF = float("nan"), float("inf")

# Shared by the op cases: a downsampling plan, so query and key/value grids differ.
IN_SHAPE, OUT_SHAPE = (8, 16), (4, 8)
PLAN = NeighborhoodPlan(IN_SHAPE, OUT_SHAPE, theta_cutoff=0.8)
Q_SHAPE, K_SHAPE, V_SHAPE = (1, 4, 8, 2, 3), (1, 8, 16, 2, 3), (1, 8, 16, 2, 5)  # Dk = 3, Dv = 5


def _ones(shape, dtype=jnp.float32):
    return jnp.ones(shape, dtype)


def _qkv(q=Q_SHAPE, k=K_SHAPE, v=V_SHAPE, dtypes=(jnp.float32,) * 3):
    return tuple(_ones(s, d) for s, d in zip((q, k, v), dtypes))


def _random_qkv(seed=0, q=Q_SHAPE, k=K_SHAPE, v=V_SHAPE):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(s), jnp.float32) for s in (q, k, v))


def _raises(call, error, match):
    with pytest.raises(error, match=match) as info:
        call()
    return info


def _is_cpu_only() -> bool:
    return all(d.platform == "cpu" for d in jax.devices())


# ============================================================================ grids


@pytest.mark.parametrize(
    "nlat, grid, error, match",
    [
        (8.5, "equiangular", TypeError, r"nlat must be an integer, got 8\.5"),
        ("8", "equiangular", TypeError, r"nlat must be an integer, got '8'"),
        (True, "equiangular", TypeError, r"nlat must be an integer, got True"),
        (None, "equiangular", TypeError, r"nlat must be an integer, got None"),
        (1, "equiangular", ValueError, r"nlat must be at least 2, got 1\b"),
        (0, "lobatto", ValueError, r"nlat must be at least 2, got 0\b"),
        (-1, "equiangular-trapezoidal", ValueError, r"nlat must be at least 2, got -1\b"),
        (0, "legendre-gauss", ValueError, r"nlat must be at least 1, got 0\b"),
        (8, "bogus", ValueError, r"grid='bogus'.*valid grids are"),
        (8, "Equiangular", ValueError, r"grid='Equiangular'"),
        (8, None, TypeError, r"grid must be a grid name.*got None"),
        (8, 3, TypeError, r"grid must be a grid name.*got 3"),
    ],
    ids=["float", "str", "bool", "None", "one", "zero-lobatto", "negative", "zero-gauss", "unknown-grid",
         "grid-case", "grid-None", "grid-int"],  # fmt: skip
)
def test_precompute_latitudes_rejects(nlat, grid, error, match):
    _raises(lambda: precompute_latitudes(nlat, grid), error, match)


@pytest.mark.parametrize(
    "nlat, grid, error, match",
    [
        (8.5, "equiangular", TypeError, r"nlat must be an integer, got 8\.5"),
        (1, "equiangular", ValueError, r"nlat must be at least 2, got 1\b"),
        (8, "bogus", ValueError, r"grid='bogus'"),
        (8, 1, TypeError, r"grid must be a grid name.*got 1"),
    ],
    ids=["float", "one", "unknown-grid", "grid-int"],
)
def test_latitude_spacing_rejects(nlat, grid, error, match):
    _raises(lambda: latitude_spacing(nlat, grid), error, match)


@pytest.mark.parametrize(
    "nlon, error, match",
    [
        (8.5, TypeError, r"nlon must be an integer, got 8\.5"),
        ("8", TypeError, r"nlon must be an integer, got '8'"),
        (True, TypeError, r"nlon must be an integer, got True"),
        (0, ValueError, r"nlon must be at least 1, got 0\b"),
        (-3, ValueError, r"nlon must be at least 1, got -3\b"),
    ],
    ids=["float", "str", "bool", "zero", "negative"],
)
def test_precompute_longitudes_rejects(nlon, error, match):
    _raises(lambda: precompute_longitudes(nlon), error, match)


@pytest.mark.parametrize("make", [np.int64, np.int32, np.uint8, int], ids=["int64", "int32", "uint8", "int"])
def test_grids_accept_integers_of_any_kind(make):
    theta, weights = precompute_latitudes(make(5), "equiangular")
    assert theta.shape == weights.shape == (5,)
    np.testing.assert_allclose(theta, np.linspace(0.0, np.pi, 5), atol=1e-15)  # Clenshaw-Curtis nodes
    assert precompute_longitudes(make(4)).shape == (4,)
    assert latitude_spacing(make(5)) == pytest.approx(np.pi / 4)


def test_legendre_gauss_takes_a_single_ring():
    theta, weights = precompute_latitudes(1, "legendre-gauss")
    np.testing.assert_allclose(theta, [np.pi / 2])
    np.testing.assert_allclose(weights, [2.0])


# ============================================================================ NeighborhoodPlan

PLAN_SHAPE_CASES = {
    "nlat-float": ((8.5, 16), TypeError, r"nlat must be an integer, got 8\.5.*in_shape=\(8\.5, 16\)"),
    "nlat-str": (("8", 16), TypeError, r"nlat must be an integer, got '8'.*in_shape="),
    "nlat-bool": ((True, 16), TypeError, r"nlat must be an integer, got True.*in_shape="),
    "nlon-None": ((8, None), TypeError, r"nlon must be an integer, got None.*in_shape="),
    "nlon-float": ((8, 16.0), TypeError, r"nlon must be an integer, got 16\.0.*in_shape="),
    "nlat-negative": ((-1, 16), ValueError, r"nlat must be at least 2, got -1.*in_shape=\(-1, 16\)"),
    "nlat-one": ((1, 16), ValueError, r"nlat must be at least 2, got 1\b.*in_shape=\(1, 16\)"),
    "nlon-one": ((8, 1), ValueError, r"nlon must be at least 2, got 1\b.*in_shape=\(8, 1\)"),
    "scalar": (8, TypeError, r"in_shape must be a pair \(nlat, nlon\).*got 8\b"),
    "string": ("8x16", TypeError, r"in_shape must be a pair \(nlat, nlon\).*got '8x16'"),
    "triple": ((8, 16, 2), TypeError, r"in_shape must be a pair \(nlat, nlon\).*got \(8, 16, 2\)"),
    "None": (None, TypeError, r"in_shape must be a pair \(nlat, nlon\).*got None"),
}


@pytest.mark.parametrize("case", PLAN_SHAPE_CASES)
def test_plan_rejects_in_shape(case):
    shape, error, match = PLAN_SHAPE_CASES[case]
    _raises(lambda: NeighborhoodPlan(shape, (8, 16)), error, match)


@pytest.mark.parametrize(
    "shape, error, match",
    [
        ((4, 8.5), TypeError, r"nlon must be an integer, got 8\.5.*out_shape=\(4, 8\.5\)"),
        ((0, 8), ValueError, r"nlat must be at least 2, got 0\b.*out_shape=\(0, 8\)"),
        ((4, 8, 1), TypeError, r"out_shape must be a pair \(nlat, nlon\).*got \(4, 8, 1\)"),
    ],
    ids=["nlon-float", "nlat-zero", "triple"],
)
def test_plan_rejects_out_shape(shape, error, match):
    _raises(lambda: NeighborhoodPlan((8, 16), shape), error, match)


def test_plan_accepts_numpy_integer_shapes():
    plan = NeighborhoodPlan((np.int64(8), np.int32(16)), np.array([4, 8]), theta_cutoff=np.float32(0.8))
    assert plan.in_shape == (8, 16) and plan.out_shape == (4, 8)
    assert all(type(n) is int for n in (*plan.in_shape, *plan.out_shape))
    assert plan == NeighborhoodPlan((8, 16), (4, 8), theta_cutoff=float(np.float32(0.8)))


THETA_CUTOFF_CASES = {
    "str": ("abc", TypeError, r"theta_cutoff must be a (real )?number.*got 'abc'"),
    "list": ([0.1], TypeError, r"theta_cutoff must be a (real )?number.*got \[0\.1\]"),
    "bool": (True, TypeError, r"theta_cutoff must be a (real )?number.*got True"),
    "complex": (0.1 + 0.1j, TypeError, r"theta_cutoff must be a (real )?number.*got \(0\.1\+0\.1j\)"),
    "nan": (NAN, ValueError, r"theta_cutoff must be a finite number greater than 0.*got nan"),
    "inf": (INF, ValueError, r"theta_cutoff must be a finite number greater than 0.*got inf"),
    "minus-inf": (-INF, ValueError, r"theta_cutoff must be a finite number greater than 0.*got -inf"),
    "zero": (0, ValueError, r"theta_cutoff must be a finite number greater than 0.*got 0(\.0)?\b"),
    "negative": (-0.1, ValueError, r"theta_cutoff must be a finite number greater than 0.*got -0\.1"),
}


@pytest.mark.parametrize("case", THETA_CUTOFF_CASES)
def test_plan_rejects_theta_cutoff(case):
    value, error, match = THETA_CUTOFF_CASES[case]
    _raises(lambda: NeighborhoodPlan((8, 16), (8, 16), theta_cutoff=value), error, match)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(grid_in="bogus"), ValueError, r"grid_in='bogus'.*valid grids are"),
        (dict(grid_out="gauss"), ValueError, r"grid_out='gauss'.*valid grids are"),
        (dict(grid_in=None), TypeError, r"grid_in must be a grid name.*got None"),
        (dict(grid_out=3), TypeError, r"grid_out must be a grid name.*got 3"),
    ],
    ids=["grid_in-unknown", "grid_out-unknown", "grid_in-None", "grid_out-int"],
)
def test_plan_rejects_grid(kwargs, error, match):
    _raises(lambda: NeighborhoodPlan((8, 16), (8, 16), **kwargs), error, match)


@pytest.mark.parametrize(
    "in_shape, out_shape, match",
    [
        ((8, 16), (8, 12), r"nlon_in=16 and nlon_out=12.*multiple"),
        ((8, 12), (8, 16), r"nlon_in=12 and nlon_out=16.*multiple"),
        ((8, 10), (4, 4), r"nlon_in=10 and nlon_out=4.*multiple"),
    ],
    ids=["16-to-12", "12-to-16", "10-to-4"],
)
def test_plan_rejects_longitude_counts_not_dividing(in_shape, out_shape, match):
    _raises(lambda: NeighborhoodPlan(in_shape, out_shape), ValueError, match)


SUGGESTION = re.compile(r"theta_cutoff\s*>=\s*([0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?)")


@pytest.mark.parametrize(
    "in_shape, out_shape, cutoff",
    [((16, 32), (8, 16), 0.05), ((4, 8), (4, 64), 0.01)],
    ids=["latitude-gap", "longitude-gap"],
)
def test_empty_neighbourhood_names_theta_cutoff_and_a_cutoff_that_works(in_shape, out_shape, cutoff):
    info = _raises(
        lambda: NeighborhoodPlan(in_shape, out_shape, theta_cutoff=cutoff),
        ValueError,
        rf"theta_cutoff={cutoff}\b.*no input neighbour",
    )
    found = SUGGESTION.search(str(info.value))
    assert found, f"the message gives no cutoff that works: {info.value}"
    suggested = float(found.group(1))
    assert suggested > cutoff
    plan = NeighborhoodPlan(in_shape, out_shape, theta_cutoff=suggested)
    assert plan.theta_cutoff == suggested and plan.max_neighbors >= 1
    # "the smallest cutoff": one percent less leaves a point without neighbour again.
    with pytest.raises(ValueError, match=r"theta_cutoff=.*no input neighbour"):
        NeighborhoodPlan(in_shape, out_shape, theta_cutoff=0.99 * suggested)


# ============================================================================ neighborhood_attention


def _with(index, value):
    """(q, k, v) of the default shapes with entry ``index`` replaced by ``value``."""
    arrays = list(_qkv())
    arrays[index] = value
    return tuple(arrays)


NA_CASES = {
    # ranks
    "query-rank-3": (lambda: _with(0, _ones((8, 2, 3))), ValueError, r"query must have shape .*rank >= 4.*\(8, 2, 3\)"),
    "key-rank-3": (lambda: _with(1, _ones((16, 2, 3))), ValueError, r"key must have shape .*rank >= 4.*\(16, 2, 3\)"),
    "value-rank-2": (lambda: _with(2, _ones((2, 5))), ValueError, r"value must have shape .*rank >= 4.*\(2, 5\)"),
    # grids
    "query-on-input-grid": (lambda: _with(0, _ones((1, 8, 16, 2, 3))), ValueError,
                            r"query has shape \(1, 8, 16, 2, 3\).*output grid \(4, 8\)"),
    "query-nlon": (lambda: _with(0, _ones((1, 4, 9, 2, 3))), ValueError, r"query has shape \(1, 4, 9, 2, 3\)"),
    "key-on-output-grid": (lambda: _with(1, _ones((1, 4, 8, 2, 3))), ValueError,
                           r"key has shape \(1, 4, 8, 2, 3\), expected \(1, 8, 16, 2, 3\)"),
    "value-nlat": (lambda: _with(2, _ones((1, 7, 16, 2, 5))), ValueError,
                   r"value has shape \(1, 7, 16, 2, 5\), expected \(1, 8, 16, 2, 5\)"),
    # heads, head dims, batch
    "key-heads": (lambda: _with(1, _ones((1, 8, 16, 3, 3))), ValueError,
                  r"key has shape \(1, 8, 16, 3, 3\), expected \(1, 8, 16, 2, 3\).*heads \(2\)"),
    "value-heads": (lambda: _with(2, _ones((1, 8, 16, 1, 5))), ValueError,
                    r"value has shape \(1, 8, 16, 1, 5\), expected \(1, 8, 16, 2, 5\).*heads \(2\)"),
    "key-head_dim": (lambda: _with(1, _ones((1, 8, 16, 2, 4))), ValueError,
                     r"key has shape \(1, 8, 16, 2, 4\), expected \(1, 8, 16, 2, 3\).*head_dim \(3\)"),
    "key-batch": (lambda: _with(1, _ones((2, 8, 16, 2, 3))), ValueError,
                  r"key has shape \(2, 8, 16, 2, 3\), expected \(1, 8, 16, 2, 3\).*batch axes \(1,\)"),
    "value-batch-rank": (lambda: _with(2, _ones((1, 1, 8, 16, 2, 5))), ValueError,
                         r"value has shape \(1, 1, 8, 16, 2, 5\), expected \(1, 8, 16, 2, 5\)"),
    "query-head_dim-0": (lambda: _qkv(q=(1, 4, 8, 2, 0), k=(1, 8, 16, 2, 0)), ValueError, r"query has head_dim 0"),
    "value-head_dim-0": (lambda: _qkv(v=(1, 8, 16, 2, 0)), ValueError, r"value has head_dim 0"),
    # dtypes
    "key-bfloat16": (lambda: _qkv(dtypes=(jnp.float32, jnp.bfloat16, jnp.float32)), TypeError,
                     r"share one dtype.*key=bfloat16"),
    "value-float64": (lambda: _qkv(dtypes=(jnp.float32, jnp.float32, jnp.float64)), TypeError,
                      r"share one dtype.*value=float64"),
    "all-int32": (lambda: _qkv(dtypes=(jnp.int32,) * 3), TypeError, r"query has dtype int32"),
    "key-int8": (lambda: _qkv(dtypes=(jnp.float32, jnp.int8, jnp.float32)), TypeError, r"key has dtype int8"),
    "all-complex64": (lambda: _qkv(dtypes=(jnp.complex64,) * 3), TypeError, r"query has dtype complex64"),
    "all-bool": (lambda: _qkv(dtypes=(jnp.bool_,) * 3), TypeError, r"query has dtype bool"),
    # not arrays
    "query-list": (lambda: _with(0, np.ones(Q_SHAPE).tolist()), TypeError, r"query must be an array, got list"),
    "key-str": (lambda: _with(1, "key"), TypeError, r"key must be an array, got str"),
    "value-None": (lambda: _with(2, None), TypeError, r"value must be an array, got NoneType"),
}  # fmt: skip


@pytest.mark.parametrize("case", NA_CASES)
def test_neighborhood_attention_rejects_arrays(case):
    make, error, match = NA_CASES[case]
    q, k, v = make()
    _raises(lambda: neighborhood_attention(q, k, v, PLAN), error, match)


@pytest.mark.parametrize(
    "plan, match",
    [((8, 16), r"got tuple"), (None, r"got NoneType"), ("plan", r"got str"), (PLAN.tables, r"got PlanTables")],
    ids=["tuple", "None", "str", "tables"],
)
def test_neighborhood_attention_rejects_plan(plan, match):
    q, k, v = _qkv()
    match = r"plan must be a jax_s2attn\.NeighborhoodPlan.*" + match
    _raises(lambda: neighborhood_attention(q, k, v, plan), TypeError, match)


SCALE_CASES = {
    "nan": (NAN, ValueError, r"scale must be a finite number greater than 0.*got nan"),
    "inf": (INF, ValueError, r"scale must be a finite number greater than 0.*got inf"),
    "zero": (0, ValueError, r"scale must be a finite number greater than 0.*got 0(\.0)?\b"),
    "negative": (-1, ValueError, r"scale must be a finite number greater than 0.*got -1(\.0)?\b"),
    "str": ("abc", TypeError, r"scale must be a (real )?number.*got 'abc'"),
    "list": ([0.1], TypeError, r"scale must be a (real )?number.*got \[0\.1\]"),
    "bool": (True, TypeError, r"scale must be a (real )?number.*got True"),
    "complex": (1 + 1j, TypeError, r"scale must be a (real )?number.*got \(1\+1j\)"),
    "array-1d": (np.array([0.5]), TypeError, r"scale must be a (real )?number.*got array\(\[0\.5\]\)"),
}


@pytest.mark.parametrize("case", SCALE_CASES)
def test_neighborhood_attention_rejects_scale(case):
    value, error, match = SCALE_CASES[case]
    q, k, v = _qkv()
    _raises(lambda: neighborhood_attention(q, k, v, PLAN, scale=value), error, match)


def test_neighborhood_attention_rejects_a_traced_scale():
    q, k, v = _qkv()
    attend = jax.jit(lambda s: neighborhood_attention(q, k, v, PLAN, scale=s))
    _raises(lambda: attend(0.5), TypeError, r"scale must be a concrete number.*traced")


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(implementation="bogus"), ValueError, r"implementation='bogus' is not supported.*'reference'"),
        (dict(implementation="FFI"), ValueError, r"implementation='FFI' is not supported"),
        (dict(return_residual="yes"), TypeError, r"return_residual must be True or False, got 'yes'"),
        (dict(return_residual=1), TypeError, r"return_residual must be True or False, got 1\b"),
        (dict(return_residual=None), TypeError, r"return_residual must be True or False, got None"),
    ],
    ids=["implementation-bogus", "implementation-case", "return_residual-str", "return_residual-int",
         "return_residual-None"],  # fmt: skip
)
def test_neighborhood_attention_rejects_options(kwargs, error, match):
    q, k, v = _qkv()
    _raises(lambda: neighborhood_attention(q, k, v, PLAN, **kwargs), error, match)


@pytest.mark.skipif(not _is_cpu_only(), reason="the inputs must live on a CPU-only process")
@pytest.mark.parametrize(
    "implementation, dtype, match",
    [("ffi-tiled", jnp.float32, r"implementation='ffi-tiled' cannot run on cpu"),
     ("ffi", jnp.float64, r"implementation='ffi' cannot run on cpu.*float64"),
     ("ffi-arc", jnp.float64, r"implementation='ffi-arc' cannot run on cpu.*float64")],
    ids=["tensor-cores-on-cpu", "ffi-float64", "arc-float64"],
)  # fmt: skip
def test_neighborhood_attention_rejects_kernels_that_cannot_run(implementation, dtype, match):
    q, k, v = _qkv(dtypes=(dtype,) * 3)
    _raises(lambda: neighborhood_attention(q, k, v, PLAN, implementation=implementation), ValueError, match)


def test_neighborhood_attention_errors_at_trace_time():
    q, k, v = _qkv(q=(1, 4, 9, 2, 3))
    lower = jax.jit(neighborhood_attention).lower
    _raises(lambda: lower(q, k, v, PLAN), ValueError, r"query has shape \(1, 4, 9, 2, 3\)")


@pytest.mark.parametrize("implementation", ["reference", None], ids=["reference", "default"])
@pytest.mark.parametrize(
    "q_shape, k_shape, v_shape",
    [((0, 4, 8, 2, 3), (0, 8, 16, 2, 3), (0, 8, 16, 2, 5)),
     ((2, 0, 4, 8, 2, 3), (2, 0, 8, 16, 2, 3), (2, 0, 8, 16, 2, 5)),
     ((1, 4, 8, 0, 3), (1, 8, 16, 0, 3), (1, 8, 16, 0, 5))],
    ids=["empty-batch", "empty-inner-batch", "zero-heads"],
)  # fmt: skip
def test_neighborhood_attention_takes_empty_inputs(q_shape, k_shape, v_shape, implementation):
    q, k, v = _qkv(q=q_shape, k=k_shape, v=v_shape)
    out, lse = neighborhood_attention(q, k, v, PLAN, implementation=implementation, return_residual=True)
    assert out.shape == (*q_shape[:-1], 5) and out.dtype == jnp.float32
    assert lse.shape == q_shape[:-1] and lse.dtype == jnp.float32
    jitted = jax.jit(lambda q, k, v: neighborhood_attention(q, k, v, PLAN, implementation=implementation))
    assert jitted(q, k, v).shape == (*q_shape[:-1], 5)


def test_neighborhood_attention_takes_numpy_inputs_and_scales():
    q, k, v = (np.asarray(x) for x in _random_qkv())
    for scale in (np.float32(0.3), jnp.float32(0.3), np.float64(0.3), 0.3):
        out = neighborhood_attention(q, k, v, PLAN, scale=scale)
        assert out.shape == (1, 4, 8, 2, 5) and out.dtype == jnp.float32
    assert neighborhood_attention(q, k, v, PLAN, scale=0.3, return_residual=np.True_)[1].shape == (1, 4, 8, 2)


def _cast_every_leaf(tree):
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16), tree)


def _cast_floating_leaves(tree):
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


CAST_MESSAGE = r"table (forward|backward)_\w+ is bfloat16.*int32.*(cast only floating leaves|leave the plan out)"


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_plan_with_every_leaf_cast_names_the_table(jit):
    q, k, v = _qkv()
    cast = _cast_every_leaf(PLAN)
    attend = jax.jit(neighborhood_attention) if jit else neighborhood_attention
    _raises(lambda: attend(q, k, v, cast), TypeError, CAST_MESSAGE)


def test_plan_with_every_leaf_cast_is_rejected_by_attention_s2():
    plan = NeighborhoodPlan((8, 16), (4, 8), theta_cutoff=0.8)
    q, k, v = _qkv()
    _raises(lambda: attention_s2(q, k, v, _cast_every_leaf(plan)), TypeError, CAST_MESSAGE)


@pytest.mark.parametrize("implementation", ["reference", None], ids=["reference", "default"])
def test_plan_with_floating_leaves_cast_gives_the_same_bits(implementation):
    q, k, v = _random_qkv(1)
    cast = _cast_floating_leaves(PLAN)
    assert all(leaf.dtype == jnp.int32 for leaf in jax.tree.leaves(cast))
    attend = jax.jit(lambda q, k, v, plan: neighborhood_attention(q, k, v, plan, implementation=implementation))
    expected = np.asarray(attend(q, k, v, PLAN))
    np.testing.assert_array_equal(np.asarray(attend(q, k, v, cast)), expected)
    eager = neighborhood_attention(q, k, v, cast, implementation=implementation)
    uncast = neighborhood_attention(q, k, v, PLAN, implementation=implementation)
    np.testing.assert_array_equal(np.asarray(eager), np.asarray(uncast))


# ============================================================================ attention_s2

S2_Q, S2_K, S2_V = (1, 4, 8, 2, 3), (1, 8, 16, 2, 3), (1, 8, 16, 2, 5)
S2_WEIGHTS = np.ones(8)

WEIGHT_CASES = {
    "nan": (np.array([1, NAN, 1, 1, 1, 1, 1, 1.0]), ValueError, r"quad_weights must be finite.*latitude 1 .*nan"),
    "inf": (np.array([1, 1, INF, 1, 1, 1, 1, 1.0]), ValueError, r"quad_weights must be finite.*latitude 2 .*inf"),
    "negative": (np.array([1, 1, 1, -0.5, 1, 1, 1, 1.0]), ValueError, r"quad_weights must be .*non-negative.*latitude 3 .*-0\.5"),
    "all-zero": (np.zeros(8), ValueError, r"quad_weights must be .*one positive.*every weight is 0"),
    "too-short": (np.ones(7), ValueError, r"quad_weights has shape \(7,\), expected \(8,\)"),
    "too-long": (np.ones(9), ValueError, r"quad_weights has shape \(9,\), expected \(8,\)"),
    "2d": (np.ones((8, 1)), ValueError, r"quad_weights has shape \(8, 1\), expected \(8,\)"),
    "str": ("abcdefgh", TypeError, r"quad_weights must be .*real.*got str"),
    "bool-dtype": (np.ones(8, bool), TypeError, r"quad_weights must be real.*bool"),
    "jax-nan": (jnp.array([1, NAN, 1, 1, 1, 1, 1, 1.0]), ValueError, r"quad_weights must be finite.*latitude 1 .*nan"),
}


@pytest.mark.parametrize("case", WEIGHT_CASES)
def test_attention_s2_rejects_weights(case):
    weights, error, match = WEIGHT_CASES[case]
    q, k, v = _qkv(S2_Q, S2_K, S2_V)
    _raises(lambda: attention_s2(q, k, v, weights), error, match)


@pytest.mark.parametrize("case", SCALE_CASES)
def test_attention_s2_rejects_scale(case):
    value, error, match = SCALE_CASES[case]
    q, k, v = _qkv(S2_Q, S2_K, S2_V)
    _raises(lambda: attention_s2(q, k, v, S2_WEIGHTS, scale=value), error, match)


@pytest.mark.parametrize(
    "make, kwargs, error, match",
    [
        (lambda: _qkv(S2_Q, S2_K, S2_V), dict(implementation="bogus"), ValueError,
         r"implementation='bogus' is not supported by attention_s2"),
        (lambda: _qkv(S2_Q, S2_K, S2_V), dict(implementation="reference"), ValueError,
         r"implementation='reference' is not supported by attention_s2"),
        (lambda: _qkv(S2_Q, S2_K, S2_V), dict(implementation="cudnn"), TypeError,
         r"implementation='cudnn' needs float16 or bfloat16 inputs, got float32"),
        (lambda: _qkv(S2_Q, (1, 8, 16, 3, 3), S2_V), {}, ValueError, r"key has shape \(1, 8, 16, 3, 3\), expected \(1, 8, 16, 2, 3\)"),
        (lambda: _qkv(S2_Q, S2_K, (1, 8, 15, 2, 5)), {}, ValueError, r"value has shape \(1, 8, 15, 2, 5\), expected \(1, 8, 16, 2, 5\)"),
        (lambda: _qkv(S2_Q, S2_K, S2_V, (jnp.float32, jnp.float16, jnp.float32)), {}, TypeError, r"share one dtype.*key=float16"),
        (lambda: _qkv(S2_Q, S2_K, S2_V, (jnp.int32,) * 3), {}, TypeError, r"query has dtype int32"),
        (lambda: (np.ones(S2_Q).tolist(), *_qkv(S2_Q, S2_K, S2_V)[1:]), {}, TypeError, r"query must be an array, got list"),
        (lambda: _qkv((4, 8, 3), S2_K, S2_V), {}, ValueError, r"query must have shape .*rank >= 4.*\(4, 8, 3\)"),
        (lambda: _qkv((1, 4, 8, 2, 0), (1, 8, 16, 2, 0), S2_V), {}, ValueError, r"query has head_dim 0"),
    ],
    ids=["implementation-bogus", "implementation-reference", "cudnn-float32", "key-heads", "value-nlon",
         "mixed-dtypes", "int32", "query-list", "query-rank-3", "head_dim-0"],
)  # fmt: skip
def test_attention_s2_rejects(make, kwargs, error, match):
    q, k, v = make()
    _raises(lambda: attention_s2(q, k, v, S2_WEIGHTS, **kwargs), error, match)


@pytest.mark.parametrize(
    "q_shape, k_shape, v_shape",
    [((0, 4, 8, 2, 3), (0, 8, 16, 2, 3), (0, 8, 16, 2, 5)), ((1, 4, 8, 0, 3), (1, 8, 16, 0, 3), (1, 8, 16, 0, 5))],
    ids=["empty-batch", "zero-heads"],
)
def test_attention_s2_takes_empty_inputs(q_shape, k_shape, v_shape):
    q, k, v = _qkv(q_shape, k_shape, v_shape)
    out = attention_s2(q, k, v, S2_WEIGHTS)
    assert out.shape == (*q_shape[:-1], 5) and out.dtype == jnp.float32


def test_attention_s2_takes_a_plan_and_lists_of_weights():
    q, k, v = _random_qkv(2, S2_Q, S2_K, S2_V)
    assert attention_s2(q, k, v, PLAN).shape == (1, 4, 8, 2, 5)
    assert attention_s2(q, k, v, [1.0] * 8).shape == (1, 4, 8, 2, 5)
    assert attention_s2(q, k, v, np.arange(8)).shape == (1, 4, 8, 2, 5)  # one zero weight removes a latitude


# ============================================================================ sharded op


def _one_device_mesh(names=("lat", "lon")):
    return jax.make_mesh((1,) * len(names), names, devices=jax.devices()[:1])


SHARDED_CASES = {
    "lon_axis-None": (dict(lon_axis=None), ValueError, r"lon_axis=None.*pass the name of a mesh axis"),
    "lat_axis-None": (dict(lat_axis=None), ValueError, r"lat_axis=None.*pass the name of a mesh axis"),
    "mesh-str": (dict(mesh="mesh"), TypeError, r"mesh must be a jax\.sharding\.Mesh.*got str"),
    "mesh-None": (dict(mesh=None), TypeError, r"mesh must be a jax\.sharding\.Mesh.*got NoneType"),
    "mesh-devices": (dict(mesh=jax.devices()[:1]), TypeError, r"mesh must be a jax\.sharding\.Mesh.*got list"),
    "lat_axis-unknown": (dict(lat_axis="x"), ValueError, r"lat_axis='x' is not an axis of the mesh.*\('lat', 'lon'\)"),
    "lon_axis-unknown": (dict(lon_axis="longitude"), ValueError, r"lon_axis='longitude' is not an axis of the mesh"),
    "batch_axis-unknown": (dict(batch_axis="batch"), ValueError, r"batch_axis='batch' is not an axis of the mesh"),
    "same-axis-twice": (dict(lon_axis="lat"), ValueError, r"lat_axis, lon_axis and batch_axis must be distinct"),
    "scale-zero": (dict(scale=0.0), ValueError, r"scale must be a finite number greater than 0"),
    "scale-str": (dict(scale="abc"), TypeError, r"scale must be a (real )?number.*got 'abc'"),
    "implementation-bogus": (dict(implementation="bogus"), ValueError, r"implementation='bogus' is not supported"),
    "plan-tuple": (dict(plan=(8, 16)), TypeError, r"plan must be a jax_s2attn\.NeighborhoodPlan.*got tuple"),
    "query-grid": (dict(query=_ones((1, 4, 9, 2, 3))), ValueError, r"query has shape \(1, 4, 9, 2, 3\)"),
}


@pytest.mark.parametrize("case", SHARDED_CASES)
def test_sharded_rejects(case):
    overrides, error, match = SHARDED_CASES[case]
    q, k, v = _qkv()
    args = dict(query=q, key=k, value=v, plan=PLAN, mesh=_one_device_mesh())
    args.update(overrides)
    _raises(lambda: sharded_neighborhood_attention(**args), error, match)


@pytest.mark.parametrize(
    "plan, kwargs, error, match",
    [
        ("plan", {}, TypeError, r"plan must be a jax_s2attn\.NeighborhoodPlan.*got str"),
        (PLAN, dict(lon_axis=None), ValueError, r"lon_axis=None"),
        (PLAN, dict(mesh="mesh"), TypeError, r"mesh must be a jax\.sharding\.Mesh.*got str"),
    ],
    ids=["plan-str", "lon_axis-None", "mesh-str"],
)
def test_padded_grid_shapes_rejects(plan, kwargs, error, match):
    args = {"mesh": _one_device_mesh(), **kwargs}
    _raises(lambda: padded_grid_shapes(plan, **args), error, match)


@pytest.mark.parametrize(
    "q_shape, k_shape, v_shape",
    [((0, 4, 8, 2, 3), (0, 8, 16, 2, 3), (0, 8, 16, 2, 5)), ((1, 4, 8, 0, 3), (1, 8, 16, 0, 3), (1, 8, 16, 0, 5))],
    ids=["empty-batch", "zero-heads"],
)
def test_sharded_takes_empty_inputs(q_shape, k_shape, v_shape):
    # (Sharded results of real inputs are tested against the serial op in test_parallel.py.)
    q, k, v = _qkv(q_shape, k_shape, v_shape)
    out = sharded_neighborhood_attention(q, k, v, PLAN, mesh=_one_device_mesh())
    assert out.shape == (*q_shape[:-1], 5) and out.dtype == jnp.float32


needs_8_devices = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices; see conftest.py")


def _mesh(shape, names):
    return jax.make_mesh(shape, names, devices=jax.devices()[: int(np.prod(shape))])


@needs_8_devices
@pytest.mark.parametrize(
    "mesh_shape, names, q_shape, k_shape, kwargs, match",
    [
        ((1, 1, 2), ("lat", "lon", "batch"), (3, 4, 8, 2, 3), (3, 8, 16, 2, 3), dict(batch_axis="batch"),
         r"batch_axis='batch' splits the first batch dimension over 2 devices.*batch shape is \(3,\)"),
        ((1, 1, 2), ("lat", "lon", "batch"), (4, 8, 2, 3), (8, 16, 2, 3), dict(batch_axis="batch"),
         r"batch_axis='batch' splits the first batch dimension over 2 devices.*batch shape is \(\)"),
        ((8, 1), ("lat", "lon"), (1, 4, 8, 2, 3), (1, 8, 16, 2, 3), {},
         r"mesh axis 'lat' has 8 devices.*only 4 latitudes.*at most 4 devices along 'lat'"),
    ],
    ids=["batch-not-divisible", "no-batch-axis", "more-lat-devices-than-latitudes"],
)  # fmt: skip
def test_sharded_rejects_splits_that_cannot_work(mesh_shape, names, q_shape, k_shape, kwargs, match):
    q, k = _ones(q_shape), _ones(k_shape)
    mesh = _mesh(mesh_shape, names)
    _raises(lambda: sharded_neighborhood_attention(q, k, k, PLAN, mesh=mesh, **kwargs), ValueError, match)


@needs_8_devices
def test_sharded_halo_too_deep_names_the_axis_and_a_device_count_that_works():
    plan = NeighborhoodPlan((16, 32), (16, 32), theta_cutoff=2.0)
    x = _ones((1, 16, 32, 1, 2))
    info = _raises(
        lambda: sharded_neighborhood_attention(x, x, x, plan, mesh=_mesh((4, 1), ("lat", "lon"))),
        ValueError,
        r"mesh axis 'lat' \(4 devices\).*theta_cutoff=2.*at most (\d+) devices along 'lat'",
    )
    devices = int(re.search(r"at most (\d+) devices along 'lat'", str(info.value)).group(1))
    assert 1 <= devices < 4
    # The suggested split lays out (padded_grid_shapes raises the same error where the split cannot work).
    assert padded_grid_shapes(plan, _mesh((devices, 1), ("lat", "lon"))) == ((16, 32), (16, 32))


# ============================================================================ layers

LAYER_DEFAULTS = dict(in_features=4, in_shape=(8, 16), out_shape=(8, 16))


def _make_layer(front, name, **kwargs):
    args = {**LAYER_DEFAULTS, **kwargs}
    positional = (args.pop("in_features"), args.pop("in_shape"), args.pop("out_shape"))
    if front == "nnx":
        return getattr(nnx_layers, name)(*positional, **args, rngs=nnx.Rngs(0))
    return getattr(linen_layers, name)(*positional, **args)


ALL_LAYERS = [("nnx", "NeighborhoodAttentionS2"), ("nnx", "AttentionS2"), ("linen", "NeighborhoodAttentionS2"),
              ("linen", "AttentionS2")]  # fmt: skip
NEIGHBOURHOOD_LAYERS = [layer for layer in ALL_LAYERS if layer[1] == "NeighborhoodAttentionS2"]
_LAYER_IDS = [f"{front}.{name}" for front, name in ALL_LAYERS]
_NEIGHBOURHOOD_IDS = [f"{front}.{name}" for front, name in NEIGHBOURHOOD_LAYERS]

LAYER_CASES = {
    # sizes
    "in_features=0": (dict(in_features=0), ValueError, r"in_features must be at least 1, got 0\b"),
    "in_features=-1": (dict(in_features=-1), ValueError, r"in_features must be at least 1, got -1\b"),
    "in_features=2.5": (dict(in_features=2.5), TypeError, r"in_features must be an integer, got 2\.5"),
    "in_features='8'": (dict(in_features="8"), TypeError, r"in_features must be an integer, got '8'"),
    "in_features=True": (dict(in_features=True), TypeError, r"in_features must be an integer, got True"),
    "in_features=None": (dict(in_features=None), TypeError, r"in_features must be an integer, got None"),
    "num_heads=0": (dict(num_heads=0), ValueError, r"num_heads must be at least 1, got 0\b"),
    "num_heads=2.0": (dict(num_heads=2.0), TypeError, r"num_heads must be an integer, got 2\.0"),
    "qk_features=0": (dict(qk_features=0), ValueError, r"qk_features must be at least 1, got 0\b"),
    "out_features='4'": (dict(out_features="4"), TypeError, r"out_features must be an integer, got '4'"),
    # heads dividing the features
    "heads-vs-explicit-qk": (dict(in_features=8, num_heads=4, qk_features=6), ValueError,
                             r"num_heads=4 must divide qk_features=6"),
    "heads-vs-explicit-out": (dict(in_features=8, num_heads=4, out_features=6), ValueError,
                              r"num_heads=4 must divide out_features=6"),
    # scale
    "scale=nan": (dict(scale=NAN), ValueError, r"scale must be a finite number greater than 0.*got nan"),
    "scale=inf": (dict(scale=INF), ValueError, r"scale must be a finite number greater than 0.*got inf"),
    "scale=0": (dict(scale=0), ValueError, r"scale must be a finite number greater than 0.*got 0(\.0)?\b"),
    "scale=-1": (dict(scale=-1.0), ValueError, r"scale must be a finite number greater than 0.*got -1(\.0)?\b"),
    "scale='abc'": (dict(scale="abc"), TypeError, r"scale must be a (real )?number.*got 'abc'"),
    "scale=[0.1]": (dict(scale=[0.1]), TypeError, r"scale must be a (real )?number.*got \[0\.1\]"),
    "scale=True": (dict(scale=True), TypeError, r"scale must be a (real )?number.*got True"),
    # flags
    "normalize_qk='yes'": (dict(normalize_qk="yes"), TypeError, r"normalize_qk must be True or False, got 'yes'"),
    "normalize_qk=None": (dict(normalize_qk=None), TypeError, r"normalize_qk must be True or False, got None"),
    "use_bias=1": (dict(use_bias=1), TypeError, r"use_bias must be True or False, got 1\b"),
    # implementation and dtypes
    "implementation='bogus'": (dict(implementation="bogus"), ValueError, r"implementation='bogus' is not supported"),
    "dtype='bogus'": (dict(dtype="bogus"), TypeError, r"^dtype must be None or a float dtype.*got 'bogus'"),
    "dtype=int8": (dict(dtype=jnp.int8), TypeError, r"^dtype must be None or a float dtype.*int8"),
    "param_dtype=int32": (dict(param_dtype=jnp.int32), TypeError, r"^param_dtype must be a float dtype.*int32"),
    "param_dtype='bogus'": (dict(param_dtype="bogus"), TypeError, r"^param_dtype must be a float dtype.*'bogus'"),
    "param_dtype=None": (dict(param_dtype=None), TypeError, r"^param_dtype must be a float dtype.*None"),
    # grids
    "in_shape=(8.5, 16)": (dict(in_shape=(8.5, 16)), TypeError, r"nlat must be an integer, got 8\.5.*in_shape=\(8\.5, 16\)"),
    "in_shape=('8', 16)": (dict(in_shape=("8", 16)), TypeError, r"nlat must be an integer, got '8'.*in_shape="),
    "in_shape=8": (dict(in_shape=8), TypeError, r"in_shape must be a pair \(nlat, nlon\).*got 8\b"),
    "in_shape=(8, 16, 2)": (dict(in_shape=(8, 16, 2)), TypeError, r"in_shape must be a pair .*got \(8, 16, 2\)"),
    "out_shape=(1, 16)": (dict(out_shape=(1, 16)), ValueError, r"nlat must be at least 2, got 1\b.*out_shape=\(1, 16\)"),
    "grid_in='bogus'": (dict(grid_in="bogus"), ValueError, r"grid_in='bogus'.*valid grids are"),
    "grid_out=3": (dict(grid_out=3), TypeError, r"grid_out must be a grid name.*got 3"),
}  # fmt: skip


@pytest.mark.parametrize("case", LAYER_CASES)
@pytest.mark.parametrize("front, name", ALL_LAYERS, ids=_LAYER_IDS)
def test_layer_constructor_rejects(front, name, case):
    kwargs, error, match = LAYER_CASES[case]
    _raises(lambda: _make_layer(front, name, **kwargs), error, match)


@pytest.mark.parametrize(
    "kwargs, defaulted",
    [(dict(in_features=6, num_heads=4), "qk_features"), (dict(in_features=6, num_heads=4, qk_features=8), "out_features")],
    ids=["qk-and-out-defaulted", "out-defaulted"],
)
@pytest.mark.parametrize("front, name", ALL_LAYERS, ids=_LAYER_IDS)
def test_layer_heads_not_dividing_a_defaulted_width_names_in_features(front, name, kwargs, defaulted):
    info = _raises(lambda: _make_layer(front, name, **kwargs), ValueError, r"num_heads=4 must divide in_features=6")
    # The user never passed the defaulted width: it must not be named as if they had.
    assert f"{defaulted}=6" not in str(info.value)


NEIGHBOURHOOD_LAYER_CASES = {
    **{f"theta_cutoff-{case}": (dict(theta_cutoff=value), error, match)
       for case, (value, error, match) in THETA_CUTOFF_CASES.items()},
    "longitudes-not-dividing": (dict(out_shape=(8, 12)), ValueError, r"nlon_in=16 and nlon_out=12"),
    "empty-neighbourhood": (dict(in_shape=(16, 32), out_shape=(8, 16), theta_cutoff=0.05), ValueError,
                            r"theta_cutoff=0\.05\b.*no input neighbour.*theta_cutoff >= "),
    "mesh-str": (dict(mesh="mesh"), TypeError, r"mesh must be a jax\.sharding\.Mesh.*got str"),
    "lon_axis-None": (dict(mesh=_one_device_mesh(), lon_axis=None), ValueError, r"lon_axis=None"),
    "lat_axis-None": (dict(mesh=_one_device_mesh(), lat_axis=None), ValueError, r"lat_axis=None"),
    "lat_axis-unknown": (dict(mesh=_one_device_mesh(), lat_axis="foo"), ValueError,
                         r"lat_axis='foo' is not an axis of the mesh"),
    "implementation-of-attention_s2": (dict(implementation="xla"), ValueError, r"implementation='xla' is not supported"),
}  # fmt: skip


@pytest.mark.parametrize("case", NEIGHBOURHOOD_LAYER_CASES)
@pytest.mark.parametrize("front, name", NEIGHBOURHOOD_LAYERS, ids=_NEIGHBOURHOOD_IDS)
def test_neighbourhood_layer_constructor_rejects(front, name, case):
    kwargs, error, match = NEIGHBOURHOOD_LAYER_CASES[case]
    _raises(lambda: _make_layer(front, name, **kwargs), error, match)


@pytest.mark.parametrize("front", ["nnx", "linen"])
def test_global_layer_rejects_a_neighbourhood_implementation(front):
    _raises(lambda: _make_layer(front, "AttentionS2", implementation="reference"), ValueError,
            r"implementation='reference' is not supported by attention_s2")  # fmt: skip


@pytest.mark.parametrize("front, name", ALL_LAYERS, ids=_LAYER_IDS)
def test_layers_accept_numpy_integers(front, name):
    sizes = dict(in_features=np.int64(4), num_heads=np.int32(2), in_shape=(np.int64(8), np.int64(16)))
    assert _make_layer(front, name, **sizes) is not None


CALL_CASES = {
    "channels": (lambda: (_ones((1, 8, 16, 5)),), ValueError, r"query has shape \(1, 8, 16, 5\).*\[batch\.\.\., 8, 16, 4\]"),
    "grid": (lambda: (_ones((1, 8, 8, 4)),), ValueError, r"query has shape \(1, 8, 8, 4\).*\[batch\.\.\., 8, 16, 4\]"),
    "key-batch": (lambda: (_ones((1, 8, 16, 4)), _ones((2, 8, 16, 4))), ValueError, r"key has batch axes \(2,\) but query has \(1,\)"),
    "query-list": (lambda: (np.ones((1, 8, 16, 4)).tolist(),), TypeError, r"query must be an array, got list"),
}  # fmt: skip


@pytest.mark.parametrize("case", CALL_CASES)
@pytest.mark.parametrize("front, name", ALL_LAYERS, ids=_LAYER_IDS)
def test_layer_call_rejects(front, name, case):
    make, error, match = CALL_CASES[case]
    args = make()
    layer = _make_layer(front, name, num_heads=2)
    if front == "nnx":
        _raises(lambda: layer(*args), error, match)
    else:
        _raises(lambda: layer.init(jax.random.key(0), *args), error, match)


def test_nnx_layer_with_every_leaf_of_its_state_cast_names_the_table():
    layer = _make_layer("nnx", "NeighborhoodAttentionS2", num_heads=2)
    graphdef, state = nnx.split(layer)
    cast = nnx.merge(graphdef, _cast_every_leaf(state))
    _raises(lambda: cast(_ones((1, 8, 16, 4))), TypeError, CAST_MESSAGE)


# ---------------------------------------------------------------------------- torch-harmonics state dicts

# torch-harmonics 0.9.3's names and shapes for in_channels = k_channels = out_channels = 4, 2 heads,
# bias and qk-norm on (written out here, not taken from the library under test).
TH_SHAPES = {
    "q_weights": (4, 4, 1, 1), "k_weights": (4, 4, 1, 1), "v_weights": (4, 4, 1, 1), "proj_weights": (4, 4, 1, 1),
    "q_bias": (4,), "k_bias": (4,), "v_bias": (4,), "proj_bias": (4,),
    "q_norm_weights": (2,), "k_norm_weights": (2,),
}  # fmt: skip
OUR_NAMES = {
    "q_weights": "q_kernel", "k_weights": "k_kernel", "v_weights": "v_kernel", "proj_weights": "out_kernel",
    "q_bias": "q_bias", "k_bias": "k_bias", "v_bias": "v_bias", "proj_bias": "out_bias",
    "q_norm_weights": "q_norm_weight", "k_norm_weights": "k_norm_weight",
}  # fmt: skip
STATE_LAYER = dict(num_heads=2, normalize_qk=True)


def _numpy_state(seed=0):
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in TH_SHAPES.items()}


def _expected_params(state):
    """Our parameters from a float32 numpy torch-harmonics state, by the documented layout."""
    return {OUR_NAMES[n]: (a[:, :, 0, 0].T if a.ndim == 4 else a) for n, a in state.items()}


def _loaded(front, state):
    layer = _make_layer(front, "NeighborhoodAttentionS2", **STATE_LAYER)
    if front == "nnx":
        layer.load_torch_harmonics_state_dict(state)
        return {name: np.asarray(getattr(layer, name)[...]) for name in OUR_NAMES.values()}
    return {name: np.asarray(p) for name, p in linen_layers.load_torch_harmonics_state_dict(layer, state).items()}


@pytest.mark.parametrize("front", ["nnx", "linen"])
def test_state_dict_of_numpy_float32_loads_by_the_documented_layout(front):
    state = _numpy_state()
    loaded = _loaded(front, state)
    expected = _expected_params(state)
    assert sorted(loaded) == sorted(expected)
    for name, value in expected.items():
        assert loaded[name].dtype == np.float32
        np.testing.assert_array_equal(loaded[name], value, err_msg=name)


@pytest.mark.parametrize("kind", ["requires_grad", "bfloat16", "float16", "float64"])
@pytest.mark.parametrize("front", ["nnx", "linen"])
def test_state_dict_of_torch_tensors_loads_like_float32_numpy(front, kind):
    torch = pytest.importorskip("torch")
    state = _numpy_state(1)
    if kind == "requires_grad":
        tensors = {n: torch.from_numpy(a.copy()).requires_grad_() for n, a in state.items()}
        reference = state
    else:
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}[kind]
        tensors = {n: torch.from_numpy(a.copy()).to(dtype) for n, a in state.items()}
        # Every bfloat16/float16 value is a float32 exactly: widen them (torch, not the library under test).
        reference = {n: t.to(torch.float32).numpy() for n, t in tensors.items()}
    loaded = _loaded(front, tensors)
    expected = _loaded(front, reference)
    for name, value in _expected_params(reference).items():
        np.testing.assert_array_equal(expected[name], value, err_msg=name)
        np.testing.assert_array_equal(loaded[name], value, err_msg=f"{kind} {name}")
        assert loaded[name].dtype == np.float32


def _without(name):
    state = _numpy_state()
    del state[name]
    return state


def _replaced(name, value):
    state = _numpy_state()
    state[name] = value
    return state


STATE_CASES = {
    "missing-q_bias": (lambda: _without("q_bias"), ValueError, r"missing \['q_bias'\]"),
    "missing-k_norm_weights": (lambda: _without("k_norm_weights"), ValueError, r"missing \['k_norm_weights'\]"),
    "unexpected-key": (lambda: {**_numpy_state(), "extra": np.zeros(3, np.float32)}, ValueError, r"unexpected \['extra'\]"),
    "q_bias-shape": (lambda: _replaced("q_bias", np.zeros(3, np.float32)), ValueError,
                     r"state_dict\['q_bias'\] has shape \(3,\), expected \(4,\)"),
    "q_weights-2d": (lambda: _replaced("q_weights", np.zeros((4, 4), np.float32)), ValueError,
                     r"state_dict\['q_weights'\] has shape \(4, 4\), expected \(4, 4, 1, 1\)"),
    "proj_weights-shape": (lambda: _replaced("proj_weights", np.zeros((4, 2, 1, 1), np.float32)), ValueError,
                           r"state_dict\['proj_weights'\] has shape \(4, 2, 1, 1\), expected \(4, 4, 1, 1\)"),
    "q_norm_weights-shape": (lambda: _replaced("q_norm_weights", np.zeros(4, np.float32)), ValueError,
                             r"state_dict\['q_norm_weights'\] has shape \(4,\), expected \(2,\)"),
    "int-entry": (lambda: _replaced("v_bias", np.zeros(4, np.int32)), TypeError, r"state_dict\['v_bias'\] must hold floats"),
    "str-entry": (lambda: _replaced("v_bias", "abcd"), TypeError, r"state_dict\['v_bias'\]"),
    "not-a-mapping": (lambda: list(_numpy_state().values()), TypeError, r"state_dict must be a mapping.*got list"),
}  # fmt: skip


@pytest.mark.parametrize("case", STATE_CASES)
@pytest.mark.parametrize("front", ["nnx", "linen"])
def test_state_dict_rejects(front, case):
    make, error, match = STATE_CASES[case]
    state = make()
    _raises(lambda: _loaded(front, state), error, match)


# ============================================================================ native_status


def test_native_status_has_one_line_per_platform():
    lines = jax_s2attn.native_status().splitlines()
    assert [line.split(":", 1)[0] for line in lines] == ["cpu", "cuda"], lines
    platforms_here = {d.platform for d in jax.devices()}
    for line in lines:
        platform, text = (part.strip() for part in line.split(":", 1))
        if text.startswith("built"):
            assert re.fullmatch(r"built; (usable here|not usable here: .+)", text), line
            has_device = ("gpu" if platform == "cuda" else platform) in platforms_here
            assert text.startswith("built; usable here") == has_device, line
        else:
            assert re.search(r"not built|built against|built from other sources", text), line
    if _is_cpu_only():
        cuda = lines[1]
        assert "built; usable here" not in cuda, cuda  # no CUDA device in a CPU-only process
