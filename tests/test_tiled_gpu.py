"""The tiled tensor-core kernels on the GPU against float64 oracles and the arc kernels.

The tiled kernels round probabilities (and dS) to the 16-bit input dtype before their
matrix products, so their bar is the 16-bit one: relative error <= 1e-2 against float64
for outputs and gradients; the log-sum-exp stays float32-exact (1e-5), as in every test.
Shapes are chosen for the kernels' corner cases: odd latitude counts, longitude counts
that are not multiples of the tile width, seams, polar rows of full rings, pscale 2
both ways, and several heads.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_s2attn import NeighborhoodPlan, neighborhood_attention
from jax_s2attn.ops import _ffi
from jax_s2attn.ops.local import full_window, local_row_order
from jax_s2attn.ops.neighborhood import uses_stencil_rows
from jax_s2attn.parallel import sharded_neighborhood_attention

sys.path.insert(0, str(Path(__file__).parent))
from test_nbhd_ffi import _tile, _window  # noqa: E402  (blocks of a grid with padding)
from test_nbhd_grad import _vjp  # noqa: E402  ((out, lse, dq, dk, dv) of the op)
from kernel_cases import (  # noqa: E402  (NaN reach; smooth values; the formed delta's bar)
    FORMED_DELTA_TOLERANCE,
    OUT_TOLERANCE,
    check_nan_poisoning,
    smooth_field,
)

pytestmark = pytest.mark.gpu

EQ, LG, LOB = "equiangular", "legendre-gauss", "lobatto"
DTYPES = [jnp.bfloat16, jnp.float16]
NAMES = ("out", "lse", "dq", "dk", "dv")

# (in_shape, out_shape, grid_in, grid_out, theta_cutoff), heads, head dim; batch 2 everywhere.
CASES = [
    (((17, 36), (17, 36), EQ, EQ, None), 4, 32),  # self, odd nlat, nlon not a multiple of 32
    (((33, 72), (33, 72), LG, LG, 0.25), 1, 64),
    (((17, 36), (17, 36), LOB, LOB, 1.2), 4, 128),  # polar rows: many full rings
    (((65, 100), (65, 100), EQ, EQ, 0.1), 1, 64),
    (((34, 72), (17, 36), EQ, EQ, None), 1, 128),  # down, pscale 2
    (((66, 144), (33, 72), LG, LG, 0.2), 4, 32),  # down, pscale 2
    (((17, 36), (33, 72), EQ, EQ, None), 4, 64),  # up, pscale 2
    (((33, 50), (65, 100), LOB, LOB, 0.15), 1, 32),  # up, pscale 2, odd
    (((150, 8), (150, 8), EQ, EQ, 3.0), 1, 64),  # up to 150 segments a row: several batches of segment slots
]


def _case_id(case):
    (in_shape, out_shape, grid_in, grid_out, cutoff), heads, dim = case
    return f"{in_shape}->{out_shape}-{grid_in}-{cutoff}-H{heads}-D{dim}"


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
    for name, g, w in zip(NAMES, got, want):
        assert g.dtype == (jnp.float32 if name == "lse" else dtype), name
        assert rel_error(g, w) <= (1e-5 if name == "lse" else 1e-2), (name, rel_error(g, w))


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_float64_oracle(case, exact_random, dense_attention, rel_error):
    geometry, heads, dim = case
    plan = NeighborhoodPlan(*geometry)
    q = exact_random(2, *plan.out_shape, heads, dim)
    k, v = (exact_random(2, *plan.in_shape, heads, dim) for _ in range(2))
    cotangents = (exact_random(2, *plan.out_shape, heads, dim), exact_random(2, *plan.out_shape, heads))
    want = _oracle(plan, (q, k, v), cotangents, dense_attention)
    for dtype in DTYPES:
        as_dtype = lambda xs: tuple(jnp.asarray(x, dtype) for x in xs)  # noqa: E731 (exact: see exact_random)
        got = _compiled_vjp(plan, "ffi-tiled")(as_dtype((q, k, v)), as_dtype(cotangents))
        _check(got, want, rel_error, dtype)


# Plans whose walks leave row pairs to the stencil kernels (jax_s2attn.plan.stencil_pairs): every head dim
# (blocks of 64, 32, 16 longitudes), rings shorter than the staged window, more key rows than query rows.
STENCIL_CASES = [
    (((17, 72), (17, 72), EQ, EQ, None), 2, 32),
    (((17, 72), (17, 72), EQ, EQ, None), 1, 64),
    (((9, 4), (9, 4), EQ, EQ, None), 2, 128),
    (((10, 40), (9, 40), EQ, EQ, 0.2), 1, 64),
    (((13, 24), (13, 24), LG, LG, None), 2, 128),
]


@pytest.mark.parametrize("case", STENCIL_CASES, ids=_case_id)
def test_stencil_rows(case, exact_random, dense_attention, rel_error):
    """The tiled kernels leaving the plan's stencil pairs to the stencil kernels (as the op does from enough
    query points): results poisoned with NaN first are all written; on those rows out, lse and dq (query
    rows), dk and dv (key rows; float32 throughout) are within float32 round-off of float64, every other row's
    out, lse and dq is the tiled kernels' alone, bit for bit, and out in the activations' dtype is the float32
    out rounded (with its remainder; without it, P multiplied once on the tiled rows, within the 16-bit bar);
    the op's results and gradients meet the 16-bit bar."""
    geometry, heads, dim = case
    plan = NeighborhoodPlan(*geometry)
    pairs, key_pairs = plan.forward_stencil_pairs, plan.backward_stencil_pairs
    assert pairs.size and key_pairs.size, "the plan must leave rows to the stencil kernels"
    rows, key_rows = np.zeros(plan.nlat_out, bool), np.zeros(plan.nlat_in, bool)
    rows[pairs[:, 0]] = rows[pairs[:, 0] + 1] = True
    key_rows[key_pairs[:, 0]] = key_rows[key_pairs[:, 0] + 1] = True
    q = exact_random(2, *plan.out_shape, heads, dim)
    k, v = (exact_random(2, *plan.in_shape, heads, dim) for _ in range(2))
    cotangents = (exact_random(2, *plan.out_shape, heads, dim), exact_random(2, *plan.out_shape, heads))
    want = [np.asarray(x) for x in _oracle(plan, (q, k, v), cotangents, dense_attention)]
    for dtype in DTYPES:
        as_dtype = lambda xs: tuple(jnp.asarray(x, dtype) for x in xs)  # noqa: E731 (exact: see exact_random)
        _check(_compiled_vjp(plan, "ffi-tiled")(as_dtype((q, k, v)), as_dtype(cotangents)), want, rel_error, dtype)
        args = (*as_dtype((q, k, v)), plan, full_window(plan), plan.tables.forward_row_order)
        kwargs = dict(scale=1.0 / np.sqrt(dim), kernel="tiled", poison_results=True)
        out, lse = (np.asarray(x) for x in _ffi.ffi_forward(*args, stencil=True, **kwargs))
        alone_out, alone_lse = (np.asarray(x) for x in _ffi.ffi_forward(*args, **kwargs))
        narrow_out, narrow_lse, _ = (np.asarray(x) for x in _ffi.ffi_forward(*args, stencil=True, out_dtype=dtype,
                                                                              remainder=True, **kwargs))  # fmt: skip
        one_part_out, one_part_lse = (np.asarray(x) for x in _ffi.ffi_forward(*args, stencil=True, out_dtype=dtype,
                                                                               **kwargs))  # fmt: skip
        assert not np.isnan(out).any() and not np.isnan(lse).any() and not np.isnan(narrow_out).any()
        assert rel_error(out[:, rows], want[0][:, rows]) <= 2e-5
        assert rel_error(lse[:, rows], want[1][:, rows]) <= 1e-5
        assert not np.array_equal(out[:, rows], alone_out[:, rows]), "the stencil rows are the tiled kernel's"
        np.testing.assert_array_equal(out[:, ~rows], alone_out[:, ~rows])
        np.testing.assert_array_equal(lse[:, ~rows], alone_lse[:, ~rows])
        rounded = np.asarray(jnp.asarray(out).astype(dtype))
        np.testing.assert_array_equal(narrow_out.view(np.uint16), rounded.view(np.uint16))
        assert narrow_lse.tobytes() == lse.tobytes()
        # Without a remainder the tiled rows multiply P once; the stencil rows (float32 P) stay out rounded.
        assert rel_error(one_part_out, want[0]) <= 1e-2 and one_part_lse.tobytes() == lse.tobytes()
        np.testing.assert_array_equal(one_part_out[:, rows].view(np.uint16), rounded[:, rows].view(np.uint16))
        # dq forming delta from that out, with and without the stencil rows (float32 dq).
        backward = (*as_dtype((q, k, v, cotangents[0])), lse, out, np.asarray(cotangents[1], np.float32), *args[3:])
        dq_kwargs = dict(scale=kwargs["scale"], poison_results=True)
        dq, delta = (np.asarray(x) for x in _ffi.ffi_backward_dq_delta(*backward, stencil=True, **dq_kwargs))
        alone_dq, _ = (np.asarray(x) for x in _ffi.ffi_backward_dq_delta(*backward, **dq_kwargs))
        assert not np.isnan(dq).any() and not np.isnan(delta).any()
        assert rel_error(dq[:, rows], want[2][:, rows]) <= 2e-5
        assert not np.array_equal(dq[:, rows], alone_dq[:, rows]), "the stencil rows are the tiled kernel's"
        np.testing.assert_array_equal(dq[:, ~rows], alone_dq[:, ~rows])
        # dk and dv from that delta, with and without the key rows' stencil pairs (float32).
        dkv_args = (*backward[:5], delta, plan, full_window(plan), plan.tables.backward_row_order)
        dk, dv = (np.asarray(x) for x in _ffi.ffi_backward_dkv(*dkv_args, stencil=True, kernel="tiled", **dq_kwargs))
        alone_dk, alone_dv = (np.asarray(x) for x in _ffi.ffi_backward_dkv(*dkv_args, kernel="tiled", **dq_kwargs))
        for got, alone, expected in [(dk, alone_dk, want[3]), (dv, alone_dv, want[4])]:
            assert not np.isnan(got).any()
            assert rel_error(got[:, key_rows], expected[:, key_rows]) <= 2e-5
            assert not np.array_equal(got[:, key_rows], alone[:, key_rows]), "the stencil rows are the tiled kernel's"
            np.testing.assert_array_equal(got[:, ~key_rows], alone[:, ~key_rows])


