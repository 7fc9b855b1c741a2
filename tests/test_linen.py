"""Flax Linen layers: same numbers as the NNX layers, the tables collection, checkpoints, validation."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
from flax import nnx  # noqa: E402

from jax_s2attn import linen as s2linen  # noqa: E402
from jax_s2attn import nnx as s2nnx  # noqa: E402

KWARGS = dict(num_heads=2, qk_features=6, out_features=4, grid_in="legendre-gauss", grid_out="legendre-gauss")


def layer_pair(kind, in_shape, out_shape, **kwargs):
    """The Linen and NNX versions of one layer, built with the same arguments."""
    kwargs = {**KWARGS, **kwargs}
    linen_layer = getattr(s2linen, kind)(3, in_shape, out_shape, **kwargs)
    nnx_layer = getattr(s2nnx, kind)(3, in_shape, out_shape, rngs=nnx.Rngs(0), **kwargs)
    return linen_layer, nnx_layer


@pytest.mark.parametrize(
    "kind, in_shape, out_shape, extra",
    [
        ("NeighborhoodAttentionS2", (6, 12), (6, 12), dict(normalize_qk=True)),
        ("NeighborhoodAttentionS2", (10, 16), (5, 8), dict(theta_cutoff=0.8)),
        ("NeighborhoodAttentionS2", (5, 8), (9, 16), dict(use_bias=False)),
        ("AttentionS2", (6, 12), (4, 6), dict(normalize_qk=True)),
    ],
    ids=["self", "down", "up", "global"],
)
def test_linen_equals_nnx_with_the_same_parameters(kind, in_shape, out_shape, extra, rng):
    linen_layer, nnx_layer = layer_pair(kind, in_shape, out_shape, **extra)
    query = jnp.asarray(rng.standard_normal((2, *out_shape, 3)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((2, *in_shape, 3)), jnp.float32)
    variables = linen_layer.init(jax.random.key(0), query, kv)
    # Same structure and initialisation bounds: Linen's parameters drop into the NNX layer.
    nnx_params = {path[-1]: p.get_value() for path, p in nnx.to_flat_state(nnx.state(nnx_layer, nnx.Param))}
    assert jax.tree.map(jnp.shape, variables["params"]) == jax.tree.map(jnp.shape, nnx_params)
    params = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype), variables["params"])
    for name, value in params.items():
        getattr(nnx_layer, name).set_value(value)
    ours = jax.jit(linen_layer.apply)({**variables, "params": params}, query, kv)
    np.testing.assert_allclose(ours, jax.jit(lambda q, kv: nnx_layer(q, kv))(query, kv), rtol=1e-6, atol=1e-6)


def argument_shapes(lowered) -> str:
    return re.search(r"func\.func public @main\((.*?)\)", lowered.as_text()).group(1)


def test_tables_collection_is_optional_and_keeps_tables_out_of_the_program(rng):
    layer = s2linen.NeighborhoodAttentionS2(3, (24, 48), (24, 48), num_heads=3)
    x = jnp.asarray(rng.standard_normal((1, 24, 48, 3)), jnp.float32)
    variables = layer.init(jax.random.key(0), x)
    assert set(variables) == {"params", s2linen.TABLES_COLLECTION}
    plan = variables[s2linen.TABLES_COLLECTION]["tables"]
    arcs = f"tensor<{plan.tables.forward_arcs.shape[0]}x3xi32>"
    apply = jax.jit(layer.apply)
    assert arcs in argument_shapes(apply.lower(variables, x))
    params_only = {"params": variables["params"]}
    assert arcs not in argument_shapes(apply.lower(params_only, x))
    np.testing.assert_allclose(apply(variables, x), apply(params_only, x), rtol=1e-6, atol=1e-6)


def test_layer_built_and_initialised_inside_jit(rng):
    x = jnp.asarray(rng.standard_normal((1, 6, 12, 3)), jnp.float32)

    @jax.jit
    def init_and_apply(x):
        layer = s2linen.NeighborhoodAttentionS2(3, (6, 12), (6, 12), theta_cutoff=0.6)
        variables = layer.init(jax.random.key(0), x)
        return layer.apply(variables, x), variables

    out, variables = init_and_apply(x)
    layer = s2linen.NeighborhoodAttentionS2(3, (6, 12), (6, 12), theta_cutoff=0.6)
    np.testing.assert_allclose(out, layer.apply(variables, x), rtol=1e-6, atol=1e-6)


def test_load_torch_harmonics_state_dict(rng):
    layer = s2linen.AttentionS2(3, (6, 12), (6, 12), num_heads=1, use_bias=False, param_dtype=jnp.float64)
    state = {
        name: rng.standard_normal((3, 3, 1, 1)) for name in ("q_weights", "k_weights", "v_weights", "proj_weights")
    }
    params = s2linen.load_torch_harmonics_state_dict(layer, state)
    assert set(params) == {"q_kernel", "k_kernel", "v_kernel", "out_kernel"}
    np.testing.assert_array_equal(params["v_kernel"], state["v_weights"][:, :, 0, 0].T)
    assert params["v_kernel"].dtype == jnp.float64
    with pytest.raises(ValueError, match=r"unexpected \['q_bias'\]"):
        s2linen.load_torch_harmonics_state_dict(layer, {**state, "q_bias": np.zeros(3)})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_heads=2), "num_heads=2 must divide in_features=3 (the default qk_features)"),
        (dict(grid_out="healpix"), "grid_out='healpix'"),
        (dict(out_shape=(6, 7)), "integer multiple"),
    ],
)
def test_invalid_arguments_raise_at_construction(kwargs, match):
    args = {"out_shape": (6, 12), **kwargs}
    with pytest.raises(ValueError, match=re.escape(match)):
        s2linen.NeighborhoodAttentionS2(3, (6, 12), **args)
