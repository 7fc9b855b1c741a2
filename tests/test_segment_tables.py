"""The plan's segment tables (the arcs merged per walking row, which the stencil kernels read)."""

import math
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jax_s2attn import NeighborhoodPlan
from jax_s2attn.plan import ArcTable, SegmentTable

sys.path.insert(0, str(Path(__file__).parent))
from kernel_cases import psi_pairs  # noqa: E402

FULL = 2 * math.pi  # a cutoff that takes in the whole sphere

# (in_shape, out_shape, grid_in, grid_out, cutoff): every direction, grid and cutoff kind, odd
# latitude counts, and longitude counts below, between and above multiples of 64.
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


def _walks(plan):
    """``(segment table, walking shape, other shape, expected (walk, other) pairs)`` of both walks."""
    query, key = psi_pairs(plan)
    return [
        (plan.forward_segments, plan.out_shape, plan.in_shape, (query, key)),
        (plan.backward_segments, plan.in_shape, plan.out_shape, (key, query)),
    ]


def _segment_codes(table: SegmentTable, walk_shape, other_shape) -> np.ndarray:
    """``walk * (other points) + other`` of every pair ``table`` lists, sorted (duplicates kept): point ``(h, w)``
    reads ``len_r`` longitudes from ``lo_r + S*(w // R)`` of each of its row's segments, ``r = w % R``."""
    (nlat, nlon), r = walk_shape, table.residues
    w = np.arange(nlon)
    codes = [np.zeros(0, np.int64)]
    for h in range(nlat):
        for segment in table.segments[table.offsets[h] : table.offsets[h + 1]].astype(np.int64):
            start = segment[1 : 1 + r][w % r] + table.shift * (w // r)
            length = segment[1 + r :][w % r]
            j = np.arange(length.max(initial=0))
            keep = j[None, :] < length[:, None]
            other = segment[0] * table.nlon + (start[:, None] + j[None, :]) % table.nlon
            walk = np.broadcast_to((h * nlon + w)[:, None], keep.shape)
            codes.append(walk[keep] * math.prod(other_shape) + other[keep])
    return np.sort(np.concatenate(codes))


@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_segments_cover_every_pair_exactly_once(config):
    plan = NeighborhoodPlan(*config)
    for table, walk_shape, other_shape, (walk, other) in _walks(plan):
        expected = np.sort(walk.astype(np.int64) * math.prod(other_shape) + other)
        assert expected.size == plan.num_pairs and np.all(np.diff(expected) > 0)
        np.testing.assert_array_equal(_segment_codes(table, walk_shape, other_shape), expected)


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


def test_segments_of_two_residues_sit_side_by_side():
    # R = 2, S = 1: walking longitude w (200 of them) reads other longitudes q (100) with
    # |w - 2q| <= 2: even w = 2p reads q = p-1..p+1, odd w = 2p+1 reads q = p, p+1. The arc
    # table stores them wrapped, (lo, len) = (99, 3) and (0, 2); the segment unwraps the odd
    # residue to lo = 100 so that both sit side by side (stored wrapped, the odd residue would
    # start at p, and a tile's union of arcs would span the whole ring).
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
    w, q = np.meshgrid(np.arange(200), np.arange(100), indexing="ij")
    reads = np.isin((w - 2 * q) % 200, [0, 1, 2, 198, 199])
    np.testing.assert_array_equal(_segment_codes(table, (1, 200), (1, 100)), np.sort(w[reads] * 100 + q[reads]))
