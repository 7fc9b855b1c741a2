"""Sharded attention (latitude halo + longitude ring) on 8 virtual CPU devices.

The oracle is the serial op in float64 (itself checked against a dense float64
softmax in test_reference.py); the sharded op runs in float32, so agreement to 1e-5 relative
means the sharding adds nothing but float32 round-off.
"""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_s2attn
from jax_s2attn import RESIDUAL_NAME, NeighborhoodPlan, neighborhood_attention
from jax_s2attn.parallel import padded_grid_shapes, shard_layout, sharded_neighborhood_attention
from jax_s2attn.parallel.halo import exchange_halo
from jax_s2attn.parallel.layout import AxisSplit
from jax_s2attn.parallel.ring import merge_partials

IMPLEMENTATIONS = ["reference"] + (["ffi"] if jax_s2attn.native_backends()["cpu"] else [])
TOL = 1e-5

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices; see conftest.py")


def _mesh(shape, names=("lat", "lon"), axis_type=AxisType.Explicit):
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names))


# --- layout ---------------------------------------------------------------------------


@pytest.mark.parametrize("size, parts, counts", [(13, 4, (4, 4, 4, 1)), (16, 4, (4,) * 4), (13, 8, (2,) * 6 + (1, 0))])
def test_axis_split_is_jax_layout_of_the_end_padded_axis(size, parts, counts):
    split = AxisSplit.contiguous(size, parts)
    assert split.counts == counts and split.padded_size == parts * split.block
    x = jnp.arange(1, size + 1, dtype=jnp.float32)[None, :, None]
    blocks = np.asarray(split.to_blocks(x, axis=1))[0, :, 0]
    for shard, (start, count) in enumerate(zip(split.starts, counts)):
        block = blocks[shard * split.block : (shard + 1) * split.block]
        np.testing.assert_array_equal(block[:count], np.arange(start + 1, start + count + 1))
        np.testing.assert_array_equal(block[count:], 0)
    np.testing.assert_array_equal(split.from_blocks(split.to_blocks(x, 1), 1), x)


LAYOUT_CASES = [
    ((13, 24), (13, 24), "legendre-gauss", None, 4),
    ((16, 32), (16, 32), "equiangular", 0.5, 2),
    ((24, 48), (12, 24), "equiangular", None, 4),
    ((12, 24), (24, 48), "legendre-gauss", None, 6),
    ((13, 24), (7, 12), "equiangular", None, 3),
    ((7, 12), (13, 24), "equiangular", None, 4),
]


@pytest.mark.parametrize("in_shape, out_shape, grid, cutoff, parts", LAYOUT_CASES)
def test_layout_halo_is_exactly_the_rows_queries_need(in_shape, out_shape, grid, cutoff, parts, dense_membership):
    plan = NeighborhoodPlan(in_shape, out_shape, grid_in=grid, grid_out=grid, theta_cutoff=cutoff)
    layout = shard_layout(plan, parts, 1)
    needs = dense_membership(plan).reshape(plan.nlat_out, plan.nlon_out, plan.nlat_in, plan.nlon_in).any(axis=(1, 3))
    assert sum(layout.k_lat.counts) == plan.nlat_in and sum(layout.q_lat.counts) == plan.nlat_out
    for shard in range(parts):
        window = np.asarray(layout.window(shard, 0, 0))
        q0, qn, k0, kn = window[0], window[2], window[4], window[6]
        rows = np.flatnonzero(needs[q0 : q0 + qn].any(axis=0))
        own = range(layout.k_lat.starts[shard], layout.k_lat.starts[shard] + layout.k_lat.counts[shard])
        # The window is the union of the shard's own rows and the rows its queries read.
        assert k0 == min(rows.min(), own.start) and k0 + kn - 1 == max(rows.max(), own.stop - 1)
        assert layout.halo_top[shard] <= (layout.k_lat.counts[shard - 1] if shard else 0)
        assert layout.halo_bottom[shard] <= (layout.k_lat.counts[shard + 1] if shard < parts - 1 else 0)