def test_op_with_stencil_rows_agrees_with_arc_kernels_and_under_vmap(exact_random, rel_error):
    """Query points enough for the op to leave the plan's stencil pairs to the stencil kernel (5,400 x 98
    heads per batch entry; test_dispatch checks the program from 25): out, lse and gradients against the arc
    kernels'; vmapped over the batch (the pairs then come as copies), the same bits as batched."""
    plan = NeighborhoodPlan((65, 100), (65, 100))
    primals = tuple(jnp.asarray(exact_random(2, 65, 100, 98, 32), jnp.bfloat16) for _ in range(3))
    assert uses_stencil_rows(plan, primals[0], "tiled")
    dout = jnp.asarray(exact_random(2, 65, 100, 98, 32), jnp.bfloat16)
    cotangents = (dout, jnp.asarray(exact_random(2, 65, 100, 98)))
    tiled = _compiled_vjp(plan, "ffi-tiled")(primals, cotangents)
    arc = _compiled_vjp(plan, "ffi-arc")(primals, cotangents)
    _check(tiled, arc, rel_error, jnp.bfloat16)
    def attend(q, k, v):
        return neighborhood_attention(q, k, v, plan, implementation="ffi-tiled", return_residual=True)

    for a, b in zip(jax.jit(attend)(*primals), jax.jit(jax.vmap(attend))(*primals)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


# (in_shape, out_shape, grid, theta_cutoff) of the smooth-field checks: every direction.
SMOOTH_CASES = [
    ((33, 72), (33, 72), EQ, 0.15),
    ((66, 144), (33, 72), LG, 0.15),  # down, pscale 2
    ((33, 72), (65, 144), EQ, 0.15),  # up, pscale 2, odd nlat
]


@pytest.mark.parametrize("geometry", SMOOTH_CASES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_smooth_values_keep_gradients_accurate(dtype, geometry, rng, dense_attention, rel_error):
    """Values smooth in position (+1% noise): dP - D nearly cancels in dS, so dq and dk are small differences;
    they keep the 1e-2 bar only if D comes from an output carrying more than bfloat16's bits (the op's: out in
    bfloat16 plus its rounding remainder; from a bfloat16-rounded output alone, dq and dk miss it in each of
    these geometries: 2.1e-2 to 3.7e-2 against the float64 reference's backward on the same inputs)."""
    in_shape, out_shape, grid, cutoff = geometry
    plan = NeighborhoodPlan(in_shape, out_shape, grid_in=grid, grid_out=grid, theta_cutoff=cutoff)
    heads, dim = 1, 64
    v = smooth_field(*in_shape, dim, grid)[None, :, :, None, :] + 0.01 * rng.standard_normal((2, *in_shape, heads, dim))
    q, dout = (rng.standard_normal((2, *out_shape, heads, dim)) for _ in range(2))
    k = rng.standard_normal((2, *in_shape, heads, dim))
    primals = tuple(_rounded(x, dtype) for x in (q, k, v))
    cotangents = (_rounded(dout, dtype), np.zeros((2, *out_shape, heads)))
    want = _oracle(plan, primals, cotangents, dense_attention)
    got = _compiled_vjp(plan, "ffi-tiled")(
        tuple(jnp.asarray(x, dtype) for x in primals), (jnp.asarray(cotangents[0], dtype), cotangents[1])
    )
    _check(got, want, rel_error, dtype)


# ----------------------------------------------------------------------------- targets

# Geometries of the windowed checks: a self-attention (odd nlat), a downsampling and an upsampling walk.
WINDOW_CASES = [CASES[0][0], CASES[4][0], CASES[6][0]]
WINDOW_SCALE = 0.125


def _whole_grid_forward(geometry, dtype, rng, exact_random):
    """The plan of a windowed check; q, k, v (batch 2, heads 2, D 64) and a cotangent dout, all
    float32 holding values of ``dtype``; and the forward's out and lse over the whole grids."""
    plan = NeighborhoodPlan(*geometry)
    q = _rounded(exact_random(2, *plan.out_shape, 2, 64), dtype).astype(np.float32)
    k, v = (_rounded(exact_random(2, *plan.in_shape, 2, 64), dtype).astype(np.float32) for _ in range(2))
    out, lse = (np.asarray(x) for x in _ffi.ffi_forward(q, k, v, plan, full_window(plan),
                                                        plan.tables.forward_row_order, scale=WINDOW_SCALE))  # fmt: skip
    dout = _rounded(rng.standard_normal(out.shape), dtype).astype(np.float32)
    return plan, q, k, v, dout, out, lse


@pytest.mark.parametrize("geometry", WINDOW_CASES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_windowed_targets_write_every_result_and_match_the_arc_kernels(dtype, geometry, rng, exact_random, rel_error):
    """Query blocks x key blocks with padding: every tiled result (poisoned with NaN first)
    is written, padding holds zeros (-inf for lse), and each partial matches the arc
    kernel's partial of the same window. Gradients written in the activations' dtype (also
    poisoned first) are the float32 ones rounded, bit for bit, and so is out written in that dtype with its
    remainder (with the float32 forward's lse); without it (P multiplied once) out is within the 16-bit bar."""
    plan, q, k, v, dout, out, lse = _whole_grid_forward(geometry, dtype, rng, exact_random)
    delta = np.sum(dout * out, axis=-1)
    for qb in _tile(*plan.out_shape, 2, 2):
        ql, doutl, lsel, deltal = (qb.extract(x, rng).astype(np.float32) for x in (q, dout, lse, delta))
        q_rows = local_row_order(plan, "forward", qb.lat0, qb.local_shape[0])
        for kb in _tile(*plan.in_shape, 2, 3):
            kl, vl = kb.extract(k, rng), kb.extract(v, rng)
            k_rows = local_row_order(plan, "backward", kb.lat0, kb.local_shape[0])
            activations = [jnp.asarray(x, dtype) for x in (ql, kl, vl, doutl)]
            window = _window(qb, kb)

            backward = (*activations, lsel, deltal, plan, window)

            def run(kernel):
                kwargs = dict(scale=WINDOW_SCALE, kernel=kernel, poison_results=True)
                return (
                    *_ffi.ffi_forward(*activations[:3], plan, window, q_rows, **kwargs),
                    _ffi.ffi_backward_dq(*backward, q_rows, **kwargs),
                    *_ffi.ffi_backward_dkv(*backward, k_rows, **kwargs),
                )

            tiled = [np.asarray(x) for x in run("tiled")]
            arc = [np.asarray(x) for x in run("arc")]
            narrow = dict(scale=WINDOW_SCALE, kernel="tiled", poison_results=True)
            narrow_out, narrow_lse, _ = _ffi.ffi_forward(*activations[:3], plan, window, q_rows, out_dtype=dtype,
                                                         remainder=True, **narrow)  # fmt: skip
            assert np.asarray(narrow_lse).tobytes() == tiled[1].tobytes()
            # Without a remainder, P multiplied once: within the 16-bit bar of the arc kernels' float32 out.
            one_part_out, one_part_lse = _ffi.ffi_forward(*activations[:3], plan, window, q_rows, out_dtype=dtype,
                                                          **narrow)  # fmt: skip
            assert np.asarray(one_part_lse).tobytes() == tiled[1].tobytes()
            one_part_out = np.asarray(one_part_out)
            assert not np.isnan(one_part_out).any() and (qb.padding(one_part_out) == 0).all()
            assert rel_error(one_part_out, arc[0]) <= 1e-2 or np.abs(arc[0]).max() == 0 == np.abs(one_part_out).max()
            gradients = (_ffi.ffi_backward_dq(*backward, q_rows, gradient_dtype=dtype, **narrow),
                         *_ffi.ffi_backward_dkv(*backward, k_rows, gradient_dtype=dtype, **narrow))  # fmt: skip
            for name, got, wide in zip(("out", *NAMES[2:]), (narrow_out, *gradients), (tiled[0], *tiled[2:])):
                assert got.dtype == dtype, name
                want = np.asarray(jnp.asarray(wide).astype(dtype))
                np.testing.assert_array_equal(np.asarray(got).view(np.uint16), want.view(np.uint16), err_msg=name)
            for name, t, a, block in zip(NAMES, tiled, arc, (qb, qb, qb, kb, kb)):
                assert not np.isnan(t).any(), name
                assert (block.padding(t) == (-np.inf if name == "lse" else 0)).all(), name
                if name == "lse":
                    np.testing.assert_array_equal(t == -np.inf, a == -np.inf)
                    finite = np.isfinite(a)
                    assert not finite.any() or rel_error(t[finite], a[finite]) <= 1e-5
                else:  # out (float32, delta's residual) far inside the 16-bit bar
                    bar = OUT_TOLERANCE if name == "out" else 1e-2
                    assert rel_error(t, a) <= bar or np.abs(a).max() == 0 == np.abs(t).max(), name


@pytest.mark.parametrize("geometry", WINDOW_CASES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dq_forming_delta_on_windows(dtype, geometry, rng, exact_random):
    """The tiled dq that forms delta (the op's) on query blocks x key blocks with padding: both
    results poisoned with NaN first and fully written; delta = sum(dout * out) - dlse of every local
    row (padding too) to float32 round-off; dq the bits of the tiled dq given that delta, in float32
    and in the activations' dtype."""
    plan, q, k, v, dout, out, lse = _whole_grid_forward(geometry, dtype, rng, exact_random)
    dlse = rng.standard_normal(lse.shape).astype(np.float32)
    for qb in _tile(*plan.out_shape, 2, 2):
        ql, doutl, lsel, outl, dlsel = (qb.extract(x, rng).astype(np.float32) for x in (q, dout, lse, out, dlse))
        q_rows = local_row_order(plan, "forward", qb.lat0, qb.local_shape[0])
        terms = _rounded(doutl, dtype).astype(np.float64) * outl
        bound = FORMED_DELTA_TOLERANCE * (np.abs(terms).sum(-1) + np.abs(dlsel))
        for kb in _tile(*plan.in_shape, 2, 3):
            activations = [jnp.asarray(x, dtype) for x in (ql, kb.extract(k, rng), kb.extract(v, rng), doutl)]
            window = _window(qb, kb)
            for gradient_dtype in (jnp.float32, dtype):
                kwargs = dict(scale=WINDOW_SCALE, poison_results=True, gradient_dtype=gradient_dtype)
                dq, delta = _ffi.ffi_backward_dq_delta(*activations, lsel, outl, dlsel, plan, window, q_rows, **kwargs)
                given = _ffi.ffi_backward_dq(*activations, lsel, delta, plan, window, q_rows, kernel="tiled", **kwargs)
                dq, delta, given = (np.asarray(x) for x in (dq, delta, given))
                assert not np.isnan(dq).any() and not np.isnan(delta).any()
                assert dq.dtype == gradient_dtype and dq.tobytes() == given.tobytes()
                assert (np.abs(delta - (terms.sum(-1) - dlsel)) <= bound).all()


@pytest.mark.parametrize("cutoff", [0.1, None])  # None: the default cutoff
def test_gradients_are_bitwise_reproducible(cutoff, exact_random):
    """Two runs of one compiled program give the same bits (no atomics)."""
    plan = NeighborhoodPlan((65, 100), (65, 100), theta_cutoff=cutoff)
    primals = tuple(jnp.asarray(exact_random(2, 65, 100, 2, 64), jnp.bfloat16) for _ in range(3))
    cotangents = (jnp.asarray(exact_random(2, 65, 100, 2, 64), jnp.bfloat16), jnp.zeros((2, 65, 100, 2)))
    program = _compiled_vjp(plan, "ffi-tiled")
    first = program(primals, cotangents)
    second = program(tuple(jnp.array(x, copy=True) for x in primals), cotangents)
    for name, a, b in zip(NAMES, first, second):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8), err_msg=name)


@pytest.mark.parametrize("cutoff", [None, 0.1])
def test_tiled_agrees_with_arc_kernels_at_91x180(cutoff, exact_random, rel_error):
    plan = NeighborhoodPlan((91, 180), (91, 180), theta_cutoff=cutoff)
    dtype = jnp.bfloat16
    primals = tuple(jnp.asarray(exact_random(1, 91, 180, 2, 64), dtype) for _ in range(3))
    cotangents = (jnp.asarray(exact_random(1, 91, 180, 2, 64), dtype), jnp.asarray(exact_random(1, 91, 180, 2)))
    tiled = _compiled_vjp(plan, "ffi-tiled")(primals, cotangents)
    arc = _compiled_vjp(plan, "ffi-arc")(primals, cotangents)
    _check(tiled, arc, rel_error, dtype)


@pytest.mark.parametrize("operand", ["q", "k"])
@pytest.mark.parametrize("kernel", ["tiled", "arc"])
def test_nan_poisons_exactly_the_rows_that_see_it(kernel, operand, exact_random):
    """A NaN in one query (one key) makes that query's (every query that has the key as a
    neighbour's) out and lse NaN and leaves the others finite: a NaN sum is never read as
    'no neighbour' (0, -inf)."""
    plan = NeighborhoodPlan((33, 72), (33, 72), theta_cutoff=0.25)
    q, k, v = (exact_random(1, 33, 72, 1, 64) for _ in range(3))
    row, lon = 16, 3
    (q if operand == "q" else k)[0, row, lon, 0, 5] = np.nan
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    out, lse = _ffi.ffi_forward(q, k, v, plan, full_window(plan), plan.tables.forward_row_order, scale=0.125,
                                kernel=kernel)  # fmt: skip
    check_nan_poisoning(plan, out, lse, row * 72 + lon, operand)


# ----------------------------------------------------------------------------- dispatch


def _lowered(fn, *args) -> str:
    return jax.jit(fn).lower(*args).as_text()


def test_ffi_runs_tiled_kernels_where_they_apply_serial_and_sharded(exact_random, rel_error):
    """On CUDA, implementation="ffi" (serial and sharded) lowers to the tiled targets for
    16-bit heads of 64 and to the arc targets for float32; the sharded op on a 1x1 mesh
    (ring of one step) equals the serial tiled op."""
    plan = NeighborhoodPlan((17, 36), (17, 36))
    mesh = jax.make_mesh((1, 1), ("lat", "lon"), devices=jax.devices("gpu")[:1])
    primals = tuple(jnp.asarray(exact_random(2, 17, 36, 2, 64), jnp.bfloat16) for _ in range(3))
    dout = jnp.asarray(exact_random(2, 17, 36, 2, 64), jnp.bfloat16)

    def sharded(q, k, v):
        return sharded_neighborhood_attention(q, k, v, plan, mesh=mesh, implementation="ffi")

    def serial(implementation):
        return lambda q, k, v: neighborhood_attention(q, k, v, plan, implementation=implementation)

    def value_and_grads(attention):
        def run(primals):
            out, pullback = jax.vjp(attention, *primals)
            return out, *pullback(dout.astype(out.dtype))

        return run

    def calls(text, targets):
        return {t for t in targets if f"@{t}(" in text}

    # The serial op's tiled dq forms delta itself; the ring's dq runs once per key block, after one delta.
    dq_targets = (_ffi.TILED_BACKWARD_DQ_DELTA_TARGET, _ffi.TILED_BACKWARD_DQ_TARGET)
    for fn, dq_target in zip((serial("ffi"), sharded), dq_targets):
        text = _lowered(value_and_grads(fn), primals)
        want = {_ffi.TILED_FORWARD_TARGET, dq_target, _ffi.TILED_BACKWARD_DKV_TARGET}
        assert calls(text, _ffi.TILED_TARGETS) == want and not calls(text, _ffi.TARGETS)
        text = _lowered(value_and_grads(fn), tuple(x.astype(jnp.float32) for x in primals))
        assert calls(text, _ffi.TARGETS) == set(_ffi.TARGETS) and not calls(text, _ffi.TILED_TARGETS)
    got = jax.jit(value_and_grads(sharded))(primals)
    want = jax.jit(value_and_grads(serial("ffi-tiled")))(primals)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert rel_error(g, w) <= 2**-8, name  # at most one bfloat16 rounding apart


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
        out, vjp = jax.vjp(lambda *a: neighborhood_attention(*a, plan, implementation=implementation), *args)
        assert next(iter(out.devices())) == device
        return [np.asarray(x.astype(jnp.float32)) for x in (out, *vjp(jnp.ones_like(out)))]

    devices = jax.devices("gpu")
    first = run(devices[0])
    for device in devices[1:]:
        for a, b in zip(run(device), first):
            np.testing.assert_array_equal(a, b)
