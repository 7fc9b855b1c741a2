"""The NNX and Linen neighbourhood layers between ring grids: flat fields, the same outputs as the functional
op on the projections, NNX and Linen alike, and what bad arguments and fields get."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
from flax import nnx  # noqa: E402

from jax_s2attn import RingGrid, RingPlan, linen, neighborhood_attention  # noqa: E402
from jax_s2attn import nnx as s2nnx  # noqa: E402

GRID_IN, GRID_OUT, CUTOFF = RingGrid.latlon(13, 24), RingGrid.healpix(4), 0.3


def _expected(params, query, key, plan, heads):
    """Projections, heads and the op by hand (no layer code)."""
    project = lambda x, name: x @ params[f"{name}_kernel"] + params[f"{name}_bias"]  # noqa: E731
    split = lambda x: x.reshape(*x.shape[:-1], heads, -1)  # noqa: E731
    q, k, v = split(project(query, "q")), split(project(key, "k")), split(project(key, "v"))
    out = neighborhood_attention(q, k, v, plan, scale=1 / np.sqrt(q.shape[-1]))
    return project(out.reshape(*out.shape[:-2], -1), "out")


def _fields(seed):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((2, GRID_OUT.npoints, 6)), jnp.float32),
            jnp.asarray(rng.standard_normal((2, GRID_IN.npoints, 6)), jnp.float32))  # fmt: skip


def test_nnx_and_linen_layers_compute_the_op_on_their_projections():
    query, key = _fields(0)
    layer = s2nnx.NeighborhoodAttentionS2(6, grid_in=GRID_IN, grid_out=GRID_OUT, theta_cutoff=CUTOFF, num_heads=2,
                                          rngs=nnx.Rngs(0))  # fmt: skip
    assert layer.plan == RingPlan(GRID_IN, GRID_OUT, CUTOFF)
    params = {name: getattr(layer, name)[...] for name in ("q_kernel", "k_kernel", "v_kernel", "out_kernel",
                                                           "q_bias", "k_bias", "v_bias", "out_bias")}  # fmt: skip
    params = {**params, **{f"{n}_bias": jnp.full_like(params[f"{n}_bias"], 0.1 * i)
                           for i, n in enumerate(("q", "k", "v", "out"))}}  # fmt: skip
    for name in ("q_bias", "k_bias", "v_bias", "out_bias"):
        getattr(layer, name).set_value(params[name])
    out = layer(query, key)
    expected = _expected(params, query, key, layer.plan, 2)
    assert out.shape == (2, GRID_OUT.npoints, 6)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    module = linen.NeighborhoodAttentionS2(6, grid_in=GRID_IN, grid_out=GRID_OUT, theta_cutoff=CUTOFF, num_heads=2)
    variables = module.init(jax.random.key(0), query, key)
    np.testing.assert_allclose(module.apply({**variables, "params": params}, query, key), out, rtol=1e-6, atol=1e-6)


def test_layers_take_ring_grids_by_name():
    """"healpix(4)", "O8" and "equiangular(13, 24)" are those grids: the same plan, parameters and outputs as the
    RingGrid objects."""
    query, _ = _fields(1)
    by_object = s2nnx.NeighborhoodAttentionS2(6, grid_in=GRID_IN, grid_out=GRID_OUT, theta_cutoff=CUTOFF,
                                              rngs=nnx.Rngs(3))  # fmt: skip
    by_name = s2nnx.NeighborhoodAttentionS2(6, grid_in="equiangular(13, 24)", grid_out="healpix(4)",
                                            theta_cutoff=CUTOFF, rngs=nnx.Rngs(3))  # fmt: skip
    assert by_name.plan == by_object.plan
    key = jnp.asarray(np.random.default_rng(4).standard_normal((2, GRID_IN.npoints, 6)), jnp.float32)
    np.testing.assert_array_equal(by_name(query, key), by_object(query, key))
    module = linen.NeighborhoodAttentionS2(6, grid_in="equiangular(13, 24)", grid_out="healpix(4)", theta_cutoff=CUTOFF)
    variables = module.init(jax.random.key(0), query, key)
    assert variables["params"]["q_kernel"].shape == (6, 6)
    octahedral = s2nnx.AttentionS2(6, grid_in="O8", grid_out="healpix(4)", rngs=nnx.Rngs(0))
    assert octahedral(query, jnp.zeros((2, RingGrid.octahedral(8).npoints, 6))).shape == query.shape
    assert RingGrid.named("O8") == RingGrid.octahedral(8) and RingGrid.named(GRID_OUT.name) == GRID_OUT


def test_self_attention_on_healpix_takes_key_from_query():
    healpix = RingGrid.healpix(2)
    layer = s2nnx.NeighborhoodAttentionS2(4, (48,), (48,), grid_in=healpix, grid_out=healpix, theta_cutoff=0.7,
                                          rngs=nnx.Rngs(1))  # fmt: skip
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 48, 4)), jnp.float32)
    np.testing.assert_array_equal(layer(x), layer(x, x, x))


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        (dict(grid_in=GRID_IN, grid_out="equiangular", theta_cutoff=CUTOFF), TypeError, r"grid_out must be a RingGrid"),
        (dict(grid_in=GRID_IN, grid_out=GRID_OUT, theta_cutoff=CUTOFF, in_shape=(13, 24)), TypeError,
         r"in_shape must be None or \(312,\) between ring grids"),
        (dict(grid_in=GRID_IN, grid_out=GRID_OUT, theta_cutoff=CUTOFF, in_shape=(311,)), ValueError,
         r"in_shape=\(311,\) does not match the layer's ring grid \(312 points"),
        (dict(grid_in=GRID_IN, grid_out=GRID_OUT), ValueError, r"theta_cutoff is needed"),
        (dict(grid_in="healpix4", grid_out=GRID_OUT, theta_cutoff=CUTOFF), ValueError,
         r"grid_in='healpix4': 'healpix4' names no ring grid; ring grids are named \"healpix\(<nside>\)\".*"
         r"The valid grids are 'equiangular'"),
        (dict(grid_in=GRID_IN, grid_out="healpix(0)", theta_cutoff=CUTOFF), ValueError,
         r"grid_out='healpix\(0\)': nside must be at least 1"),
        (dict(grid_in=GRID_IN, grid_out=GRID_OUT, theta_cutoff=CUTOFF, out_shape=192), TypeError,
         r"out_shape must be None or \(192,\) between ring grids"),
        (dict(grid_in=GRID_IN, grid_out=GRID_OUT, theta_cutoff=CUTOFF, out_shape=(192.0,)), TypeError,
         r"out_shape\[0\] must be an integer"),
    ],
)
def test_bad_layer_arguments_are_refused(arguments, error, match):
    with pytest.raises(error, match=match):
        s2nnx.NeighborhoodAttentionS2(6, **arguments, rngs=nnx.Rngs(0))
    with pytest.raises(error, match=match):
        linen.NeighborhoodAttentionS2(6, **arguments)


def _ring_mesh(shape, names):
    cpus = jax.devices("cpu")
    if len(cpus) < int(np.prod(shape)):
        pytest.fail(f"needs {int(np.prod(shape))} CPU devices (tests/conftest.py asks XLA for 8)")
    return jax.make_mesh(shape, names, devices=cpus[: int(np.prod(shape))],
                         axis_types=(jax.sharding.AxisType.Auto,) * len(names))  # fmt: skip


def test_layers_on_a_mesh_split_the_rings_and_give_the_serial_results():
    """With a mesh the rings are split over lat_axis (sharded_ring_attention; lon_axis replicates, batch_axis splits
    the batch): the NNX and Linen layers give the serial layer's outputs, and the same parameter gradients."""
    grid, cutoff = RingGrid.healpix(4), 0.35
    mesh = _ring_mesh((2, 2, 2), ("batch", "lat", "lon"))
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((2, grid.npoints, 6)), jnp.float32)
    serial = s2nnx.NeighborhoodAttentionS2(6, grid_in=grid, grid_out=grid, theta_cutoff=cutoff, num_heads=2,
                                           rngs=nnx.Rngs(7))  # fmt: skip
    sharded = s2nnx.NeighborhoodAttentionS2(6, grid_in=grid, grid_out=grid, theta_cutoff=cutoff, num_heads=2,
                                            mesh=mesh, batch_axis="batch", rngs=nnx.Rngs(7))  # fmt: skip
    np.testing.assert_allclose(sharded(x), serial(x), rtol=1e-6, atol=1e-6)

    def grads(layer):
        graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
        loss = lambda p: jnp.sum(nnx.merge(graphdef, p, rest)(x) ** 2)  # noqa: E731
        return jax.grad(loss)(params)

    # The key bias's exact gradient is zero (it adds one constant to all of a query's scores), so both layers hold
    # only round-off there: it is checked to be round-off of the largest gradient, every other leaf as before.
    serial_grads = grads(serial)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(serial_grads))
    leaves = zip(jax.tree_util.tree_leaves_with_path(grads(sharded)), jax.tree.leaves(serial_grads), strict=True)
    for (path, a), b in leaves:
        if jax.tree_util.keystr(path).startswith("['k_bias']"):
            assert max(float(jnp.abs(a).max()), float(jnp.abs(b).max())) <= 1e-6 * scale, jax.tree_util.keystr(path)
        else:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    module = linen.NeighborhoodAttentionS2(6, grid_in=grid, grid_out=grid, theta_cutoff=cutoff, num_heads=2,
                                           mesh=mesh, batch_axis="batch")  # fmt: skip
    variables = module.init(jax.random.key(0), x)
    plain = linen.NeighborhoodAttentionS2(6, grid_in=grid, grid_out=grid, theta_cutoff=cutoff, num_heads=2)
    np.testing.assert_allclose(module.apply(variables, x), plain.apply(variables, x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("arguments", "match"),
    [
        (dict(implementation="reference"), r"implementation='reference': a layer between ring grids on a mesh runs"),
        (dict(lat_axis="rings"), r"axis='rings' is not an axis of the mesh"),
        (dict(batch_axis="lat"), r"axis must name the mesh axis that splits the rings \(not the batch axis\)"),
    ],
)
def test_bad_mesh_arguments_between_ring_grids_are_refused(arguments, match):
    mesh = _ring_mesh((2, 2), ("lat", "lon"))
    kwargs = dict(grid_in=GRID_IN, grid_out=GRID_OUT, theta_cutoff=CUTOFF, mesh=mesh, **arguments)
    with pytest.raises(ValueError, match=match):
        s2nnx.NeighborhoodAttentionS2(6, **kwargs, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=match):
        linen.NeighborhoodAttentionS2(6, **kwargs)


def test_flat_shapes_belong_to_ring_grids_only():
    with pytest.raises(TypeError, match=r"in_shape must be a pair \(nlat, nlon\)"):
        s2nnx.AttentionS2(4, (48,), (48,), rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"in_shape must be a pair \(nlat, nlon\)"):
        linen.NeighborhoodAttentionS2(4, (48,), (48,))


def test_fields_off_the_grid_are_refused_naming_the_flat_layout():
    layer = s2nnx.NeighborhoodAttentionS2(6, grid_in=GRID_IN, grid_out=GRID_OUT, theta_cutoff=CUTOFF,
                                          rngs=nnx.Rngs(0))  # fmt: skip
    query, key = _fields(3)
    with pytest.raises(ValueError, match=r"key has shape \(2, 13, 24, 6\); this layer expects key of shape "
                                         r"\[batch\.\.\., 312, 6\]"):  # fmt: skip
        layer(query, key.reshape(2, 13, 24, 6))
    with pytest.raises(ValueError, match=r"query has shape \(2, 191, 6\)"):
        layer(query[:, :191], key)


def test_global_attention_between_ring_grids_is_the_neighbourhood_op_at_cutoff_pi():
    """attention_s2 with a RingGrid (point weights, flat fields) against the neighbourhood op whose cutoff takes
    every pair; and AttentionS2 (NNX, Linen) between ring grids on it."""
    from jax_s2attn import attention_s2

    grid_in, grid_out = RingGrid.healpix(2), RingGrid.latlon(5, 8)
    rng = np.random.default_rng(4)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32)
               for s in ((2, grid_out.npoints, 2, 4), (2, grid_in.npoints, 2, 4), (2, grid_in.npoints, 2, 3)))  # fmt: skip
    expected = neighborhood_attention(q, k, v, RingPlan(grid_in, grid_out, np.pi))
    np.testing.assert_allclose(attention_s2(q, k, v, grid_in), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"key has shape \(2, 47, 2, 4\), expected \(2, 48, 2, 4\)"):
        attention_s2(q, k[:, :47], v, grid_in)

    layer = s2nnx.AttentionS2(6, grid_in=grid_in, grid_out=grid_out, num_heads=2, rngs=nnx.Rngs(5))
    params = {name: getattr(layer, name)[...] for name in ("q_kernel", "k_kernel", "v_kernel", "out_kernel",
                                                           "q_bias", "k_bias", "v_bias", "out_bias")}  # fmt: skip
    query = jnp.asarray(rng.standard_normal((3, grid_out.npoints, 6)), jnp.float32)
    key = jnp.asarray(rng.standard_normal((3, grid_in.npoints, 6)), jnp.float32)
    plan = RingPlan(grid_in, grid_out, np.pi)
    np.testing.assert_allclose(layer(query, key), _expected(params, query, key, plan, 2), rtol=1e-5, atol=1e-5)
    module = linen.AttentionS2(6, grid_in=grid_in, grid_out=grid_out, num_heads=2)
    variables = module.init(jax.random.key(0), query, key)
    np.testing.assert_allclose(module.apply({"params": params}, query, key), layer(query, key), rtol=1e-6, atol=1e-6)
    with pytest.raises(TypeError, match=r"grid_out must be a RingGrid like the other grid"):
        s2nnx.AttentionS2(6, grid_in=grid_in, grid_out="equiangular", rngs=nnx.Rngs(0))
    assert set(variables) == {"params"}