@pytest.mark.parametrize("in_shape, out_shape", [((16, 32), (16, 32)), ((16, 36), (8, 12)), ((8, 10), (16, 30))])
def test_layout_longitudes_keep_the_grid_ratio(in_shape, out_shape):
    plan = NeighborhoodPlan(in_shape, out_shape)
    layout = shard_layout(plan, 1, 4)
    q, k = layout.q_lon, layout.k_lon
    assert sum(q.counts) == plan.nlon_out and sum(k.counts) == plan.nlon_in
    coarse, fine = (q, k) if plan.nlon_in >= plan.nlon_out else (k, q)
    assert coarse.counts == AxisSplit.contiguous(coarse.size, 4).counts
    assert fine.counts == tuple(c * (fine.size // coarse.size) for c in coarse.counts)


def test_impossible_splits_name_the_axis_and_an_alternative():
    plan = NeighborhoodPlan((24, 48), (12, 24), theta_cutoff=0.6)
    with pytest.raises(ValueError, match=r"mesh axis 'rows'.*at most (\d+) devices along 'rows'") as info:
        shard_layout(plan, 8, 1, "rows", "cols")
    fitting = int(info.value.args[0].split("at most ")[1].split()[0])
    assert 1 <= fitting < 8
    shard_layout(plan, fitting, 1)  # the suggestion works
    with pytest.raises(ValueError, match=r"mesh axis 'cols' has 8 devices but the coarser grid has only 6 lon"):
        shard_layout(NeighborhoodPlan((8, 12), (8, 6)), 1, 8, "rows", "cols")
    with pytest.raises(ValueError, match=r"has only 5 latitudes. Use at most 5 devices along 'lat'"):
        shard_layout(NeighborhoodPlan((10, 8), (5, 8)), 8, 1)


def test_bad_arguments_are_named():
    plan = NeighborhoodPlan((8, 16), (8, 16))
    q = jnp.zeros((2, 8, 16, 1, 4), jnp.float32)
    attend = functools.partial(sharded_neighborhood_attention, q, q, q, plan)
    mesh = _mesh((2, 2))
    with pytest.raises(ValueError, match=r"lon_axis='x' is not an axis of the mesh"):
        attend(mesh=mesh, lon_axis="x")
    with pytest.raises(ValueError, match="must be distinct"):
        attend(mesh=mesh, lon_axis="lat")
    with pytest.raises(ValueError, match=r"batch_axis='b' splits the first batch dimension over 3 devices"):
        attend(mesh=jax.make_mesh((2, 1, 3), ("lat", "lon", "b"), devices=jax.devices()[:6]), batch_axis="b")
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        attend(mesh=None)
    with pytest.raises(ValueError, match="key has shape"):
        sharded_neighborhood_attention(q, q[:, :7], q, plan, mesh=mesh)
    with pytest.raises(ValueError, match="implementation='ffi' cannot run.*float64"):
        sharded_neighborhood_attention(*(q.astype(jnp.float64),) * 3, plan, mesh=mesh, implementation="ffi")


# --- halo exchange --------------------------------------------------------------------


def _halo_fn(layout, mesh):
    spec = P(None, "lat", "lon")
    return jax.jit(
        jax.shard_map(functools.partial(exchange_halo, layout=layout, axis=1), mesh=mesh, in_specs=spec, out_specs=spec)
    )


def test_halo_exchange_places_the_needed_rows(rng):
    plan = NeighborhoodPlan((13, 24), (13, 24), grid_in="legendre-gauss", grid_out="legendre-gauss", theta_cutoff=0.6)
    layout = shard_layout(plan, 4, 2)
    assert layout.radius_top == layout.radius_bottom == 2
    mesh = _mesh((4, 2))
    rows = np.arange(1.0, plan.nlat_in + 1)[None, :, None] * np.ones((1, 1, 8))
    blocks = jax.device_put(layout.k_lat.to_blocks(jnp.asarray(rows), 1), NamedSharding(mesh, P(None, "lat", "lon")))
    ext = np.asarray(_halo_fn(layout, mesh)(blocks)).reshape(4, layout.k_ext_block, 8)
    for shard in range(4):
        window = np.asarray(layout.window(shard, 0, 0))
        k0, kn = window[4], window[6]
        np.testing.assert_array_equal(ext[shard, :kn], np.arange(k0 + 1, k0 + kn + 1)[:, None] * np.ones(8))
        np.testing.assert_array_equal(ext[shard, kn:], 0)


def test_halo_adjoint_returns_gradients_to_their_owners(rng):
    plan = NeighborhoodPlan((13, 24), (13, 24), grid_in="legendre-gauss", grid_out="legendre-gauss", theta_cutoff=0.6)
    layout = shard_layout(plan, 4, 2)
    mesh = _mesh((4, 2))
    sharding = NamedSharding(mesh, P(None, "lat", "lon"))
    halo = _halo_fn(layout, mesh)
    x = jax.device_put(layout.k_lat.to_blocks(jnp.asarray(rng.standard_normal((2, 13, 8))), 1), sharding)
    y = jax.device_put(jnp.asarray(rng.standard_normal((2, 4 * layout.k_ext_block, 8))), sharding)
    ext, adjoint = jax.vjp(halo, x)
    (back,) = adjoint(y)
    np.testing.assert_allclose(np.vdot(ext, y), np.vdot(x, back), rtol=1e-12)
    # With unit cotangents each row collects one count per window holding it: its owner's
    # and each neighbour's that reads it as halo.
    (copies,) = adjoint(jnp.ones_like(y))
    copies = np.asarray(layout.k_lat.from_blocks(np.asarray(copies), 1))[0, :, 0]
    expected = np.zeros(13)
    for shard in range(4):
        window = np.asarray(layout.window(shard, 0, 0))
        expected[window[4] : window[4] + window[6]] += 1
    np.testing.assert_array_equal(copies, expected)
    assert expected.max() > 1  # some rows really are halo rows


# --- log-sum-exp merge ----------------------------------------------------------------


def test_merge_partials_is_exact_and_handles_empty_sides(rng):
    logits = rng.standard_normal((5, 9)) * 3
    values = rng.standard_normal((9, 4))
    mask = rng.random((5, 9)) < 0.5
    mask[0], mask[1] = False, True  # one row empty on side a, one empty on side b

    def partial(m):
        lg = np.where(m, logits, -np.inf)
        lse = np.logaddexp.reduce(lg, axis=1)
        weights = np.where(m, np.exp(lg - np.where(np.isfinite(lse), lse, 0)[:, None]), 0)
        return weights @ values, lse

    out, lse = merge_partials(*partial(mask), *partial(~mask))
    full_lse = np.logaddexp.reduce(logits, axis=1)
    np.testing.assert_allclose(lse, full_lse, rtol=1e-12)
    np.testing.assert_allclose(out, np.exp(logits - full_lse[:, None]) @ values, rtol=1e-12, atol=1e-12)
    empty = np.full(3, -np.inf)
    out, lse = merge_partials(np.zeros((3, 2)), empty, np.zeros((3, 2)), empty)
    assert np.all(lse == -np.inf) and np.all(out == 0)


# --- sharded == serial ----------------------------------------------------------------

HEADS, DK, DV = 2, 4, 6

# (in_shape, out_shape, grid, mesh shape): every direction on both grids, every mesh,
# latitude counts that do not divide the mesh, longitude counts that do not divide it.
# The fast tier keeps self (uneven, with an empty longitude block), down (uneven) and up.
SELF = ((16, 32), (16, 32))
DOWN = ((16, 32), (8, 16))
UP = ((8, 16), (16, 32))
slow = functools.partial(pytest.param, marks=pytest.mark.slow)
CASES = [
    slow(*SELF, "equiangular", (1, 1)),
    slow(*SELF, "equiangular", (2, 1)),
    slow(*SELF, "equiangular", (1, 4)),
    slow(*SELF, "equiangular", (2, 4)),
    slow(*SELF, "equiangular", (4, 2)),
    slow((13, 24), (13, 24), "equiangular", (8, 1)),  # 2 latitudes per shard, the last shard empty
    slow((13, 18), (13, 18), "legendre-gauss", (4, 2)),
    ((13, 9), (13, 9), "legendre-gauss", (2, 4)),  # longitude blocks 3, 3, 3 and 0
    slow(*DOWN, "equiangular", (4, 2)),
    ((13, 24), (7, 12), "legendre-gauss", (2, 4)),
    (*UP, "equiangular", (2, 4)),
    slow((7, 10), (13, 30), "legendre-gauss", (4, 2)),
]


def _inputs(plan, batch=(2,)):
    """Fixed random float64 inputs and output cotangent for a plan (shared by its cases)."""
    rng = np.random.default_rng(zlib.crc32(repr(plan).encode()))
    shapes = [(*plan.out_shape, HEADS, DK), (*plan.in_shape, HEADS, DK), (*plan.in_shape, HEADS, DV)]
    shapes.append((*plan.out_shape, HEADS, DV))
    return [rng.standard_normal((*batch, *s)) for s in shapes]


@functools.lru_cache(maxsize=None)
def _serial(plan):
    """Float64 serial output and (dq, dk, dv) for ``_inputs(plan)``."""

    @jax.jit
    def run(q, k, v, cot, plan):
        op = functools.partial(neighborhood_attention, plan=plan, implementation="reference")
        out, vjp = jax.vjp(lambda q, k, v: op(q, k, v), q, k, v)
        return out, vjp(cot)

    out, grads = run(*_inputs(plan), plan)
    return np.asarray(out), [np.asarray(g) for g in grads]


def _sharded(plan, mesh, *, spec=P(None, "lat", "lon"), **kwargs):
    """Float32 sharded output and grads for ``_inputs(plan)``, inputs placed on ``mesh`` when they divide it."""
    arrays = [jnp.asarray(x, jnp.float32) for x in _inputs(plan)]
    shard = lambda x: x.shape[1] % mesh.shape["lat"] == 0 and x.shape[2] % mesh.shape["lon"] == 0  # noqa: E731
    arrays = [jax.device_put(x, NamedSharding(mesh, spec if shard(x) else P())) for x in arrays]

    @jax.jit
    def run(q, k, v, cot, plan):
        out, vjp = jax.vjp(lambda q, k, v: sharded_neighborhood_attention(q, k, v, plan, mesh=mesh, **kwargs), q, k, v)
        return out, vjp(jax.sharding.reshard(cot, jax.typeof(out).sharding))

    return run(*arrays, plan)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("in_shape, out_shape, grid, mesh_shape", CASES)
def test_sharded_matches_serial(in_shape, out_shape, grid, mesh_shape, implementation, rel_error):
    plan = NeighborhoodPlan(in_shape, out_shape, grid_in=grid, grid_out=grid)
    mesh = _mesh(mesh_shape)
    out, grads = _sharded(plan, mesh, implementation=implementation)
    expected_out, expected_grads = _serial(plan)
    assert out.dtype == jnp.float32 and out.shape == expected_out.shape
    assert rel_error(out, expected_out) <= TOL
    for name, g, expected in zip("qkv", grads, expected_grads):
        assert rel_error(g, expected) <= TOL, f"d{name}"
    if plan.nlat_out % mesh_shape[0] == 0 and plan.nlon_out % mesh_shape[1] == 0:
        assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "lat", "lon")), out.ndim)


