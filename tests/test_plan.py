"""Neighbourhood plan: sparsity, arc tables, defaults, validation."""

import pickle
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_s2attn import GRIDS, NeighborhoodPlan
from jax_s2attn._native import kernel_limits
from jax_s2attn.plan import _build_plan

# Reference sizes of equiangular self-attention: (nlat, nlon, cutoff) -> (min, max neighbours per
# point, total arcs, psi nnz, total pairs). cutoff None = default.
SPEC_SIZES = {
    (180, 360, 0.017): (1, 360, 180, 1_934, 696_240),
    (180, 360, 0.03): (9, 720, 538, 7_340, 2_642_400),
    (180, 360, None): (5, 720, 538, 3_828, 1_378_080),
    (360, 720, 0.017): (9, 1620, 1_078, 18_368, 13_224_960),
    (360, 720, 0.03): (37, 2880, 2_508, 57_744, 41_575_680),
    (360, 720, None): (5, 1440, 1_078, 7_996, 5_757_120),
    (721, 1440, 0.017): (45, 6140, 5_035, 151_153, 217_660_320),
    (721, 1440, 0.03): (145, 10472, 9_331, 428_391, 616_883_040),
    (721, 1440, None): (5, 2880, 2_161, 16_681, 24_020_640),
}

# Small configurations covering every direction and grid: (in_shape, out_shape, grid_in, grid_out, cutoff).
CONFIGS = [
    ((13, 24), (13, 24), "equiangular", "equiangular", 0.4),
    ((13, 24), (13, 24), "legendre-gauss", "legendre-gauss", None),
    ((12, 20), (12, 20), "lobatto", "lobatto", 0.5),
    ((11, 16), (11, 16), "equiangular-trapezoidal", "equiangular-trapezoidal", None),
    ((12, 24), (6, 12), "equiangular", "equiangular", None),  # downsample pscale 2
    ((12, 24), (6, 8), "legendre-gauss", "legendre-gauss", 0.6),  # pscale 3
    ((7, 12), (5, 6), "equiangular", "lobatto", 0.7),  # odd latitudes, mixed grids
    ((12, 12), (6, 12), "equiangular", "equiangular", None),  # latitude-only
    ((6, 24), (12, 12), "equiangular", "equiangular", None),  # more latitudes, fewer longitudes
    ((6, 12), (12, 24), "equiangular", "equiangular", None),  # upsample pscale 2
    ((6, 8), (12, 24), "legendre-gauss", "legendre-gauss", 0.6),  # upsample pscale 3
    ((5, 6), (7, 12), "lobatto", "equiangular", 0.8),  # odd, mixed
    ((6, 12), (6, 24), "equiangular", "equiangular", 0.5),  # longitude-only upsample
    ((9, 16), (9, 16), "equiangular", "equiangular", 3.2),  # cutoff > pi: global
]


def _config_id(c):
    return f"{c[0]}->{c[1]}-{c[2]}-{c[3]}-{c[4]}"


def _pairs_from_csr(plan):
    """Dense [out points, in points] membership from torch-harmonics' psi layout."""
    dense = np.zeros((plan.nlat_out * plan.nlon_out, plan.nlat_in * plan.nlon_in), bool)
    rows = np.repeat(np.arange(plan.csr_offsets.size - 1), np.diff(plan.csr_offsets))
    if plan.direction == "gather":
        h_in, w_in = np.divmod(plan.csr_columns, plan.nlon_in)
        for wo in range(plan.nlon_out):
            dense[rows * plan.nlon_out + wo, h_in * plan.nlon_in + (w_in + plan.pscale * wo) % plan.nlon_in] = True
    else:
        h_out, w_out = np.divmod(plan.csr_columns, plan.nlon_out)
        for wi in range(plan.nlon_in):
            dense[h_out * plan.nlon_out + (w_out + plan.pscale * wi) % plan.nlon_out, rows * plan.nlon_in + wi] = True
    return dense


def _pairs_from_arcs(table, nlat_walk, nlon_walk):
    """Dense [walking points, other points] membership by expanding an ArcTable."""
    dense = np.zeros((nlat_walk * nlon_walk, (table.arcs[:, 0].max() + 1) * table.nlon), bool)
    for h in range(nlat_walk):
        for w in range(nlon_walk):
            pattern, position = h * table.residues + w % table.residues, w // table.residues
            dense[h * nlon_walk + w, table.expand(pattern, position)] = True
    return dense


