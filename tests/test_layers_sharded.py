"""Flax layers on a device mesh (8 virtual CPU devices): same numbers as without a mesh.

The serial layer is itself checked against a float64 oracle in test_nnx; here the
sharded layer runs in float32 against it, so 1e-5 relative means the mesh adds only
float32 round-off.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

pytest.importorskip("flax")
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jax_s2attn import linen as s2linen  # noqa: E402
from jax_s2attn import nnx as s2nnx  # noqa: E402
from jax_s2attn.parallel import padded_grid_shapes  # noqa: E402

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices; see conftest.py")

TOL = 1e-5
CHANNELS = 4
GRID = (16, 32)
KWARGS = dict(num_heads=2, qk_features=6, out_features=4, theta_cutoff=0.5)


def make_mesh():
    return jax.make_mesh((2, 4), ("lat", "lon"), axis_types=(AxisType.Explicit,) * 2)


def nnx_layer(in_shape, out_shape, **kwargs):
    return s2nnx.NeighborhoodAttentionS2(CHANNELS, in_shape, out_shape, rngs=nnx.Rngs(0), **KWARGS, **kwargs)


def randomize(layer, rng):
    """Random values for every parameter, biases and norm weights included (they start at zero)."""
    for _, param in nnx.to_flat_state(nnx.state(layer, nnx.Param)):
        value = param.get_value()
        param.set_value(jnp.asarray(0.5 * rng.standard_normal(value.shape), value.dtype))


def random_array(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


@pytest.mark.parametrize(
    "in_shape, out_shape, extra",
    [(GRID, GRID, dict(normalize_qk=True)), (GRID, (9, 16), dict(grid_in="legendre-gauss", grid_out="legendre-gauss"))],
    ids=["self", "down-uneven"],
)
def test_nnx_layer_on_a_mesh_equals_the_serial_layer(in_shape, out_shape, extra, rng, rel_error):
    mesh = make_mesh()
    serial, sharded = nnx_layer(in_shape, out_shape, **extra), nnx_layer(in_shape, out_shape, mesh=mesh, **extra)
    randomize(serial, rng)
    nnx.update(sharded, nnx.state(serial, nnx.Param))
    query, kv = random_array(rng, 2, *out_shape, CHANNELS), random_array(rng, 2, *in_shape, CHANNELS)
    apply = nnx.jit(lambda layer, q, kv: layer(q, kv))
    expected = apply(serial, query, kv)
    assert rel_error(apply(sharded, query, kv), expected) <= TOL

    # Inputs end-padded to the mesh's layout are accepted too; the output keeps the padding.
    (nlat_out, nlon_out), (nlat_in, nlon_in) = padded_grid_shapes(sharded.plan, mesh)
    if (nlat_out, nlon_out) != out_shape:
        def pad(x, nlat, nlon):
            return jnp.pad(x, ((0, 0), (0, nlat - x.shape[1]), (0, nlon - x.shape[2]), (0, 0)))

        padded = np.asarray(apply(sharded, pad(query, nlat_out, nlon_out), pad(kv, nlat_in, nlon_in)))
        assert padded.shape == (2, nlat_out, nlon_out, KWARGS["out_features"])
        assert rel_error(padded[:, : out_shape[0], : out_shape[1]], expected) <= TOL
        # Without a mesh only the true size is accepted.
        with pytest.raises(ValueError, match=r"expects query of shape \[batch..., 9, 16, 4\]"):
            serial(pad(query, nlat_out, nlon_out), kv)


def test_linen_layer_on_a_mesh_equals_the_serial_layer(rng, rel_error):
    kwargs = dict(in_features=CHANNELS, in_shape=GRID, out_shape=(8, 16), **KWARGS)
    serial = s2linen.NeighborhoodAttentionS2(**kwargs)
    sharded = s2linen.NeighborhoodAttentionS2(**kwargs, mesh=make_mesh())
    query, kv = random_array(rng, 2, 8, 16, CHANNELS), random_array(rng, 2, *GRID, CHANNELS)
    variables = serial.init(jax.random.key(0), query, kv)
    params = jax.tree.map(lambda p: random_array(rng, *p.shape), variables["params"])
    variables = {**variables, "params": params}
    expected = jax.jit(serial.apply)(variables, query, kv)
    assert rel_error(jax.jit(sharded.apply)(variables, query, kv), expected) <= TOL


def test_mesh_arguments_are_checked_at_construction():
    mesh = make_mesh()
    with pytest.raises(ValueError, match="lat_axis='rows'"):
        nnx_layer(GRID, GRID, mesh=mesh, lat_axis="rows")
    with pytest.raises(ValueError, match="distinct mesh axes"):
        s2linen.NeighborhoodAttentionS2(CHANNELS, GRID, GRID, mesh=mesh, batch_axis="lon")
    with pytest.raises(TypeError, match="mesh must be"):
        nnx_layer(GRID, GRID, mesh="lat x lon")


class Model(nnx.Module):
    """Lift to the layer's channels, attend on the sphere, read out one value per point."""

    def __init__(self, mesh=None):
        self.lift = nnx.Linear(3, CHANNELS, rngs=nnx.Rngs(1))
        self.attention = nnx_layer(GRID, GRID, mesh=mesh, normalize_qk=True)
        self.readout = nnx.Linear(CHANNELS, 1, rngs=nnx.Rngs(2))

    def __call__(self, x):
        return self.readout(jax.nn.gelu(self.attention(self.lift(x))))[..., 0]


def test_jitted_training_step_on_a_mesh_matches_the_serial_step(rng, rel_error):
    optimizer = optax.adam(1e-2)

    def train(model, x, y, place):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        params, rest = place(params), place(rest)
        x, y = place(x, P(None, "lat", "lon")), place(y, P(None, "lat", "lon"))

        @jax.jit
        def step(params, opt_state, rest, x, y):
            def loss_fn(params):
                return jnp.mean((nnx.merge(graphdef, params, rest)(x) - y) ** 2)

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss, grads

        opt_state, history = optimizer.init(params), []
        for _ in range(2):
            params, opt_state, loss, grads = step(params, opt_state, rest, x, y)
            history.append((loss, grads))
        return params, history

    mesh = make_mesh()
    serial, sharded = Model(), Model(mesh)
    randomize(serial.attention, rng)
    nnx.update(sharded, nnx.state(serial, nnx.Param))
    x, y = random_array(rng, 2, *GRID, 3), random_array(rng, 2, *GRID)
    to_mesh = lambda tree, spec=P(): jax.device_put(tree, NamedSharding(mesh, spec))  # noqa: E731
    ours = train(sharded, x, y, to_mesh)
    theirs = train(serial, x, y, lambda tree, spec=None: tree)

    assert ours[1][1][0] < ours[1][0][0]  # it trains
    leaves = lambda tree: jax.tree_util.tree_leaves_with_path(tree)  # noqa: E731
    for (loss, grads), (loss_ref, grads_ref) in zip(ours[1], theirs[1]):
        assert rel_error(loss, loss_ref) <= TOL
        for (path, grad), (_, grad_ref) in zip(leaves(grads), leaves(grads_ref), strict=True):
            assert rel_error(grad, grad_ref) <= TOL, jax.tree_util.keystr(path)
    for (path, param), (_, param_ref) in zip(leaves(ours[0]), leaves(theirs[0]), strict=True):
        assert rel_error(param, param_ref) <= TOL, jax.tree_util.keystr(path)
