"""The scheduled tensor-core kernels between ring grids (ring block schedules, flat fields) on an sm_90 GPU.

The op runs them for 16-bit inputs with ``Dk == Dv`` of 32, 64 or 128 from ``RING_SCHEDULED_MIN_NEIGHBORS`` neighbours
per output point (``"ffi-tiled"`` forces them). Checked against the float64 reference at the 16-bit bar (outputs
and q, k, v gradients within 1e-2; lse 1e-5) on random and smooth fields, on HEALPix, 3:2 and 2:3 longitude ratios
and between grid kinds; every result written (poisoned first); gradients the same bits run to run; the handler
refuses a ring schedule on grids of more than one row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_s2attn import RingGrid, RingPlan, neighborhood_attention
from jax_s2attn.ops import _checks, _ffi, neighborhood

pytestmark = pytest.mark.gpu

# (input grid, output grid, cutoff): self-attention with whole polar rings, 3:2 and 2:3 ratios, between kinds.
PLANS = {
    "healpix_self": lambda: RingPlan(RingGrid.healpix(8), RingGrid.healpix(8), 0.5),
    "latlon_3_to_2": lambda: RingPlan(RingGrid.latlon(37, 72), RingGrid.latlon(25, 48), 0.3),
    "latlon_2_to_3": lambda: RingPlan(RingGrid.latlon(25, 48), RingGrid.latlon(37, 72), 0.3),
    "octahedral_to_healpix": lambda: RingPlan(RingGrid.octahedral(16), RingGrid.healpix(8), 0.4),
    "healpix_to_latlon": lambda: RingPlan(RingGrid.healpix(8), RingGrid.latlon(33, 64), 0.35),
}
DTYPES = [jnp.bfloat16, jnp.float16]
CASES = [(name, 64) for name in PLANS] + [("healpix_self", 32), ("latlon_3_to_2", 128)]


@pytest.fixture(autouse=True)
def on_the_gpu():
    with jax.default_device(jax.devices("gpu")[0]):
        yield


def _fields(plan, values, heads=2, d=64, batch=2):
    return (values(batch, plan.npoints_out, heads, d), values(batch, plan.npoints_in, heads, d),
            values(batch, plan.npoints_in, heads, d))  # fmt: skip


def _smooth(plan, heads=2, d=64):
    def field(grid, phase):
        theta, phi = grid.point_colatitudes(), grid.point_longitudes()
        c = np.arange(heads * d).reshape(heads, d) + phase
        return (np.cos(theta[:, None, None] * (1 + c % 3) + 0.3 * c) * np.sin(phi[:, None, None] + 0.1 * c))[None]

    return field(plan.grid_out, 0.0), field(plan.grid_in, 1.0), field(plan.grid_in, 2.0)


def _loss(plan, implementation, cotangent):
    def loss(q, k, v):
        out = neighborhood_attention(q, k, v, plan, implementation=implementation)
        return jnp.vdot(out.astype(cotangent.dtype), cotangent)

    return loss


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _check_against_float64(plan, q, k, v, dtype, rng):
    q, k, v = (np.asarray(jnp.asarray(x, dtype), np.float64) for x in (q, k, v))  # representable
    cotangent = rng.standard_normal((*q.shape[:-1], v.shape[-1]))
    with jax.enable_x64(True):
        args = [jnp.asarray(x, jnp.float64) for x in (q, k, v)]
        out64, lse64 = neighborhood_attention(*args, plan, implementation="reference", return_residual=True)
        grads64 = jax.grad(_loss(plan, "reference", jnp.asarray(cotangent)), argnums=(0, 1, 2))(*args)
    args = [jnp.asarray(x, dtype) for x in (q, k, v)]
    out, lse = neighborhood_attention(*args, plan, implementation="ffi-tiled", return_residual=True)
    assert out.dtype == dtype and _rel(out, out64) <= 1e-2 and _rel(lse, lse64) <= 1e-5
    grads = jax.grad(_loss(plan, "ffi-tiled", jnp.asarray(cotangent, jnp.float32)), argnums=(0, 1, 2))(*args)
    for label, g, expected in zip("qkv", grads, grads64):
        assert g.dtype == dtype and _rel(g, expected) <= 1e-2, label


def test_the_op_runs_the_scheduled_kernels_between_ring_grids(exact_random):
    wide, narrow = PLANS["healpix_self"](), RingPlan(RingGrid.healpix(8), RingGrid.healpix(8), 0.15)
    assert wide.num_pairs >= neighborhood.RING_SCHEDULED_MIN_NEIGHBORS * wide.npoints_out
    assert narrow.num_pairs < neighborhood.RING_SCHEDULED_MIN_NEIGHBORS * narrow.npoints_out
    assert _checks.ring_kernel_for("ffi", "cuda", jnp.bfloat16, 64, 64) == "scheduled"
    for plan, target in ((wide, _ffi.SCHEDULED_FORWARD_TARGET), (narrow, _ffi.RING_FORWARD_TARGET)):
        q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in _fields(plan, exact_random))
        text = jax.jit(lambda q, k, v, plan=plan: neighborhood_attention(q, k, v, plan)).lower(q, k, v).as_text()
        assert target in text
        other = _ffi.RING_FORWARD_TARGET if target == _ffi.SCHEDULED_FORWARD_TARGET else _ffi.SCHEDULED_FORWARD_TARGET
        assert other not in text


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("name", "d"), CASES, ids=[f"{n}-D{d}" for n, d in CASES])
def test_matches_float64_on_random_fields(name, d, dtype, exact_random, rng):
    plan = PLANS[name]()
    _check_against_float64(plan, *_fields(plan, exact_random, d=d), dtype, rng)


@pytest.mark.parametrize("name", ["healpix_self", "latlon_3_to_2", "healpix_to_latlon"])
def test_matches_float64_on_smooth_fields(name, rng):
    plan = PLANS[name]()
    _check_against_float64(plan, *_smooth(plan), jnp.bfloat16, rng)


@pytest.mark.parametrize("name", ["healpix_self", "latlon_2_to_3", "octahedral_to_healpix"])
def test_targets_write_every_result(name, exact_random):
    plan = PLANS[name]()
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in _fields(plan, exact_random, batch=3))
    out, lse = _ffi.ffi_ring_scheduled_forward(q, k, v, plan, scale=0.3, poison_results=True)
    dout = jnp.asarray(exact_random(*q.shape), jnp.bfloat16)
    dq, delta = _ffi.ffi_ring_scheduled_dq_delta(q, k, v, dout, lse, out, jnp.zeros_like(lse), plan, scale=0.3,
                                                  poison_results=True)  # fmt: skip
    dk, dv = _ffi.ffi_ring_scheduled_dkv(q, k, v, dout, lse, delta, plan, scale=0.3, poison_results=True)
    for label, x in zip(("out", "lse", "dq", "delta", "dk", "dv"), (out, lse, dq, delta, dk, dv)):
        assert np.isfinite(np.asarray(x, np.float32)).all(), label


def test_gradients_are_the_same_bits_across_programs(exact_random):
    plan = PLANS["octahedral_to_healpix"]()
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in _fields(plan, exact_random))
    cotangent = jnp.asarray(exact_random(*q.shape), jnp.float32)
    grad = jax.grad(_loss(plan, "ffi-tiled", cotangent), argnums=(0, 1, 2))
    first = grad(q, k, v)
    second = jax.jit(lambda q, k, v: [g * 1 for g in grad(q, k, v)] + [jnp.sum(q)])(q, k, v)[:3]
    for a, b in zip(first, second):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_vmap_gives_the_batched_results(exact_random):
    """vmap broadcasts the schedule's tables with the activations (the handler reads their first copy): the mapped
    op, its gradients and a map over the query alone give the batch's bits."""
    plan = PLANS["latlon_3_to_2"]()
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in _fields(plan, exact_random, batch=3))
    attend = lambda q, k, v: neighborhood_attention(q, k, v, plan)  # noqa: E731
    np.testing.assert_array_equal(np.asarray(jax.vmap(attend)(q[:, None], k[:, None], v[:, None]))[:, 0],
                                  np.asarray(attend(q, k, v)))  # fmt: skip
    shared = jax.vmap(lambda q: attend(q, k[0], v[0]))(q)
    np.testing.assert_array_equal(np.asarray(shared[1]), np.asarray(attend(q[1], k[0], v[0])))
    cotangent = jnp.asarray(exact_random(*q.shape), jnp.float32)
    loss = lambda q, k, v, g: jnp.vdot(attend(q, k, v).astype(jnp.float32), g)  # noqa: E731
    mapped = jax.vmap(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, cotangent)
    single = jax.grad(loss, argnums=(0, 1, 2))(q[2], k[2], v[2], cotangent[2])
    for a, b in zip(mapped, single):
        assert np.asarray(a[2]).tobytes() == np.asarray(b).tobytes()


def test_a_ring_schedule_on_grids_of_several_rows_is_refused(exact_random):
    plan = PLANS["healpix_self"]()
    q, k, v = (jnp.asarray(x, jnp.bfloat16).reshape(2, 2, -1, 2, 64) for x in _fields(plan, exact_random))
    schedule, attributes = _ffi._ring_scheduled_operands(plan, "forward", 0.125)
    attributes.update(nlat_q=np.int64(2), nlon_q=np.int64(plan.npoints_out // 2), nlat_k=np.int64(2),
                      nlon_k=np.int64(plan.npoints_in // 2))  # fmt: skip
    with pytest.raises(Exception, match=r"a ring grids' schedule \(tiles of runs\) takes grids of one row"):
        out, _ = _ffi._call(_ffi.SCHEDULED_FORWARD_TARGET, (q, k, v, *schedule), [q.shape, q.shape[:-1]],
                            attributes, False, (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)))  # fmt: skip
        np.asarray(out)
