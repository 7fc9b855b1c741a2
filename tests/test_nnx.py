"""Flax NNX layers: math against an independent float64 oracle, init, dtypes, jit, checkpoints, training."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.test_util import check_grads  # noqa: E402

from jax_s2attn import NeighborhoodPlan, precompute_latitudes  # noqa: E402
from jax_s2attn._layers import TORCH_NAMES  # noqa: E402
from jax_s2attn.nnx import AttentionS2, NeighborhoodAttentionS2, S2Tables  # noqa: E402

IN_FEATURES = 4
# name: (in_shape, out_shape, grid_in, grid_out, theta_cutoff, heads, qk_features, out_features, normalize_qk)
CASES = {
    "self": ((6, 12), (6, 12), "equiangular", "equiangular", 0.7, 2, 6, 4, True),
    "down": ((10, 16), (5, 8), "legendre-gauss", "legendre-gauss", 0.9, 1, None, 6, False),
    "up": ((5, 6), (8, 12), "lobatto", "equiangular", 0.8, 2, None, None, True),
}


def rel_error(actual, expected) -> float:
    actual = np.asarray(actual, np.float64)
    assert np.all(np.isfinite(actual)), "non-finite values"
    return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


def make_layer(case, param_dtype=jnp.float32, **kwargs):
    in_shape, out_shape, grid_in, grid_out, cutoff, heads, qk, out, norm = CASES[case]
    return NeighborhoodAttentionS2(
        IN_FEATURES,
        in_shape,
        out_shape,
        num_heads=heads,
        qk_features=qk,
        out_features=out,
        grid_in=grid_in,
        grid_out=grid_out,
        theta_cutoff=cutoff,
        normalize_qk=norm,
        param_dtype=param_dtype,
        rngs=nnx.Rngs(0),
        **kwargs,
    )


def randomize(layer, rng):
    """Random values for every parameter (biases and norm weights too); returns them as float64."""
    values = {}
    for path, param in nnx.to_flat_state(nnx.state(layer, nnx.Param)):
        name = path[-1]
        values[name] = 0.5 * rng.standard_normal(param.get_value().shape)
        getattr(layer, name).set_value(jnp.asarray(values[name], layer.param_dtype))
    return values


def grid_points(shape, grid):
    theta, _ = precompute_latitudes(shape[0], grid)
    lon = 2 * np.pi * np.arange(shape[1]) / shape[1]
    return np.repeat(theta, shape[1]), np.tile(lon, shape[0])


def oracle(params, query, key, value, case, eps):
    """The layer in float64 from its definition: dense softmax over the geodesic ball."""
    in_shape, out_shape, grid_in, grid_out, cutoff, heads, *_, norm = CASES[case]
    theta_o, lon_o = grid_points(out_shape, grid_out)
    theta_i, lon_i = grid_points(in_shape, grid_in)
    cos_d = np.cos(theta_o)[:, None] * np.cos(theta_i)[None, :] + np.sin(theta_o)[:, None] * np.sin(theta_i)[
        None, :
    ] * np.cos(lon_o[:, None] - lon_i[None, :])
    inside = np.arccos(np.clip(cos_d, -1, 1)) <= 1.001 * cutoff
    _, w = precompute_latitudes(in_shape[0], grid_in)
    # The exact weights: the float64 layer computes with them (float32 with their float32 rounding).
    log_w = np.repeat(np.log(2 * np.pi * w / in_shape[1]), in_shape[1])
    bias = np.where(inside, log_w[None, :], -np.inf)

    def project(x, name):
        y = x.reshape(*x.shape[:-3], -1, x.shape[-1]) @ params[f"{name}_kernel"]
        return y + params.get(f"{name}_bias", 0.0)

    def split(x):
        return x.reshape(*x.shape[:-1], heads, -1)

    q, k, v = split(project(query, "q")), split(project(key, "k")), split(project(value, "v"))
    if norm:
        q = q / jnp.sqrt(jnp.mean(q * q, axis=-1, keepdims=True) + eps) * (1 + params["q_norm_weight"])
        k = k / jnp.sqrt(jnp.mean(k * k, axis=-1, keepdims=True) + eps) * (1 + params["k_norm_weight"])
    logits = jnp.einsum("...thd,...shd->...hts", q, k) / math.sqrt(q.shape[-1]) + bias
    out = jnp.einsum("...hts,...shd->...thd", jax.nn.softmax(logits, axis=-1), v)
    out = out.reshape(*out.shape[:-2], -1) @ params["out_kernel"] + params.get("out_bias", 0.0)
    return out.reshape(*query.shape[:-1], -1)


def random_inputs(rng, case, batch=(2,)):
    in_shape, out_shape = CASES[case][:2]
    query = rng.standard_normal((*batch, *out_shape, IN_FEATURES))
    if in_shape == out_shape:
        return [query]
    return [
        query,
        rng.standard_normal((*batch, *in_shape, IN_FEATURES)),
        rng.standard_normal((*batch, *in_shape, IN_FEATURES)),
    ]


def values_and_grads(fn, args, cotangent):
    @jax.jit
    def run(args, cotangent):
        out, vjp = jax.vjp(fn, *args)
        return [out, *vjp(cotangent.astype(out.dtype))]

    return run(args, cotangent)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(
    "dtype, tolerance", [pytest.param(jnp.float64, 1e-12, marks=pytest.mark.slow), (jnp.float32, 1e-5)]
)
def test_matches_float64_oracle(case, dtype, tolerance, rng):
    layer = make_layer(case, dtype)
    params = randomize(layer, rng)
    inputs = random_inputs(rng, case)

    def oracle_fn(query, key=None, value=None):
        key = query if key is None else key
        return oracle(params, query, key, key if value is None else value, case, eps=np.finfo(dtype).eps)

    out_features = layer.spec.out_features
    cotangent = jnp.asarray(rng.standard_normal((2, *CASES[case][1], out_features)))
    ours = values_and_grads(layer, [jnp.asarray(x, dtype) for x in inputs], cotangent)
    expected = values_and_grads(oracle_fn, [jnp.asarray(x) for x in inputs], cotangent)
    assert ours[0].shape == (2, *CASES[case][1], out_features)
    for name, a, e in zip(("out", "d query", "d key", "d value"), ours, expected):
        assert a.dtype == dtype
        assert rel_error(a, e) <= tolerance, name


def test_check_grads_float64(rng):
    layer = make_layer("down", jnp.float64)
    randomize(layer, rng)
    inputs = [jnp.asarray(x) for x in random_inputs(rng, "down", batch=(1,))]
    check_grads(jax.jit(lambda *x: layer(*x)), inputs, order=1, modes=("rev",), atol=1e-6, rtol=1e-6)


def test_full_cutoff_equals_global_attention(rng):
    kwargs = dict(num_heads=2, qk_features=6, grid_in="legendre-gauss", grid_out="legendre-gauss", normalize_qk=True)
    local = NeighborhoodAttentionS2(IN_FEATURES, (5, 10), (5, 10), theta_cutoff=np.pi, rngs=nnx.Rngs(0), **kwargs)
    dense = AttentionS2(IN_FEATURES, (5, 10), (5, 10), rngs=nnx.Rngs(1), **kwargs)
    randomize(local, rng)
    nnx.update(dense, nnx.state(local, nnx.Param))
    x = jnp.asarray(rng.standard_normal((2, 5, 10, IN_FEATURES)), jnp.float32)
    cotangent = jnp.asarray(rng.standard_normal((2, 5, 10, IN_FEATURES)), jnp.float32)
    for a, b in zip(values_and_grads(local, [x], cotangent), values_and_grads(dense, [x], cotangent)):
        assert rel_error(b, np.asarray(a, np.float64)) <= 1e-5


def test_initialization_follows_torch_harmonics():
    layer = NeighborhoodAttentionS2(
        16, (6, 12), (6, 12), num_heads=2, qk_features=32, out_features=8, normalize_qk=True, rngs=nnx.Rngs(0)
    )
    params = {path[-1]: p.get_value() for path, p in nnx.to_flat_state(nnx.state(layer, nnx.Param))}
    assert set(params) == set(TORCH_NAMES)
    bounds = {"q_kernel": math.sqrt(6 / 48), "k_kernel": math.sqrt(6 / 48), "v_kernel": math.sqrt(6 / 24)}
    bounds["out_kernel"] = math.sqrt(3 / 8)
    shapes = {"q_kernel": (16, 32), "k_kernel": (16, 32), "v_kernel": (16, 8), "out_kernel": (8, 8)}
    for name, bound in bounds.items():
        w = np.asarray(params[name])
        assert w.shape == shapes[name] and w.dtype == np.float32
        assert np.abs(w).max() <= bound and np.abs(w).max() > 0.8 * bound, name
        assert abs(w.std() - bound / math.sqrt(3)) < 0.25 * bound / math.sqrt(3), name
    for name in ("q_bias", "k_bias", "v_bias", "out_bias", "q_norm_weight", "k_norm_weight"):
        assert not np.any(params[name]), name
    assert params["q_norm_weight"].shape == (16,)
    assert not np.array_equal(params["q_kernel"], params["k_kernel"])
    assert len(nnx.to_flat_state(nnx.state(layer, S2Tables))) == 1


def test_defaults():
    layer = NeighborhoodAttentionS2(12, (8, 16), (4, 8), num_heads=3, use_bias=False, rngs=nnx.Rngs(0))
    assert (layer.spec.qk_features, layer.spec.out_features) == (12, 12)
    assert layer.spec.scale == pytest.approx(0.5)
    assert layer.plan == NeighborhoodPlan((8, 16), (4, 8))
    names = {path[-1] for path, _ in nnx.to_flat_state(nnx.state(layer, nnx.Param))}
    assert names == {"q_kernel", "k_kernel", "v_kernel", "out_kernel"}


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(num_heads=3), ValueError, "num_heads=3 must divide in_features=4 (the default qk_features)"),
        (dict(num_heads=2, out_features=3), ValueError, "must divide out_features=3"),
        (dict(in_features=0), ValueError, "in_features must be at least 1, got 0"),
        (dict(out_shape=(6, 10)), ValueError, "integer multiple"),
        (dict(grid_in="gauss"), ValueError, "grid_in='gauss'"),
        (dict(theta_cutoff=-1.0), ValueError, "theta_cutoff"),
        (dict(in_shape=(6,)), TypeError, "in_shape must be a pair"),
    ],
)
def test_invalid_construction_raises(kwargs, error, match):
    args = dict(in_features=4, in_shape=(6, 12), out_shape=(6, 12))
    args.update(kwargs)
    with pytest.raises(error, match=re.escape(match)):
        NeighborhoodAttentionS2(
            args.pop("in_features"), args.pop("in_shape"), args.pop("out_shape"), rngs=nnx.Rngs(0), **args
        )


def test_invalid_inputs_raise():
    layer = make_layer("down")
    query = jnp.ones((2, 5, 8, IN_FEATURES))
    with pytest.raises(ValueError, match=r"key has shape \(2, 5, 8, 4\).*pass key \(and value\) on the input grid"):
        layer(query)
    with pytest.raises(ValueError, match=r"query has shape \(2, 5, 8, 3\)"):
        layer(query[..., :3], jnp.ones((2, 10, 16, IN_FEATURES)))
    with pytest.raises(ValueError, match="batch axes"):
        layer(query, jnp.ones((3, 10, 16, IN_FEATURES)))


def test_batch_axes_are_free(rng):
    layer = make_layer("self")
    x = jnp.asarray(rng.standard_normal((3, 2, 6, 12, IN_FEATURES)), jnp.float32)
    batched = layer(x)
    assert batched.shape == (3, 2, 6, 12, 4)
    np.testing.assert_allclose(layer(x[1, 0]), batched[1, 0], rtol=1e-6, atol=1e-6)


def test_dtype_policy(rng):
    x = jnp.asarray(rng.standard_normal((2, 6, 12, IN_FEATURES)), jnp.float32)
    assert make_layer("self")(x).dtype == jnp.float32
    assert make_layer("self")(x.astype(jnp.bfloat16)).dtype == jnp.float32  # promoted with float32 params
    out = make_layer("self", dtype=jnp.bfloat16)(x)
    assert out.dtype == jnp.bfloat16
    assert rel_error(out.astype(jnp.float32), np.asarray(make_layer("self")(x), np.float64)) <= 3e-2


def largest_constant(hlo_text: str) -> int:
    """Element count of the largest dense constant in StableHLO text."""
    sizes = [1]
    for dims in re.findall(r"stablehlo\.constant dense<[^>]*> : tensor<((?:\d+x)*)\w+>", hlo_text):
        sizes.append(math.prod(int(d) for d in dims.split("x") if d))
    return max(sizes)


def test_jit_passes_plan_tables_as_arguments(rng):
    layer = NeighborhoodAttentionS2(4, (24, 48), (24, 48), num_heads=2, rngs=nnx.Rngs(0))
    arcs = layer.plan.tables.forward_arcs
    x = jnp.asarray(rng.standard_normal((1, 24, 48, 4)), jnp.float32)
    graphdef, state = nnx.split(layer)
    as_argument = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x)).lower(state, x).as_text()
    assert f"tensor<{arcs.shape[0]}x3xi32>" in re.search(r"func\.func public @main\((.*?)\)", as_argument).group(1)
    assert largest_constant(as_argument) < arcs.size
    # Control: the same layer closed over bakes the tables in, and the check sees it.
    closed_over = jax.jit(lambda x: layer(x)).lower(x).as_text()
    assert largest_constant(closed_over) >= arcs.size
    np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(layer, x), layer(x), rtol=1e-6, atol=1e-6)


def test_load_torch_harmonics_state_dict(rng):
    layer = make_layer("self")
    spec = layer.spec
    state = {
        "q_weights": rng.standard_normal((spec.qk_features, IN_FEATURES, 1, 1)),
        "k_weights": rng.standard_normal((spec.qk_features, IN_FEATURES, 1, 1)),
        "v_weights": rng.standard_normal((spec.out_features, IN_FEATURES, 1, 1)),
        "proj_weights": rng.standard_normal((spec.out_features, spec.out_features, 1, 1)),
        "q_bias": rng.standard_normal(spec.qk_features),
        "k_bias": rng.standard_normal(spec.qk_features),
        "v_bias": rng.standard_normal(spec.out_features),
        "proj_bias": rng.standard_normal(spec.out_features),
        "q_norm_weights": rng.standard_normal(spec.qk_head_dim),
        "k_norm_weights": rng.standard_normal(spec.qk_head_dim),
    }
    layer.load_torch_harmonics_state_dict(state)
    np.testing.assert_array_equal(layer.q_kernel[...], state["q_weights"][:, :, 0, 0].T.astype(np.float32))
    np.testing.assert_array_equal(layer.out_kernel[...], state["proj_weights"][:, :, 0, 0].T.astype(np.float32))
    np.testing.assert_array_equal(layer.k_norm_weight[...], state["k_norm_weights"].astype(np.float32))
    assert layer.v_bias[...].dtype == jnp.float32

    with pytest.raises(ValueError, match=r"missing \['k_bias'\], unexpected \['extra'\]"):
        layer.load_torch_harmonics_state_dict({**{k: v for k, v in state.items() if k != "k_bias"}, "extra": 0})
    with pytest.raises(ValueError, match=r"state_dict\['v_weights'\] has shape \(4, 4\), expected \(4, 4, 1, 1\)"):
        layer.load_torch_harmonics_state_dict({**state, "v_weights": state["v_weights"][:, :, 0, 0]})
    with pytest.raises(TypeError, match="mapping"):
        layer.load_torch_harmonics_state_dict([("q_weights", state["q_weights"])])


def test_training_reduces_loss_and_leaves_tables_alone(rng):
    # Student-teacher: the target is the same layer with other parameters, so it is learnable.
    teacher, student = make_layer("self"), make_layer("self")
    randomize(teacher, rng)
    x = jnp.asarray(rng.standard_normal((4, 6, 12, IN_FEATURES)), jnp.float32)
    target = teacher(x)
    optimizer = nnx.Optimizer(student, optax.adam(3e-2), wrt=nnx.Param)
    plan = student.plan

    @nnx.jit
    def step(layer, optimizer, x, target):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - target) ** 2))(layer)
        optimizer.update(layer, grads)
        return loss

    losses = [float(step(student, optimizer, x, target)) for _ in range(40)]
    assert losses[-1] < 0.2 * losses[0]
    assert student.plan == plan
    np.testing.assert_array_equal(student.plan.tables.forward_arcs, plan.tables.forward_arcs)
