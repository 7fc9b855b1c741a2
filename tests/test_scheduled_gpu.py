"""The scheduled tensor-core kernels (wgmma on the plan's block schedules) on an sm_90 GPU.

``implementation="ffi"`` runs them for 16-bit inputs with ``Dk == Dv`` of 32, 64 or 128 on whole grids (and
``"ffi-tiled"``, the tensor-core path, forces them); the op is checked against float64 oracles at the 16-bit bar
(relative error <= 1e-2 for outputs and q, k, v gradients; lse float32-exact, 1e-5), on random and smooth fields,
in every direction, on three grids, with odd sizes, longitude counts that are not multiples of the tile, polar
whole rings, the whole sphere, several heads and a batch, and against the arc kernels at 91x180. The targets'
results, poisoned with NaN first, are all written; their 16-bit results are the float32 ones rounded; gradients
are the same bits run to run, on every GPU, and under vmap (stencil rows included); a NaN reaches exactly the rows
that see it. On the windows of sharded layouts (local blocks with padding, halo-extended key rows, the window's
schedule picked by a traced index) every partial matches the arc kernels' partial of the same window, and the
sharded op on one GPU runs them.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_s2attn
from jax_s2attn import NeighborhoodPlan
from jax_s2attn.ops import _checks, _ffi, local, neighborhood
from jax_s2attn.parallel import shard_layout, sharded_neighborhood_attention
from jax_s2attn.parallel.layout import window_schedules

sys.path.insert(0, str(Path(__file__).parent))
from test_nbhd_ffi import _Block  # noqa: E402
from test_nbhd_grad import _vjp  # noqa: E402  ((out, lse, dq, dk, dv) of the op)
from kernel_cases import (  # noqa: E402
    FORMED_DELTA_TOLERANCE,
    check_nan_poisoning,
    check_stencil_formed_delta,
    smooth_field,
    stencil_rows_of,
)

pytestmark = pytest.mark.gpu

EQ, LG, LOB = "equiangular", "legendre-gauss", "lobatto"
DTYPES = [jnp.bfloat16, jnp.float16]
NAMES = ("out", "lse", "dq", "dk", "dv")

# (in_shape, out_shape, grid_in, grid_out, theta_cutoff), heads; batch 2.
CASES = [
    (((17, 36), (17, 36), EQ, EQ, None), 4),  # self, odd nlat, nlon not a multiple of 16
    (((33, 72), (33, 72), LG, LG, 0.25), 1),
    (((17, 36), (17, 36), LOB, LOB, 1.2), 2),  # polar rows: many whole rings
    (((65, 100), (65, 100), EQ, EQ, 0.1), 1),
    (((66, 144), (33, 72), LG, LG, 0.2), 2),  # down, pscale 2
    (((36, 72), (12, 24), EQ, EQ, 0.4), 1),  # down, pscale 3
    (((17, 36), (33, 72), EQ, EQ, None), 2),  # up, pscale 2
    (((33, 50), (65, 100), LOB, LOB, 0.15), 1),  # up, pscale 2, odd
    (((150, 8), (150, 8), EQ, EQ, 3.0), 1),  # the whole sphere: every tile walks 150 key rows' chunks
]


# Every case at head dim 64; at 32 (64-byte rows) and 128 (two 64-element blocks a row) self, polar rings, down, up.
HEAD_DIM_CASES = [(case, 64) for case in CASES] + [(CASES[i], d) for d in (32, 128) for i in (0, 2, 4, 6)]


def _case_id(case):
    (in_shape, out_shape, grid_in, _, cutoff), heads = case
    return f"{in_shape}->{out_shape}-{grid_in}-{cutoff}-H{heads}"


def _head_dim_case_id(case_and_head_dim):
    case, head_dim = case_and_head_dim
    return f"{_case_id(case)}-D{head_dim}"


@pytest.fixture(autouse=True)
def on_the_gpu():
    with jax.default_device(jax.devices("gpu")[0]):
        yield


def _rounded(x, dtype):
    """``x`` rounded to ``dtype`` and back to float64: the values both sides compute with."""
    return np.asarray(jnp.asarray(x, dtype).astype(jnp.float64))


@functools.cache
def _compiled_vjp(plan, implementation):
    return jax.jit(lambda primals, cotangents: _vjp(plan, implementation, primals, cotangents))


def _oracle(plan, primals, cotangents, dense_attention):
    """Float64 ``(out, lse, dq, dk, dv)`` of the dense masked softmax."""
    scale = 1.0 / np.sqrt(primals[0].shape[-1])
    (out, lse), pullback = jax.vjp(lambda q, k, v: dense_attention(q, k, v, plan, scale), *map(jnp.asarray, primals))
    return (out, lse, *pullback(tuple(map(jnp.asarray, cotangents))))


def _check(got, want, rel_error, dtype):
    """``(out, lse, dq, dk, dv)`` of the op in ``dtype`` (lse float32) within the 16-bit bar of ``want``."""
    for name, g, w in zip(NAMES, got, want):
        assert g.dtype == (jnp.float32 if name == "lse" else dtype), name
        assert rel_error(g, w) <= (1e-5 if name == "lse" else 1e-2), (name, rel_error(g, w))


def test_the_op_runs_the_scheduled_kernels_here():
    """On an sm_90 GPU with an sm_90a build (the H200 this suite runs on), "ffi" picks them."""
    for head_dim in (32, 64, 128):
        assert _ffi.scheduled_unavailable_reason("cuda", jnp.bfloat16, head_dim, head_dim) is None
        assert _checks.kernel_for("ffi", "cuda", jnp.bfloat16, head_dim, head_dim) == "scheduled"
    assert _checks.kernel_for("ffi", "cuda", jnp.bfloat16, 16, 16) == "arc"


@pytest.mark.parametrize("case_and_head_dim", HEAD_DIM_CASES, ids=_head_dim_case_id)
def test_matches_float64_oracle(case_and_head_dim, exact_random, dense_attention, rel_error):
    (geometry, heads), d = case_and_head_dim
    plan = NeighborhoodPlan(*geometry)
    q = exact_random(2, *plan.out_shape, heads, d)
    k, v = (exact_random(2, *plan.in_shape, heads, d) for _ in range(2))
    cotangents = (exact_random(2, *plan.out_shape, heads, d), exact_random(2, *plan.out_shape, heads))
    want = _oracle(plan, (q, k, v), cotangents, dense_attention)
    for dtype in DTYPES:
        as_dtype = lambda xs: tuple(jnp.asarray(x, dtype) for x in xs)  # noqa: E731 (exact: see exact_random)
        got = _compiled_vjp(plan, "ffi")(as_dtype((q, k, v)), as_dtype(cotangents))
        _check(got, want, rel_error, dtype)


# (in_shape, out_shape, grid, theta_cutoff) of the smooth-field checks: every direction.
SMOOTH_CASES = [
    ((33, 72), (33, 72), EQ, 0.15),
    ((66, 144), (33, 72), LG, 0.15),  # down, pscale 2
    ((33, 72), (65, 144), EQ, 0.15),  # up, pscale 2, odd nlat
]


@pytest.mark.parametrize(("geometry", "d"), [(g, 64) for g in SMOOTH_CASES] + [(SMOOTH_CASES[0], d) for d in (32, 128)],
                         ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_smooth_values_keep_gradients_accurate(dtype, geometry, d, rng, dense_attention, rel_error):
    """Values smooth in position (+1 % noise): dP - delta nearly cancels, and P multiplied once keeps dq and dk
    within the bar because out is divided by the row sums of the rounded P and kept in float32 for delta."""
    in_shape, out_shape, grid, cutoff = geometry
    plan = NeighborhoodPlan(in_shape, out_shape, grid_in=grid, grid_out=grid, theta_cutoff=cutoff)
    v = smooth_field(*in_shape, d, grid)[None, :, :, None, :] + 0.01 * rng.standard_normal((2, *in_shape, 1, d))
    q, dout = (rng.standard_normal((2, *out_shape, 1, d)) for _ in range(2))
    k = rng.standard_normal((2, *in_shape, 1, d))
    primals = tuple(_rounded(x, dtype) for x in (q, k, v))
    cotangents = (_rounded(dout, dtype), np.zeros((2, *out_shape, 1)))
    want = _oracle(plan, primals, cotangents, dense_attention)
    got = _compiled_vjp(plan, "ffi")(
        tuple(jnp.asarray(x, dtype) for x in primals), (jnp.asarray(cotangents[0], dtype), cotangents[1])
    )
    _check(got, want, rel_error, dtype)


def _run_targets(plan, q, k, v, dout, result_dtype, **kwargs) -> list[np.ndarray]:
    """``(out, lse, dq, dk, dv)`` of the three scheduled targets, results poisoned with NaN first, of
    ``result_dtype`` (lse float32); the backward from this forward's lse and the delta target's delta of its float32
    out (the op forms the same delta in its dq: test_the_dq_that_forms_delta_*). ``kwargs``: the targets' ``scale``
    and ``stencil``."""
    kwargs["poison_results"] = True
    out, lse = _ffi.ffi_scheduled_forward(q, k, v, plan, out_dtype=result_dtype, **kwargs)
    out32, _ = _ffi.ffi_scheduled_forward(q, k, v, plan, **kwargs)
    delta = _ffi.ffi_delta(dout, out32)
    dq = _ffi.ffi_scheduled_dq(q, k, v, dout, lse, delta, plan, gradient_dtype=result_dtype, **kwargs)
    dk, dv = _ffi.ffi_scheduled_dkv(q, k, v, dout, lse, delta, plan, gradient_dtype=result_dtype, **kwargs)
    return [np.asarray(x) for x in (out, lse, dq, dk, dv)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case_and_head_dim", [(CASES[0], 64), (CASES[4], 64), (CASES[6], 64), (CASES[6], 32),
                                               (CASES[6], 128)],
                         ids=_head_dim_case_id)
def test_targets_write_every_result(case_and_head_dim, dtype, exact_random):
    """Every result of the three targets, poisoned with NaN first, is written; results in the activations' dtype
    are the float32 ones rounded, bit for bit; and a second call gives the same bits."""
    (geometry, heads), d = case_and_head_dim
    plan = NeighborhoodPlan(*geometry)
    q, dout = (jnp.asarray(exact_random(2, *plan.out_shape, heads, d), dtype) for _ in range(2))
    k, v = (jnp.asarray(exact_random(2, *plan.in_shape, heads, d), dtype) for _ in range(2))
    run = functools.partial(_run_targets, plan, q, k, v, dout, scale=0.125)
    wide, narrow, again = run(jnp.float32), run(dtype), run(jnp.float32)
    for name, w, n, a in zip(("out", "lse", "dq", "dk", "dv"), wide, narrow, again, strict=True):
        assert not np.isnan(w).any() and not np.isnan(n).any(), f"{name}: unwritten elements"
        assert w.tobytes() == a.tobytes(), f"{name}: not the same bits run to run"
        expected = w if name == "lse" else np.asarray(jnp.asarray(w).astype(dtype))
        assert n.tobytes() == expected.tobytes(), f"{name}: not the float32 result rounded"


def _assert_formed_delta(delta, dout, out, dlse) -> None:
    """delta = sum(dout * out, -1) - dlse of every point within FORMED_DELTA_TOLERANCE of float64."""
    terms = np.asarray(dout, np.float64) * np.asarray(out, np.float64)
    excess = np.abs(delta - (terms.sum(-1) - np.asarray(dlse))) - FORMED_DELTA_TOLERANCE * (
        np.abs(terms).sum(-1) + np.abs(np.asarray(dlse)))  # fmt: skip
    assert (excess <= 0).all(), f"delta: error exceeds its bound by up to {excess.max():.2e}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case_and_head_dim", [(CASES[0], 64), (CASES[4], 64), (CASES[6], 64), (CASES[6], 128)],
                         ids=_head_dim_case_id)  # fmt: skip
def test_the_dq_that_forms_delta_matches_the_dq_given_delta(case_and_head_dim, dtype, exact_random):
    """The scheduled dq that forms delta from the float32 out and dlse: both results written (poisoned with NaN
    first), delta within FORMED_DELTA_TOLERANCE of float64, dq the bits of the scheduled dq given that delta."""
    (geometry, heads), d = case_and_head_dim
    plan = NeighborhoodPlan(*geometry)
    q, dout = (jnp.asarray(exact_random(2, *plan.out_shape, heads, d), dtype) for _ in range(2))
    k, v = (jnp.asarray(exact_random(2, *plan.in_shape, heads, d), dtype) for _ in range(2))
    dlse = jnp.asarray(exact_random(2, *plan.out_shape, heads), jnp.float32)
    out, lse = _ffi.ffi_scheduled_forward(q, k, v, plan, scale=0.125)
    dq, delta = _ffi.ffi_scheduled_dq_delta(q, k, v, dout, lse, out, dlse, plan, scale=0.125, poison_results=True)
    given = _ffi.ffi_scheduled_dq(q, k, v, dout, lse, delta, plan, scale=0.125, poison_results=True)
    dq, delta, given = (np.asarray(x) for x in (dq, delta, given))
    assert not np.isnan(dq).any() and not np.isnan(delta).any(), "unwritten elements"
    _assert_formed_delta(delta, dout, out, dlse)
    assert dq.tobytes() == given.tobytes(), "dq: not the bits of the dq given its delta"


@pytest.mark.parametrize("name", ["out", "dlse", "delta"])
def test_the_dq_that_forms_delta_refuses_misshapen_operands(exact_random, name):
    """The handler checks the forward's out and dlse and the delta result against the query grid (the Python
    wrapper checks them first, so a raw call reaches these): a wrong shape fails with INVALID_ARGUMENT naming it."""
    plan = NeighborhoodPlan((17, 36), (17, 36))
    q, k, v, dout = (jnp.asarray(exact_random(1, 17, 36, 1, 64), jnp.bfloat16) for _ in range(4))
    out, lse = _ffi.ffi_scheduled_forward(q, k, v, plan, scale=0.125)
    dlse, delta_shape = jnp.zeros_like(lse), lse.shape
    if name == "out":
        out = out[:, :, :-1]
    elif name == "dlse":
        dlse = dlse[:, :-1]
    else:
        delta_shape = (*lse.shape, 1)
    schedule, attributes = _ffi._scheduled_operands(plan, "forward", 0.125, q, k)
    with pytest.raises(Exception, match=f"{name} has the wrong shape"):
        dq, _ = _ffi._call(_ffi.SCHEDULED_BACKWARD_DQ_DELTA_TARGET, (q, k, v, dout, lse, out, dlse, *schedule),
                           [q.shape, delta_shape], attributes, False,
                           (jnp.dtype(jnp.float32), jnp.dtype(jnp.float32)))  # fmt: skip
        np.asarray(dq)


def test_vmap_gives_the_batched_results(exact_random):
    """vmap broadcasts the schedule's tables with the activations (the handler reads their first copy)."""
    geometry, heads = CASES[4]
    plan = NeighborhoodPlan(*geometry)
    q = jnp.asarray(exact_random(3, *plan.out_shape, heads, 64), jnp.bfloat16)
    k, v = (jnp.asarray(exact_random(3, *plan.in_shape, heads, 64), jnp.bfloat16) for _ in range(2))
    attend = lambda q, k, v: jax_s2attn.neighborhood_attention(q, k, v, plan, implementation="ffi")  # noqa: E731
    np.testing.assert_array_equal(np.asarray(jax.vmap(attend)(q, k, v)), np.asarray(attend(q, k, v)))
    shared = jax.vmap(lambda q: attend(q, k[0], v[0]))(q)
    np.testing.assert_array_equal(np.asarray(shared[1]), np.asarray(attend(q[1], k[0], v[0])))


