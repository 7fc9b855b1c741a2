"""RingPlan: the default cutoff where it is defined, the cutoff it asks for where a point would have no
neighbour, caching, immutability, pickling and use under jit."""

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_s2attn import NeighborhoodPlan
from jax_s2attn.grids import RingGrid
from jax_s2attn.ring_plan import RingPlan


def test_default_cutoff_is_the_regular_plans():
    for in_shape, out_shape in [((19, 36), (19, 36)), ((37, 72), (19, 36)), ((19, 36), (37, 72))]:
        ring = RingPlan(RingGrid.latlon(*in_shape), RingGrid.latlon(*out_shape))
        regular = NeighborhoodPlan(in_shape, out_shape)
        assert ring.theta_cutoff == regular.theta_cutoff and ring.num_pairs == regular.num_pairs


def test_a_grid_of_one_ring_needs_a_cutoff():
    one = RingGrid.latlon(1, 8, "legendre-gauss")
    assert one.regular_shape == (1, 8)
    with pytest.raises(ValueError, match=r"theta_cutoff is needed .* two or more rings"):
        RingPlan(one, one)


def test_the_sharded_op_says_where_ring_plans_run():
    from jax_s2attn import sharded_neighborhood_attention

    plan = RingPlan(RingGrid.healpix(2), RingGrid.healpix(2), 0.6)
    x = jnp.ones((1, 48, 1, 4))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("lat", "lon"))
    with pytest.raises(TypeError, match=r"plan is a RingPlan.*runs serially through jax_s2attn.neighborhood_attention, and over a mesh through "
                       r"jax_s2attn.parallel.sharded_ring_attention"):
        sharded_neighborhood_attention(x, x, x, plan, mesh=mesh)


def test_other_grids_need_a_cutoff():
    with pytest.raises(ValueError, match=r"theta_cutoff is needed between healpix\(4\) and equiangular\(9, 16\)"):
        RingPlan(RingGrid.healpix(4), RingGrid.latlon(9, 16))
    with pytest.raises(ValueError, match=r"theta_cutoff is needed .* longitude counts divide one another"):
        RingPlan(RingGrid.latlon(9, 24), RingGrid.latlon(9, 16))


def test_a_cutoff_leaving_points_alone_names_the_one_that_does_not():
    grid_in, grid_out = RingGrid.healpix(2), RingGrid.latlon(9, 16)
    with pytest.raises(ValueError, match=r"no input neighbour on healpix\(2\).*pass theta_cutoff >= ") as error:
        RingPlan(grid_in, grid_out, 0.2)
    suggestion = float(str(error.value).rsplit(">= ", 1)[1].rstrip("."))
    plan = RingPlan(grid_in, grid_out, suggestion)  # enough, by the rounding up of the suggestion
    assert plan.patterns.lengths.min() >= 1
    with pytest.raises(ValueError, match="no input neighbour"):
        RingPlan(grid_in, grid_out, suggestion * (1 - 1e-4))


def test_plans_are_cached_immutable_hashable_and_pickle():
    plan = RingPlan(RingGrid.healpix(2), RingGrid.octahedral(3), 0.5)
    assert RingPlan(RingGrid.healpix(2), RingGrid.octahedral(3), 0.5) is plan
    assert hash(plan) == hash(pickle.loads(pickle.dumps(plan))) and pickle.loads(pickle.dumps(plan)) == plan
    with pytest.raises(AttributeError, match="immutable"):
        plan.theta_cutoff = 1.0
    with pytest.raises(ValueError, match="read-only"):
        plan.arcs.arcs[0, 0] = 3
    assert "healpix(2)" in repr(plan) and "O3" in repr(plan)


def test_a_plan_is_an_ordinary_jit_argument():
    plan = RingPlan(RingGrid.healpix(2), RingGrid.healpix(2), 0.6)
    traced = jax.jit(lambda x, p: x * p.max_neighbors)(jnp.ones(3), plan)
    np.testing.assert_array_equal(traced, np.full(3, plan.max_neighbors))
    assert jax.tree_util.tree_leaves(plan) == []


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        (((9, 16), RingGrid.healpix(2), 0.3), TypeError, r"grid_in must be a RingGrid"),
        ((RingGrid.healpix(2), "healpix", 0.3), TypeError, r"grid_out must be a RingGrid"),
        ((RingGrid.healpix(2), RingGrid.healpix(2), -1.0), ValueError, r"theta_cutoff"),
        ((RingGrid.healpix(2), RingGrid.healpix(2), "0.3"), TypeError, r"theta_cutoff"),
    ],
)
def test_bad_arguments_are_refused(arguments, error, match):
    with pytest.raises(error, match=match):
        RingPlan(*arguments)
