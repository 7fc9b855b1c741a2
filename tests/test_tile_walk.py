"""Segment tables and the numpy emulation of the tiled kernels' walk."""

import importlib.util
import math
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from jax_s2attn import NeighborhoodPlan
from jax_s2attn.plan import ArcTable, SegmentTable

sys.path.insert(0, str(Path(__file__).parent))
from kernel_cases import psi_pairs  # noqa: E402

# The walk's replay lives with the benchmark that reports its statistics.
_SPEC = importlib.util.spec_from_file_location("tile_walk", Path(__file__).parents[1] / "benchmarks" / "tile_walk.py")
tile_walk = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(tile_walk)
BLOCK, TILE, WARP = tile_walk.BLOCK, tile_walk.TILE, tile_walk.WARP
computed_pairs, tile_pairs, tile_statistics = tile_walk.computed_pairs, tile_walk.tile_pairs, tile_walk.tile_statistics

FULL = 2 * math.pi  # a cutoff that takes in the whole sphere

# (in_shape, out_shape, grid_in, grid_out, cutoff): every direction, grid and cutoff kind, odd
# latitude counts, and longitude counts below, between and above multiples of TILE = 64.
CONFIGS = [
    ((13, 24), (13, 24), "equiangular", "equiangular", None),
    ((13, 24), (13, 24), "equiangular", "equiangular", 0.25),
    ((13, 24), (13, 24), "equiangular", "equiangular", FULL),
    ((12, 72), (12, 72), "legendre-gauss", "legendre-gauss", None),
    ((12, 72), (12, 72), "legendre-gauss", "legendre-gauss", 0.25),
    ((11, 20), (11, 20), "lobatto", "lobatto", 0.25),
    ((11, 20), (11, 20), "lobatto", "lobatto", FULL),
    ((9, 100), (9, 100), "equiangular-trapezoidal", "equiangular-trapezoidal", None),
    ((9, 100), (9, 100), "equiangular-trapezoidal", "equiangular-trapezoidal", 0.25),
    ((10, 200), (10, 200), "equiangular", "equiangular", 0.25),
    ((12, 144), (6, 72), "equiangular", "equiangular", None),  # downsampling, pscale 2
    ((12, 144), (6, 72), "equiangular", "equiangular", 0.25),
    ((12, 144), (6, 72), "equiangular", "equiangular", FULL),
    ((11, 40), (6, 20), "lobatto", "lobatto", 0.25),
    ((9, 300), (5, 100), "legendre-gauss", "legendre-gauss", None),  # pscale 3
    ((9, 300), (5, 100), "legendre-gauss", "legendre-gauss", 0.25),
    ((7, 36), (4, 12), "equiangular-trapezoidal", "equiangular-trapezoidal", None),
    ((7, 36), (4, 12), "equiangular-trapezoidal", "equiangular-trapezoidal", FULL),
    ((6, 72), (12, 144), "equiangular", "equiangular", None),  # upsampling, pscale 2: R = 2
    ((6, 72), (12, 144), "equiangular", "equiangular", FULL),
    ((6, 10), (11, 20), "lobatto", "lobatto", None),
    ((6, 10), (11, 20), "lobatto", "lobatto", FULL),
    ((15, 40), (29, 80), "equiangular", "legendre-gauss", 0.25),
    ((5, 24), (9, 72), "legendre-gauss", "legendre-gauss", None),  # pscale 3: R = 3
    ((15, 24), (29, 72), "legendre-gauss", "equiangular", 0.25),
    ((4, 100), (7, 300), "equiangular-trapezoidal", "equiangular-trapezoidal", None),
    ((4, 100), (7, 300), "equiangular-trapezoidal", "equiangular-trapezoidal", FULL),
]


def _config_id(c):
    return f"{c[0]}->{c[1]}-{c[2]}-{c[3]}-{c[4]}"


def _codes(walk, other, num_other):
    return np.sort(walk.astype(np.int64) * num_other + other)