@pytest.mark.parametrize("d", [32, 64, 128])
def test_gradients_are_the_same_bits_run_to_run(exact_random, d):
    geometry, heads = CASES[0]
    plan = NeighborhoodPlan(*geometry)
    q = jnp.asarray(exact_random(2, *plan.out_shape, heads, d), jnp.bfloat16)
    k, v = (jnp.asarray(exact_random(2, *plan.in_shape, heads, d), jnp.bfloat16) for _ in range(2))
    cotangents = (jnp.asarray(exact_random(2, *plan.out_shape, heads, d), jnp.bfloat16),
                  jnp.asarray(exact_random(2, *plan.out_shape, heads), jnp.float32))  # fmt: skip
    first, second = (_compiled_vjp(plan, "ffi")((q, k, v), cotangents) for _ in range(2))
    for a, b in zip(first, second, strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize("cutoff", [0.1, None])  # None: the default cutoff
def test_gradients_of_a_larger_grid_are_the_same_bits_run_to_run(cutoff, exact_random):
    """Two runs of one compiled program at 65x100 (the second on fresh copies of the inputs) give the same bits:
    no atomics."""
    plan = NeighborhoodPlan((65, 100), (65, 100), theta_cutoff=cutoff)
    primals = tuple(jnp.asarray(exact_random(2, 65, 100, 2, 64), jnp.bfloat16) for _ in range(3))
    cotangents = (jnp.asarray(exact_random(2, 65, 100, 2, 64), jnp.bfloat16), jnp.zeros((2, 65, 100, 2)))
    program = _compiled_vjp(plan, "ffi-tiled")
    first = program(primals, cotangents)
    second = program(tuple(jnp.array(x, copy=True) for x in primals), cotangents)
    for name, a, b in zip(NAMES, first, second, strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8), err_msg=name)