def test_batch_axis_extra_mesh_axis_and_auto_axes(rel_error):
    """Batch split over its own axis, a replicating 'model' axis, and an Auto-typed mesh."""
    plan = NeighborhoodPlan(*SELF)
    expected_out, expected_grads = _serial(plan)
    mesh = _mesh((2, 2, 2), ("batch", "lat", "lon"))
    out, grads = _sharded(plan, mesh, spec=P("batch", "lat", "lon"), batch_axis="batch")
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("batch", "lat", "lon")), out.ndim)
    mesh = _mesh((2, 2, 2), ("lat", "model", "lon"), axis_type=AxisType.Auto)
    out_auto, grads_auto = _sharded(plan, mesh)
    for actual in (out, out_auto):
        assert rel_error(actual, expected_out) <= TOL
    for actual in (grads, grads_auto):
        for g, expected in zip(actual, expected_grads):
            assert rel_error(g, expected) <= TOL


def test_leading_batch_dims_and_no_batch_dims(rel_error):
    plan = NeighborhoodPlan((8, 16), (8, 16))
    q, k, v, _ = (jnp.asarray(x) for x in _inputs(plan, batch=(2, 3)))
    mesh = _mesh((2, 2))
    sharded = jax.jit(lambda q, k, v, plan: sharded_neighborhood_attention(q, k, v, plan, mesh=mesh))
    f32 = lambda *xs: [x.astype(jnp.float32) for x in xs]  # noqa: E731
    expected = neighborhood_attention(q, k, v, plan, implementation="reference")
    assert rel_error(sharded(*f32(q, k, v), plan), expected) <= TOL
    assert rel_error(sharded(*f32(q[1, 2], k[1, 2], v[1, 2]), plan), expected[1, 2]) <= TOL


