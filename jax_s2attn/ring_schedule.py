"""Block-sparse schedules between ring grids: the scheduled tensor-core kernels' work list on flat fields.

The kernels see a ring grid as one row of all its points (flat fields, ring order), so a schedule here is a
:class:`~jax_s2attn.schedule.BlockSchedule` of that one-row grid with two differences (``cuda/README.md``,
"Scheduled targets"):

- **Tiles are runs.** A tile is ``runs`` runs of up to ``run_points`` consecutive points of one ring (the kernels'
  8 x 8: ``tiles [num_tiles, runs, 2]`` of ``(first point, points)``). The builder lays ``tile_rings`` consecutive
  walking rings side by side, ``runs * run_points / tile_rings`` points of each: a tile is a patch of the sphere,
  not a strip, so that its points' arcs on a visited ring overlap. Ring ``r`` of a group, cut into ``m_r``
  segments, gives segment ``s`` to the group's tile ``s * M // m_r`` (``M`` the group's most segments): segments
  of neighbouring rings at about the same longitude share a tile, and each tile holds at most one of a ring's.
- **A record per point** (``classes == tile_cols``, ``shift`` unused). For a tile and a visited ring it meets
  (a *staging*) the records are the points' arcs in coordinates unwrapped from a base of the staging's own: the
  start of the arc after the largest gap between the arcs, so that each arc is one interval ``[start, start +
  length)`` and all of them lie within one turn (*window mode*). Where the arcs together cover the ring, so that
  unwrapped they would span more than a turn, the staging is in *ring mode*: records are the arcs' ring positions,
  taken modulo the ring's points, and every point of the ring is staged once.

Chunks are ``chunk_cols`` consecutive points of one visited ring: ``(0, first point, offset, valid, flags,
staging)``, cut at the ring's end as a regular grid's are at longitude ``nlon``. In ring mode the flags are
``RING | ring points << RING_POINTS_SHIFT``, the modulus being the chunk's own ring's. Window-mode chunks no arc of
their staging enters are not listed; ``FULL`` ones (window mode) lie inside every point's arc. Tiles come most
chunks first, tiles without chunks last. ``tests/test_ring_schedule.py`` expands the schedules by this contract
against the plan's pairs.
"""

from __future__ import annotations

import numpy as np

from . import _validate
from .grids import RingGrid
from .ring_plan import RingPlan
from .schedule import FULL, RING, RING_POINTS_SHIFT, BlockSchedule

__all__ = ["RING_POINTS_SHIFT", "TILE_RINGS", "ring_block_schedule"]

#: Walking rings a tile may lay side by side; :func:`ring_block_schedule` keeps the one of fewest chunks.
TILE_RINGS = (8, 4, 2)


def ring_block_schedule(
    plan: RingPlan, walk: str, *, runs: int = 8, run_points: int = 8, chunk_cols: int = 32,
    tile_rings: int | None = None,
) -> BlockSchedule:  # fmt: skip
    """The block-sparse schedule of ``plan``'s ``walk`` ("forward": output points over input points, the forward
    and dq; "backward": input points over output points, dk/dv) for the scheduled kernels on flat fields.

    Args:
      plan: a :class:`~jax_s2attn.RingPlan`.
      walk: ``"forward"`` or ``"backward"``.
      runs, run_points: a tile's runs and the most points of one (the kernels': ``kernel_limits().scheduled_runs``).
      chunk_cols: points of a chunk (the kernels' ``scheduled_shape[2]``).
      tile_rings: walking rings a tile lays side by side (a divisor of ``runs``); default: of
        :data:`TILE_RINGS` the one whose schedule multiplies the fewest chunks.

    Returns a :class:`~jax_s2attn.schedule.BlockSchedule` (host numpy, int32, read-only; cached with the plan) with
    ``tiles [num_tiles, runs, 2]``, ``records [stagings, runs * run_points // 16, 16, 2]`` (``tile_rows`` x
    ``tile_cols`` = 4 x 16 for the kernels' 8 x 8), ``nlat_walk`` 1, ``nlon_walk`` the walking grid's points and
    ``nlon`` the other grid's.
    """
    if not isinstance(plan, RingPlan):
        raise TypeError(f"plan must be a RingPlan, got {type(plan).__name__}.")
    if walk not in ("forward", "backward"):
        raise ValueError(f"walk must be 'forward' or 'backward', got {walk!r}.")
    runs = _validate.integer(runs, "runs", 1)
    run_points = _validate.integer(run_points, "run_points", 1)
    chunk_cols = _validate.integer(chunk_cols, "chunk_cols", 1)
    if (runs * run_points) % 16:
        raise ValueError(f"runs * run_points must be a multiple of 16 (tile rows of 16 points), got {runs * run_points}.")
    if tile_rings is not None:
        tile_rings = _validate.integer(tile_rings, "tile_rings", 1)
        if runs % tile_rings:
            raise ValueError(f"tile_rings must divide runs ({runs}), got {tile_rings}.")
    return _cached_schedule(plan, walk, runs, run_points, chunk_cols, tile_rings)