@pytest.mark.parametrize("cutoff", [None, 0.1])
def test_agrees_with_the_arc_kernels_at_91x180(cutoff, exact_random, rel_error):
    """The tensor-core path ("ffi-tiled") against the arc kernels ("ffi-arc") on the same bfloat16 inputs: out,
    lse and the gradients within the 16-bit bar."""
    plan = NeighborhoodPlan((91, 180), (91, 180), theta_cutoff=cutoff)
    dtype = jnp.bfloat16
    primals = tuple(jnp.asarray(exact_random(1, 91, 180, 2, 64), dtype) for _ in range(3))
    cotangents = (jnp.asarray(exact_random(1, 91, 180, 2, 64), dtype), jnp.asarray(exact_random(1, 91, 180, 2)))
    scheduled = _compiled_vjp(plan, "ffi-tiled")(primals, cotangents)
    arc = _compiled_vjp(plan, "ffi-arc")(primals, cotangents)
    _check(scheduled, arc, rel_error, dtype)


@pytest.mark.parametrize("operand", ["q", "k"])
@pytest.mark.parametrize("kernel", ["scheduled", "arc"])
def test_nan_poisons_exactly_the_rows_that_see_it(kernel, operand, exact_random):
    """A NaN in one query (one key) makes that query's (every query that has the key as a
    neighbour's) out and lse NaN and leaves the others finite: a NaN sum is never read as
    'no neighbour' (0, -inf)."""
    plan = NeighborhoodPlan((33, 72), (33, 72), theta_cutoff=0.25)
    q, k, v = (exact_random(1, 33, 72, 1, 64) for _ in range(3))
    row, lon = 16, 3
    (q if operand == "q" else k)[0, row, lon, 0, 5] = np.nan
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    if kernel == "scheduled":
        out, lse = _ffi.ffi_scheduled_forward(q, k, v, plan, scale=0.125)
    else:
        out, lse = _ffi.ffi_forward(q, k, v, plan, local.full_window(plan), plan.tables.forward_row_order,
                                    scale=0.125)  # fmt: skip
    check_nan_poisoning(plan, out, lse, row * 72 + lon, operand)