def _walks(plan):
    """``(segment table, walking shape, other shape, expected (walk, other) pairs)`` of both walks."""
    query, key = psi_pairs(plan)
    return [
        (plan.forward_segments, plan.out_shape, plan.in_shape, (query, key)),
        (plan.backward_segments, plan.in_shape, plan.out_shape, (key, query)),
    ]


@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_walk_covers_every_pair_exactly_once(config):
    plan = NeighborhoodPlan(*config)
    for table, walk_shape, other_shape, (walk, other) in _walks(plan):
        expected = _codes(walk, other, math.prod(other_shape))
        assert expected.size == plan.num_pairs and np.all(np.diff(expected) > 0)
        result = tile_pairs(table, *walk_shape)
        np.testing.assert_array_equal(_codes(*result.pairs.T, math.prod(other_shape)), expected)
        assert result.computed_pairs >= expected.size
        # The vectorised block count of tile_statistics agrees with the block-by-block walk.
        assert computed_pairs(table, *walk_shape) == result.computed_pairs


@pytest.mark.parametrize("config", [CONFIGS[9], CONFIGS[14], CONFIGS[18]], ids=_config_id)
def test_walk_of_a_longitude_window(config):
    plan = NeighborhoodPlan(*config)
    for table, (nlat, nlon), _, _ in _walks(plan):
        everything = tile_pairs(table, nlat, nlon).pairs
        start, stop = 3, nlon - 5
        inside = (everything[:, 0] % nlon >= start) & (everything[:, 0] % nlon < stop)
        window = tile_pairs(table, nlat, nlon, lon_range=(start, stop)).pairs
        np.testing.assert_array_equal(np.sort(window[:, 0] * 10**9 + window[:, 1]),
                                      np.sort(everything[inside, 0] * 10**9 + everything[inside, 1]))


@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_segment_tables_merge_the_arc_tables(config):
    plan = NeighborhoodPlan(*config)
    for segments, arcs, walk_shape in [
        (plan.forward_segments, plan.forward_arcs, plan.out_shape),
        (plan.backward_segments, plan.backward_arcs, plan.in_shape),
    ]:
        r = arcs.residues
        assert (segments.residues, segments.shift, segments.nlon) == (r, arcs.shift, arcs.nlon)
        assert segments.offsets.dtype == segments.segments.dtype == np.int32
        assert segments.offsets.shape == (walk_shape[0] + 1,) and segments.offsets[0] == 0
        assert segments.segments.shape == (segments.offsets[-1], 1 + 2 * r)
        if r == 1:
            np.testing.assert_array_equal(segments.offsets, arcs.offsets)
            np.testing.assert_array_equal(segments.segments, arcs.arcs)
        # Rebuild every walking row's segments from the arcs of its R patterns.
        for h in range(walk_shape[0]):
            expected = {}
            for residue in range(r):
                p = h * r + residue
                for row, lo, length in arcs.arcs[arcs.offsets[p] : arcs.offsets[p + 1]]:
                    entry = expected.setdefault(int(row), [0] * 2 * r)
                    entry[residue], entry[r + residue] = lo, length
            rows = segments.segments[segments.offsets[h] : segments.offsets[h + 1]]
            assert np.all(np.diff(rows[:, 0]) > 0)  # ascending, one segment per row
            assert {int(s[0]): [*(s[1 : 1 + r] % arcs.nlon), *s[1 + r :]] for s in rows} == expected

        # The arcs of one segment are unwrapped consistently: centred on their points' own
        # longitudes r*S/R to within a fraction of a longitude, smallest lo in [0, nlon).
        lo, length = segments.segments[:, 1 : 1 + r], segments.segments[:, 1 + r :]
        present, partial = length > 0, (length > 0) & (length < arcs.nlon)
        assert np.all(lo[present] >= 0) and np.all(np.where(present, lo, arcs.nlon).min(axis=1) < arcs.nlon)
        offset = lo + (length - 1) / 2 - np.arange(r) * arcs.shift / r
        spread = np.where(partial, offset, -np.inf).max(axis=1) - np.where(partial, offset, np.inf).min(axis=1)
        assert np.all(spread[partial.sum(axis=1) > 1] < 1)


