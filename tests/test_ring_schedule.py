"""Ring block schedules (jax_s2attn.ring_schedule): expanded by the kernels' contract, they hold exactly the
plan's pairs, once each, for both walks, every tile shape and grids of every kind."""

import sys
from pathlib import Path

import numpy as np
import pytest

from jax_s2attn.grids import RingGrid
from jax_s2attn.ring_plan import RingPlan
from jax_s2attn.ring_schedule import TILE_RINGS, ring_block_schedule
from jax_s2attn.schedule import FULL, RING

sys.path.insert(0, str(Path(__file__).parent))
from kernel_cases import expand_runs_schedule  # noqa: E402

PLANS = {
    "healpix-self": lambda: RingPlan(RingGrid.healpix(4), RingGrid.healpix(4), 0.35),
    "healpix-8-wide": lambda: RingPlan(RingGrid.healpix(8), RingGrid.healpix(8), 0.9),  # whole polar rings
    "latlon-3:2": lambda: RingPlan(RingGrid.latlon(19, 36), RingGrid.latlon(13, 24), 0.3),
    "latlon-2:3": lambda: RingPlan(RingGrid.latlon(13, 24), RingGrid.latlon(19, 36), 0.3),
    "octahedral-healpix": lambda: RingPlan(RingGrid.octahedral(8), RingGrid.healpix(4), 0.3),
    "latlon-healpix": lambda: RingPlan(RingGrid.latlon(17, 64), RingGrid.healpix(8), 0.4),
    "latlon-polar": lambda: RingPlan(RingGrid.latlon(17, 64), RingGrid.latlon(17, 64), 0.4),  # rings of 64 > chunk
}


def dense_pairs(plan: RingPlan) -> np.ndarray:
    """``[output point, input point]`` counts of the plan's pairs, from its ring-pair arcs (``RingArcs.keys_of``,
    not the patterns the schedule is built from)."""
    pairs = np.zeros((plan.npoints_out, plan.npoints_in), np.int32)
    for point in range(plan.npoints_out):
        pairs[point, plan.arcs.keys_of(plan.grid_in, plan.grid_out, point)] += 1
    return pairs


@pytest.fixture(scope="module", params=sorted(PLANS))
def plan_and_pairs(request):
    plan = PLANS[request.param]()
    return plan, dense_pairs(plan)


@pytest.mark.parametrize("tile_rings", [*TILE_RINGS, 1, None])
@pytest.mark.parametrize("walk", ["forward", "backward"])
def test_schedule_holds_every_pair_once(plan_and_pairs, walk, tile_rings):
    plan, pairs = plan_and_pairs
    schedule = ring_block_schedule(plan, walk, tile_rings=tile_rings)
    expected = pairs if walk == "forward" else pairs.T
    np.testing.assert_array_equal(expand_runs_schedule(schedule), expected)


@pytest.mark.parametrize("walk", ["forward", "backward"])
def test_tiles_hold_every_walking_point_once_in_runs_of_one_ring(plan_and_pairs, walk):
    plan, _ = plan_and_pairs
    schedule = ring_block_schedule(plan, walk)
    walking = plan.grid_out if walk == "forward" else plan.grid_in
    runs = schedule.tiles.reshape(-1, 2)
    runs = runs[runs[:, 1] > 0]
    assert (runs[:, 1] <= 8).all()
    points = np.concatenate([first + np.arange(count) for first, count in runs])
    np.testing.assert_array_equal(np.sort(points), np.arange(walking.npoints))
    ring = np.searchsorted(walking.ring_offsets, runs[:, 0], side="right") - 1
    assert (runs[:, 0] + runs[:, 1] <= walking.ring_offsets[ring + 1]).all(), "a run crosses its ring's end"
    chunks = np.diff(schedule.tile_offsets)
    assert (np.diff(chunks[chunks > 0]) <= 0).all(), "tiles with most chunks first, empty tiles last"


def test_schedules_use_window_ring_and_full_chunks():
    """The cases above reach every kind of chunk: window and RING stagings, FULL chunks (window mode only: a
    RING staging has an arc short of its ring)."""
    flags = np.concatenate([ring_block_schedule(PLANS[name](), walk).chunks[:, 4]
                            for name in ("healpix-8-wide", "latlon-polar") for walk in ("forward", "backward")])  # fmt: skip
    full, ring = (flags & FULL) > 0, (flags & RING) > 0
    assert ring.any() and (~ring).any()
    assert (full & ~ring).any() and not (full & ring).any()


def test_the_default_tile_shape_has_fewest_chunks():
    plan = PLANS["healpix-8-wide"]()
    chunks = [len(ring_block_schedule(plan, "forward", tile_rings=rings).chunks) for rings in TILE_RINGS]
    assert len(ring_block_schedule(plan, "forward").chunks) == min(chunks)


def test_schedules_are_cached_read_only():
    plan = PLANS["healpix-self"]()
    schedule = ring_block_schedule(plan, "forward")
    assert ring_block_schedule(plan, "forward") is schedule
    with pytest.raises(ValueError):
        schedule.chunks[0, 0] = 1


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        (dict(walk="keys"), ValueError, r"walk must be 'forward' or 'backward'"),
        (dict(tile_rings=3), ValueError, r"tile_rings must divide runs"),
        (dict(runs=3, run_points=8), ValueError, r"multiple of 16"),
        (dict(chunk_cols=0), ValueError, r"chunk_cols must be at least 1"),
        (dict(runs=8.0), TypeError, r"runs must be an integer"),
    ],
)
def test_bad_arguments(arguments, error, match):
    arguments = {"walk": "forward", **arguments}
    with pytest.raises(error, match=match):
        ring_block_schedule(PLANS["healpix-self"](), **arguments)


def test_needs_a_ring_plan():
    from jax_s2attn import NeighborhoodPlan

    with pytest.raises(TypeError, match="plan must be a RingPlan"):
        ring_block_schedule(NeighborhoodPlan((8, 16), (8, 16)), "forward")