def test_the_op_lowers_to_the_scheduled_targets_for_16_bit_inputs_and_to_the_arc_targets_for_float32(exact_random):
    """On CUDA, implementation="ffi" lowers serially to the scheduled targets (forward, the dq that forms delta,
    dk/dv) for 16-bit heads of 64, and serially and sharded to the arc targets alone for float32."""
    plan = NeighborhoodPlan((17, 36), (17, 36))
    mesh = jax.make_mesh((1, 1), ("lat", "lon"), devices=jax.devices("gpu")[:1])
    primals = tuple(jnp.asarray(exact_random(2, 17, 36, 2, 64), jnp.bfloat16) for _ in range(3))

    def value_and_grads(attention):
        def run(primals):
            out, pullback = jax.vjp(attention, *primals)
            return out, *pullback(jnp.ones_like(out))

        return jax.jit(run)

    def calls(text, targets):
        return {t for t in targets if f"@{t}(" in text}

    serial = value_and_grads(lambda q, k, v: jax_s2attn.neighborhood_attention(q, k, v, plan, implementation="ffi"))
    sharded = value_and_grads(lambda q, k, v: sharded_neighborhood_attention(q, k, v, plan, mesh=mesh,
                                                                             implementation="ffi"))  # fmt: skip
    text = serial.lower(primals).as_text()
    want = {_ffi.SCHEDULED_FORWARD_TARGET, _ffi.SCHEDULED_BACKWARD_DQ_DELTA_TARGET, _ffi.SCHEDULED_BACKWARD_DKV_TARGET}
    assert calls(text, _ffi.SCHEDULED_TARGETS) == want and not calls(text, _ffi.TARGETS)
    wide = tuple(x.astype(jnp.float32) for x in primals)
    for program in (serial, sharded):
        text = program.lower(wide).as_text()
        assert calls(text, _ffi.TARGETS) == set(_ffi.TARGETS)
        assert not calls(text, (*_ffi.SCHEDULED_TARGETS, *_ffi.STENCIL_TARGETS))


