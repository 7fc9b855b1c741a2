"""Block-sparse schedules: the work list of the tensor-core kernels, built once on the host.

A walk (queries over keys for the forward pass and dQ, keys over queries for dK/dV) is cut into *tiles*
of ``tile_rows`` consecutive walking rows by ``tile_cols`` consecutive walking longitudes: the M = 64
rows of one wgmma. For every tile the schedule lists the *chunks* it multiplies: ``chunk_cols``
consecutive longitudes of one row of the other grid, staged as one box. The kernels do no geometry
beyond turning a (point, chunk) pair into an interval of chunk columns.

**Stagings.** For a tile and one other-grid row it sees, the union of its points' arcs is the
*window*. It is either shorter than the ring (*window mode*: columns are unwrapped longitudes from the
window's ``base``, which may cross longitude ``nlon``) or it covers the ring (*ring mode*: ``base`` 0,
every column once). Each staging holds, for each tile row ``a`` and *class* ``u < classes``, the
record ``(start, length)``: point ``j = u + classes * t`` of row ``a`` sees the unwrapped columns
``start + shift * t + i`` for ``i < length`` (in ring mode modulo ``nlon``). ``classes`` is
``min(R, tile_cols)`` for a segment table of ``R`` residues, so one record serves every point of a
residue class; a window with padding longitudes (below), or a grid whose rings have their own point counts,
stores one record per point (``classes == tile_cols``) in the same format.

**Chunks** ``(other row, longitude, offset, valid, flags, staging)``: the producer stages ``valid``
columns from ``longitude`` (a chunk never crosses longitude ``nlon``: a window crossing it is cut
there, and the part after it starts a new chunk), ``offset`` is the chunk's first column in the
staging's unwrapped coordinates. A point's columns in the chunk are then ``[start + shift*t - offset,
... + length)`` clipped to ``[0, valid)`` (window mode), or the same modulo ``nlon`` (``RING``).
``FULL`` chunks have ``valid == chunk_cols`` and lie inside the arc of every point of the tile that
is on the grid: no mask at all. Chunks no point sees are not listed.

**Order.** Every tile of the walking grid is listed, most chunks first (longest-processing-time order for
the hardware's dynamic block dispatch); tiles without chunks (points no other point sees, e.g. keys
between the outputs of a strong downsampling) come last, and their results are zeros. A tile's chunks
come by other row, then in window (``offset``) order.

Points of a tile past the walking grid (the last rows, or longitudes past ``nlon_walk``) take part in
no window and no ``FULL`` test; the kernels compute them and do not write them.

**Stencil rows.** Beside the stencil kernels (rows of short arcs, on CUDA cores) a whole-grid schedule leaves
out the tiles whose rows are all the stencil kernels' (:func:`tile_stencil_pairs` keeps the stencil pairs whose
tile holds no other row, :func:`without_row_tiles` drops those tiles): the two families then write disjoint rows,
and every other tile is listed as before.

**Windows** (:class:`WalkWindow`: the blocks of one shard of a sharded grid, cuda/README.md "Windows"). The
walking grid is then the shard's local arrays (its real block and padding) and the other grid the other
window's block, both in local coordinates: tiles cover the local arrays, chunks name local rows and
longitudes. Only pairs of a real walking point and a real other point are listed: stagings of other rows
outside the other window are dropped, and a staging's chunks are cut from its parts inside the other
window's longitudes (at most two, and the cut at longitude ``nlon`` is the case of a whole ring). Records
and offsets keep their global meaning (``nlon`` stays the other grid's ring), padding points get empty
records (per point where padding longitudes share a row with real ones), and a tile with padding points has no
``FULL`` chunks, so that padding results are zeros.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import _validate

__all__ = [
    "FULL", "RING", "RING_POINTS_SHIFT", "BlockSchedule", "ScheduleSet", "WalkWindow", "as_runs", "build_schedule",
    "check_shape", "join_schedules", "tile_stencil_pairs", "without_row_tiles",
]  # fmt: skip

#: Chunk flag: every on-grid point of the tile sees every column: no mask.
FULL = 1
#: Chunk flag: the staging is in ring mode: a point's interval is taken modulo ``nlon``.
RING = 2
#: In the ring grids' format (flat fields, :func:`as_runs`, :mod:`jax_s2attn.ring_schedule`) a ``RING`` chunk's
#: flags hold its ring's points (the modulus of its records) from this bit (``kRingPointsShift`` of
#: ``cuda/gpu/sched_attn_device.cuh``).
RING_POINTS_SHIFT = 2

# Bounds the temporaries: candidate (tile, other row) stagings, and then their chunks, are expanded per
# point ~2M entries at a time.
_BATCH_POINTS = 1 << 21


class WalkWindow(NamedTuple):
    """A windowed walk's blocks: the walking grid's real block ``(lat0, lon0, nlat, nlon)`` (global first row and
    longitude, rows and longitudes), its local arrays' ``block_nlat x block_nlon`` (the real block first, then
    padding), and the other grid's real block ``(other_lat0, other_lon0, other_nlat, other_nlon)``. Blocks do
    not wrap in longitude."""

    lat0: int
    lon0: int
    nlat: int
    nlon: int
    block_nlat: int
    block_nlon: int
    other_lat0: int
    other_lon0: int
    other_nlat: int
    other_nlon: int


class BlockSchedule(NamedTuple):
    """The block-sparse schedule of one walk (host numpy, int32 tables).

    Attributes:
      tiles: ``[num_tiles, 2]`` ``(first walking row, first walking longitude)`` of every tile of the walking
        grid, in work order (tiles without chunks last: their points' results are zeros).
      tile_offsets: ``[num_tiles + 1]`` CSR offsets of each tile's chunks into ``chunks``.
      chunks: ``[num_chunks, 6]`` rows of ``(other row, longitude, offset, valid, flags, staging)``.
      records: ``[num_stagings, tile_rows, classes, 2]`` ``(start, length)`` per tile row and class.
      tile_rows, tile_cols, chunk_cols: the shape of a tile and of a chunk.
      classes, shift: point ``j`` of a tile row uses record ``j % classes``, shifted by ``shift * (j // classes)``.
      nlat_walk, nlon_walk: the walking grid's arrays (a window's local block); nlon: longitudes of the other
        grid's ring.
    """

    tiles: np.ndarray
    tile_offsets: np.ndarray
    chunks: np.ndarray
    records: np.ndarray
    tile_rows: int
    tile_cols: int
    chunk_cols: int
    classes: int
    shift: int
    nlat_walk: int
    nlon_walk: int
    nlon: int

    @property
    def computed_pairs(self) -> int:
        """Rows times columns of every multiplied chunk: what the kernels' products cost."""
        return int(self.chunks.shape[0]) * self.tile_rows * self.tile_cols * self.chunk_cols

    @property
    def full_fraction(self) -> float:
        """Fraction of the chunks that need no mask."""
        return float((self.chunks[:, 4] & FULL).astype(bool).mean()) if self.chunks.size else 0.0


class ScheduleSet(NamedTuple("_ScheduleSet", list(BlockSchedule.__annotations__.items()))):
    """The schedules of several windows of one walk (the shards and ring steps of a sharded layout), joined so
    that a call picks one by index: each window's ``tiles`` and ``tile_offsets`` (offsets into the joined
    ``chunks``, whose staging fields count into the joined ``records``). Host numpy, int32.

    Attributes:
      tiles: ``[windows, num_tiles, 2]``.
      tile_offsets: ``[windows, num_tiles + 1]``.
      chunks: ``[num_chunks, 6]``, every window's in turn.
      records: ``[num_stagings, tile_rows, classes, 2]``, every window's in turn.
      tile_rows, tile_cols, chunk_cols, classes, shift, nlat_walk, nlon_walk, nlon: as for
        :class:`BlockSchedule` (the windows share them), whose fields these are.
    """

    __slots__ = ()


def join_schedules(schedules) -> ScheduleSet:
    """One :class:`ScheduleSet` of ``schedules`` (a sequence of :class:`BlockSchedule` of one shape: the same
    tile counts, classes and grids), in their order."""
    schedules = list(schedules)
    if not schedules:
        raise ValueError("join_schedules needs at least one schedule.")
    shape = schedules[0][4:]
    if any(s[4:] != shape or s.tiles.shape != schedules[0].tiles.shape for s in schedules):
        raise ValueError("joined schedules must share tile counts, tile and chunk shape, classes, shift and grids.")
    chunks_before = np.cumsum([0] + [s.chunks.shape[0] for s in schedules[:-1]])
    stagings_before = np.cumsum([0] + [s.records.shape[0] for s in schedules[:-1]])
    chunks = [s.chunks + np.array([0, 0, 0, 0, 0, n], np.int32) for s, n in zip(schedules, stagings_before)]
    if chunks_before[-1] + schedules[-1].chunks.shape[0] >= 1 << 31:
        raise ValueError("the joined schedules exceed the kernels' 32-bit indices.")
    return ScheduleSet(
        tiles=np.stack([s.tiles for s in schedules]),
        tile_offsets=np.stack([s.tile_offsets + n for s, n in zip(schedules, chunks_before)]).astype(np.int32),
        chunks=np.ascontiguousarray(np.concatenate(chunks)),
        records=np.ascontiguousarray(np.concatenate([s.records for s in schedules])),
        **dict(zip(BlockSchedule._fields[4:], shape)),
    )


def tile_stencil_pairs(pairs: np.ndarray, nlat_walk: int, tile_rows: int) -> np.ndarray:
    """The row pairs of ``pairs`` (a stencil table, ``[n, 2]`` rows of (first walking row, first other row): the
    walking rows ``2i, 2i + 1``) whose tile, ``tile_rows`` walking rows from a multiple of ``tile_rows``, holds
    only rows of ``pairs`` or rows past the ``nlat_walk`` rows of the grid: those the stencil kernels take beside
    a schedule without their tiles (:func:`without_row_tiles`)."""
    pairs = np.asarray(pairs, np.int32).reshape(-1, 2)
    while True:  # a pair dropped can leave its tile's other pairs in a tile no longer whole (odd tile_rows)
        padded = np.ones(-(-nlat_walk // tile_rows) * tile_rows, bool)
        padded[:nlat_walk] = _row_mask(pairs, nlat_walk)
        whole = padded.reshape(-1, tile_rows).all(axis=1)
        first_rows = pairs[:, 0].astype(np.int64)
        keep = whole[first_rows // tile_rows] & whole[(first_rows + 1) // tile_rows]
        if keep.all():
            return np.ascontiguousarray(pairs)
        pairs = pairs[keep]


def without_row_tiles(schedule: BlockSchedule, pairs: np.ndarray) -> BlockSchedule:
    """``schedule`` (of whole grids) without the tiles whose rows all belong to the row pairs ``pairs`` (from
    :func:`tile_stencil_pairs`, whose every row then lies in such a tile) or lie past the walking grid, with their
    chunks; the other tiles keep their order, stagings are renumbered by first use."""
    s = schedule
    padded = np.ones(s.nlat_walk + s.tile_rows, bool)
    padded[: s.nlat_walk] = _row_mask(pairs, s.nlat_walk)
    drop = padded[s.tiles[:, 0, None] + np.arange(s.tile_rows)[None, :]].all(axis=1)
    counts = np.diff(s.tile_offsets)
    chunks = s.chunks[np.repeat(~drop, counts)].copy()
    used, first = np.unique(chunks[:, 5], return_index=True)
    order = used[np.argsort(first)]  # the kept stagings in order of first use
    renumber = np.zeros(s.records.shape[0], np.int32)
    renumber[order] = np.arange(order.size, dtype=np.int32)
    chunks[:, 5] = renumber[chunks[:, 5]]
    tile_offsets = np.zeros(int((~drop).sum()) + 1, np.int32)
    np.cumsum(counts[~drop], out=tile_offsets[1:])
    return s._replace(tiles=np.ascontiguousarray(s.tiles[~drop]), tile_offsets=tile_offsets,
                      chunks=np.ascontiguousarray(chunks), records=np.ascontiguousarray(s.records[order]))  # fmt: skip


def as_runs(schedule: BlockSchedule, runs: int, run_points: int, nlat_other: int) -> BlockSchedule:
    """``schedule`` (of whole regular grids, any tile shape of ``runs * run_points`` points whose rows are whole
    runs) in the ring grids' format (:mod:`jax_s2attn.ring_schedule`): the walking grid as one row of all its
    points in row-major order, a tile as ``runs`` runs of up to ``run_points`` consecutive points along one of its
    rows (``tiles [num_tiles, runs, 2]`` of ``(first point, points)``; points past the walking grid are in no run),
    one record per point (``records [stagings, runs * run_points // 16, 16, 2]``, ``classes`` 16), chunks naming
    row 0 and the flat index of their first point, ``RING`` chunks carrying the other grid's longitudes from bit
    :data:`RING_POINTS_SHIFT` of their flags, and ``nlon`` the other grid's points (``nlat_other`` rows);
    ``tile_rows`` and ``tile_cols`` become the records' layout (``runs * run_points // 16`` × 16). The pairs are
    ``schedule``'s, tile for tile and chunk for chunk: the kernels take in this format tile shapes the regular one
    does not have (1 × 64 for the polar rows of small cutoffs)."""
    s = schedule
    points = runs * run_points
    if s.tile_rows * s.tile_cols != points or s.tile_cols % run_points or points % 16:
        raise ValueError(
            f"a {s.tile_rows}x{s.tile_cols} tile is not {runs} runs of {run_points} points along its rows "
            "(in tiles of whole multiples of 16 points)."
        )
    # Point p of a tile (row-major, as the regular records' rows and classes lay them out) is tile row
    # p // tile_cols, column p % tile_cols; run r holds points r * run_points ...
    tile_point = np.arange(points)
    row = s.tiles[:, 0, None].astype(np.int64) + tile_point // s.tile_cols
    lon = s.tiles[:, 1, None].astype(np.int64) + tile_point % s.tile_cols
    on_grid = (row < s.nlat_walk) & (lon < s.nlon_walk)
    run_first = (row * s.nlon_walk + lon)[:, ::run_points]
    run_length = on_grid.reshape(-1, runs, run_points).sum(axis=2)
    tiles = np.stack([np.where(run_length > 0, run_first, 0), run_length], axis=2)
    # Records per point: class p % classes of its tile row, moved on by shift * (its column // classes); a RING
    # staging's starts reduced modulo the ring (the kernels' mask takes starts within one turn of the offset).
    column = tile_point % s.tile_cols
    start = s.records[:, tile_point // s.tile_cols, column % s.classes, 0] + s.shift * (column // s.classes)
    length = s.records[:, tile_point // s.tile_cols, column % s.classes, 1]
    ring_staging = np.zeros(s.records.shape[0], bool)
    ring_staging[s.chunks[(s.chunks[:, 4] & RING) != 0, 5]] = True
    start = np.where(ring_staging[:, None], start % s.nlon, start)
    records = np.stack([start, length], axis=2).reshape(-1, points // 16, 16, 2)
    chunks = s.chunks.astype(np.int64)
    chunks[:, 1] += chunks[:, 0] * s.nlon
    chunks[:, 0] = 0
    chunks[:, 4] |= np.where(chunks[:, 4] & RING, s.nlon << RING_POINTS_SHIFT, 0)
    if max(nlat_other * s.nlon, s.nlat_walk * s.nlon_walk) >= 1 << 31 or s.nlon >= 1 << (31 - RING_POINTS_SHIFT):
        raise ValueError("the flat grids exceed the kernels' 32-bit indices.")
    return s._replace(tiles=np.ascontiguousarray(tiles, np.int32), chunks=chunks.astype(np.int32),
                      records=np.ascontiguousarray(records, np.int32), tile_rows=points // 16, tile_cols=16,
                      classes=16, shift=1, nlat_walk=1, nlon_walk=s.nlat_walk * s.nlon_walk,
                      nlon=nlat_other * s.nlon)  # fmt: skip


def _row_mask(pairs: np.ndarray, nlat_walk: int) -> np.ndarray:
    """Whether each of ``nlat_walk`` walking rows belongs to a row pair of ``pairs``."""
    mask = np.zeros(nlat_walk, bool)
    first_rows = np.asarray(pairs, np.int64).reshape(-1, 2)[:, 0]
    mask[first_rows], mask[first_rows + 1] = True, True
    return mask


def check_shape(name: str, value, multiple: int) -> int:
    """``value`` as an ``int`` if it is a positive integer multiple of ``multiple``; a ``TypeError`` or
    ``ValueError`` naming ``name`` otherwise."""
    value = _validate.integer(value, name, 1)
    if value % multiple:
        raise ValueError(f"{name}={value} must be a multiple of {multiple}.")
    return value


def build_schedule(
    segments,
    nlat_walk: int,
    nlon_walk: int,
    *,
    tile_rows: int = 4,
    tile_cols: int = 16,
    chunk_cols: int = 32,
    window: WalkWindow | None = None,
    per_point_records: bool = False,
) -> BlockSchedule:
    """The schedule of the walk described by a :class:`~jax_s2attn.plan.SegmentTable`.

    Args:
      segments: the walk's segment table (``plan.forward_segments`` over the query grid, or
        ``plan.backward_segments`` over the key grid).
      nlat_walk, nlon_walk: shape of the (global) walking grid.
      tile_rows, tile_cols: walking rows and longitudes of a tile (their product is the kernels' M).
      chunk_cols: other-grid columns of a chunk, a multiple of 16 (the k-step of P·V).
      window: the blocks of a windowed walk (local coordinates, see the module's docs); None for whole grids.
      per_point_records: one record per tile point (``classes == tile_cols``) instead of one per residue class;
        always so for a window with padding longitudes, whose points share no class with the real ones.
    """
    tile_rows = check_shape("tile_rows", tile_rows, 1)
    tile_cols = check_shape("tile_cols", tile_cols, 1)
    chunk_cols = check_shape("chunk_cols", chunk_cols, 16)
    residues, shift, nlon = segments.residues, segments.shift, segments.nlon
    if segments.offsets.size != nlat_walk + 1 or shift * nlon_walk != residues * nlon:
        raise ValueError(
            f"the segment table (walking rows {segments.offsets.size - 1}, R={residues}, S={shift}, nlon={nlon}) "
            f"does not describe a walk over a {nlat_walk}x{nlon_walk} grid."
        )
    if segments.segments.shape[0] == 0:
        raise ValueError("the segment table is empty: a plan's walk has at least one neighbour per point.")
    if window is None:
        window = WalkWindow(0, 0, nlat_walk, nlon_walk, nlat_walk, nlon_walk, 0, 0, 1 << 31, nlon)
    window = _checked_window(window, nlat_walk, nlon_walk, nlon)
    per_point_records = per_point_records or window.block_nlon > window.nlon
    classes = tile_cols if per_point_records else min(residues, tile_cols)

    # One entry per (band of tile_rows local walking rows, other row) of the window: each tile row's segment there.
    walk_row = np.repeat(np.arange(nlat_walk), np.diff(segments.offsets))
    table = segments.segments.astype(np.int64)
    inside = (walk_row >= window.lat0) & (walk_row < window.lat0 + window.nlat)
    inside &= (table[:, 0] >= window.other_lat0) & (table[:, 0] < window.other_lat0 + window.other_nlat)
    walk_row, table = walk_row[inside] - window.lat0, table[inside]
    nrows = int(table[:, 0].max(initial=0)) + 1
    band_keys, band_entry = np.unique((walk_row // tile_rows) * nrows + table[:, 0], return_inverse=True)
    band_lo = np.zeros((band_keys.size, tile_rows, residues), np.int64)
    band_len = np.zeros((band_keys.size, tile_rows, residues), np.int64)
    band_lo[band_entry, walk_row % tile_rows] = table[:, 1 : 1 + residues]
    band_len[band_entry, walk_row % tile_rows] = table[:, 1 + residues :]
    # Each arc's centre nearest its point's own longitude r*S/R on the other grid (scaled by 2R to stay
    # integer), for every walking row alike: a tile's window is then the union of nearby arcs.
    centre = 2 * residues * band_lo + residues * (band_len - 1) - 2 * shift * np.arange(residues)
    band_lo -= nlon * np.floor_divide(centre + residues * nlon, 2 * residues * nlon)
    band, band_other = np.divmod(band_keys, nrows)

    tiles_per_row = -(-window.block_nlon // tile_cols)
    column = np.arange(tile_cols)
    parts = []
    per_batch = max(1, _BATCH_POINTS // (tile_rows * tile_cols))
    candidates = band_keys.size * tiles_per_row
    stagings_before = 0
    for first in range(0, max(candidates, 1), per_batch):
        entry = np.arange(first, min(first + per_batch, candidates))
        part = _stagings(entry // tiles_per_row, entry % tiles_per_row * tile_cols, band, band_lo, band_len, column,
                         window, residues, shift, nlon, classes, chunk_cols)  # fmt: skip
        part[5] += stagings_before  # chunk -> staging, numbered across batches
        stagings_before += part[0].size
        parts.append(part)
    keep = [np.concatenate([p[i] for p in parts]) for i in range(len(parts[0]))]
    g_band, g_lon0, g_base, g_ring, g_records, c_staging, c_offset, c_valid, c_full = keep

    # Every tile (band, first longitude) in work order, those without chunks (points no other point sees)
    # last; chunks grouped by tile, then other row, then offset.
    g_other = band_other[g_band]
    num_tiles = -(-window.block_nlat // tile_rows) * tiles_per_row
    chunk_tile = (band[g_band] * tiles_per_row + g_lon0 // tile_cols)[c_staging]
    chunk_count = np.bincount(chunk_tile, minlength=num_tiles)
    rank = np.empty(num_tiles, np.int64)
    rank[np.argsort(-chunk_count, kind="stable")] = np.arange(num_tiles)
    order = np.lexsort((c_offset, g_other[c_staging], rank[chunk_tile]))
    c_staging, c_offset, c_valid, c_full = c_staging[order], c_offset[order], c_valid[order], c_full[order]
    # Stagings renumbered in order of first use.
    first_use = np.unique(c_staging, return_index=True)[1]
    staging_order = c_staging[np.sort(first_use)]
    renumber = np.empty(g_band.size, np.int64)
    renumber[staging_order] = np.arange(staging_order.size)

    ring = g_ring[c_staging]
    longitude = (g_base[c_staging] + c_offset) % nlon - window.other_lon0
    flags = np.where(c_full, FULL, 0) | np.where(ring, RING, 0)
    chunks = np.stack(
        [g_other[c_staging] - window.other_lat0, longitude, c_offset, c_valid, flags, renumber[c_staging]], axis=1
    ).astype(np.int32)
    tile_order = np.argsort(rank)
    tiles = np.stack([tile_order // tiles_per_row * tile_rows, tile_order % tiles_per_row * tile_cols],
                     axis=1).astype(np.int32)  # fmt: skip
    tile_offsets = np.zeros(num_tiles + 1, np.int32)
    np.cumsum(chunk_count[tile_order], out=tile_offsets[1:])
    return BlockSchedule(
        tiles=tiles,
        tile_offsets=tile_offsets,
        chunks=np.ascontiguousarray(chunks.reshape(-1, 6)),
        records=np.ascontiguousarray(g_records[staging_order].astype(np.int32).reshape(-1, tile_rows, classes, 2)),
        tile_rows=tile_rows,
        tile_cols=tile_cols,
        chunk_cols=chunk_cols,
        classes=classes,
        shift=shift,
        nlat_walk=window.block_nlat,
        nlon_walk=window.block_nlon,
        nlon=nlon,
    )


def _checked_window(window, nlat_walk: int, nlon_walk: int, nlon: int) -> WalkWindow:
    """``window`` as a :class:`WalkWindow` of ints, or a ``ValueError`` saying which block leaves its grid."""
    window = WalkWindow(*(_validate.integer(x, f"window.{name}", 0) for name, x in zip(WalkWindow._fields, window)))
    if window.lat0 + window.nlat > nlat_walk or window.lon0 + window.nlon > nlon_walk:
        raise ValueError(f"the walking block of {window} leaves the {nlat_walk}x{nlon_walk} walking grid.")
    if window.block_nlat < window.nlat or window.block_nlon < window.nlon or window.block_nlat * window.block_nlon < 1:
        raise ValueError(f"the local arrays of {window} are smaller than its walking block (or empty).")
    if window.other_lon0 + window.other_nlon > nlon:
        raise ValueError(f"the other block of {window} wraps past longitude {nlon} (blocks do not wrap).")
    return window


def _stagings(band_index, lon0, band, band_lo, band_len, column, window, residues, shift, nlon, classes,
              chunk_cols):  # fmt: skip
    """The stagings and chunks of a batch of candidate (band entry, first local tile longitude) pairs."""
    tile_rows = band_lo.shape[1]
    lon = lon0[:, None] + column[None, :]  # [n, tile_cols] local walking longitudes
    row = band[band_index][:, None] * tile_rows + np.arange(tile_rows)[None, :]
    real = (row < window.nlat)[:, :, None] & (lon < window.nlon)[:, None, :]  # [n, tile_rows, tile_cols]
    written = (row < window.block_nlat)[:, :, None] & (lon < window.block_nlon)[:, None, :]
    global_lon = np.broadcast_to((window.lon0 + lon)[:, None, :], real.shape)
    start = np.take_along_axis(band_lo[band_index], global_lon % residues, axis=2) + shift * (global_lon // residues)
    length = np.take_along_axis(band_len[band_index], global_lon % residues, axis=2)
    length = np.where(real, length, 0)  # [n, tile_rows, tile_cols]

    seen = length > 0
    lo = np.where(seen, start, np.iinfo(np.int64).max).min(axis=(1, 2))
    hi = np.where(seen, start + length, np.iinfo(np.int64).min).max(axis=(1, 2))
    keep = seen.any(axis=(1, 2))
    band_index, lon0, start, length, written, lo, hi = (
        x[keep] for x in (band_index, lon0, start, length, written, lo, hi)
    )
    ring = hi - lo >= nlon
    base = np.where(ring, 0, lo)
    # Records: window mode relative to the base; ring mode the arc's start modulo nlon.
    relative = np.where(ring[:, None, None], start % nlon, start - base[:, None, None])
    records = np.stack([relative[:, :, :classes], length[:, :, :classes]], axis=-1)

    # Chunks: the staging's unwrapped columns [base, base + width) meet the other window's longitudes, repeated
    # every nlon, in at most two parts (for a whole ring: the cut at the seam, unwrapped column nlon); each part
    # is cut into chunks from its first column.
    width = np.where(ring, nlon, hi - lo)
    copy = window.other_lon0 + nlon * np.floor_divide(base - window.other_lon0, nlon)  # at or before base
    counts, part_lo, part_hi = [], [], []
    for first_column in (copy, copy + nlon):
        lo_p = np.maximum(base, first_column) - base
        hi_p = np.maximum(np.minimum(base + width, first_column + window.other_nlon) - base, lo_p)
        part_lo.append(lo_p), part_hi.append(hi_p), counts.append(-(-(hi_p - lo_p) // chunk_cols))
    count = counts[0] + counts[1]
    staging = np.repeat(np.arange(width.size), count)
    k = np.arange(staging.size) - np.repeat(np.cumsum(count) - count, count)
    in_first = k < counts[0][staging]
    offset = np.where(in_first, part_lo[0][staging] + k * chunk_cols,
                      part_lo[1][staging] + (k - counts[0][staging]) * chunk_cols)  # fmt: skip
    part_end = np.where(in_first, part_hi[0][staging], part_hi[1][staging])
    valid = np.minimum(chunk_cols, part_end - offset)

    # Per chunk: whether any real point sees a column of it (chunks none sees are dropped) and whether every
    # written point sees all of them (FULL), a batch of chunks at a time.
    touched, full = np.empty(staging.size, bool), np.empty(staging.size, bool)
    step = max(1, _BATCH_POINTS // (tile_rows * lon.shape[1]))
    for first in range(0, staging.size, step):
        part = slice(first, first + step)
        touched[part], full[part] = _covers(relative, length, written, ring, staging[part], offset[part], valid[part],
                                            nlon, chunk_cols)  # fmt: skip
    staging, offset, valid, full = staging[touched], offset[touched], valid[touched], full[touched]
    return [band_index, lon0, base, ring, records, staging, offset, valid, full]


def _covers(relative, length, written, ring, staging, offset, valid, nlon, chunk_cols):
    """Per chunk: whether any point sees one of its columns, and whether every written point sees all."""
    begin = relative[staging] - offset[:, None, None]  # window mode: the point's first column in the chunk
    length = length[staging]
    valid_columns = valid[:, None, None]
    # Ring mode: d is the chunk's first column after the arc's start, modulo nlon.
    d = (offset[:, None, None] - relative[staging]) % nlon
    ring = ring[staging][:, None, None]
    sees_any = np.where(ring, (d < length) | (d + valid_columns > nlon), (begin < valid_columns) & (begin + length > 0))
    sees_all = np.where(ring, (length == nlon) | (d + valid_columns <= length),
                        (begin <= 0) & (begin + length >= valid_columns))  # fmt: skip
    touched = (sees_any & (length > 0)).any(axis=(1, 2))
    full = (valid == chunk_cols) & np.where(written[staging], sees_all, True).all(axis=(1, 2))
    return touched, full