@pytest.mark.parametrize(
    "shape, cutoff", [((13, 24), None), ((31, 64), 0.3), ((20, 100), FULL), ((360, 720), 0.03)]
)
def test_self_attention_segments_are_symmetric(shape, cutoff):
    # On equiangular grids the transposed pattern has the same arcs.
    plan = NeighborhoodPlan(shape, shape, theta_cutoff=cutoff)
    np.testing.assert_array_equal(plan.forward_segments.offsets, plan.backward_segments.offsets)
    np.testing.assert_array_equal(plan.forward_segments.segments, plan.backward_segments.segments)


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[14], CONFIGS[23]], ids=_config_id)
def test_device_segment_tables(config):
    plan = NeighborhoodPlan(*config)
    tables = plan.tables
    first = tables._fields.index("forward_segment_offsets")
    assert tables._fields[first : first + 4] == (
        "forward_segment_offsets", "forward_segments", "backward_segment_offsets", "backward_segments"
    )
    for host, offsets, segments, arc_offsets, arcs in [
        (plan.forward_segments, tables.forward_segment_offsets, tables.forward_segments,
         tables.forward_offsets, tables.forward_arcs),
        (plan.backward_segments, tables.backward_segment_offsets, tables.backward_segments,
         tables.backward_offsets, tables.backward_arcs),
    ]:
        assert isinstance(offsets, jax.Array) and isinstance(segments, jax.Array)
        np.testing.assert_array_equal(np.asarray(offsets), host.offsets)
        np.testing.assert_array_equal(np.asarray(segments), host.segments)
        if host.residues == 1:  # shared, not uploaded twice
            assert offsets is arc_offsets and segments is arcs
    leaves, tree = jax.tree.flatten(plan)
    assert jax.tree.unflatten(tree, leaves).tables.backward_segments is tables.backward_segments


def test_hand_counted_window_walk():
    # One walking row of 200 longitudes, R = S = 1, one segment: point w reads longitudes
    # w-1, w, w+1 (lo = 199, len = 3) of other row 0 (200 longitudes).
    table = SegmentTable(np.array([0, 1], np.int32), np.array([[0, 199, 3]], np.int32), 1, 1, 200)
    # CTAs 0-2 (64 points each): starts w0+199 .. w0+262, window of 66 columns; warp u's
    # band is [16u, 16u + 18), which touches blocks u and u + 1 (block 4 starts at 64 < 66):
    # 4 warps * 2 blocks = 8 blocks per CTA. CTA 3 (points 192-199): window of 10 columns,
    # one block. (3*8 + 1) blocks * 16 rows * 16 columns = 6400 computed pairs.
    walk = tile_pairs(table, 1, 200)
    assert walk.computed_pairs == computed_pairs(table, 1, 200) == 25 * WARP * BLOCK == 6400
    w = np.arange(200)
    expected = np.concatenate([np.stack([w, (w + d) % 200], axis=1) for d in (-1, 0, 1)])
    np.testing.assert_array_equal(_codes(*walk.pairs.T, 200), _codes(*expected.T, 200))