def test_the_op_with_stencil_rows_under_vmap_gives_the_batched_bits(exact_random):
    """At 360x720 (one head) the op leaves the stencil rows to the stencil targets in both walks; vmapped over the
    batch (the schedules and the stencil pairs then come as copies) its out, lse and gradients are the bits of the
    batched op's."""
    plan = NeighborhoodPlan((360, 720), (360, 720))
    primals = tuple(jnp.asarray(exact_random(2, 360, 720, 1, 32), jnp.bfloat16) for _ in range(3))
    assert all(neighborhood.uses_stencil_rows(plan, primals[0], "scheduled", walk) for walk in ("forward", "backward"))
    dout = jnp.asarray(exact_random(2, 360, 720, 1, 32), jnp.bfloat16)

    def attend(q, k, v, dout):
        (out, lse), pullback = jax.vjp(
            lambda q, k, v: jax_s2attn.neighborhood_attention(q, k, v, plan, implementation="ffi-tiled",
                                                              return_residual=True), q, k, v)  # fmt: skip
        return out, lse, *pullback((dout, jnp.zeros_like(lse)))

    batched = jax.jit(attend)(*primals, dout)
    vmapped = jax.jit(jax.vmap(attend))(*primals, dout)
    for name, a, b in zip(NAMES, batched, vmapped, strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8), err_msg=name)


@pytest.mark.parametrize("implementation", ["ffi-tiled", "ffi-arc"])
def test_every_gpu_gives_the_same_bits(implementation, exact_random):
    """Each visible GPU runs the kernels with its own stream's device current (gpu/stream_device.h): the
    results and gradients on every device are the bits of the first, also when the calling thread's current
    device is another one (every device but the first). One GPU checks the first device alone."""
    plan = NeighborhoodPlan((23, 46), (23, 46), theta_cutoff=0.3)
    shape = (1, 23, 46, 2, 64)
    dtype = jnp.bfloat16 if implementation == "ffi-tiled" else jnp.float32
    q, k, v = (jnp.asarray(exact_random(*shape), dtype) for _ in range(3))

    def run(device):
        args = [jax.device_put(x, device) for x in (q, k, v)]
        out, vjp = jax.vjp(lambda *a: jax_s2attn.neighborhood_attention(*a, plan, implementation=implementation),
                           *args)  # fmt: skip
        assert next(iter(out.devices())) == device
        return [np.asarray(x.astype(jnp.float32)) for x in (out, *vjp(jnp.ones_like(out)))]

    devices = jax.devices("gpu")
    first = run(devices[0])
    for device in devices[1:]:
        for a, b in zip(run(device), first):
            np.testing.assert_array_equal(a, b)


# (plan geometry, lat parts, lon parts): a self-attention with padding longitudes (36 over 5: blocks of 8, the last of
# 4), a downsampling over 3 x 4 (halo rows), an upsampling over 2 x 3.
LAYOUT_CASES = [
    (((17, 36), (17, 36), EQ, EQ, None), 2, 5),
    (((66, 144), (33, 72), LG, LG, 0.2), 3, 4),
    (((17, 36), (33, 72), EQ, EQ, None), 2, 3),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("geometry", "lat_parts", "lon_parts"), LAYOUT_CASES, ids=str)
def test_windows_of_a_layout_match_the_arc_kernels(geometry, lat_parts, lon_parts, dtype, rng, exact_random,
                                                   rel_error):  # fmt: skip
    """Every window of a sharded layout (each shard with each key chunk; local blocks padded with noise, key rows
    halo-extended) on the scheduled kernels, the window's schedules picked by a traced index: every result
    (poisoned with NaN first) is written, padding holds zeros (-inf for lse), and out, lse, dq, dk and dv match
    the arc kernels' partials of the same window (lse to 1e-5; the rest to 1e-2, out included: the scheduled
    forward multiplies P rounded once to the activations' dtype)."""
    plan = NeighborhoodPlan(*geometry)
    layout = shard_layout(plan, lat_parts, lon_parts)
    forward, backward = window_schedules(plan, layout, *_ffi.kernel_limits().scheduled_shape)
    q, dout = (_rounded(exact_random(2, *plan.out_shape, 2, 64), dtype).astype(np.float32) for _ in range(2))
    k, v = (_rounded(exact_random(2, *plan.in_shape, 2, 64), dtype).astype(np.float32) for _ in range(2))
    # The global lse and delta the backward takes, from the arc kernels on the whole grids.
    out, lse = (np.asarray(x) for x in _ffi.ffi_forward(q, k, v, plan, local.full_window(plan),
                                                        plan.tables.forward_row_order, scale=0.125))  # fmt: skip
    delta = np.sum(dout * out, axis=-1)
    q_shape, k_shape = (layout.q_lat.block, layout.q_lon.block), (layout.k_ext_block, layout.k_lon.block)

    def run(kernel, q, k, v, dout, lse, delta, window, index):
        kwargs = dict(scale=0.125, kernel=kernel)
        if kernel == "scheduled":
            kwargs["schedules"] = _ffi.WindowSchedules(forward, backward, index)
        q_rows = local.local_row_order(plan, "forward", window[0], q.shape[1])
        k_rows = local.local_row_order(plan, "backward", window[4], k.shape[1])
        backward_args = (q, k, v, dout, lse, delta, plan, window)
        return (*local.local_forward(q, k, v, plan, window, q_rows, **kwargs),
                local.local_backward_dq(*backward_args, q_rows, **kwargs),
                *local.local_backward_dkv(*backward_args, k_rows, **kwargs))  # fmt: skip

    scheduled, arc = jax.jit(functools.partial(run, "scheduled")), jax.jit(functools.partial(run, "arc"))
    seen = 0
    for index, window in enumerate(layout.windows.tolist()):
        qb, kb = _Block(*window[:4], q_shape), _Block(*window[4:], k_shape)
        blocks = [qb.extract(q, rng), kb.extract(k, rng), kb.extract(v, rng)]
        blocks += [qb.extract(x, rng) for x in (dout, lse, delta)]
        operands = [jnp.asarray(x, dtype) for x in blocks[:4]] + [jnp.asarray(x) for x in blocks[4:]]
        got = [np.asarray(x) for x in scheduled(*operands, jnp.asarray(window, jnp.int32), jnp.int32(index))]
        want = [np.asarray(x) for x in arc(*operands, jnp.asarray(window, jnp.int32), 0)]
        for name, g, w, block in zip(NAMES, got, want, (qb, qb, qb, kb, kb), strict=True):
            assert not np.isnan(g).any(), f"window {window}: {name} has unwritten elements"
            assert (block.padding(g) == (-np.inf if name == "lse" else 0)).all(), f"window {window}: {name} padding"
            if name == "lse":
                np.testing.assert_array_equal(g == -np.inf, w == -np.inf)
                finite = np.isfinite(w)
                assert not finite.any() or rel_error(g[finite], w[finite]) <= 1e-5, f"window {window}: lse"
            else:
                assert rel_error(g, w) <= 1e-2 or np.abs(w).max() == 0 == np.abs(g).max(), f"window {window}: {name}"
        seen += np.isfinite(got[1]).any()
    assert seen >= len(layout.windows) // 3  # most windows see keys


