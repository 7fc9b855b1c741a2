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
    # Input ranges of no ring on some shards (a coarse input grid), one shard, and rings of few points (more rings
    # than a shard has points).
    "coarse_input": (RingGrid.latlon(6, 12), RingGrid.latlon(37, 72), 0.6, 8),
    "one_shard": (RingGrid.healpix(2), RingGrid.latlon(9, 18), 0.5, 1),
    "thin_rings": (RingGrid.latlon(33, 4), RingGrid.latlon(33, 4), 0.3, 8),
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
    sharded = _sharded(wide, layout, _mesh((8,), ("rings",)))
    np.testing.assert_array_equal(np.asarray(sharded(q, k, v)), np.asarray(neighborhood_attention(q, k, v, wide)))
    grads = jax.grad(lambda *x: jnp.vdot(sharded(*x), g), argnums=(0, 1, 2))(q, k, v)
    expected = jax.grad(lambda *x: jnp.vdot(neighborhood_attention(*x, wide), g), argnums=(0, 1, 2))(q, k, v)
    for label, a, b in zip("qkv", grads, expected):
        assert _rel(a, b) <= 1e-6, label


def test_padding_rings_are_no_larger_than_the_grids_rings():
    """The launch covers max_ring_points columns per walking ring: padding must not raise it past the grids'."""
    for name in ("latlon_3_to_2", "healpix_8", "coarse_input"):
        grid_in, grid_out, cutoff, parts = CASES[name]
        layout = ring_shard_layout(RingPlan(grid_in, grid_out, cutoff), parts)
        for (tables, sizes), grid in ((layout.forward, grid_out), (layout.backward, grid_in)):
            assert sizes.max_ring_points == grid.nlon.max()
            assert tables.walk_rings[..., 1].max() <= sizes.max_ring_points


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
    grads = jax.grad(lambda *x: jnp.sum(sharded_ring_attention(*x, plan, mesh=mesh)), argnums=(0, 1, 2))(*blocks)
    for grad, grid in zip(grads, ("out", "in", "in")):
        assert (np.asarray(grad)[:, ~real[grid]] == 0).all() and np.asarray(grad).any()
    with pytest.raises(ValueError, match=r"grid must be 'out' .* or 'in'"):
        layout.to_blocks(q, "query")
    with pytest.raises(ValueError, match=r"x must have shape \[\.\.\., npoints = 192, heads, head_dim\]"):
        layout.to_blocks(q[:, 1:], "out")
    with pytest.raises(ValueError, match=r"x must have shape \[\.\.\., parts \* block"):
        layout.from_blocks(q, "out")


def test_gradients_are_the_same_bits_in_different_programs():
    grid_in, grid_out, cutoff, parts = CASES["healpix_8"]
    plan = RingPlan(grid_in, grid_out, cutoff)
    sharded = _sharded(plan, ring_shard_layout(plan, parts), _mesh((parts,), ("rings",)))
    q, k, v, g = _fields(plan, seed=5)
    grad = jax.grad(lambda *x: jnp.vdot(sharded(*x), g), argnums=(0, 1, 2))
    first = jax.jit(grad)(q, k, v)
    # Another program: other work fused beside it, inputs scaled by an exact power of two and back.
    second = jax.jit(lambda q, k, v: [x * 1.0 for x in grad(q * 2.0 / 2.0, k, v)] + [jnp.sum(k * 3.0)])(q, k, v)
    for a, b in zip(first, second[:3]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_empty_batch_and_no_heads():
    grid_in, grid_out, cutoff, parts = CASES["latlon_3_to_2"]
    plan = RingPlan(grid_in, grid_out, cutoff)
    layout, (q, k, v) = _block_inputs(plan, parts)
    mesh = _mesh((parts,), ("rings",))
    out = sharded_ring_attention(q[:0], k[:0], v[:0], plan, mesh=mesh)
    assert out.shape == (0, parts * layout.q_block, 2, 5)
    out = sharded_ring_attention(q[:, :, :0], k[:, :, :0], v[:, :, :0], plan, mesh=mesh)
    assert out.shape == (2, parts * layout.q_block, 0, 5)


def test_explicit_mesh_axes():
    grid_in, grid_out, cutoff, parts = CASES["latlon_2_to_3"]
    plan = RingPlan(grid_in, grid_out, cutoff)
    layout = ring_shard_layout(plan, parts)
    mesh = jax.make_mesh((parts,), ("rings",), devices=CPUS[:parts], axis_types=(AxisType.Explicit,))
    q, k, v, _ = _fields(plan, seed=6)
    blocks = layout.to_blocks(q, "out"), layout.to_blocks(k, "in"), layout.to_blocks(v, "in")
    out = jax.jit(lambda *x: sharded_ring_attention(*x, plan, mesh=mesh))(*blocks)
    assert out.sharding.spec[1] == "rings"
    np.testing.assert_array_equal(np.asarray(layout.from_blocks(out, "out")),
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
        (dict(mesh=("batch", "rings"), batch_axis="batch"), ValueError, r"batch_axis='batch' splits the first batch"),
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
    if "mesh" in change:  # a batch axis of 2 devices beside the 4 ring shards, and a batch of 1
        change["mesh"] = _mesh((2, 4), change["mesh"])
        q, k, v = (x[:1] for x in (q, k, v))
    arguments.update(change)
    with pytest.raises(error, match=match):
        sharded_ring_attention(q, k, v, arguments.pop("plan"), **arguments)


def test_too_many_shards_for_the_rings_name_the_fix():
    plan = RingPlan(RingGrid.healpix(1), RingGrid.healpix(1), 1.5)  # 3 rings
    with pytest.raises(ValueError, match=r"cannot cut the 3 output rings .* into 8 ring ranges .* fewer devices"):
        ring_shard_layout(plan, 8)
