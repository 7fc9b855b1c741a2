"""The pure-JAX reference on ring grids against a dense float64 evaluation: outputs, lse and the q/k/v
gradients, in float64 and bfloat16, for HEALPix, octahedral, 3:2 lat-lon and mixed pairs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_s2attn.grids import RingGrid
from jax_s2attn.ops.ring_reference import reference_ring_attention
from jax_s2attn.ring_plan import RingPlan

CASES = {
    "healpix from latlon": (RingGrid.healpix(4), RingGrid.latlon(17, 32), 0.25),
    "octahedral from healpix": (RingGrid.octahedral(6), RingGrid.healpix(3), 0.4),
    "latlon 3:2": (RingGrid.latlon(13, 24), RingGrid.latlon(19, 36), 0.2),
    "healpix self": (RingGrid.healpix(2), RingGrid.healpix(2), 0.6),
}
SCALE = 0.3


def _dense(q, k, v, grid_out, grid_in, theta_cutoff):
    """out and lse by a dense masked softmax over every (query, key) pair (jnp, differentiable)."""

    def unit(grid):
        theta, phi = grid.point_colatitudes(), grid.point_longitudes()
        return np.stack([np.sin(theta) * np.cos(phi), np.sin(theta) * np.sin(phi), np.cos(theta)], axis=1)

    mask = np.arccos(np.clip(unit(grid_out) @ unit(grid_in).T, -1, 1)) <= (1 + 1e-3) * theta_cutoff
    logits = jnp.einsum("bohd,bihd->bhoi", q, k) * SCALE + jnp.log(grid_in.point_weights())
    logits = jnp.where(mask, logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)
    out = jnp.einsum("bhoi,bihd->bohd", jnp.exp(logits - lse[..., None]), v)
    return out, jnp.moveaxis(lse, 1, 2)


def _inputs(grid_out, grid_in, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((2, grid_out.npoints, 2, 8)), rng.standard_normal((2, grid_in.npoints, 2, 8)),
            rng.standard_normal((2, grid_in.npoints, 2, 6)))  # fmt: skip


@pytest.mark.parametrize("name", CASES)
def test_float64_outputs_and_gradients_are_the_dense_ones(name):
    grid_out, grid_in, theta_cutoff = CASES[name]
    with jax.enable_x64(True):
        q, k, v = (jnp.asarray(x) for x in _inputs(grid_out, grid_in, 0))
        plan = RingPlan(grid_in, grid_out, theta_cutoff)
        out, lse = reference_ring_attention(q, k, v, plan, SCALE, chunk_elements=4096)
        dense_out, dense_lse = _dense(q, k, v, grid_out, grid_in, theta_cutoff)
        np.testing.assert_allclose(out, dense_out, rtol=0, atol=1e-13)
        np.testing.assert_allclose(lse, dense_lse, rtol=0, atol=1e-13)
        g = jnp.asarray(np.random.default_rng(1).standard_normal(out.shape))
        loss = lambda f: lambda q, k, v: jnp.vdot(f(q, k, v)[0], g)  # noqa: E731
        ours = jax.grad(loss(lambda *a: reference_ring_attention(*a, plan, SCALE)), argnums=(0, 1, 2))(q, k, v)
        dense = jax.grad(loss(lambda *a: _dense(*a, grid_out, grid_in, theta_cutoff)), argnums=(0, 1, 2))(q, k, v)
        for name_, a, b in zip("qkv", ours, dense):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-12, err_msg=name_)


@pytest.mark.parametrize("name", ["healpix from latlon", "latlon 3:2"])
def test_bfloat16_is_within_1e_2_of_float64(name):
    grid_out, grid_in, theta_cutoff = CASES[name]
    q, k, v = _inputs(grid_out, grid_in, 2)
    with jax.enable_x64(True):
        expected, _ = _dense(*(jnp.asarray(x) for x in (q, k, v)), grid_out, grid_in, theta_cutoff)
        expected = np.asarray(expected)
    out, lse = reference_ring_attention(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)),
                                        RingPlan(grid_in, grid_out, theta_cutoff), SCALE)  # fmt: skip
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    error = np.linalg.norm(np.asarray(out, np.float64) - expected) / np.linalg.norm(expected)
    assert error <= 1e-2, error