def _meshes() -> list[tuple[int, int]]:
    """(lat, lon) mesh shapes this process's GPUs can make: one GPU; with two or more, also 2 x 1 and 1 x 2."""
    return [(1, 1)] + ([(2, 1), (1, 2)] if len(jax.devices("gpu")) >= 2 else [])


def test_the_sharded_op_runs_the_scheduled_kernels(exact_random, rel_error):
    """The sharded op picks the scheduled kernels where the serial op does, on every mesh of this machine's GPUs
    (one GPU: the 1 x 1 mesh, a single whole-grid window; halo rows and a ring of key chunks need two), and its
    output and gradients match the serial op's within a bfloat16 rounding or two; every device's program runs the
    scheduled targets alone."""
    plan = NeighborhoodPlan((33, 72), (33, 72), theta_cutoff=0.25)
    primals = tuple(jnp.asarray(exact_random(2, 33, 72, 2, 64), jnp.bfloat16) for _ in range(3))
    dout = jnp.asarray(exact_random(2, 33, 72, 2, 64), jnp.bfloat16)

    def value_and_grads(attention):
        def run(primals):
            out, pullback = jax.vjp(attention, *primals)
            return out, *pullback(dout)

        return jax.jit(run)

    want = value_and_grads(lambda q, k, v: jax_s2attn.neighborhood_attention(q, k, v, plan, implementation="ffi"))(
        primals
    )
    for shape in _meshes():
        mesh = jax.make_mesh(shape, ("lat", "lon"), devices=jax.devices("gpu")[: shape[0] * shape[1]])
        sharded = value_and_grads(lambda q, k, v: sharded_neighborhood_attention(q, k, v, plan, mesh=mesh,
                                                                                 implementation="ffi"))  # fmt: skip
        text = sharded.lower(primals).as_text()
        # the windows' targets, dq given delta (the delta target's, formed once)
        windowed = (_ffi.SCHEDULED_FORWARD_TARGET, _ffi.SCHEDULED_BACKWARD_DQ_TARGET,
                    _ffi.SCHEDULED_BACKWARD_DKV_TARGET, _ffi.DELTA_TARGET)  # fmt: skip
        assert all(f"@{target}(" in text for target in windowed), shape
        assert f"@{_ffi.SCHEDULED_BACKWARD_DQ_DELTA_TARGET}(" not in text, shape
        assert not any(f"@{target}(" in text for target in _ffi.TARGETS), shape
        for name, g, w in zip(("out", "dq", "dk", "dv"), sharded(primals), want):
            assert rel_error(g, w) <= 2**-7, f"{shape}: {name}"  # a bfloat16 rounding or two apart


def test_a_schedule_of_another_plan_is_refused(exact_random):
    """The handler checks the schedule's tile count against the grids: a call with another plan's schedule fails
    with INVALID_ARGUMENT instead of running."""
    other = NeighborhoodPlan((33, 72), (33, 72))
    q, k, v = (jnp.asarray(exact_random(1, 17, 36, 1, 64), jnp.bfloat16) for _ in range(3))
    grid = jax.ShapeDtypeStruct((1, 33, 72, 1, 64), jnp.bfloat16)
    schedule, attributes = _ffi._scheduled_operands(other, "forward", 0.125, grid, grid)
    attributes.update(nlat_q=np.int64(17), nlon_q=np.int64(36), nlat_k=np.int64(17), nlon_k=np.int64(36))
    shapes = [(1, 17, 36, 1, 64), (1, 17, 36, 1)]
    with pytest.raises(Exception, match="the schedule lists"):
        out, _ = _ffi._call(_ffi.SCHEDULED_FORWARD_TARGET, (q, k, v, *schedule), shapes, attributes, False,
                            (jnp.dtype(jnp.float32), jnp.dtype(jnp.float32)))  # fmt: skip
        np.asarray(out)