def _cached_schedule(plan, walk, runs, run_points, chunk_cols, tile_rings) -> BlockSchedule:
    key = (walk, runs, run_points, chunk_cols, tile_rings)
    cache = plan.block_schedules
    if key not in cache:
        cache[key] = _schedule(plan, walk, runs, run_points, chunk_cols, tile_rings)
    return cache[key]


def _schedule(plan, walk, runs, run_points, chunk_cols, tile_rings) -> BlockSchedule:
    walking, other = (plan.grid_out, plan.grid_in) if walk == "forward" else (plan.grid_in, plan.grid_out)
    arcs = _walk_arcs(plan.patterns if walk == "forward" else plan.key_patterns, walking)
    candidates = [tile_rings] if tile_rings is not None else [r for r in TILE_RINGS if runs % r == 0] or [1]
    best = None
    for rings in candidates:
        schedule = _build(walking, other, arcs, runs, run_points, chunk_cols, rings)
        if best is None or len(schedule.chunks) < len(best.chunks):
            best = schedule
    for table in best[:4]:
        table.setflags(write=False)
    return best


def _walk_arcs(patterns, walking: RingGrid) -> tuple[np.ndarray, ...]:
    """Every walking point's arcs as flat arrays ``(point, visited ring, first point of that ring, start, length,
    ring points)``: the patterns expanded, each start moved on by the point's position (arcs of length 0 left
    out)."""
    ring = np.repeat(np.arange(walking.nrings), walking.nlon)
    index = np.arange(walking.npoints) - walking.ring_offsets[ring]
    period = patterns.period[ring]
    pattern = patterns.ring_patterns[ring] + index % period
    begin = patterns.offsets[pattern]
    count = patterns.offsets[pattern + 1] - begin
    point = np.repeat(np.arange(walking.npoints), count)
    arc = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count - begin, count)
    b, first, start, length, nlon, shift = (patterns.arcs[arc, f].astype(np.int64) for f in range(6))
    start = (start + (index // period)[point] * shift) % nlon
    keep = length > 0
    return point[keep], b[keep], first[keep], start[keep], length[keep], nlon[keep]


def _argmax_within(values: np.ndarray, group_start: np.ndarray) -> np.ndarray:
    """Index of the first largest of ``values`` in each group (groups start at ``group_start``, in order)."""
    largest = np.maximum.reduceat(values, group_start)
    group = np.repeat(np.arange(len(group_start)), np.diff(np.r_[group_start, len(values)]))
    hits = np.flatnonzero(values == largest[group])
    return hits[np.r_[True, group[hits][1:] != group[hits][:-1]]]


def _tiles(walking: RingGrid, runs: int, run_points: int, tile_rings: int) -> tuple[np.ndarray, ...]:
    """``(runs table [tiles, runs, 2], tile of every walking point, slot of every walking point)``."""
    per_ring = runs * run_points // tile_rings  # points of one ring in a tile
    nlon = walking.nlon.astype(np.int64)
    rings = np.arange(walking.nrings)
    group, place = rings // tile_rings, rings % tile_rings
    segments = -(-nlon // per_ring)
    most = np.maximum.reduceat(segments, np.arange(0, walking.nrings, tile_rings))
    group_base = np.cumsum(most) - most
    ring = np.repeat(rings, nlon)
    index = np.arange(walking.npoints) - walking.ring_offsets[ring]
    segment = index // per_ring
    tile = group_base[group[ring]] + segment * most[group[ring]] // segments[ring]
    slot = place[ring] * per_ring + index - segment * per_ring
    table = np.zeros((int(most.sum()), runs, 2), np.int32)
    starts = np.flatnonzero(slot % run_points == 0)
    table[tile[starts], slot[starts] // run_points] = np.stack(
        [starts, np.minimum(run_points, nlon[ring[starts]] - index[starts])], axis=1
    )
    return table, tile, slot


def _build(walking, other, arcs, runs, run_points, chunk_cols, tile_rings) -> BlockSchedule:
    point, b, first, start, length, nlon = arcs
    runs_table, tile_of_point, slot_of_point = _tiles(walking, runs, run_points, tile_rings)
    tile, slot = tile_of_point[point], slot_of_point[point]
    # Stagings: (tile, visited ring), numbered in that order; arcs sorted by staging, then start (one sort of
    # one int64 key where it fits).
    pair = tile * other.nrings + b
    big = 4 * int(other.nlon.max())  # keeps running maxima, and keys, within their staging
    order = np.argsort(pair * big + start) if (int(pair.max()) + 1) * big < 2**62 else np.lexsort((start, pair))
    pair, start, length, nlon, slot, first = (x[order] for x in (pair, start, length, nlon, slot, first))
    new = np.r_[True, pair[1:] != pair[:-1]]
    group_start = np.flatnonzero(new)
    group_end = np.r_[group_start[1:], len(pair)]
    stagings, staging = pair[group_start], np.cumsum(new) - 1
    reach = np.maximum.accumulate(staging * big + start + length) - staging * big
    first_of = np.zeros(len(staging), bool)
    first_of[group_start] = True
    # The gap before each arc (before a staging's first arc: the one across the ring's seam; before the others
    # also past the part of the arcs that wraps the seam); the largest's arc is the staging's base.
    last_reach = reach[group_end - 1][staging]
    gap = np.where(first_of, start + nlon - last_reach, start - np.maximum(np.r_[0, reach[:-1]], last_reach - nlon))
    base_arc = _argmax_within(gap, group_start)
    base = start[base_arc]
    ring_points = nlon[group_start]
    rel = np.where(length >= nlon, 0, (start - base[staging]) % nlon)
    ring_mode = np.maximum.reduceat(rel + length, group_start) > ring_points  # the arcs cover the ring
    base[ring_mode] = 0
    rel = np.where(ring_mode[staging], start, rel)
    end = rel + length
    lo = np.where(ring_mode, 0, np.minimum.reduceat(rel, group_start))
    hi = np.where(ring_mode, ring_points, np.maximum.reduceat(end, group_start))

    # Chunks: the hull [lo, hi) of every staging, cut every chunk_cols points and at the ring's end.
    parts = []
    x, alive = lo.copy(), np.arange(len(group_start))
    while alive.size:
        position = (base[alive] + x[alive]) % ring_points[alive]
        valid = np.minimum(np.minimum(chunk_cols, hi[alive] - x[alive]), ring_points[alive] - position)
        parts.append((alive, x[alive].copy(), valid, position))
        x[alive] += valid
        alive = alive[x[alive] < hi[alive]]
    g, x0, valid, position = (np.concatenate(p) for p in zip(*parts))
    # A chunk stays where some arc of its staging enters it: the last arc starting before its end reaches past
    # its start (arcs sorted by staging and relative start, their running maximum of ends).
    by_rel = np.argsort(staging * big + rel)
    keys = staging[by_rel] * big + rel[by_rel]
    reach_rel = np.maximum.accumulate(staging[by_rel] * big + end[by_rel]) - staging[by_rel] * big
    last = np.searchsorted(keys, g * big + x0 + valid, side="left") - 1
    entered = (reach_rel[last] > x0) | ring_mode[g]
    g, x0, valid, position = g[entered], x0[entered], valid[entered], position[entered]

    # FULL: every real point of the tile has an arc on the ring, and each covers the chunk (window mode: in ring
    # mode some arc is not the whole ring, or the hull would be one turn).
    staging_tile = stagings // other.nrings
    real_points = np.bincount(tile_of_point, minlength=len(runs_table))
    arcs_of = group_end - group_start
    max_rel = np.maximum.reduceat(rel, group_start)
    min_end = np.minimum.reduceat(end, group_start)
    covered = ~ring_mode[g] & (max_rel[g] <= x0) & (min_end[g] >= x0 + chunk_cols)
    full = (valid == chunk_cols) & (arcs_of[g] == real_points[staging_tile[g]]) & covered
    flags = np.where(full, FULL, 0) | np.where(ring_mode[g], RING | ring_points[g] << RING_POINTS_SHIFT, 0)

    # Work order: tiles with most chunks first; a tile's chunks by visited ring, then offset.
    chunk_tile = staging_tile[g]
    per_tile = np.bincount(chunk_tile, minlength=len(runs_table))
    tile_order = np.argsort(-per_tile, kind="stable")
    rank = np.empty_like(tile_order)
    rank[tile_order] = np.arange(len(tile_order))
    chunk_order = np.lexsort((x0, g, rank[chunk_tile]))
    visited_first = other.ring_offsets[stagings % other.nrings]
    chunks = np.stack([np.zeros(len(g), np.int64), visited_first[g] + position, x0, valid,
                       flags, g], axis=1)[chunk_order]  # fmt: skip
    tile_points = runs * run_points
    records = np.zeros((len(stagings), tile_points, 2), np.int32)
    records[staging, slot] = np.stack([rel, length], axis=1)
    return BlockSchedule(
        tiles=runs_table[tile_order],
        tile_offsets=np.r_[0, np.cumsum(per_tile[tile_order])].astype(np.int32),
        chunks=chunks.astype(np.int32),
        records=records.reshape(len(stagings), tile_points // 16, 16, 2),
        tile_rows=tile_points // 16,
        tile_cols=16,
        chunk_cols=chunk_cols,
        classes=16,
        shift=1,
        nlat_walk=1,
        nlon_walk=walking.npoints,
        nlon=other.npoints,
    )
