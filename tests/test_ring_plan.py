"""Neighbourhoods between ring grids (:func:`jax_s2attn.ring_plan.ring_arcs`) against a dense float64 evaluation
of the rule on every pair of points, for every grid kind and direction; the regular grids' neighbourhoods of
:class:`~jax_s2attn.NeighborhoodPlan` reproduced; what bad arguments get."""

import numpy as np
import pytest

from jax_s2attn import NeighborhoodPlan
from jax_s2attn.grids import RingGrid
from jax_s2attn.ring_plan import RingArcs, RingPlan, ring_arcs

CASES = {
    "healpix self": (RingGrid.healpix(4), RingGrid.healpix(4), 0.3),
    "octahedral self": (RingGrid.octahedral(8), RingGrid.octahedral(8), 0.25),
    "latlon 3:2 finer keys (poles)": (RingGrid.latlon(13, 24), RingGrid.latlon(19, 36), 0.2),
    "latlon 2:3 coarser keys (poles)": (RingGrid.latlon(19, 36), RingGrid.latlon(13, 24), 0.2),
    "healpix from latlon": (RingGrid.healpix(4), RingGrid.latlon(17, 32), 0.25),
    "latlon from healpix": (RingGrid.latlon(17, 32), RingGrid.healpix(4), 0.25),
    "octahedral from healpix": (RingGrid.octahedral(6), RingGrid.healpix(3), 0.4),
    "gaussian from octahedral, wide": (RingGrid.latlon(9, 16, "legendre-gauss"), RingGrid.octahedral(10), 0.7),
    "pole rings, one-point rings": (
        RingGrid([0.0, 0.6, np.pi], [1, 5, 1], [0.0, 0.3, 0.0], [0.1, 1.8, 0.1], "poles"),
        RingGrid.latlon(9, 10),
        0.65,
    ),
    "one ring to a grid": (RingGrid([1.2], [7], [0.2], [2.0], "one"), RingGrid.octahedral(4), 0.9),
    "own rings, offsets": (
        RingGrid([0.3, 1.1, 1.9, 2.8], [5, 9, 7, 3], [0.2, 0.0, 0.45, 1.0], [0.3, 0.7, 0.7, 0.3], "own"),
        RingGrid.healpix(2),
        0.6,
    ),
}


def _dense_distances(grid_out: RingGrid, grid_in: RingGrid) -> np.ndarray:
    """Geodesic distances of every (output, input) pair from unit vectors: an evaluation of the rule
    independent of the arcs' construction."""

    def unit(grid):
        theta, phi = grid.point_colatitudes(), grid.point_longitudes()
        return np.stack([np.sin(theta) * np.cos(phi), np.sin(theta) * np.sin(phi), np.cos(theta)], axis=1)

    return np.arccos(np.clip(unit(grid_out) @ unit(grid_in).T, -1.0, 1.0))


@pytest.mark.parametrize("name", CASES)
def test_arcs_are_the_rule_on_every_pair(name):
    grid_out, grid_in, theta_cutoff = CASES[name]
    arcs = ring_arcs(grid_in, grid_out, theta_cutoff)
    distance = _dense_distances(grid_out, grid_in)
    eff = (1 + 1e-3) * theta_cutoff
    for point in range(grid_out.npoints):
        keys = arcs.keys_of(grid_in, grid_out, point)
        assert np.unique(keys).size == keys.size, point
        member = np.zeros(grid_in.npoints, bool)
        member[keys] = True
        differ = np.flatnonzero(member != (distance[point] <= eff))
        # Two float64 evaluations may disagree only on a pair at the cutoff itself.
        assert np.all(np.abs(distance[point, differ] - eff) <= 1e-12), (point, differ)
    assert arcs.num_pairs(grid_out) == sum(arcs.keys_of(grid_in, grid_out, o).size for o in range(grid_out.npoints))
    key_ring = np.repeat(arcs.pairs[:, 1], arcs.pairs[:, 2])
    assert np.all(arcs.arcs[:, 1] <= grid_in.nlon[key_ring])