@pytest.mark.parametrize("ring_nlon", [0, -36, 1 << 29])
def test_a_ring_modulus_out_of_range_is_refused(exact_random, ring_nlon):
    """The handler checks the RING chunks' modulus (the other grid's longitudes): one out of [1, 2^29) fails with
    INVALID_ARGUMENT naming ring_nlon instead of running."""
    plan = NeighborhoodPlan((17, 36), (17, 36), theta_cutoff=0.3)
    q, k, v = (jnp.asarray(exact_random(1, 17, 36, 1, 64), jnp.bfloat16) for _ in range(3))
    schedule, attributes = _ffi._scheduled_operands(plan, "forward", 0.125, q, k)
    attributes["ring_nlon"] = np.int64(ring_nlon)
    shapes = [(1, 17, 36, 1, 64), (1, 17, 36, 1)]
    with pytest.raises(Exception, match="ring_nlon"):
        out, _ = _ffi._call(_ffi.SCHEDULED_FORWARD_TARGET, (q, k, v, *schedule), shapes, attributes, False,
                            (jnp.dtype(jnp.float32), jnp.dtype(jnp.float32)))  # fmt: skip
        np.asarray(out)


# Plans whose walks leave rows to the stencil kernels (_ffi.stencil_schedule): a band in mid-grid, the same at a
# longer ring, more key rows than query rows (these three on tiles of one row, in the ring grids' format), and every
# row but one (on the kernels' 4 x 16 tiles); heads, head dim.
STENCIL_CASES = [
    (((17, 72), (17, 72), EQ, EQ, None), 2, 64),
    (((65, 144), (65, 144), EQ, EQ, None), 1, 32),
    (((10, 40), (9, 40), EQ, EQ, 0.2), 2, 128),
    (((9, 4), (9, 4), EQ, EQ, None), 1, 64),
]


def test_the_stencil_cases_take_both_schedule_formats():
    flat = {_ffi.stencil_schedule(NeighborhoodPlan(*geometry), walk).flat
            for geometry, _, _ in STENCIL_CASES for walk in ("forward", "backward")}  # fmt: skip
    assert flat == {True, False}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", STENCIL_CASES, ids=str)
def test_targets_beside_the_stencil_rows_match_float64(case, dtype, exact_random, dense_attention, rel_error):
    """The scheduled targets on the schedules without the stencil rows' tiles, the stencil targets writing those
    rows into the same results (poisoned with NaN first): every element written, out, lse and the gradients
    against float64 (the backward from this forward's lse and the delta target's delta of its float32 out);
    results in the activations' dtype the float32 ones rounded, bit for bit."""
    geometry, heads, d = case
    plan = NeighborhoodPlan(*geometry)
    assert all(len(_ffi.stencil_schedule(plan, walk).pairs) for walk in ("forward", "backward"))
    q = exact_random(2, *plan.out_shape, heads, d)
    k, v = (exact_random(2, *plan.in_shape, heads, d) for _ in range(2))
    dout = exact_random(2, *plan.out_shape, heads, d)
    want = _oracle(plan, (q, k, v), (dout, np.zeros(dout.shape[:-1])), dense_attention)
    q, k, v, dout = (jnp.asarray(x, dtype) for x in (q, k, v, dout))
    run = functools.partial(_run_targets, plan, q, k, v, dout, scale=1 / np.sqrt(d), stencil=True)
    wide, narrow = run(jnp.float32), run(dtype)
    for name, w, n, expected in zip(NAMES, wide, narrow, want, strict=True):
        assert not np.isnan(w).any() and not np.isnan(n).any(), f"{name}: unwritten elements"
        assert rel_error(w, expected) <= (1e-5 if name == "lse" else 1e-2), (name, rel_error(w, expected))
        rounded = w if name == "lse" else np.asarray(jnp.asarray(w).astype(dtype))
        assert n.tobytes() == rounded.tobytes(), f"{name}: not the float32 result rounded"


