"""sharded_ring_attention on 8 virtual CPU devices: sharded == serial (outputs and q/k/v gradients) for HEALPix and
3:2 / 2:3 longitude ratios (scaled down), halos of one and two blocks, a batch axis, the block layout and its
padding, bitwise-repeatable gradients, and what bad input gets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from jax_s2attn import RingGrid, RingPlan, neighborhood_attention
from jax_s2attn.ops import _ffi
from jax_s2attn.parallel import ring_shard_layout, sharded_ring_attention

pytestmark = pytest.mark.skipif(_ffi.ring_unavailable_reason("cpu", jnp.float32) is not None,
                                reason="native CPU module with the ring targets not built")  # fmt: skip

CPUS = jax.devices("cpu")

# (input grid, output grid, cutoff, shards): HEALPix self-attention (a halo of two blocks on 8 shards), 721x1440 ->
# 480x960's 3:2 ratio and the decoder's 2:3 scaled down, and between grid kinds.
CASES = {
    "healpix_8": (RingGrid.healpix(4), RingGrid.healpix(4), 0.35, 8),
    "latlon_3_to_2": (RingGrid.latlon(37, 72), RingGrid.latlon(25, 48), 0.2, 4),
    "latlon_2_to_3": (RingGrid.latlon(25, 48), RingGrid.latlon(37, 72), 0.2, 4),
    "octahedral_to_healpix": (RingGrid.octahedral(8), RingGrid.healpix(4), 0.3, 2),
}


def _mesh(shape, names):
    return jax.make_mesh(shape, names, devices=CPUS[: int(np.prod(shape))], axis_types=(AxisType.Auto,) * len(names))


def _fields(plan, seed, batch=(2,), heads=2, dk=8, dv=5, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(shape).astype(np.float32), dtype) for shape in (
        (*batch, plan.npoints_out, heads, dk), (*batch, plan.npoints_in, heads, dk), (*batch, plan.npoints_in, heads, dv),
        (*batch, plan.npoints_out, heads, dv))]  # fmt: skip


def _sharded(plan, layout, mesh, **kwargs):
    """The sharded op on flat fields (through the block layout)."""

    def attend(q, k, v):
        blocks = layout.to_blocks(q, "out"), layout.to_blocks(k, "in"), layout.to_blocks(v, "in")
        return layout.from_blocks(sharded_ring_attention(*blocks, plan, mesh=mesh, **kwargs), "out")

    return attend


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("name", sorted(CASES))
def test_sharded_equals_serial_outputs_and_gradients(name):
    grid_in, grid_out, cutoff, parts = CASES[name]
    plan = RingPlan(grid_in, grid_out, cutoff)
    layout = ring_shard_layout(plan, parts)
    q, k, v, g = _fields(plan, seed=parts)
    sharded = _sharded(plan, layout, _mesh((parts,), ("rings",)))
    serial = lambda q, k, v: neighborhood_attention(q, k, v, plan)  # noqa: E731
    out = jax.jit(sharded)(q, k, v)
    # The forward walks the same arcs in the same order: the same bits.
    np.testing.assert_array_equal(np.asarray(out), np.asarray(serial(q, k, v)))
    grads = jax.grad(lambda *x: jnp.vdot(sharded(*x), g), argnums=(0, 1, 2))(q, k, v)
    expected = jax.grad(lambda *x: jnp.vdot(serial(*x), g), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_array_equal(np.asarray(grads[0]), np.asarray(expected[0]))  # dq: the same walk too
    for label, a, b in zip("kv", grads[1:], expected[1:]):  # halo keys' gradients add up across shards
        assert _rel(a, b) <= 1e-6, label


def test_halos_reach_as_far_as_the_cutoff():
    plan = RingPlan(RingGrid.healpix(4), RingGrid.healpix(4), 0.35)
    assert [ring_shard_layout(plan, parts).halo for parts in (2, 4, 8)] == [1, 1, 2]
    wide = RingPlan(RingGrid.latlon(19, 36), RingGrid.latlon(19, 36), 1.2)
    layout = ring_shard_layout(wide, 8)
    assert layout.halo >= 3
    q, k, v, g = _fields(wide, seed=1)
    out = _sharded(wide, layout, _mesh((8,), ("rings",)))(q, k, v)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(neighborhood_attention(q, k, v, wide)))


def test_batch_axis_and_16_bit_inputs():
    grid_in, grid_out, cutoff, _ = CASES["latlon_3_to_2"]
    plan = RingPlan(grid_in, grid_out, cutoff)
    layout = ring_shard_layout(plan, 4)
    mesh = _mesh((2, 4), ("batch", "rings"))
    q, k, v, _ = _fields(plan, seed=3, batch=(4, 3), dtype=jnp.bfloat16)
    out = jax.jit(_sharded(plan, layout, mesh, batch_axis="batch"))(q, k, v)
    assert out.dtype == jnp.bfloat16 and out.shape == (4, 3, plan.npoints_out, 2, 5)
    np.testing.assert_array_equal(np.asarray(out, np.float32),
                                  np.asarray(neighborhood_attention(q, k, v, plan), np.float32))  # fmt: skip


def test_block_layout_round_trips_and_padding_is_ignored():
    grid_in, grid_out, cutoff, parts = CASES["healpix_8"]
    plan = RingPlan(grid_in, grid_out, cutoff)
    layout = ring_shard_layout(plan, parts)
    q, k, v, g = _fields(plan, seed=4)
    for x, grid, block in ((q, "out", layout.q_block), (k, "in", layout.k_block)):
        blocks = layout.to_blocks(x, grid)
        assert blocks.shape[-3] == parts * block
        np.testing.assert_array_equal(np.asarray(layout.from_blocks(blocks, grid)), np.asarray(x))
    slots = layout.q_slots.reshape(parts, layout.q_block)
    assert (np.diff(slots[slots >= 0]) == 1).all() and (slots[:, :1] >= 0).all()  # ring order, no empty shard
    # Garbage (NaN) in every padding slot of the inputs changes nothing, and the output's padding is zero.
    blocks = [layout.to_blocks(x, grid) for x, grid in ((q, "out"), (k, "in"), (v, "in"))]
    real = {"out": layout.q_slots >= 0, "in": layout.k_slots >= 0}
    poisoned = [jnp.where(real[grid][:, None, None], b, jnp.nan) for b, grid in zip(blocks, ("out", "in", "in"))]
    mesh = _mesh((parts,), ("rings",))
    out = sharded_ring_attention(*poisoned, plan, mesh=mesh)
    assert not np.isnan(np.asarray(out)).any()
    np.testing.assert_array_equal(np.asarray(out)[:, layout.q_slots < 0], 0.0)
    np.testing.assert_array_equal(np.asarray(layout.from_blocks(out, "out")),
                                  np.asarray(neighborhood_attention(q, k, v, plan)))  # fmt: skip
    # Padding slots get zero gradients.
    grads = jax.grad(lambda *x: jnp.sum(sharded_ring_attention(*x, plan, mesh=mesh)), argnums=(0, 1))(*blocks)
    assert (np.asarray(grads[0])[:, layout.q_slots < 0] == 0).all()
    assert (np.asarray(grads[1])[:, layout.k_slots < 0] == 0).all()


def test_gradients_are_bitwise_repeatable():
    grid_in, grid_out, cutoff, parts = CASES["octahedral_to_healpix"]
    plan = RingPlan(grid_in, grid_out, cutoff)
    sharded = _sharded(plan, ring_shard_layout(plan, parts), _mesh((parts,), ("rings",)))
    q, k, v, g = _fields(plan, seed=5)
    grad = jax.jit(jax.grad(lambda *x: jnp.vdot(sharded(*x), g), argnums=(0, 1, 2)))
    for a, b in zip(grad(q, k, v), grad(q, k, v)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_explicit_mesh_axes():
    grid_in, grid_out, cutoff, parts = CASES["latlon_2_to_3"]
    plan = RingPlan(grid_in, grid_out, cutoff)
    layout = ring_shard_layout(plan, parts)
    mesh = jax.make_mesh((parts,), ("rings",), devices=CPUS[:parts], axis_types=(AxisType.Explicit,))
    q, k, v, _ = _fields(plan, seed=6)
    blocks = layout.to_blocks(q, "out"), layout.to_blocks(k, "in"), layout.to_blocks(v, "in")
    out = jax.jit(lambda *x: sharded_ring_attention(*x, plan, mesh=mesh))(*blocks)
    np.testing.assert_array_equal(np.asarray(layout.from_blocks(np.asarray(out), "out")),
                                  np.asarray(neighborhood_attention(q, k, v, plan)))  # fmt: skip


def _block_inputs(plan, parts, dtype=np.float32):
    layout = ring_shard_layout(plan, parts)
    q, k, v, _ = _fields(plan, seed=7, dtype=dtype)
    return layout, (layout.to_blocks(q, "out"), layout.to_blocks(k, "in"), layout.to_blocks(v, "in"))


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (dict(implementation="reference"), ValueError, r"implementation='reference': the sharded op .* ring kernels"),
        (dict(implementation="ffi-tiled"), ValueError, r"implementation='ffi-tiled'"),
        (dict(axis="lat"), ValueError, r"axis='lat' is not an axis of the mesh"),
        (dict(batch_axis="rings"), ValueError, r"axis must name the mesh axis that splits the rings"),
        (dict(plan="healpix"), TypeError, r"plan must be a jax_s2attn.RingPlan"),
        (dict(query=lambda q: q[:, :-1]), ValueError, r"query has shape .* the block layout of ring_shard_layout"),
        (dict(value=lambda v: v[..., :0, :, :]), ValueError, r"value has shape"),
        (dict(dtype=np.float64), ValueError, r"runs the ring kernels, which cannot run here: .*float64"),
    ],
)
def test_bad_input_is_refused_at_trace_time(change, error, match):
    grid_in, grid_out, cutoff, parts = CASES["healpix_8"]
    plan = RingPlan(grid_in, grid_out, cutoff)
    dtype = change.pop("dtype", np.float32)
    _, (q, k, v) = _block_inputs(plan, 4, dtype)
    q = change.pop("query", lambda x: x)(q)
    v = change.pop("value", lambda x: x)(v)
    arguments = dict(plan=plan, mesh=_mesh((4,), ("rings",)))
    arguments.update(change)
    with pytest.raises(error, match=match):
        sharded_ring_attention(q, k, v, arguments.pop("plan"), **arguments)


def test_too_many_shards_for_the_rings_name_the_fix():
    plan = RingPlan(RingGrid.healpix(1), RingGrid.healpix(1), 1.5)  # 3 rings
    with pytest.raises(ValueError, match=r"cannot cut the 3 output rings .* into 8 ring ranges .* fewer devices"):
        ring_shard_layout(plan, 8)