@pytest.mark.parametrize("name", CASES)
def test_the_keys_walk_is_exactly_the_queries_walk_transposed(name):
    grid_out, grid_in, theta_cutoff = CASES[name]
    queries = ring_arcs(grid_in, grid_out, theta_cutoff)
    keys = ring_arcs(grid_in, grid_out, theta_cutoff, walk="keys")
    forward = {(o, int(i)) for o in range(grid_out.npoints) for i in queries.keys_of(grid_in, grid_out, o)}
    backward = {(int(o), i) for i in range(grid_in.npoints) for o in keys.keys_of(grid_out, grid_in, i)}
    assert forward == backward and keys.num_pairs(grid_in) == len(forward)
    # The plan's key patterns walk the same pairs (each pattern's arcs at each of its positions).
    patterns = RingPlan(grid_in, grid_out, theta_cutoff).key_patterns
    walked = set()
    for b in range(grid_in.nrings):
        for j in range(int(grid_in.nlon[b])):
            pattern = patterns.ring_patterns[b] + j % patterns.period[b]
            arcs = patterns.arcs[patterns.offsets[pattern] : patterns.offsets[pattern + 1]]
            for _, first, start, length, nlon, shift in arcs:
                lon = (start + (j // patterns.period[b]) * shift + np.arange(length)) % nlon
                walked |= {(int(o), int(grid_in.ring_offsets[b] + j)) for o in first + lon}
    assert walked == forward


@pytest.mark.parametrize(
    ("in_shape", "out_shape", "theta_cutoff"),
    [((13, 24), (13, 24), 0.3), ((25, 48), (13, 24), 0.25), ((91, 180), (91, 180), None), ((13, 24), (25, 48), 0.25),
     ((19, 36), (37, 108), None)],
)
def test_regular_grids_keep_the_plans_neighbourhoods(in_shape, out_shape, theta_cutoff):
    """On two regular grids whose longitude counts divide one another, every output point sees the keys the
    plan's psi gives it (gather: the psi row of its ring, rotated; upsampling: psi is built from the keys' side,
    each key's row listing the outputs that see it), and the pair counts agree."""
    plan = NeighborhoodPlan(in_shape, out_shape, theta_cutoff=theta_cutoff)
    grid_out, grid_in = RingGrid.latlon(*out_shape), RingGrid.latlon(*in_shape)
    arcs = ring_arcs(grid_in, grid_out, plan.theta_cutoff)
    assert arcs.num_pairs(grid_out) == plan.num_pairs
    member = np.zeros((grid_out.npoints, grid_in.npoints), bool)
    nlon_in, nlon_out = in_shape[1], out_shape[1]
    for row in range(len(plan.csr_offsets) - 1):
        columns = plan.csr_columns[plan.csr_offsets[row] : plan.csr_offsets[row + 1]]
        if plan.direction == "gather":  # output (row, 0) sees input columns; (row, m) sees them moved by m pscale
            for m in range(nlon_out):
                lat, lon = np.divmod(columns, nlon_in)
                member[row * nlon_out + m, lat * nlon_in + (lon + m * plan.pscale) % nlon_in] = True
        else:  # input (row, 0) is seen by output columns; (row, m) by them moved by m pscale
            for m in range(nlon_in):
                lat, lon = np.divmod(columns, nlon_out)
                member[lat * nlon_out + (lon + m * plan.pscale) % nlon_out, row * nlon_in + m] = True
    for point in range(grid_out.npoints):
        np.testing.assert_array_equal(arcs.keys_of(grid_in, grid_out, point), np.flatnonzero(member[point]))


def test_near_tangent_rings_of_many_points_widen_their_window():
    """Rings of 300,000 points meeting at the cutoff's edge, where the analytic arc is off by more than a few
    keys: the arcs still match a dense evaluation of a few queries against every key."""
    grid_out = RingGrid([1e-4, 0.000200099999999999], [300_000] * 2, [0.0, 0.0], [1.0, 1.0], "tangent")
    grid_in = RingGrid([1e-4], [300_000], [0.0], [2.0], "ring")
    arcs = ring_arcs(grid_in, grid_out, 1e-4)
    eff = (1 + 1e-3) * 1e-4
    for point in (0, 1, 150_000, 300_000, 300_001, 450_017):
        theta_o, phi_o = grid_out.point_colatitudes()[point], grid_out.point_longitudes()[point]
        theta, phi = grid_in.point_colatitudes(), grid_in.point_longitudes()
        cos_d = np.cos(theta_o) * np.cos(theta) + np.sin(theta_o) * np.sin(theta) * np.cos(phi - phi_o)
        distance = np.arccos(np.clip(cos_d, -1, 1))
        member = np.zeros(grid_in.npoints, bool)
        member[arcs.keys_of(grid_in, grid_out, point)] = True
        differ = np.flatnonzero(member != (distance <= eff))
        assert np.all(np.abs(distance[differ] - eff) <= 1e-12), (point, differ[:5])


def test_large_grids_build_in_seconds_with_their_pair_counts():
    """721x1440 at tc 0.03: the plan's 616,883,040 pairs; HEALPix nside 256 at tc 0.055: 593 neighbours a point;
    721x1440 -> 480x960 (3:2) as FourCastNet 3's encoder."""
    big = RingGrid.latlon(721, 1440)
    assert ring_arcs(big, big, 0.03).num_pairs(big) == 616_883_040
    healpix = RingGrid.healpix(256)
    assert ring_arcs(healpix, healpix, 0.055).num_pairs(healpix) == 466_341_456
    coarse = RingGrid.latlon(480, 960)
    arcs = ring_arcs(big, coarse, 0.03)
    assert arcs.pairs[:, 2].max() == 2 and arcs.pairs[:, 3].max() == 3  # residues of a 2:3 lattice


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        (((13, 24), RingGrid.healpix(2), 0.3), TypeError, r"grid_in must be a RingGrid"),
        ((RingGrid.healpix(2), "healpix", 0.3), TypeError, r"grid_out must be a RingGrid"),
        ((RingGrid.healpix(2), RingGrid.healpix(2), 0.0), ValueError, r"theta_cutoff"),
        ((RingGrid.healpix(2), RingGrid.healpix(2), float("nan")), ValueError, r"theta_cutoff"),
        ((RingGrid.healpix(2), RingGrid.healpix(2), 0.3, "rows"), ValueError, r"walk must be 'queries' or 'keys'"),
    ],
)
def test_bad_arguments_are_refused(arguments, error, match):
    with pytest.raises(error, match=match):
        ring_arcs(*arguments)


def test_arcs_are_a_named_tuple_of_integer_tables():
    arcs = ring_arcs(RingGrid.healpix(2), RingGrid.healpix(2), 0.5)
    assert isinstance(arcs, RingArcs) and arcs.theta_cutoff == 0.5
    assert arcs.pairs.dtype == np.int64 and arcs.arcs.dtype == np.int64
    assert arcs.ring_pairs[-1] == len(arcs.pairs) and arcs.pair_offsets[-1] == len(arcs.arcs)
