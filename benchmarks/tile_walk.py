"""Numpy emulation of the tiled kernels' walk over a :class:`~jax_s2attn.plan.SegmentTable`.

A CTA owns ``TILE`` consecutive longitudes of one row of the *walking* grid (the
query grid for the forward pass and dQ, the key grid for dK/dV), split into warps
of ``WARP`` points. For each segment (one row of the other grid) of its walking
row it stages a window of the other grid's longitudes in chunks of ``CHUNK``
columns, and each warp multiplies its points against the ``BLOCK``-column blocks
its band touches. This module reproduces that walk exactly, so tests can prove
that it visits every pair of the plan once and nothing else, and so its cost
(computed pairs against useful pairs) can be measured without a GPU.

Per point ``w`` of walking row ``h`` and a segment ``(row, lo_r, len_r)``:
``r = w % R``, ``start_w = lo_r + S*(w // R)`` (not wrapped), ``len_w = len_r``.
Over the CTA's points with ``len_w > 0``, ``[lo_cta, hi_cta)`` is the union of
their arcs. If it spans the whole other ring (*ring mode*) the CTA stages the
ring from longitude 0 and point ``w`` covers column ``c`` iff
``(c - start_w) mod nlon < len_w``; otherwise (*window mode*) it stages
``hi_cta - lo_cta`` columns from longitude ``lo_cta mod nlon`` and ``w`` covers
``c`` iff ``0 <= c - (start_w - lo_cta) < len_w``. Column ``c`` is other-grid
longitude ``(base + c) mod nlon``. Here ``mod`` is the non-negative remainder
(``c - start_w`` is often negative; C's ``%`` would be wrong), and ``start_w`` may
exceed ``nlon`` since a segment's ``lo_r`` are unwrapped (see ``SegmentTable``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from jax_s2attn.plan import NeighborhoodPlan, SegmentTable

__all__ = ["BLOCK", "CHUNK", "TILE", "WARP", "TileWalk", "computed_pairs", "tile_pairs", "tile_statistics"]

# These mirror the CUDA kernel's constants (cuda/gpu/tiled_attn_device.cuh); keep them in sync.
TILE = 64  # walking points per CTA
WARP = 16  # walking points per warp: the M of one MMA
# Other-grid columns staged at a time by dk/dv (forward and dq stage 32: tiled_narrow_shape.cuh). The
# blocks lie on one BLOCK-column grid either way, so the walk's pairs and counts do not depend on it.
CHUNK = 64
BLOCK = 16  # columns of one multiplied block: the N of one MMA

_WARPS = TILE // WARP
# (CTA, segment) entries processed at once by the vectorised walk: ~2M points.
_BATCH = 1 << 15


class _Stagings(NamedTuple):
    """One entry per (CTA, segment) with at least one neighbour: what the CTA stages and multiplies.

    ``start``/``length`` are per point (``[n, TILE]``, ``length`` 0 for points past
    the walking range or without an arc on the row); in window mode ``start`` is
    already relative to the window (``start_w - lo_cta``), in ring mode it is
    ``start_w``. ``band_lo``/``band_hi`` (``[n, WARPS]``) are each warp's columns,
    ``band_lo == band_hi`` for a warp with nothing to do.
    """

    walk_row: np.ndarray
    first_lon: np.ndarray
    other_row: np.ndarray
    ring: np.ndarray
    base: np.ndarray
    width: np.ndarray
    start: np.ndarray
    length: np.ndarray
    band_lo: np.ndarray
    band_hi: np.ndarray


def _check_walking_grid(table: SegmentTable, nlat_walk: int, nlon_walk: int) -> None:
    if table.offsets.size != nlat_walk + 1:
        raise ValueError(f"the segment table has {table.offsets.size - 1} walking rows, not nlat_walk={nlat_walk}.")
    if table.shift * nlon_walk != table.residues * table.nlon:
        raise ValueError(
            f"nlon_walk={nlon_walk} does not match the segment table (R={table.residues}, S={table.shift}, "
            f"nlon={table.nlon}): S*nlon_walk must equal R*nlon."
        )


def _stagings(table: SegmentTable, lon_start: int, lon_stop: int):
    """Yield :class:`_Stagings` batches for CTAs at ``lon_start, lon_start + TILE, ...`` below ``lon_stop``."""
    residues, nlon = table.residues, table.nlon
    ctas = -(-(lon_stop - lon_start) // TILE)
    num_segments = table.segments.shape[0]
    segment_walk_row = np.repeat(np.arange(table.offsets.size - 1), np.diff(table.offsets))
    for first in range(0, num_segments * ctas, _BATCH):
        entry = np.arange(first, min(first + _BATCH, num_segments * ctas))
        segment, cta = np.divmod(entry, ctas)
        lon = lon_start + TILE * cta[:, None] + np.arange(TILE)[None, :]
        seg = table.segments[segment].astype(np.int64)
        residue = lon % residues
        lo = np.take_along_axis(seg[:, 1 : 1 + residues], residue, axis=1)
        length = np.take_along_axis(seg[:, 1 + residues :], residue, axis=1)
        length[lon >= lon_stop] = 0
        start = lo + table.shift * (lon // residues)

        has = length > 0
        lo_cta = np.where(has, start, np.iinfo(np.int64).max).min(axis=1)
        hi_cta = np.where(has, start + length, np.iinfo(np.int64).min).max(axis=1)
        keep = has.any(axis=1)
        has, start, length, lo_cta, hi_cta = has[keep], start[keep], length[keep], lo_cta[keep], hi_cta[keep]
        segment, cta = segment[keep], cta[keep]

        ring = hi_cta - lo_cta >= nlon
        base = np.where(ring, 0, lo_cta % nlon)
        width = np.where(ring, nlon, hi_cta - lo_cta)
        start = np.where(ring[:, None], start, start - lo_cta[:, None])

        warp_has = has.reshape(-1, _WARPS, WARP)
        warp_start = start.reshape(-1, _WARPS, WARP)
        warp_stop = warp_start + length.reshape(-1, _WARPS, WARP)
        busy = warp_has.any(axis=2)
        window_lo = np.where(warp_has, warp_start, np.iinfo(np.int64).max).min(axis=2)
        window_hi = np.where(warp_has, warp_stop, 0).max(axis=2)
        band_lo = np.where(busy & ~ring[:, None], window_lo, 0)
        band_hi = np.where(busy, np.where(ring[:, None], width[:, None], window_hi), 0)
        yield _Stagings(
            walk_row=segment_walk_row[segment],
            first_lon=lon_start + TILE * cta,
            other_row=table.segments[segment, 0].astype(np.int64),
            ring=ring,
            base=base,
            width=width,
            start=start,
            length=length,
            band_lo=band_lo,
            band_hi=band_hi,
        )


class TileWalk(NamedTuple):
    """What :func:`tile_pairs` saw the walk do.

    Attributes:
      pairs: ``[n, 2]`` int64 ``(walking point, other point)`` global flat indices
        (``row*nlon + lon`` on each grid), one per valid product, in walk order.
      computed_pairs: rows times columns of every multiplied block (``WARP*BLOCK`` each).
    """

    pairs: np.ndarray
    computed_pairs: int


def tile_pairs(
    table: SegmentTable, nlat_walk: int, nlon_walk: int, *, lon_range: tuple[int, int] | None = None
) -> TileWalk:
    """Walk ``table`` chunk by chunk and block by block, exactly as the kernel does.

    Meant for tests on small grids: it enumerates every valid pair.

    Args:
      table: the walk's segment table (``plan.forward_segments`` over the query grid,
        ``plan.backward_segments`` over the key grid).
      nlat_walk, nlon_walk: shape of the walking grid.
      lon_range: ``(start, stop)`` walking longitudes of a window (CTAs start at
        ``start``, points at or past ``stop`` take no part); default the whole ring.
    """
    _check_walking_grid(table, nlat_walk, nlon_walk)
    lon_start, lon_stop = (0, nlon_walk) if lon_range is None else lon_range
    if not 0 <= lon_start < lon_stop <= nlon_walk:
        raise ValueError(f"lon_range={lon_range} must satisfy 0 <= start < stop <= nlon_walk={nlon_walk}.")
    nlon = table.nlon
    point_warp = np.arange(TILE) // WARP
    pairs, computed = [], 0
    for batch in _stagings(table, lon_start, lon_stop):
        for i in range(batch.width.size):
            width = int(batch.width[i])
            # Column blocks in chunk-major order: chunk ci, block kb start at CHUNK*ci + BLOCK*kb.
            chunks = -(-width // CHUNK)
            block_start = (CHUNK * np.arange(chunks)[:, None] + BLOCK * np.arange(CHUNK // BLOCK)[None, :]).ravel()
            multiplied = (
                (block_start[None, :] < width)
                & (block_start[None, :] < batch.band_hi[i][:, None])
                & (block_start[None, :] + BLOCK > batch.band_lo[i][:, None])
            )  # [warps, blocks]
            computed += WARP * BLOCK * int(multiplied.sum())

            column = np.arange(chunks * CHUNK)
            relative = column[None, :] - batch.start[i][:, None]
            if batch.ring[i]:
                relative %= nlon
            covers = (relative >= 0) & (relative < batch.length[i][:, None]) & (column[None, :] < width)
            covers &= multiplied[point_warp][:, column // BLOCK]
            point, col = np.nonzero(covers)
            walk = batch.walk_row[i] * nlon_walk + batch.first_lon[i] + point
            other = batch.other_row[i] * nlon + (batch.base[i] + col) % nlon
            pairs.append(np.stack([walk, other], axis=1))
    pairs = np.concatenate(pairs) if pairs else np.zeros((0, 2), np.int64)
    return TileWalk(pairs=pairs.astype(np.int64), computed_pairs=computed)


def computed_pairs(table: SegmentTable, nlat_walk: int, nlon_walk: int) -> int:
    """Rows times columns of every block the walk multiplies (vectorised; no pairs enumerated).

    A warp's band ``[lo, hi)`` touches the blocks ``lo // BLOCK`` to ``ceil(hi / BLOCK) - 1``;
    chunks are ``CHUNK``-aligned and ``hi <= width``, so all of them lie below the staged width.
    """
    _check_walking_grid(table, nlat_walk, nlon_walk)
    blocks = 0
    for batch in _stagings(table, 0, nlon_walk):
        count = -(-batch.band_hi // BLOCK) - batch.band_lo // BLOCK
        blocks += int(np.where(batch.band_hi > batch.band_lo, count, 0).sum())
    return WARP * BLOCK * blocks


@functools.lru_cache(maxsize=64)
def _statistics(plan: NeighborhoodPlan) -> tuple[int, int, int]:
    return (
        plan.num_pairs,
        computed_pairs(plan.forward_segments, *plan.out_shape),
        computed_pairs(plan.backward_segments, *plan.in_shape),
    )


def tile_statistics(plan: NeighborhoodPlan) -> dict[str, float]:
    """Useful and computed pairs of the tiled walks of ``plan`` (cached per plan).

    Returns:
      ``useful_pairs`` (``plan.num_pairs``: every (query, key) pair of the
      neighbourhood), ``computed_pairs_forward`` (the forward/dQ walk of
      ``forward_segments`` over the query grid), ``computed_pairs_backward`` (the
      dK/dV walk of ``backward_segments`` over the key grid) and
      ``utilization_forward`` / ``utilization_backward`` (useful / computed).
    """
    useful, forward, backward = _statistics(plan._host)  # never cache a plan carrying traced tables
    return {
        "useful_pairs": useful,
        "computed_pairs_forward": forward,
        "computed_pairs_backward": backward,
        "utilization_forward": useful / forward,
        "utilization_backward": useful / backward,
    }