def test_end_padded_inputs_stay_sharded_and_their_padding_is_ignored(rel_error):
    """The 721-latitudes-on-4-devices situation in small: 13 latitudes padded to 16."""
    plan = NeighborhoodPlan((13, 24), (13, 24), grid_in="legendre-gauss", grid_out="legendre-gauss")
    mesh = _mesh((4, 2))
    assert padded_grid_shapes(plan, mesh) == ((16, 24), (16, 24))
    sharding = NamedSharding(mesh, P(None, "lat", "lon"))
    garbage = lambda x: np.full((x.shape[0], 3, *x.shape[2:]), np.nan, np.float32)  # noqa: E731
    args = [jax.device_put(np.concatenate([x.astype(np.float32), garbage(x)], axis=1), sharding)
            for x in _inputs(plan)]

    def step(q, k, v, cot, plan):
        out, vjp = jax.vjp(lambda q, k, v: sharded_neighborhood_attention(q, k, v, plan, mesh=mesh), q, k, v)
        return out, vjp(cot)

    compiled = jax.jit(step).lower(*args, plan).compile()
    assert "all-gather" not in compiled.as_text()
    out, grads = compiled(*args, plan)
    assert out.shape == (2, 16, 24, HEADS, DV) and out.sharding.is_equivalent_to(sharding, out.ndim)
    out, grads = np.asarray(out), [np.asarray(g) for g in grads]
    expected_out, expected_grads = _serial(plan)
    assert np.all(out[:, 13:] == 0) and rel_error(out[:, :13], expected_out) <= TOL
    for g, expected in zip(grads, expected_grads):
        assert g.shape[1] == 16 and np.all(g[:, 13:] == 0)
        assert rel_error(g[:, :13], expected) <= TOL


