"""The block-sparse schedule covers exactly the plan's pairs, once each, for every walk, grid and shape.

The expansion here is the kernels' contract written out independently of the builder: per chunk and
tile point, the interval of chunk columns from the staging record (``jax_s2attn/schedule.py``); the
expected pairs come from the plan's ``psi`` (``csr_offsets`` / ``csr_columns``, built from the dense
membership test).
"""

from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path

import jax
import numpy as np
import pytest

from jax_s2attn._native import kernel_limits
from jax_s2attn.ops import _ffi
from jax_s2attn.parallel.layout import shard_layout, window_schedules
from jax_s2attn.plan import NeighborhoodPlan
from jax_s2attn.schedule import (
    FULL, RING, BlockSchedule, WalkWindow, build_schedule, join_schedules, tile_stencil_pairs
)  # fmt: skip

sys.path.insert(0, str(Path(__file__).parent))
from kernel_cases import expand_runs_schedule, psi_pairs, stencil_rows_of  # noqa: E402

# (in_shape, out_shape, grid, theta_cutoff): self-attention at small, medium and whole-ring cutoffs,
# other grids, downsampling by 2, 3 and 128, upsampling by 2 and 4, odd sizes, nlon not a multiple of the tile.
PLANS = [
    ((9, 16), (9, 16), "equiangular", 0.7),
    ((17, 32), (17, 32), "equiangular", 0.3),
    ((17, 32), (17, 32), "equiangular", None),
    ((11, 40), (11, 40), "equiangular", 2.0),
    ((13, 24), (13, 24), "legendre-gauss", 0.5),
    ((12, 36), (12, 36), "lobatto", 0.4),
    ((15, 20), (15, 20), "equiangular-trapezoidal", 0.45),
    ((16, 32), (8, 16), "equiangular", 0.4),
    ((12, 48), (6, 16), "equiangular", 0.5),
    ((8, 16), (16, 32), "equiangular", 0.4),
    ((5, 12), (10, 48), "legendre-gauss", 0.9),
    ((9, 512), (9, 4), "equiangular", 0.05),  # arcs 128 columns apart: windows with empty chunks between
]
# (tile_rows, tile_cols, chunk_cols): the m64 shapes, odd tiles, and tiles narrower than a walk's residues.
SHAPES = [(4, 16, 32), (2, 32, 16), (8, 8, 64), (1, 64, 32), (3, 5, 16), (4, 2, 16)]


def _plan(args) -> NeighborhoodPlan:
    in_shape, out_shape, grid, cutoff = args
    return NeighborhoodPlan(in_shape, out_shape, grid, grid, theta_cutoff=cutoff)


def _plan_pairs(plan: NeighborhoodPlan) -> np.ndarray:
    """``(query, key)`` flat index pairs of the plan from its ``psi``, sorted."""
    pairs = np.stack(psi_pairs(plan), axis=1)
    return pairs[np.lexsort(pairs.T[::-1])]