@pytest.mark.parametrize("nlat, nlon, cutoff", list(SPEC_SIZES))
def test_spec_sizes(nlat, nlon, cutoff):
    plan = NeighborhoodPlan((nlat, nlon), (nlat, nlon), theta_cutoff=cutoff)
    lengths = plan.forward_arcs.pattern_lengths
    sizes = (int(lengths.min()), int(lengths.max()), len(plan.forward_arcs.arcs), plan.nnz, plan.num_pairs)
    assert sizes == SPEC_SIZES[(nlat, nlon, cutoff)]


@pytest.mark.parametrize(
    "in_shape, out_shape, cutoff, nnz, pairs",
    [
        ((360, 720), (180, 360), 0.017, 9_866, 3_551_760),
        ((360, 720), (180, 360), 0.03, 29_952, 10_782_720),
        ((360, 720), (180, 360), None, 13_268, 4_776_480),
        ((721, 1440), (361, 720), 0.03, 219_653, 219_653 * 720),
    ],
)
def test_spec_sizes_downsampling(in_shape, out_shape, cutoff, nnz, pairs):
    # Reference sizes of cross-resolution plans (library numbers).
    plan = NeighborhoodPlan(in_shape, out_shape, theta_cutoff=cutoff)
    assert plan.direction == "gather" and plan.nnz == nnz and plan.num_pairs == pairs


def test_upsampling_psi_is_the_downsampling_psi():
    # The 180x360 -> 360x720 psi equals the 360x720 -> 180x360 psi entry for entry.
    down = NeighborhoodPlan((360, 720), (180, 360), theta_cutoff=0.03)
    up = NeighborhoodPlan((180, 360), (360, 720), theta_cutoff=0.03)
    assert up.direction == "scatter"
    np.testing.assert_array_equal(up.csr_offsets, down.csr_offsets)
    np.testing.assert_array_equal(up.csr_columns, down.csr_columns)
    assert up.num_pairs == down.num_pairs


def test_build_time_quarter_degree():
    start = time.perf_counter()
    plan = _build_plan.__wrapped__(NeighborhoodPlan((721, 1440), (721, 1440), theta_cutoff=0.03)._key)
    elapsed = time.perf_counter() - start
    assert plan.nnz == 428_391
    assert elapsed < 5.0, f"721x1440 tc 0.03 plan took {elapsed:.2f} s"


@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_all_views_agree_with_geodesic_distance(config, dense_membership):
    in_shape, out_shape, grid_in, grid_out, cutoff = config
    plan = NeighborhoodPlan(in_shape, out_shape, grid_in, grid_out, cutoff)
    expected = dense_membership(plan)
    np.testing.assert_array_equal(_pairs_from_csr(plan), expected)
    forward = _pairs_from_arcs(plan.forward_arcs, *out_shape)
    np.testing.assert_array_equal(forward[:, : expected.shape[1]], expected)
    backward = _pairs_from_arcs(plan.backward_arcs, *in_shape)
    np.testing.assert_array_equal(backward[:, : expected.shape[0]], expected.T)
    assert plan.num_pairs == expected.sum()
    assert plan.max_neighbors == expected.sum(axis=1).max()


@pytest.mark.parametrize("config", [c for c in CONFIGS if c[0] == c[1] and c[2] == c[3]], ids=_config_id)
def test_self_attention_is_symmetric(config):
    plan = NeighborhoodPlan(*config)
    pairs = _pairs_from_csr(plan)
    np.testing.assert_array_equal(pairs, pairs.T)
    assert pairs.diagonal().all()  # every point attends to itself


@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_arc_tables_are_well_formed(config):
    plan = NeighborhoodPlan(*config)
    for table, walk_shape, other_shape in [
        (plan.forward_arcs, plan.out_shape, plan.in_shape),
        (plan.backward_arcs, plan.in_shape, plan.out_shape),
    ]:
        assert table.arcs.dtype == table.offsets.dtype == table.row_order.dtype == np.int32
        assert table.offsets[0] == 0 and np.all(np.diff(table.offsets) >= 0)
        assert table.offsets[-1] == len(table.arcs) and len(table.offsets) == walk_shape[0] * table.residues + 1
        row, lo, length = table.arcs.T
        assert np.all((0 <= row) & (row < other_shape[0]))
        assert np.all((0 <= lo) & (lo < other_shape[1]) & (1 <= length) & (length <= other_shape[1]))
        assert np.all(lo[length == other_shape[1]] == 0)  # full rings start at 0
        for p in range(len(table.offsets) - 1):  # rows strictly ascending within a pattern
            assert np.all(np.diff(row[table.offsets[p] : table.offsets[p + 1]]) > 0)
        assert sorted(table.row_order) == list(range(walk_shape[0]))
        # One step of `shift` longitudes per `residues` walking longitudes covers the other grid once.
        assert table.shift * walk_shape[1] == table.residues * other_shape[1]