def test_checkpoint_policy_keeps_the_forward_ring_from_running_twice():
    plan = NeighborhoodPlan((8, 16), (8, 16))
    mesh = _mesh((1, 2), axis_type=AxisType.Auto)
    q = jnp.ones((1, 8, 16, 1, 4), jnp.float32)
    loss = lambda q, k, v: jnp.sum(sharded_neighborhood_attention(q, k, v, plan, mesh=mesh))  # noqa: E731
    # Every ring step moves data with a ppermute, so their count tells how often each ring runs.
    ppermutes = lambda f: str(jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(q, q, q)).count("ppermute")  # noqa: E731
    policy = jax.checkpoint_policies.save_only_these_names(RESIDUAL_NAME)
    assert ppermutes(jax.checkpoint(loss, policy=policy)) == ppermutes(loss) < ppermutes(jax.checkpoint(loss))


# --- communication and memory ---------------------------------------------------------


# A problem whose activations dominate the replicated tables and the ring's fixed costs.
MEMORY_PLAN_SHAPE, MEMORY_BATCH, MEMORY_HEADS, MEMORY_HEAD_DIM = (32, 64), 2, 2, 16


@functools.lru_cache(maxsize=None)
def _compiled_step(mesh_shape, implementation):
    """The compiled forward + backward of the sharded op on a mesh (float32)."""
    plan = NeighborhoodPlan(MEMORY_PLAN_SHAPE, MEMORY_PLAN_SHAPE)
    mesh = _mesh(mesh_shape)
    shape = (MEMORY_BATCH, *MEMORY_PLAN_SHAPE, MEMORY_HEADS, MEMORY_HEAD_DIM)
    x = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, P(None, "lat", "lon")))

    def step(q, k, v, cot, plan):
        attend = functools.partial(sharded_neighborhood_attention, mesh=mesh, implementation=implementation)
        out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, plan), q, k, v)
        return out, vjp(cot)

    return jax.jit(step).lower(x, x, x, x, plan).compile()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_compiled_program_communicates_only_by_permutes(implementation):
    hlo = _compiled_step((2, 4), implementation).as_text()
    assert "collective-permute" in hlo  # halo and ring
    for collective in ("all-gather", "all-reduce", "reduce-scatter", "all-to-all"):
        assert collective not in hlo, collective