@pytest.mark.parametrize("stencil", [False, True], ids=["scheduled", "scheduled+stencil"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", STENCIL_CASES, ids=str)
def test_the_forward_writes_out_in_both_dtypes(case, dtype, stencil, exact_random):
    """The forward with float32_out (what the differentiated op runs), results poisoned with NaN first: out and lse
    the bits of the forward with an out of the activations' dtype alone, out_f32 the bits of the forward with a
    float32 out on every row the scheduled kernels take, and beside the stencil rows those rows of out_f32 left
    unwritten (the stencil dq forms their delta without it)."""
    geometry, heads, d = case
    plan = NeighborhoodPlan(*geometry)
    q = jnp.asarray(exact_random(2, *plan.out_shape, heads, d), dtype)
    k, v = (jnp.asarray(exact_random(2, *plan.in_shape, heads, d), dtype) for _ in range(2))
    run = functools.partial(_ffi.ffi_scheduled_forward, q, k, v, plan, scale=0.125, poison_results=True,
                            stencil=stencil)  # fmt: skip
    out, lse, out_f32 = (np.asarray(x) for x in run(out_dtype=dtype, float32_out=True))
    narrow, narrow_lse = (np.asarray(x) for x in run(out_dtype=dtype))
    wide = np.asarray(run()[0])
    assert out.tobytes() == narrow.tobytes() and lse.tobytes() == narrow_lse.tobytes(), "not the forward's bits"
    rows = np.zeros(plan.nlat_out, bool)
    if stencil:
        rows = stencil_rows_of(_ffi.stencil_schedule(plan, "forward").pairs, plan.nlat_out)
        assert rows.any(), "the case must have stencil rows"
    assert np.isnan(out_f32[:, rows]).all(), "out_f32: the stencil rows were written"
    assert out_f32[:, ~rows].tobytes() == wide[:, ~rows].tobytes(), "out_f32: not the float32 forward's bits"


@pytest.mark.parametrize("gradients", ["float32", "activations"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", STENCIL_CASES, ids=str)
def test_the_dq_that_forms_delta_beside_the_stencil_rows(case, dtype, gradients, exact_random):
    """The scheduled dq that forms delta on the schedule without the stencil rows' tiles writes dq and delta of
    exactly the other rows (poisoned with NaN first, the stencil rows stay NaN); the stencil dq forming delta from
    its own probabilities fills exactly those rows of the same results: every element written; on the scheduled
    rows delta within FORMED_DELTA_TOLERANCE of float64 and dq the bits of the scheduled dq given that delta, on the
    stencil rows both within STENCIL_FORMED_TOLERANCE of float64's delta and of the stencil dq given it; the same
    bits run to run."""
    geometry, heads, d = case
    plan = NeighborhoodPlan(*geometry)
    q, dout = (jnp.asarray(exact_random(2, *plan.out_shape, heads, d), dtype) for _ in range(2))
    k, v = (jnp.asarray(exact_random(2, *plan.in_shape, heads, d), dtype) for _ in range(2))
    dlse = jnp.asarray(exact_random(2, *plan.out_shape, heads), jnp.float32)
    result_dtype = jnp.dtype(jnp.float32 if gradients == "float32" else dtype)
    out, lse = _ffi.ffi_scheduled_forward(q, k, v, plan, scale=0.125, stencil=True)
    schedule, attributes = _ffi._scheduled_operands(plan, "forward", 0.125, q, k, stencil=True)
    alone = _ffi._scheduled_call(_ffi.SCHEDULED_BACKWARD_DQ_DELTA_TARGET, (q, k, v, dout, lse, out, dlse), schedule,
                                 [q.shape, lse.shape], attributes, True,
                                 (result_dtype, jnp.dtype(jnp.float32)))  # fmt: skip
    pairs = _ffi.stencil_schedule(plan, "forward").pairs
    stencil_rows = stencil_rows_of(pairs, plan.nlat_out)
    for name, x in zip(("dq", "delta"), alone, strict=True):
        unwritten = np.isnan(np.asarray(x, np.float32)).reshape(2, plan.nlat_out, -1)
        assert (unwritten.all(axis=(0, 2)) == stencil_rows).all(), f"{name}: NaN rows are not the stencil rows"
        assert not unwritten[:, ~stencil_rows].any(), f"{name}: unwritten elements outside the stencil rows"
    run = functools.partial(_ffi.ffi_scheduled_dq_delta, q, k, v, dout, lse, out, dlse, plan, scale=0.125,
                            gradient_dtype=result_dtype, poison_results=True, stencil=True)  # fmt: skip
    (dq, delta), again = run(), run()
    given = _ffi.ffi_scheduled_dq(q, k, v, dout, lse, delta, plan, scale=0.125, gradient_dtype=result_dtype,
                                  poison_results=True, stencil=True)  # fmt: skip
    dq, delta, given = (np.asarray(x) for x in (dq, delta, given))
    assert not np.isnan(np.asarray(dq, np.float32)).any() and not np.isnan(delta).any(), "unwritten elements"
    scheduled_rows = (slice(None), ~stencil_rows)
    _assert_formed_delta(*(np.asarray(x)[scheduled_rows] for x in (delta, dout, out, dlse)))
    assert dq[scheduled_rows].tobytes() == given[scheduled_rows].tobytes(), "dq: not the bits of the dq given delta"
    expected = (np.asarray(dout, np.float64) * np.asarray(out, np.float64)).sum(-1) - np.asarray(dlse, np.float64)
    check_stencil_formed_delta(delta, dq, given, expected, dout, k, v, dlse, 0.125, stencil_rows)
    assert all(np.asarray(a).tobytes() == b.tobytes() for a, b in zip(again, (dq, delta))), "not the same bits"


def test_the_scheduled_op_leaves_the_stencil_rows_to_the_stencil_targets(exact_random, rel_error):
    """At 360x720 and the default cutoff, one head, the rows of whole tiles of stencil pairs pass the stencil gate
    in both walks: the op on the scheduled kernels runs the stencil targets beside them in its forward, dq (the
    one forming delta) and dk/dv, and its out and gradients match the arc kernels' within the 16-bit bar."""
    plan = NeighborhoodPlan((360, 720), (360, 720))
    q, k, v, dout = (jnp.asarray(exact_random(1, 360, 720, 1, 64), jnp.bfloat16) for _ in range(4))
    assert all(neighborhood.uses_stencil_rows(plan, q, "scheduled", walk) for walk in ("forward", "backward"))

    def value_and_grads(kernel):
        def run(q, k, v, dout):
            out, pullback = jax.vjp(lambda q, k, v: neighborhood._native_attention(q, k, v, plan, 0.125, kernel)[0],
                                    q, k, v)  # fmt: skip
            return out, *pullback(dout)

        return jax.jit(run)

    scheduled = value_and_grads("scheduled")
    program = scheduled.lower(q, k, v, dout).as_text()
    for target in _ffi.STENCIL_TARGETS:
        assert program.count(f"@{target}(") == (target != _ffi.STENCIL_BACKWARD_DQ_TARGET), target
    arc = value_and_grads("arc")(q, k, v, dout)
    for name, got, want in zip(("out", "dq", "dk", "dv"), scheduled(q, k, v, dout), arc, strict=True):
        assert rel_error(got, want) <= 1e-2, (name, rel_error(got, want))