def test_wrapping_arcs_and_polar_rings():
    plan = NeighborhoodPlan((31, 64), (31, 64), theta_cutoff=0.3)
    row, lo, length = plan.forward_arcs.arcs.T
    full = length == 64
    assert full.any(), "polar rows must read full rings"
    # In the canonical frame every partial arc is odd and centred on longitude 0.
    partial = ~full & (length > 1)
    assert partial.any()
    assert np.all(length[partial] % 2 == 1)
    np.testing.assert_array_equal(lo[partial], 64 - (length[partial] - 1) // 2)
    assert np.all(lo[length == 1] == 0)
    # The pole (row 0) sees the whole first ring (a pole copy attends to all pole copies).
    first = plan.forward_arcs.arcs[: plan.forward_arcs.offsets[1]]
    assert tuple(first[0]) == (0, 0, 64)


def test_row_order_is_longest_first():
    plan = NeighborhoodPlan((31, 64), (31, 64), theta_cutoff=0.3)
    for table in (plan.forward_arcs, plan.backward_arcs):
        lengths = table.pattern_lengths[table.row_order]
        assert np.all(np.diff(lengths) <= 0)
        assert min(table.row_order[0], 30 - table.row_order[0]) <= 2  # a (near-)polar row


STENCIL_CONFIGS = [
    ((17, 72), (17, 72), "equiangular", "equiangular", None),
    ((9, 4), (9, 4), "equiangular", "equiangular", None),  # rings shorter than the reach
    ((10, 40), (9, 40), "equiangular", "equiangular", 0.2),  # more key rows than query rows
    ((13, 24), (13, 24), "legendre-gauss", "legendre-gauss", None),
]


needs_native = pytest.mark.skipif(kernel_limits() is None, reason="stencil pairs need a native module (pip install .)")


@needs_native
@pytest.mark.parametrize("walk", ["forward", "backward"])
@pytest.mark.parametrize("config", CONFIGS + STENCIL_CONFIGS, ids=_config_id)
def test_stencil_pairs_fit_the_stencil_kernels(config, walk):
    """Every pair's points see only the stencil_max_other_rows (4) other rows from its first and longitudes
    within stencil_max_half (3) of their own; pairs exist only for walks of one residue and shift."""
    max_half, max_other_rows = kernel_limits().stencil_max_half, kernel_limits().stencil_max_other_rows
    plan = NeighborhoodPlan(*config)
    pairs, table = getattr(plan, f"{walk}_stencil_pairs"), getattr(plan, f"{walk}_arcs")
    walking_rows, nlon = (plan.nlat_out, plan.nlon_in) if walk == "forward" else (plan.nlat_in, plan.nlon_out)
    assert pairs.dtype == np.int32 and pairs.shape == (len(pairs), 2)
    if table.residues != 1 or table.shift != 1:
        assert pairs.size == 0
    assert np.all(pairs[:, 0] % 2 == 0) and np.all(pairs[:, 0] + 1 < walking_rows)
    reach = {d % nlon for d in range(-max_half, max_half + 1)}
    for row0, first in pairs:
        for h in (row0, row0 + 1):
            neighbours = table.expand(h)  # the point at longitude 0; every other one is the same shifted
            rows, lons = np.divmod(neighbours, nlon)
            assert np.all((first <= rows) & (rows < first + max_other_rows)), (h, rows)
            assert set(lons.tolist()) <= reach, (h, lons)
    np.testing.assert_array_equal(getattr(plan.tables, f"{walk}_stencil_pairs"), pairs)


@needs_native
def test_stencil_pairs_at_the_default_cutoff():
    # 721x1440: 604 rows (302 pairs) whose arcs are all within 3 longitudes, one band around the
    # equator (an independent count from the rows' half-widths gives the same 604).
    plan = NeighborhoodPlan((721, 1440), (721, 1440))
    pairs = plan.forward_stencil_pairs
    assert len(pairs) == 302
    assert pairs[0, 0] == 58 and pairs[-1, 0] == 660  # one band around the equator
    np.testing.assert_array_equal(plan.backward_stencil_pairs, pairs)  # a symmetric neighbourhood
    tc003 = NeighborhoodPlan((721, 1440), (721, 1440), theta_cutoff=0.03)
    assert tc003.forward_stencil_pairs.size == tc003.backward_stencil_pairs.size == 0


def test_default_cutoff():
    assert NeighborhoodPlan((10, 20), (10, 20)).theta_cutoff == pytest.approx(np.pi / 9, rel=1e-14)
    # Downsampling uses the output grid, upsampling the input grid (the coarser one).
    assert NeighborhoodPlan((19, 40), (10, 20)).theta_cutoff == pytest.approx(np.pi / 9, rel=1e-14)
    assert NeighborhoodPlan((10, 20), (19, 40)).theta_cutoff == pytest.approx(np.pi / 9, rel=1e-14)
    lg = NeighborhoodPlan((180, 360), (180, 360), "legendre-gauss", "legendre-gauss")
    assert lg.theta_cutoff == pytest.approx(0.017405, abs=1e-6)


def test_quadrature_weights():
    plan = NeighborhoodPlan((12, 24), (12, 24), "legendre-gauss", "legendre-gauss")
    assert plan.quad_weights.dtype == np.float32 and plan.quad_weights.shape == (12,)
    assert plan.quad_weights.sum() * 24 == pytest.approx(4 * np.pi, rel=1e-6)


def test_plan_is_immutable_hashable_cached_and_picklable():
    a = NeighborhoodPlan((12, 24), (6, 12), theta_cutoff=0.5)
    b = NeighborhoodPlan([12, 24], (6, 12), "equiangular", "equiangular", 0.5)
    assert a is b and hash(a) == hash(b)
    assert a != NeighborhoodPlan((12, 24), (6, 12), theta_cutoff=0.6)
    with pytest.raises(AttributeError):
        a.theta_cutoff = 1.0
    with pytest.raises(ValueError):
        a.csr_columns[0] = 7  # tables are read-only
    assert pickle.loads(pickle.dumps(a)) is a
    assert "direction='gather'" in repr(a)


def test_plan_as_static_and_as_pytree_jit_argument():
    plan = NeighborhoodPlan((12, 24), (12, 24), theta_cutoff=0.5)
    leaves = jax.tree_util.tree_leaves(plan)
    # Index tables only: a cast of every floating leaf of a state holding the plan cannot reach them.
    assert len(leaves) == 12 and all(isinstance(x, jax.Array) and x.dtype == jnp.int32 for x in leaves)

    def count_pairs(p, one):  # `one` keeps the sum from being folded into a constant
        return jnp.sum(p.tables.forward_arcs[:, 2] * one) * (p.nlon_out // p.forward_arcs.residues)

    one = jnp.int32(1)
    static = jax.jit(count_pairs, static_argnums=0)(plan, one)
    dynamic = jax.jit(count_pairs)(plan, one)
    assert int(static) == int(dynamic) == plan.num_pairs
    # As an ordinary argument, the tables are parameters of the program, not constants.
    table_constant = re.compile(r'stablehlo\.constant dense<(\[|")')  # a non-splat constant (ints print as hex)
    assert table_constant.search(jax.jit(count_pairs, static_argnums=0).lower(plan, one).as_text())
    assert not table_constant.search(jax.jit(count_pairs).lower(plan, one).as_text())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(in_shape=(12, 24), out_shape=(12, 10)), "one longitude count must be an integer multiple"),
        (dict(in_shape=(12, 24), out_shape=(12, 24), theta_cutoff=0.0), "theta_cutoff must be a finite number"),
        (dict(in_shape=(12, 24), out_shape=(12, 24), theta_cutoff=-0.1), "theta_cutoff must be a finite number"),
        (dict(in_shape=(12, 24), out_shape=(12, 24), theta_cutoff=float("nan")), "theta_cutoff must be a finite number"),
        (dict(in_shape=(1, 24), out_shape=(12, 24)), r"nlat must be at least 2, got 1 in in_shape=\(1, 24\)"),
        (dict(in_shape=(12, 24), out_shape=(12, 1)), r"nlon must be at least 2, got 1 in out_shape=\(12, 1\)"),
        (dict(in_shape=(12, 24), out_shape=(12, 24), grid_in="gauss"), "grid_in='gauss'"),
        (
            dict(in_shape=(13, 24), out_shape=(8, 12), grid_in="legendre-gauss", grid_out="legendre-gauss", theta_cutoff=1e-4),
            "no input neighbour",
        ),
    ],
)
def test_invalid_plans(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NeighborhoodPlan(**kwargs)


def test_grids_are_validated_by_name():
    for grid in GRIDS:
        NeighborhoodPlan((8, 16), (8, 16), grid, grid)
