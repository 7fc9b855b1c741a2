"""Attention between ring grids over a device mesh: ring ranges per shard and a halo of neighbouring blocks.

Shard ``s`` of ``parts`` owns output rings ``out_cuts[s] .. out_cuts[s + 1] - 1`` and input rings ``in_cuts[s] ..
in_cuts[s + 1] - 1`` (cut where the points balance; the input grid at the same colatitudes). Fields live in the
*block layout* ``[B..., parts * block, H, D]``: shard ``s``'s points, in ring order, fill the first slots of its
block and padding follows (:meth:`RingShardLayout.to_blocks` and :meth:`~RingShardLayout.from_blocks` convert from
and to flat fields). A shard's key buffer is the key blocks of shards ``s - halo .. s + halo`` (``lax.ppermute``),
so every key ring its queries meet is whole in it.

Each shard runs the ring targets on tables of its own: the plan's patterns of its rings with every arc's first
point moved to the buffer (the queries' walk), and the plan's key patterns of the buffer's rings cut to the
shard's own query rings (the keys' walk, whose gradients of halo keys go back to their owners through the
transpose of the ``ppermute``). A ``shard_map`` body is one program with one set of attributes, so the tables are
stacked over the shards and padded to equal sizes: padding points form rings of their own whose pattern holds no
arc (``out = 0``, ``lse = -inf``, zero gradients), and a last pattern no ring uses holds the padding arcs.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from ..ops import _checks, _ffi
from ..ops.neighborhood import ring_walks
from ..ring_plan import RingPlan
from .sharded import _check_batch, _place

__all__ = ["RingShardLayout", "ring_shard_layout", "sharded_ring_attention"]

# An arc of one point of ring 0 at the buffer's first point: valid for every check, in the pattern no ring uses.
_PADDING_ARC = (0, 0, 0, 1, 1, 0)


@dataclasses.dataclass(frozen=True, eq=False)
class RingShardLayout:
    """The split of a :class:`~jax_s2attn.RingPlan` over ``parts`` shards (static; built by
    :func:`ring_shard_layout`).

    Attributes:
      parts: shards.
      out_cuts, in_cuts: ring boundaries (``parts + 1`` each) of the output and input grids.
      q_block, k_block: points per shard block of the output and input grids (padding included).
      halo: neighbouring key blocks a shard reads on each side.
      forward, backward: the queries' and the keys' walks, each ``(RingWalkTables stacked [parts, ...],
        RingWalkSizes)``.
    """

    parts: int
    out_cuts: tuple[int, ...]
    in_cuts: tuple[int, ...]
    q_block: int
    k_block: int
    halo: int
    forward: tuple
    backward: tuple
    q_slots: np.ndarray  # [parts * q_block] global output point of each slot, -1 for padding
    k_slots: np.ndarray  # [parts * k_block] global input point of each slot, -1 for padding

    def to_blocks(self, x, grid: str):
        """A flat field ``[B..., npoints, H, D]`` of ``grid`` ("out" or "in") in the block layout, zeros in the
        padding (an array sharded over explicit mesh axes is gathered first)."""
        slots = self._slots(grid, x, int((self._slots(grid) >= 0).sum()), "npoints")
        blocks = jnp.take(_gathered(x), np.maximum(slots, 0), axis=-3)
        return jnp.where((slots >= 0)[:, None, None], blocks, jnp.zeros((), blocks.dtype))

    def from_blocks(self, x, grid: str):
        """The flat field ``[B..., npoints, H, D]`` of ``grid`` ("out" or "in") from its block layout (an array
        sharded over explicit mesh axes is gathered first)."""
        slots = self._slots(grid, x, self._slots(grid).size, "parts * block")
        real = np.flatnonzero(slots >= 0)
        return jnp.take(_gathered(x), real[np.argsort(slots[real])], axis=-3)

    def _slots(self, grid: str, x=None, points: int = 0, layout: str = "") -> np.ndarray:
        """The slots of ``grid``, after checking that ``x`` (if given) has ``points`` along its point axis."""
        if grid not in ("out", "in"):
            raise ValueError(f"grid must be 'out' (queries, outputs) or 'in' (keys, values), got {grid!r}.")
        slots = self.q_slots if grid == "out" else self.k_slots
        if x is not None and (len(getattr(x, "shape", ())) < 3 or x.shape[-3] != points):
            raise ValueError(f"x must have shape [..., {layout} = {points}, heads, head_dim] on grid {grid!r}, got "
                             f"shape {tuple(getattr(x, 'shape', ()))}.")  # fmt: skip
        return slots


def _gathered(x):
    """``x`` as an array, gathered where it is sharded over explicit mesh axes (a gather along a sharded axis needs
    its result's sharding named)."""
    x = jnp.asarray(x)
    sharding = jax.typeof(x).sharding
    if any(part is not None for part in getattr(sharding, "spec", ())):
        return jax.sharding.reshard(x, jax.sharding.NamedSharding(sharding.mesh, PartitionSpec()))
    return x


def _cuts(plan: RingPlan, parts: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Output rings cut where their points balance; input rings at the colatitudes between the output cuts."""
    grid_out, grid_in = plan.grid_out, plan.grid_in
    targets = np.arange(1, parts) * grid_out.npoints / parts
    inner = np.searchsorted(grid_out.ring_offsets[1:-1], targets) + 1
    out_cuts = (0, *(int(c) for c in inner), grid_out.nrings)
    if any(b <= a for a, b in zip(out_cuts, out_cuts[1:])):
        raise ValueError(
            f"cannot cut the {grid_out.nrings} output rings of {grid_out.name} into {parts} ring ranges of similar "
            "points: use fewer devices along the mesh axis."
        )
    theta = grid_out.colatitudes
    between = [(theta[c - 1] + theta[c]) / 2 for c in out_cuts[1:-1]]
    in_cuts = (0, *(int(c) for c in np.searchsorted(grid_in.colatitudes, between)), grid_in.nrings)
    return out_cuts, in_cuts


def _owner(in_cuts, ring):
    return np.searchsorted(in_cuts, ring, side="right") - 1


def _split_padding(segments, rows: int, cap: int) -> list[tuple[int, int]]:
    """``rows`` padding rings ``(first, points)`` covering the padding ``segments`` ``[(first, length), ...]`` in
    order, each of 1 to ``cap`` points. Requires ``sum(ceil(length / cap)) <= rows <= sum(length)``."""
    counts = [-(-length // cap) for _, length in segments]
    extra = rows - sum(counts)
    for i, (_, length) in enumerate(segments):
        more = min(extra, length - counts[i])
        counts[i] += more
        extra -= more
    assert extra == 0, (segments, rows, cap)
    pieces = []
    for (first, length), n in zip(segments, counts):
        base, remainder = divmod(length, max(n, 1))
        for i in range(n):
            size = base + (i < remainder)
            pieces.append((first, size))
            first += size
    return pieces


def _block_and_rows(real_rows, segments_of, block: int, cap: int) -> tuple[int, int]:
    """The smallest block size from ``block`` and the row count at which every shard's real rows plus its padding
    rings (``segments_of(s, block)``, split into rings of at most ``cap`` points) come to the same count."""
    while True:
        segments = [segments_of(s, block) for s in range(len(real_rows))]
        rows = max(r + sum(-(-length // cap) for _, length in segs) for r, segs in zip(real_rows, segments))
        deficit = max(rows - r - sum(length for _, length in segs) for r, segs in zip(real_rows, segments))
        if deficit <= 0:
            return block, rows
        block += deficit


def _rings_pattern_arcs(table, first_ring: int, end_ring: int, visited_ring, visited_first):
    """``(arcs per pattern, arcs [n, 6])`` of the patterns of walking rings ``first_ring .. end_ring - 1`` of
    ``table`` (RingPatterns; a ring's patterns are consecutive), each arc ``(visited ring, first, start, length,
    nlon, shift)`` with its visited ring ``b`` and first point replaced by ``visited_ring[b]`` and
    ``visited_first[b]`` (the shard's numbering); arcs whose ``visited_ring`` is negative are dropped."""
    patterns = table.ring_patterns[first_ring : end_ring + 1]
    bounds = table.offsets[patterns[0] : patterns[-1] + 1]
    arcs = np.asarray(table.arcs[bounds[0] : bounds[-1]], np.int64)
    keep = visited_ring[arcs[:, 0]] >= 0
    pattern = np.repeat(np.arange(len(bounds) - 1), np.diff(bounds))[keep]
    moved = arcs[keep]
    moved[:, 1] = visited_first[moved[:, 0]]
    moved[:, 0] = visited_ring[moved[:, 0]]
    return np.bincount(pattern, minlength=len(bounds) - 1), moved


def _walk_tables(rings, lengths, arcs, pattern_count: int, arc_count: int) -> _ffi.RingWalkTables:
    """One shard's ``RingWalkTables`` from its rows ``(first, points, pattern, period, weight)``, its patterns' arc
    counts and their arcs ``[n, 6]``, padded to ``pattern_count`` patterns (empty but the last) and ``arc_count``
    arcs."""
    offsets = np.zeros(pattern_count + 1, np.int64)
    offsets[1 : len(lengths) + 1] = np.cumsum(lengths)
    offsets[len(lengths) + 1 :] = offsets[len(lengths)]
    padding = np.tile(np.asarray(_PADDING_ARC, np.int64), (arc_count - len(arcs), 1))
    rows = np.concatenate([arcs.reshape(-1, 6), padding])  # the padding arcs in the last pattern, which no ring uses
    offsets[-1] = arc_count
    walk_rings = np.asarray([r[:4] for r in rings], np.int32)
    return _ffi.RingWalkTables(
        walk_rings=walk_rings,
        ring_order=np.argsort(-walk_rings[:, 1], kind="stable").astype(np.int32),
        pattern_offsets=offsets.astype(np.int32),
        pattern_arcs=rows.astype(np.int32),
        quad_weights=np.asarray([r[4] for r in rings], np.float32),
    )


def _stack(tables) -> _ffi.RingWalkTables:
    """The shards' tables stacked along a new leading axis."""
    return _ffi.RingWalkTables(*(np.stack(column) for column in zip(*tables)))


@functools.lru_cache(maxsize=16)
def ring_shard_layout(plan: RingPlan, parts: int) -> RingShardLayout:
    """Split ``plan``'s ring grids over ``parts`` shards (see the module docstring).

    Raises:
      ValueError: when the output grid has too few rings for ``parts`` ranges of similar points.
    """
    if not isinstance(plan, RingPlan):
        raise TypeError(f"plan must be a jax_s2attn.RingPlan, got {type(plan).__name__}.")
    if isinstance(parts, bool) or not isinstance(parts, (int, np.integer)) or parts < 1:
        raise ValueError(f"parts must be a positive integer (the devices along the mesh axis), got {parts!r}.")
    parts = int(parts)
    grid_out, grid_in = plan.grid_out, plan.grid_in
    out_cuts, in_cuts = _cuts(plan, parts)
    q_offsets, k_offsets = grid_out.ring_offsets, grid_in.ring_offsets
    q_points = [int(q_offsets[out_cuts[s + 1]] - q_offsets[out_cuts[s]]) for s in range(parts)]
    k_points = [int(k_offsets[in_cuts[s + 1]] - k_offsets[in_cuts[s]]) for s in range(parts)]
    table, key_table = plan.patterns, plan.key_patterns

    # The halo: the farthest key block any shard's queries meet.
    halo = 0
    for s in range(parts):
        first, last = (table.offsets[table.ring_patterns[cut]] for cut in (out_cuts[s], out_cuts[s + 1]))
        visited = table.arcs[first:last, 0]
        halo = max(halo, s - int(_owner(in_cuts, visited.min())), int(_owner(in_cuts, visited.max())) - s)
    blocks = [[j for j in range(s - halo, s + halo + 1)] for s in range(parts)]
    in_range = lambda j: 0 <= j < parts  # noqa: E731
    own_rings = [range(out_cuts[s], out_cuts[s + 1]) for s in range(parts)]
    buffer_rings = [[r for j in blocks[s] if in_range(j) for r in range(in_cuts[j], in_cuts[j + 1])] for s in range(parts)]

    # Block sizes and row counts: padding points form rings of at most the grid's largest ring, as many in every
    # shard as it takes for all shards to have the same rows.
    q_cap, k_cap = int(grid_out.nlon.max()), int(grid_in.nlon.max())
    q_block, forward_rows = _block_and_rows(
        [len(own_rings[s]) for s in range(parts)], lambda s, block: [(q_points[s], block - q_points[s])],
        max(q_points), q_cap,
    )  # fmt: skip

    def key_padding(s, block):
        return [((j - s + halo) * block + (k_points[j] if in_range(j) else 0),
                 block - (k_points[j] if in_range(j) else 0)) for j in blocks[s]]  # fmt: skip

    k_block, backward_rows = _block_and_rows([len(buffer_rings[s]) for s in range(parts)], key_padding,
                                             max(k_points), k_cap)  # fmt: skip

    weights_in = (2.0 * np.pi * grid_in.weights / grid_in.nlon).astype(np.float32)
    in_rings, out_rings = np.arange(grid_in.nrings), np.arange(grid_out.nrings)
    in_owner = _owner(in_cuts, in_rings)
    owner_first = k_offsets[np.asarray(in_cuts)[in_owner]]  # each input ring's block's first point
    forward, backward = [], []
    for s in range(parts):
        # The shard's key buffer: the input rings of blocks s - halo .. s + halo (in range), contiguous.
        lo, hi = in_cuts[max(s - halo, 0)], in_cuts[min(s + halo + 1, parts)]
        in_buffer = (in_rings >= lo) & (in_rings < hi)
        buffer_first = np.where(in_buffer, (in_owner - s + halo) * k_block + k_offsets[:-1] - owner_first, -1)
        # The queries' walk: the shard's output rings, their patterns' arcs moved into the buffer (visited rings
        # numbered in the buffer, weighed by the shard's weights).
        own = np.arange(out_cuts[s], out_cuts[s + 1])
        lengths, arcs = _rings_pattern_arcs(table, out_cuts[s], out_cuts[s + 1], np.where(in_buffer, in_rings - lo, -1),
                                            buffer_first)  # fmt: skip
        assert sum(lengths) == table.offsets[table.ring_patterns[out_cuts[s + 1]]] - table.offsets[
            table.ring_patterns[out_cuts[s]]], "the halo holds every key ring the shard's queries meet"  # fmt: skip
        rings = list(zip((q_offsets[own] - q_offsets[out_cuts[s]]).tolist(), grid_out.nlon[own].tolist(),
                         (table.ring_patterns[own] - table.ring_patterns[out_cuts[s]]).tolist(),
                         table.period[own].tolist(), [1.0] * len(own)))  # fmt: skip
        padding = _split_padding([(q_points[s], q_block - q_points[s])], forward_rows - len(rings), q_cap)
        rings += [(first, count, -1, 1, 1.0) for first, count in padding]
        forward.append((rings, lengths, arcs, weights_in[lo:hi]))
        # The keys' walk: the buffer's input rings, their key patterns cut to this shard's output rings (visited
        # rings numbered from the shard's first).
        own_out = (out_rings >= out_cuts[s]) & (out_rings < out_cuts[s + 1])
        buffer = np.arange(lo, hi)
        lengths, arcs = _rings_pattern_arcs(key_table, lo, hi, np.where(own_out, out_rings - out_cuts[s], -1),
                                            q_offsets[:-1] - q_offsets[out_cuts[s]])  # fmt: skip
        rings = list(zip(buffer_first[buffer].tolist(), grid_in.nlon[buffer].tolist(),
                         (key_table.ring_patterns[buffer] - key_table.ring_patterns[lo]).tolist(),
                         key_table.period[buffer].tolist(), weights_in[buffer].tolist()))  # fmt: skip
        padding = _split_padding(key_padding(s, k_block), backward_rows - len(rings), k_cap)
        rings = sorted(rings + [(first, count, -1, 1, 1.0) for first, count in padding])  # in point order
        backward.append((rings, lengths, arcs, None))

    def finish(walks, visited_rings, cap):
        # After a shard's own patterns: the padding rows' empty pattern, more empty ones, and the padding arcs' one.
        pattern_count = max(len(lengths) for _, lengths, _, _ in walks) + 2
        arc_count = max(1, max(len(arcs) for _, _, arcs, _ in walks))
        tables = []
        for rings, lengths, arcs, weights in walks:
            rings = [(f, c, len(lengths) if p < 0 else p, period, w) for f, c, p, period, w in rings]
            walk = _walk_tables(rings, lengths, arcs, pattern_count, arc_count)
            if weights is not None:  # per visited ring, padded to the largest shard's
                padded = np.ones(visited_rings, np.float32)
                padded[: len(weights)] = weights
                walk = walk._replace(quad_weights=padded)
            tables.append(walk)
        return tables, _ffi.RingWalkSizes(len(walks[0][0]), visited_rings, pattern_count, cap)

    forward_tables, forward_sizes = finish(forward, max(len(r) for r in buffer_rings), q_cap)
    backward_tables, backward_sizes = finish(backward, max(len(r) for r in own_rings), k_cap)

    def slots(offsets, cuts, block):
        out = np.full(parts * block, -1, np.int64)
        for s in range(parts):
            n = int(offsets[cuts[s + 1]] - offsets[cuts[s]])
            out[s * block : s * block + n] = np.arange(offsets[cuts[s]], offsets[cuts[s]] + n)
        return out

    return RingShardLayout(
        parts=parts, out_cuts=out_cuts, in_cuts=in_cuts, q_block=q_block, k_block=k_block, halo=halo,
        forward=(_stack(forward_tables), forward_sizes), backward=(_stack(backward_tables), backward_sizes),
        q_slots=slots(q_offsets, out_cuts, q_block), k_slots=slots(k_offsets, in_cuts, k_block),
    )  # fmt: skip


def _check_ring_mesh(mesh, axis, batch_axis) -> None:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (e.g. from jax.make_mesh), got {type(mesh).__name__}.")
    for arg, name in (("axis", axis), ("batch_axis", batch_axis)):
        if name is not None and name not in mesh.axis_names:
            raise ValueError(f"{arg}={name!r} is not an axis of the mesh; its axes are {mesh.axis_names}.")
    if axis is None or axis == batch_axis:
        raise ValueError(f"axis must name the mesh axis that splits the rings (not the batch axis), got {axis!r}.")


def _key_buffer(x, layout: RingShardLayout, axis: str):
    """This shard's key buffer: the blocks of shards ``s - halo .. s + halo`` along the point axis (-3), zeros
    past the poles. Linear (``ppermute``), so its transpose returns the halo's gradients to their owners."""
    blocks = []
    for j in range(-layout.halo, layout.halo + 1):
        pairs = [(source, source - j) for source in range(layout.parts) if 0 <= source - j < layout.parts]
        blocks.append(x if j == 0 else jax.lax.ppermute(x, axis, pairs) if pairs else jnp.zeros_like(x))
    return jnp.concatenate(blocks, axis=-3)


def _ring_shard_body(query, key, value, forward, backward, *, layout: RingShardLayout, axis: str, scale: float):
    batch = query.shape[:-3]
    flat = lambda x: x.reshape(math.prod(batch), *x.shape[-3:])  # noqa: E731
    query, key, value = (flat(x) for x in (query, key, value))
    key, value = (_key_buffer(x, layout, axis) for x in (key, value))
    forward, backward = (jax.tree.map(lambda t: t[0], tables) for tables in (forward, backward))  # this shard's
    sizes = (layout.forward[1], layout.backward[1])
    out, _ = ring_walks(query, key, value, forward, backward, sizes, scale)
    return out.reshape(*batch, *out.shape[1:])


def sharded_ring_attention(
    query,
    key,
    value,
    plan: RingPlan,
    *,
    mesh: Mesh,
    axis: str = "rings",
    batch_axis: str | None = None,
    scale: float | None = None,
    implementation: str | None = None,
):
    """:func:`jax_s2attn.neighborhood_attention` between ring grids with the rings split over a device mesh.

    Mesh axis ``axis`` splits the rings into ranges (:func:`ring_shard_layout`), optionally ``batch_axis`` the
    first batch dimension; other mesh axes replicate the computation. Fields are in the layout's block layout,
    ``[B..., parts * block, H, D]`` (``layout.to_blocks(field, "out" or "in")`` from flat fields,
    ``layout.from_blocks`` back), sharded or not; the output comes back in it, zeros in the padding. Each device
    reads the key and value blocks its queries need from the neighbouring shards (``layout.halo`` on each side) and
    runs the ring kernels on its own tables. Differentiable in reverse mode, usable inside ``jit``.

    Args:
      query, key, value: ``[B..., parts * q_block, H, Dk]``, ``[B..., parts * k_block, H, Dk]``, ``[B...,
        parts * k_block, H, Dv]`` (one dtype: float32, bfloat16 or float16; for float64, which only the reference
        computes, call :func:`jax_s2attn.neighborhood_attention`).
      plan: the :class:`~jax_s2attn.RingPlan`.
      mesh, axis, batch_axis: the device mesh, the axis that splits the rings and the one that splits the batch.
      scale: logit scale, default ``1/sqrt(Dk)``.
      implementation: ``None``, ``"ffi"`` or ``"ffi-arc"`` (the ring kernels, which the sharded op needs).

    Returns:
      ``out [B..., parts * q_block, H, Dv]`` in the input dtype, sharded over ``axis``.
    """
    _checks.check_implementation(implementation)
    if implementation not in (None, "ffi", "ffi-arc"):
        raise ValueError(
            f"implementation={implementation!r}: the sharded op between ring grids runs the ring kernels "
            "(implementation=None, 'ffi' or 'ffi-arc'); the reference runs serially "
            "(jax_s2attn.neighborhood_attention)."
        )
    if not isinstance(plan, RingPlan):
        raise TypeError(f"plan must be a jax_s2attn.RingPlan, got {type(plan).__name__}.")
    _check_ring_mesh(mesh, axis, batch_axis)
    layout = ring_shard_layout(plan, mesh.shape[axis])
    _checks.check_arrays(query, key, value, "[..., parts * block, heads, head_dim]", rank=3)
    batch, (heads, dk), dv = tuple(query.shape[:-3]), query.shape[-2:], value.shape[-1]
    expected = {"query": (*batch, layout.parts * layout.q_block, heads, dk),
                "key": (*batch, layout.parts * layout.k_block, heads, dk),
                "value": (*batch, layout.parts * layout.k_block, heads, dv)}  # fmt: skip
    for name, x in (("query", query), ("key", key), ("value", value)):
        if tuple(x.shape) != expected[name]:
            raise ValueError(
                f"{name} has shape {tuple(x.shape)}, expected {expected[name]}: the block layout of "
                f"ring_shard_layout(plan, {layout.parts}) ({layout.parts} blocks of {layout.q_block} output or "
                f"{layout.k_block} input points); layout.to_blocks(field, 'out' or 'in') gives it from flat fields."
            )
    scale = _checks.check_scale(scale, dk)
    _check_batch(mesh, batch_axis, batch)
    platform = _ffi.ffi_platform(mesh.devices.flat[0].platform)
    reason = _ffi.ring_unavailable_reason(platform, query.dtype, dk, dv)
    if reason is not None:
        raise ValueError(f"the sharded op between ring grids runs the ring kernels, which cannot run here: {reason}.")
    lead = (batch_axis,) + (None,) * (len(batch) - 1) if batch else ()
    field = PartitionSpec(*lead, axis, None, None)
    if math.prod(batch) * heads == 0:  # an empty batch axis or no heads: nothing to compute
        return _place(jnp.zeros((*query.shape[:-1], dv), query.dtype), mesh, field)
    tables = PartitionSpec(axis)
    body = functools.partial(_ring_shard_body, layout=layout, axis=axis, scale=scale)
    forward, backward = (jax.tree.map(lambda t: _place(jnp.asarray(t), mesh, tables), walk[0])
                         for walk in (layout.forward, layout.backward))  # fmt: skip
    fields = [_place(jnp.asarray(x), mesh, field) for x in (query, key, value)]
    return jax.shard_map(body, mesh=mesh, in_specs=(field,) * 3 + (tables, tables), out_specs=field)(
        *fields, forward, backward
    )