@pytest.mark.parametrize(
    "implementation", [pytest.param(i, marks=pytest.mark.slow) if i == "reference" else i for i in IMPLEMENTATIONS]
)
def test_per_device_memory_shrinks_as_the_mesh_grows(implementation):
    meshes = [(1, 1), (2, 1), (2, 2), (2, 4)]
    stats = {}
    for shape in meshes:
        memory = _compiled_step(shape, implementation).memory_analysis()
        io = memory.argument_size_in_bytes + memory.output_size_in_bytes
        stats[shape] = (io, io + memory.temp_size_in_bytes)
    io_serial, total_serial = stats[(1, 1)]
    for shape, (io, _) in stats.items():
        # Inputs, cotangent, output and gradients split evenly; the replicated plan tables are a few kB.
        assert io <= io_serial / (shape[0] * shape[1]) + 16_384, stats
    totals = [total for _, total in stats.values()]
    if implementation == "ffi":
        assert all(a > b for a, b in zip(totals, totals[1:])), stats
        assert totals[-1] < totals[0] / 3, stats  # 8 devices: halo and ring buffers cost less than 8/3x
    else:
        # The reference's temporaries are bounded by its gather budget, not by the grid.
        assert totals[-1] < totals[0], stats


# --- end to end -----------------------------------------------------------------------


def _attention_model(params, x, attention):
    """Q/K/V projections, neighbourhood attention, output projection."""
    batch, nlat, nlon, _ = x.shape
    heads = lambda w: (x @ w).reshape(batch, nlat, nlon, HEADS, -1)  # noqa: E731
    out = attention(heads(params["wq"]), heads(params["wk"]), heads(params["wv"]))
    return out.reshape(batch, nlat, nlon, -1) @ params["wo"]


def test_jitted_training_step_matches_unsharded(rel_error):
    optax = pytest.importorskip("optax")
    plan = NeighborhoodPlan(*SELF)
    rng = np.random.default_rng(5)
    channels = 5
    shapes = {"wq": (channels, HEADS * DK), "wk": (channels, HEADS * DK), "wv": (channels, HEADS * DV)}
    shapes["wo"] = (HEADS * DV, channels)
    params = {n: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), jnp.float32) for n, s in shapes.items()}
    x, y = (jnp.asarray(rng.standard_normal((2, *plan.out_shape, channels)), jnp.float32) for _ in range(2))
    optimizer = optax.adam(1e-2)

    def make_step(attention):
        @jax.jit
        def step(params, opt_state, x, y, plan):
            def loss_fn(params):
                pred = _attention_model(params, x, lambda q, k, v: attention(q, k, v, plan))
                return jnp.mean((pred - y) ** 2)

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss, grads

        return step

    def train(step, params, x, y):
        opt_state, history = optimizer.init(params), []
        for _ in range(2):
            params, opt_state, loss, grads = step(params, opt_state, x, y, plan)
            history.append((loss, grads))
        return params, history

    mesh = _mesh((2, 4))
    place = lambda tree, spec: jax.device_put(tree, NamedSharding(mesh, spec))  # noqa: E731
    sharded_step = make_step(functools.partial(sharded_neighborhood_attention, mesh=mesh))
    sharded = train(sharded_step, place(params, P()), *place((x, y), P(None, "lat", "lon")))
    serial = train(make_step(neighborhood_attention), params, x, y)

    assert sharded[1][1][0] < sharded[1][0][0]  # it trains
    for (loss, grads), (loss_ref, grads_ref) in zip(sharded[1], serial[1]):
        assert rel_error(loss, loss_ref) <= TOL
        for name in shapes:
            assert rel_error(grads[name], grads_ref[name]) <= TOL, name
    for name in shapes:
        assert rel_error(sharded[0][name], serial[0][name]) <= TOL, name