def _expand(s: BlockSchedule, window: WalkWindow | None = None, nlon_walk: int | None = None) -> np.ndarray:
    """``(walking point, other point)`` (global flat indices) of every column a kernel keeps, in schedule order;
    asserts the contract's invariants on the way (FULL chunks need no mask, chunks stay inside the ring and the
    other window, padding points are in no FULL chunk). ``window``: the schedule's, with ``nlon_walk`` the global
    walking grid's longitudes."""
    if window is None:
        window = WalkWindow(0, 0, s.nlat_walk, s.nlon_walk, s.nlat_walk, s.nlon_walk, 0, 0, 1 << 31, s.nlon)
        nlon_walk = s.nlon_walk
    tile_of_chunk = np.repeat(np.arange(s.tiles.shape[0]), np.diff(s.tile_offsets))
    other, lon, offset, valid, flags, staging = s.chunks.T
    assert ((valid >= 1) & (valid <= s.chunk_cols)).all()
    assert ((lon >= 0) & (lon + valid <= window.other_nlon)).all(), "a chunk leaves the other window's longitudes"
    assert ((other >= 0) & (other < window.other_nlat)).all(), "a chunk leaves the other window's rows"
    a, j = np.divmod(np.arange(s.tile_rows * s.tile_cols), s.tile_cols)  # tile point -> (row, column)
    record = s.records[staging][:, a, j % s.classes]  # [chunks, points, 2]
    start = record[..., 0] + s.shift * (j // s.classes) - offset[:, None]
    column = np.arange(s.chunk_cols)
    x = column[None, None, :] - start[..., None]
    ring = (flags & RING).astype(bool)[:, None, None]
    x = np.where(ring, x % s.nlon, x)
    keeps = (x >= 0) & (x < record[..., 1:2]) & (column < valid[:, None, None])
    walk_row = s.tiles[tile_of_chunk, 0][:, None] + a[None, :]
    walk_lon = s.tiles[tile_of_chunk, 1][:, None] + j[None, :]
    written = (walk_row < s.nlat_walk) & (walk_lon < s.nlon_walk)
    real = (walk_row < window.nlat) & (walk_lon < window.nlon)
    # The kernels reduce a ring start modulo nlon by one conditional add or subtract.
    ring_chunk = ring[:, 0, 0]
    assert ((record[ring_chunk, :, 0] >= 0) & (record[ring_chunk, :, 0] < s.nlon)).all()
    reach = start[ring_chunk][written[ring_chunk]]
    assert ((reach > -s.nlon) & (reach < 2 * s.nlon)).all(), "a ring start the kernels cannot reduce"
    assert not (keeps & (written & ~real)[..., None]).any(), "a padding point keeps a column"
    full = (flags & FULL).astype(bool)
    assert (keeps | ~written[..., None])[full].all(), "a FULL chunk has columns some written point does not see"
    assert (valid[full] == s.chunk_cols).all()
    keeps &= real[..., None]
    assert keeps.any(axis=(1, 2)).all(), "a chunk no point sees is listed"
    c, p, n = np.nonzero(keeps)
    walk = (walk_row[c, p] + window.lat0) * nlon_walk + walk_lon[c, p] + window.lon0
    return np.stack([walk, (other[c] + window.other_lat0) * s.nlon + lon[c] + window.other_lon0 + n], axis=1)


def _sorted_pairs(got: np.ndarray, walk: str) -> np.ndarray:
    """``(query, key)`` pairs of a walk's expansion, sorted; asserts that none is listed twice."""
    got = got[:, ::-1] if walk == "backward" else got
    got = got[np.lexsort(got.T[::-1])]
    duplicates = int((np.diff(got, axis=0) == 0).all(axis=1).sum())
    assert duplicates == 0, f"{walk}: {duplicates} pairs computed twice"
    return got


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("args", PLANS, ids=lambda a: f"{a[0][0]}x{a[0][1]}-{a[1][0]}x{a[1][1]}-{a[2]}-{a[3]}")
def test_schedule_covers_the_plans_pairs_once(args, shape):
    plan = _plan(args)
    tile_rows, tile_cols, chunk_cols = shape
    expected = _plan_pairs(plan)
    for walk, segments, walk_shape in [("forward", plan.forward_segments, plan.out_shape),
                                       ("backward", plan.backward_segments, plan.in_shape)]:  # fmt: skip
        s = build_schedule(segments, *walk_shape, tile_rows=tile_rows, tile_cols=tile_cols, chunk_cols=chunk_cols)
        np.testing.assert_array_equal(_sorted_pairs(_expand(s), walk), expected, err_msg=f"{walk} walk")


def _windows(plan: NeighborhoodPlan, rng) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, int, int, int]]]:
    """Query and key blocks ``(lat0, lon0, nlat, nlon)`` of shards and padding ``(q_lat, q_lon, k_lat, k_lon)``:
    blocks from mid-ring, one ending at the seam, a whole key ring on some rows, a single row and column."""
    (nq_lat, nq_lon), (nk_lat, nk_lon) = plan.out_shape, plan.in_shape

    def block(nlat, nlon, at_seam=False, whole_ring=False):
        rows = int(rng.integers(1, nlat + 1))
        lat0 = int(rng.integers(0, nlat - rows + 1))
        cols = nlon if whole_ring else int(rng.integers(1, nlon + 1))
        lon0 = nlon - cols if at_seam else int(rng.integers(0, nlon - cols + 1))
        return lat0, lon0, rows, cols

    return [
        (block(nq_lat, nq_lon), block(nk_lat, nk_lon), (1, 3, 0, 2)),
        (block(nq_lat, nq_lon, at_seam=True), block(nk_lat, nk_lon, at_seam=True), (0, 0, 2, 0)),
        (block(nq_lat, nq_lon), block(nk_lat, nk_lon, whole_ring=True), (2, 17, 1, 1)),
        ((nq_lat // 2, nq_lon // 3, 1, 1), block(nk_lat, nk_lon), (0, 0, 0, 0)),
    ]


@pytest.mark.parametrize("shape", SHAPES[:2] + SHAPES[4:], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("args", PLANS, ids=lambda a: f"{a[0][0]}x{a[0][1]}-{a[1][0]}x{a[1][1]}-{a[2]}-{a[3]}")
def test_windowed_schedules_cover_the_windows_pairs_once(args, shape):
    """A shard's schedule (local coordinates, padding in the local arrays) covers exactly the plan's pairs of a
    real query of its query block and a real key of its key block, for both walks."""
    plan = _plan(args)
    tile_rows, tile_cols, chunk_cols = shape
    pairs = _plan_pairs(plan)
    (_, nq_lon), (_, nk_lon) = plan.out_shape, plan.in_shape
    q_lat, q_lon = np.divmod(pairs[:, 0], nq_lon)
    k_lat, k_lon = np.divmod(pairs[:, 1], nk_lon)
    inside = lambda lat, lon, b: (lat >= b[0]) & (lat < b[0] + b[2]) & (lon >= b[1]) & (lon < b[1] + b[3])  # noqa: E731
    for q_block, k_block, (pq_lat, pq_lon, pk_lat, pk_lon) in _windows(plan, np.random.default_rng(sum(args[0]))):
        expected = pairs[inside(q_lat, q_lon, q_block) & inside(k_lat, k_lon, k_block)]
        walks = [
            ("forward", plan.forward_segments, plan.out_shape,
             WalkWindow(*q_block, q_block[2] + pq_lat, q_block[3] + pq_lon, *k_block)),
            ("backward", plan.backward_segments, plan.in_shape,
             WalkWindow(*k_block, k_block[2] + pk_lat, k_block[3] + pk_lon, *q_block)),
        ]  # fmt: skip
        for walk, segments, walk_shape, window in walks:
            s = build_schedule(segments, *walk_shape, tile_rows=tile_rows, tile_cols=tile_cols, chunk_cols=chunk_cols,
                               window=window)  # fmt: skip
            assert (s.nlat_walk, s.nlon_walk) == (window.block_nlat, window.block_nlon)
            tiles = {(r, c) for r in range(0, s.nlat_walk, tile_rows) for c in range(0, s.nlon_walk, tile_cols)}
            assert sorted(map(tuple, s.tiles.tolist())) == sorted(tiles), "tiles do not cover the local arrays"
            got = _sorted_pairs(_expand(s, window, walk_shape[1]), walk)
            np.testing.assert_array_equal(got, expected, err_msg=f"{walk} walk on {window}")


@pytest.mark.parametrize(("args", "lat_parts", "lon_parts"), [
    (((17, 36), (17, 36), "equiangular", 0.3), 8, 5),  # two empty latitude shards; padding longitudes
    (((16, 32), (8, 16), "equiangular", 0.4), 3, 2),  # downsampling: halos of two key rows a query row
    (((8, 16), (16, 32), "equiangular", 0.4), 2, 3),  # upsampling, padding longitudes on both grids
], ids=str)  # fmt: skip
def test_a_layouts_window_schedules_cover_the_plans_pairs_once(args, lat_parts, lon_parts):
    """The joined window schedules of a sharded layout (parallel.layout.window_schedules, each window's tiles and
    offsets picked by its index as the sharded op picks them): together, every plan pair once for both walks."""
    plan = _plan(args)
    layout = shard_layout(plan, lat_parts, lon_parts)
    sets = window_schedules(plan, layout, 4, 16, 32)
    q_block, k_block = (layout.q_lat.block, layout.q_lon.block), (layout.k_ext_block, layout.k_lon.block)
    for walk, joined, walk_shape in [("forward", sets[0], plan.out_shape), ("backward", sets[1], plan.in_shape)]:
        assert joined.tiles.shape[0] == len(layout.windows)
        got = []
        for index, row in enumerate(layout.windows.tolist()):
            queries, keys = row[:4], row[4:]
            window = (WalkWindow(*queries, *q_block, *keys) if walk == "forward"
                      else WalkWindow(*keys, *k_block, *queries))  # fmt: skip
            first, last = joined.tile_offsets[index][[0, -1]]
            picked = BlockSchedule(joined.tiles[index], joined.tile_offsets[index] - first,
                                   joined.chunks[first:last], joined.records, *joined[4:])  # fmt: skip
            got.append(_expand(picked, window, walk_shape[1]))
        np.testing.assert_array_equal(_sorted_pairs(np.concatenate(got), walk), _plan_pairs(plan), err_msg=walk)


def test_a_layouts_window_schedules_keep_no_plan_but_the_host_plan():
    """A plan whose tables are other arrays (under jit: tracers) gets its host plan's window schedules, and the
    cache keeps neither it nor its tables alive."""
    plan = _plan(PLANS[1])
    layout = shard_layout(plan, 2, 3)
    copy = jax.tree.map(np.array, plan)
    table = weakref.ref(copy.tables[0])
    built = window_schedules(copy, layout, 4, 16, 16)
    assert window_schedules(plan, layout, 4, 16, 16) is built
    del copy
    gc.collect()
    assert table() is None, "the cache keeps the plan it was called with"


def test_tile_stencil_pairs_are_the_pairs_of_whole_tiles():
    pairs = np.array([[2, 0], [4, 3], [6, 5], [8, 7], [10, 9], [12, 11]], np.int32)  # rows 2..13
    np.testing.assert_array_equal(tile_stencil_pairs(pairs, 16, 4)[:, 0], [4, 6, 8, 10])
    np.testing.assert_array_equal(tile_stencil_pairs(pairs, 14, 4)[:, 0], [4, 6, 8, 10, 12])  # rows 14, 15: none
    # Tiles of 3 rows: (2, 3) straddles the first tile, which is not whole; dropping it leaves (4, 5)'s tile short.
    np.testing.assert_array_equal(tile_stencil_pairs(pairs, 14, 3)[:, 0], [6, 8, 10, 12])
    np.testing.assert_array_equal(tile_stencil_pairs(pairs, 16, 2), pairs)
    assert tile_stencil_pairs(np.zeros((0, 2), np.int32), 8, 4).shape == (0, 2)


# Self-attention plans at the default cutoff, whose walks leave row pairs to the stencil kernels: pairs in whole
# tiles only (17x72), pairs at both ends of the band in tiles shared with other rows (65x144), every row (9x4).
STENCIL_PLANS = [((17, 72), (17, 72)), ((65, 144), (65, 144)), ((9, 4), (9, 4))]


@pytest.mark.skipif(kernel_limits() is None, reason="stencil pairs need a native module's limits (CI has one)")
@pytest.mark.parametrize("shapes", STENCIL_PLANS, ids=str)
@pytest.mark.parametrize("tile_rows", [4, 3])
def test_a_schedule_beside_the_stencil_rows_covers_every_other_row_once(shapes, tile_rows):
    """The schedule without the stencil rows' tiles lists no tile with a row of the pairs the stencil kernels take,
    and covers every plan pair of the other walking rows once; those pairs' rows are all of the tiles it leaves
    out."""
    plan = NeighborhoodPlan(*shapes)
    pairs = _plan_pairs(plan)
    for walk, segments, walk_shape, column in [("forward", plan.forward_segments, plan.out_shape, 0),
                                               ("backward", plan.backward_segments, plan.in_shape, 1)]:  # fmt: skip
        stencil_pairs = plan.tile_stencil_pairs(walk, tile_rows=tile_rows)
        s = plan.block_schedule(walk, tile_rows=tile_rows, stencil=True)
        assert len(stencil_pairs) > 0 or shapes == ((65, 144), (65, 144)) and tile_rows == 3, walk
        stencil_rows = stencil_rows_of(stencil_pairs, walk_shape[0])
        tile_rows_listed = (s.tiles[:, :1] + np.arange(tile_rows)).clip(max=walk_shape[0] - 1)
        assert not stencil_rows[tile_rows_listed].any(), f"{walk}: a listed tile holds a stencil row"
        tiles_per_row = -(-walk_shape[1] // s.tile_cols)
        listed_bands = np.unique(s.tiles[:, 0] // tile_rows)
        assert s.tiles.shape[0] == listed_bands.size * tiles_per_row
        covered = np.zeros(walk_shape[0], bool)
        for band in listed_bands:
            covered[band * tile_rows : (band + 1) * tile_rows] = True
        np.testing.assert_array_equal(covered, ~stencil_rows, err_msg=f"{walk}: listed and stencil rows")
        expected = pairs[~stencil_rows[pairs[:, column] // walk_shape[1]]]
        np.testing.assert_array_equal(_sorted_pairs(_expand(s), walk), expected, err_msg=f"{walk} walk")
        full = plan.block_schedule(walk, tile_rows=tile_rows)
        assert s.chunks.shape[0] < full.chunks.shape[0] or len(stencil_pairs) == 0


def _dense_pairs(plan: NeighborhoodPlan, walk: str) -> np.ndarray:
    """``[walking point, other point]`` counts of the plan's pairs (from ``psi``)."""
    query, key = psi_pairs(plan)
    dense = np.zeros((plan.nlat_out * plan.nlon_out, plan.nlat_in * plan.nlon_in), np.int32)
    np.add.at(dense, (query, key), 1)
    return dense if walk == "forward" else dense.T


# Tiles of runs: the m64 shapes whose rows are whole runs of 8 points.
RUN_SHAPES = [(1, 64), (2, 32), (4, 16), (8, 8)]


@pytest.mark.parametrize("shape", RUN_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("args", [PLANS[i] for i in (1, 3, 4, 7, 9, 11)],
                         ids=lambda a: f"{a[0][0]}x{a[0][1]}-{a[1][0]}x{a[1][1]}-{a[2]}-{a[3]}")  # fmt: skip
def test_a_schedule_as_runs_holds_the_same_pairs(args, shape):
    """A regular schedule in the ring grids' format (as_runs) holds every plan pair once, expanded by the ring
    grids' contract on flat fields; runs cover every walking point once, none past the grid."""
    plan = _plan(args)
    for walk, walk_shape in [("forward", plan.out_shape), ("backward", plan.in_shape)]:
        s = plan.block_schedule(walk, tile_rows=shape[0], tile_cols=shape[1], runs=(8, 8))
        assert s.tiles.shape[1:] == (8, 2) and s.records.shape[1:] == (4, 16, 2) and s.classes == 16
        np.testing.assert_array_equal(expand_runs_schedule(s), _dense_pairs(plan, walk), err_msg=walk)
        runs = s.tiles.reshape(-1, 2)
        points = np.concatenate([first + np.arange(count) for first, count in runs])
        np.testing.assert_array_equal(np.sort(points), np.arange(walk_shape[0] * walk_shape[1]))


def test_as_runs_refuses_tiles_that_are_not_whole_runs():
    plan = _plan(PLANS[1])
    with pytest.raises(ValueError, match="is not 8 runs of 8 points"):
        plan.block_schedule("forward", tile_rows=16, tile_cols=4, runs=(8, 8))
    with pytest.raises(TypeError, match="runs must be a tuple"):
        plan.block_schedule("forward", runs=8)


@pytest.mark.skipif(kernel_limits() is None, reason="the kernels' shapes need a native module's limits (CI has one)")
@pytest.mark.parametrize(("shape", "flat"), [((17, 72), True), ((33, 16), False)])
def test_the_stencil_schedule_is_the_tile_shape_of_fewer_chunks(shape, flat):
    """Beside the stencil rows the op takes, of the kernels' 4 x 16 tiles and 1 x 64 tiles as runs, the schedule
    of fewer chunks (1 x 64 at the default cutoff, where the rows left are polar ones; on a tie, as on rings of 16
    points, 4 x 16), with the stencil pairs of its tiles' rows and the count of the tiles it leaves out; it covers
    every plan pair of the other rows once and none of the stencil rows."""
    plan = NeighborhoodPlan(shape, shape)
    for walk in ("forward", "backward"):
        assert len(plan.tile_stencil_pairs(walk, tile_rows=1)) > 0
        chosen = _ffi.stencil_schedule(plan, walk)
        rows = plan.block_schedule(walk, stencil=True)
        one_row = plan.block_schedule(walk, tile_rows=1, tile_cols=64, stencil=True, runs=(8, 8))
        assert chosen.flat == flat
        assert chosen.schedule is (one_row if flat else rows)
        assert chosen.schedule.chunks.shape[0] == min(rows.chunks.shape[0], one_row.chunks.shape[0])
        tile_rows, tile_cols = (1, 64) if flat else (4, 16)
        np.testing.assert_array_equal(chosen.pairs, plan.tile_stencil_pairs(walk, tile_rows=tile_rows))
        stencil_rows = stencil_rows_of(chosen.pairs, shape[0])
        stencil_bands = np.unique(np.flatnonzero(stencil_rows) // tile_rows).size  # tiles of stencil rows only
        assert chosen.stencil_tiles == stencil_bands * -(-shape[1] // tile_cols)
        if not flat:
            continue
        stencil_points = np.repeat(stencil_rows, shape[1])
        expected = _dense_pairs(plan, walk)
        expected[stencil_points] = 0
        np.testing.assert_array_equal(expand_runs_schedule(chosen.schedule), expected, err_msg=walk)


def test_joining_no_schedules_is_refused():
    with pytest.raises(ValueError, match="at least one schedule"):
        join_schedules([])


@pytest.mark.parametrize("args", PLANS[:4] + PLANS[7:9] + PLANS[-1:], ids=lambda a: f"{a[0]}-{a[1]}-{a[3]}")
def test_tiles_cover_the_walking_grid_in_work_order(args):
    plan = _plan(args)
    for segments, (nlat, nlon) in [(plan.forward_segments, plan.out_shape), (plan.backward_segments, plan.in_shape)]:
        s = build_schedule(segments, nlat, nlon)
        expected = {(r, c) for r in range(0, nlat, s.tile_rows) for c in range(0, nlon, s.tile_cols)}
        assert sorted(map(tuple, s.tiles.tolist())) == sorted(expected)  # every tile once
        counts = np.diff(s.tile_offsets)
        assert (np.diff(counts) <= 0).all(), "tiles are not in longest-first order"
        # Tiles without chunks are those whose points no other point sees (keys of a 128-fold downsampling).
        seen = np.zeros((nlat, nlon), bool)
        pairs = _plan_pairs(plan)[:, 0 if segments is plan.forward_segments else 1]
        seen.flat[pairs] = True
        empty = {(int(r), int(c)) for (r, c), n in zip(s.tiles, counts) if n == 0}
        assert empty == {(r, c) for r, c in expected if not seen[r : r + s.tile_rows, c : c + s.tile_cols].any()}
        for t in range(s.tiles.shape[0]):  # a tile's chunks by other row
            rows = s.chunks[s.tile_offsets[t] : s.tile_offsets[t + 1], 0]
            assert (np.diff(rows) >= 0).all()
        used = np.unique(s.chunks[:, 5])
        np.testing.assert_array_equal(used, np.arange(s.records.shape[0]))  # every staging used
        for table in s[:4]:
            assert table.dtype == np.int32


def test_flags_are_set_where_they_apply():
    # At a whole-ring cutoff polar stagings are rings and interior chunks are full; a small cutoff
    # on a large ring has neither rings nor (at 4 x 16 tiles) full chunks at the equator.
    s = build_schedule(_plan(PLANS[3]).forward_segments, 11, 40)
    assert (s.chunks[:, 4] & RING).any() and (s.chunks[:, 4] & FULL).any()
    assert 0 < s.full_fraction < 1
    plan = NeighborhoodPlan((33, 256), (33, 256), theta_cutoff=0.05)
    s = build_schedule(plan.forward_segments, 33, 256)
    equator = s.tiles[np.repeat(np.arange(s.tiles.shape[0]), np.diff(s.tile_offsets)), 0] // 4 == 4
    assert not (s.chunks[equator, 4] & (RING | FULL)).any()


def test_computed_pairs_bound_the_useful_ones():
    plan = NeighborhoodPlan((61, 120), (61, 120), theta_cutoff=0.15)
    narrow = build_schedule(plan.forward_segments, 61, 120, chunk_cols=16)
    wide = build_schedule(plan.forward_segments, 61, 120, chunk_cols=64)
    assert plan.num_pairs <= narrow.computed_pairs < wide.computed_pairs


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(tile_rows=0), ValueError, "tile_rows must be at least 1, got 0"),
        (dict(tile_cols=2.0), TypeError, "tile_cols must be an integer, got 2.0"),
        (dict(chunk_cols=24), ValueError, "chunk_cols=24 must be a multiple of 16"),
        (dict(tile_rows=True), TypeError, "tile_rows must be an integer, got True"),
    ],
)
def test_bad_shapes_are_refused(kwargs, error, match):
    plan = NeighborhoodPlan((9, 16), (9, 16), theta_cutoff=0.7)
    with pytest.raises(error, match=match):
        build_schedule(plan.forward_segments, 9, 16, **kwargs)
    plan.block_schedule("forward", tile_rows=1, tile_cols=2, chunk_cols=16)  # cached: the same keys hash alike
    with pytest.raises(error, match=match):
        plan.block_schedule("forward", **{"tile_rows": 1, "tile_cols": 2, "chunk_cols": 16, **kwargs})


def test_a_segment_table_of_another_grid_is_refused():
    plan = NeighborhoodPlan((16, 32), (8, 16), theta_cutoff=0.4)
    with pytest.raises(ValueError, match="does not describe a walk over a 16x32 grid"):
        build_schedule(plan.forward_segments, 16, 32)


def test_the_plan_builds_each_schedule_once():
    plan = NeighborhoodPlan((16, 32), (8, 16), theta_cutoff=0.4)
    forward = plan.block_schedule("forward")
    assert plan.block_schedule("forward") is forward
    assert NeighborhoodPlan((16, 32), (8, 16), theta_cutoff=0.4).block_schedule("forward") is forward
    expected = build_schedule(plan.forward_segments, 8, 16)
    for got, want in zip(forward[:4], expected[:4]):
        np.testing.assert_array_equal(got, want)
        assert not got.flags.writeable
    backward = plan.block_schedule("backward", tile_rows=2, tile_cols=32, chunk_cols=16)
    assert (backward.nlat_walk, backward.nlon_walk, backward.classes, backward.shift) == (16, 32, 2, 1)
    with pytest.raises(ValueError, match="walk='dkv' must be 'forward'"):
        plan.block_schedule("dkv")