def test_hand_counted_walk_of_two_residues():
    # R = 2, S = 1: walking longitude w (200 of them) reads other longitudes q (100) with
    # |w - 2q| <= 2: even w = 2p reads q = p-1..p+1, odd w = 2p+1 reads q = p, p+1. The arc
    # table stores them wrapped, (lo, len) = (99, 3) and (0, 2); the segment unwraps the odd
    # residue to lo = 100 so that both sit side by side.
    arcs = ArcTable(
        offsets=np.array([0, 1, 2], np.int32),
        arcs=np.array([[0, 99, 3], [0, 0, 2]], np.int32),
        row_order=np.array([0], np.int32),
        residues=2,
        shift=1,
        nlon=100,
    )
    table = SegmentTable.from_arcs(arcs)
    np.testing.assert_array_equal(table.segments, [[0, 99, 100, 3, 2]])
    # CTAs 0-2: points p = 32t .. 32t+31 of each residue start at 99+p and 100+p, both reach
    # 132+32t: a window of 34 columns. Warp u (p = 8u .. 8u+7) has the band [8u, 8u + 10):
    # blocks {0}, {0, 1}, {1}, {1, 2} = 6 blocks. CTA 3 (points 192-199): window [195, 201),
    # one block. (3*6 + 1) * 256 = 4864 computed pairs. Stored wrapped, the odd residue would
    # start at p: a window from 0 to 132+32t >= 100, i.e. the whole ring for every warp.
    walk = tile_pairs(table, 1, 200)
    assert walk.computed_pairs == computed_pairs(table, 1, 200) == 19 * WARP * BLOCK == 4864
    w, q = np.meshgrid(np.arange(200), np.arange(100), indexing="ij")
    reads = np.isin((w - 2 * q) % 200, [0, 1, 2, 198, 199])
    np.testing.assert_array_equal(_codes(*walk.pairs.T, 100), _codes(w[reads], q[reads], 100))


def test_hand_counted_ring_mode_at_exactly_one_ring():
    # 64 walking longitudes, each reading only itself on a 64-longitude ring (lo = 0, len = 1):
    # the union [0, 64) is exactly one ring, so the CTA stages in ring mode (width 64) and
    # every warp's band is the whole ring: 4 warps * 4 blocks * 256 = 4096 computed pairs.
    # (A window of 64 columns would have let each warp multiply its own block only: 1024.)
    table = SegmentTable(np.array([0, 1], np.int32), np.array([[0, 0, 1]], np.int32), 1, 1, 64)
    walk = tile_pairs(table, 1, 64)
    assert walk.computed_pairs == computed_pairs(table, 1, 64) == 4096
    np.testing.assert_array_equal(np.sort(walk.pairs[:, 0] * 64 + walk.pairs[:, 1]), np.arange(64) * 65)


def test_hand_counted_ring_walk():
    # 4 x 8 grid, whole sphere: every point of walking row h reads all 8 longitudes of each of
    # the 4 rows (lo = 0, len = 8). One CTA per row (8 points, all in warp 0); starts 0..7, so
    # the union [0, 15) spans the ring: ring mode, width 8, one block of warp 0 per segment.
    # 4 rows * 4 segments * 1 block * 256 = 4096 computed, 32 * 32 = 1024 useful pairs.
    plan = NeighborhoodPlan((4, 8), (4, 8), theta_cutoff=FULL)
    assert TILE == 64 and WARP * BLOCK == 256
    assert tile_statistics(plan) == {
        "useful_pairs": 1024,
        "computed_pairs_forward": 4096,
        "computed_pairs_backward": 4096,
        "utilization_forward": 0.25,
        "utilization_backward": 0.25,
    }


def test_walk_rejects_a_mismatched_grid():
    plan = NeighborhoodPlan((12, 144), (6, 72))
    with pytest.raises(ValueError, match="walking rows"):
        tile_pairs(plan.forward_segments, 12, 72)
    with pytest.raises(ValueError, match="nlon_walk=144"):
        computed_pairs(plan.forward_segments, 6, 144)
    with pytest.raises(ValueError, match="lon_range"):
        tile_pairs(plan.forward_segments, 6, 72, lon_range=(5, 5))


def test_statistics_quarter_degree():
    plan = NeighborhoodPlan((721, 1440), (721, 1440), theta_cutoff=0.03)
    start = time.perf_counter()
    stats = tile_statistics(plan)
    elapsed = time.perf_counter() - start
    print(f"721x1440 tc 0.03: {stats} in {elapsed:.2f} s")
    assert elapsed < 10.0
    assert stats["useful_pairs"] == 616_883_040
    for walk in ("forward", "backward"):
        assert stats[f"computed_pairs_{walk}"] % (WARP * BLOCK) == 0
        assert 0.2 < stats[f"utilization_{walk}"] < 1
