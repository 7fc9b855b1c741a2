"""Native (FFI) forward and backward targets against float64 oracles, serial and windowed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_s2attn import NeighborhoodPlan, neighborhood_attention
from jax_s2attn.ops import _ffi
from jax_s2attn.ops.local import full_window, local_row_order
from jax_s2attn.ops.reference import reference_local_forward

pytestmark = pytest.mark.skipif(not _ffi.HAS_CPU_EXT, reason="native CPU module not built")

EQ, LG, LOB, TRAP = "equiangular", "legendre-gauss", "lobatto", "equiangular-trapezoidal"

# (in_shape, out_shape, grid_in, grid_out, theta_cutoff): every direction and grid.
CASES = [
    ((8, 16), (8, 16), EQ, EQ, None),
    ((7, 12), (7, 12), LG, LG, 0.6),
    ((8, 12), (8, 12), LOB, LOB, 0.5),
    ((7, 10), (7, 10), TRAP, TRAP, None),
    ((12, 24), (6, 12), EQ, EQ, None),  # downsample, pscale 2
    ((12, 24), (6, 8), LG, LG, 0.6),  # downsample, pscale 3
    ((12, 12), (6, 12), EQ, EQ, None),  # latitude-only downsample
    ((7, 12), (5, 6), EQ, LOB, 0.7),  # odd latitudes, mixed grids
    ((6, 24), (12, 12), EQ, EQ, None),  # more latitudes, fewer longitudes
    ((6, 12), (12, 24), EQ, EQ, None),  # upsample, pscale 2
    ((6, 8), (12, 24), LG, LG, 0.6),  # upsample, pscale 3
    ((5, 6), (7, 12), LOB, EQ, 0.8),  # odd upsample, mixed grids
    ((6, 12), (12, 12), EQ, EQ, None),  # latitude-only upsample (gather walk)
]
# The fast tier keeps every grid, direction and head shape; the slow tier also the other odd geometries.
TIERED_CASES = [pytest.param(c, marks=pytest.mark.slow) if i in (5, 6, 7, 8, 10) else c for i, c in enumerate(CASES)]

# (batch dims, heads, Dk, Dv), cycled over CASES so that every value appears.
SHAPES = [
    ((3,), 1, 5, 7),
    ((3,), 4, 32, 32),
    ((2,), 4, 64, 16),
    ((3,), 1, 130, 5),
    ((), 4, 5, 64),
    ((1, 2), 1, 32, 130),
]

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _case_id(case):
    (in_shape, out_shape, grid_in, grid_out, cutoff) = case
    return f"{in_shape}->{out_shape}-{grid_in}-{grid_out}-{cutoff}"


def _plan(case) -> NeighborhoodPlan:
    return NeighborhoodPlan(*case)


def _inputs(exact_random, plan, batch, heads, dk, dv):
    q = exact_random(*batch, *plan.out_shape, heads, dk)
    k = exact_random(*batch, *plan.in_shape, heads, dk)
    v = exact_random(*batch, *plan.in_shape, heads, dv)
    return q, k, v


def _flat(x):
    """``[batch..., nlat, nlon, H, D] -> [prod(batch), nlat, nlon, H, D]``."""
    return np.reshape(x, (-1, *np.shape(x)[-4:]))


@pytest.mark.parametrize("case", TIERED_CASES, ids=_case_id)
def test_forward_matches_dense_oracle(platform, case, exact_random, dense_attention, rel_error, tolerance):
    plan = _plan(case)
    batch, heads, dk, dv = SHAPES[CASES.index(case) % len(SHAPES)]
    q, k, v = _inputs(exact_random, plan, batch, heads, dk, dv)
    scale = 1.0 / np.sqrt(dk)
    want_out, want_lse = dense_attention(_flat(q), _flat(k), _flat(v), plan, scale)
    want_out = want_out.reshape(*batch, *want_out.shape[1:])
    want_lse = want_lse.reshape(*batch, *want_lse.shape[1:])
    for dtype in DTYPES:
        qd, kd, vd = (jnp.asarray(x, dtype) for x in (q, k, v))
        # The target itself, with every result poisoned (NaN) before the call.
        out, lse = _ffi.ffi_forward(
            qd, kd, vd, plan, full_window(plan), plan.tables.forward_row_order, scale=scale, poison_results=True
        )
        assert out.dtype == lse.dtype == jnp.float32
        assert rel_error(out, want_out) <= 1e-5, dtype
        assert rel_error(lse, want_lse) <= 1e-5, dtype
        # The public op: output rounded to the input dtype.
        out, lse = neighborhood_attention(qd, kd, vd, plan, implementation="ffi", return_residual=True)
        assert out.dtype == dtype and lse.dtype == jnp.float32
        assert rel_error(out, want_out) <= tolerance(dtype), dtype
        assert rel_error(lse, want_lse) <= 1e-5, dtype


def test_default_implementation_is_native(platform, exact_random):
    """``implementation=None`` runs the native kernels (bitwise equal to forcing "ffi")."""
    plan = _plan(CASES[4])
    q, k, v = (jnp.asarray(x, jnp.float32) for x in _inputs(exact_random, plan, (2,), 2, 8, 8))
    auto = jax.jit(lambda *a: neighborhood_attention(*a, plan, return_residual=True))(q, k, v)
    forced = jax.jit(lambda *a: neighborhood_attention(*a, plan, implementation="ffi", return_residual=True))(q, k, v)
    reference = neighborhood_attention(q, k, v, plan, implementation="reference", return_residual=True)
    for a, f, r in zip(auto, forced, reference):
        np.testing.assert_array_equal(a, f)
        assert not np.array_equal(a, r)  # the reference differs in rounding: the check above can fail


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_16bit_values_are_widened_exactly(platform, dtype):
    """Values that are the same at every key come out unchanged (up to float32 rounding):
    every finite float16 pattern (subnormals included) and a spread of bfloat16 ones."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    exponent = 0x7C00 if dtype == jnp.float16 else 0x7F80
    values = bits[(bits & exponent) != exponent].view(dtype).astype(np.float64)  # every finite value
    if dtype == jnp.float16:
        values = values[::7]  # ~9000 values, ~290 of them subnormal
    else:  # float32 arithmetic on float32 subnormals is not relative-exact; stay normal
        values = values[((np.abs(values) > 1e-30) & (np.abs(values) < 1e30)) | (values == 0)][::97]
    plan = _plan(CASES[0])
    q = jnp.asarray(np.cos(0.7 * np.arange(8 * 16 * 4)).reshape(1, 8, 16, 1, 4), dtype)
    k = jnp.asarray(np.sin(0.3 * np.arange(8 * 16 * 4)).reshape(1, 8, 16, 1, 4), dtype)
    for chunk in np.array_split(values, -(-values.size // 4096)):  # within the CUDA kernels' head-dim limit
        v = jnp.asarray(np.broadcast_to(chunk, (1, *plan.in_shape, 1, chunk.size)), dtype)
        out, _ = _ffi.ffi_forward(q, k, v, plan, full_window(plan), plan.tables.forward_row_order, scale=1.0)
        assert np.all(np.abs(np.asarray(out) - chunk) <= 1e-5 * np.abs(chunk))


def test_empty_batch(platform):
    """Zero-size activations run (nothing to write) and keep their shapes through grad."""
    plan = _plan(CASES[9])
    q = jnp.zeros((0, *plan.out_shape, 2, 5), jnp.bfloat16)
    k = jnp.zeros((0, *plan.in_shape, 2, 5), jnp.bfloat16)
    v = jnp.zeros((0, *plan.in_shape, 2, 3), jnp.bfloat16)

    def loss(q, k, v):
        return jnp.sum(neighborhood_attention(q, k, v, plan, implementation="ffi").astype(jnp.float32))

    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


# ----------------------------------------------------------------------------- windows

# One case per walk kind: self-attention, downsampling (shift), upsampling (residues),
# and more output latitudes than input latitudes with fewer longitudes.
WINDOW_CASES = [CASES[0], CASES[5], CASES[9], CASES[8]]


class _Block:
    """A local block of one grid: global window plus the padded local array shape."""

    def __init__(self, lat0, lon0, nlat, nlon, local_shape):
        self.lat0, self.lon0, self.nlat, self.nlon = lat0, lon0, nlat, nlon
        self.local_shape = local_shape

    def extract(self, x, rng):
        """The block of ``x [B, nlat, nlon, ...]`` padded with noise to the local shape."""
        local = rng.standard_normal((x.shape[0], *self.local_shape, *x.shape[3:])).astype(x.dtype)
        local[:, : self.nlat, : self.nlon] = x[:, self.lat0 : self.lat0 + self.nlat, self.lon0 : self.lon0 + self.nlon]
        return local

    def insert(self, total, local):
        """Add the real part of a local result into the global array ``total``."""
        total[:, self.lat0 : self.lat0 + self.nlat, self.lon0 : self.lon0 + self.nlon] += local[
            :, : self.nlat, : self.nlon
        ]

    def padding(self, local):
        """Every padding element of a local result (flattened)."""
        mask = np.ones(self.local_shape, bool)
        mask[: self.nlat, : self.nlon] = False
        return local[:, mask]


def _tile(nlat, nlon, lat_parts, lon_parts):
    """Blocks tiling a grid unevenly, all with one local shape one larger than the biggest."""
    lats = np.array_split(np.arange(nlat), lat_parts)
    lons = np.array_split(np.arange(nlon), lon_parts)
    local_shape = (max(map(len, lats)) + 1, max(map(len, lons)) + 1)
    return [_Block(int(a[0]), int(o[0]), len(a), len(o), local_shape) for a in lats for o in lons]


def _window(qb, kb):
    return np.array([qb.lat0, qb.lon0, qb.nlat, qb.nlon, kb.lat0, kb.lon0, kb.nlat, kb.nlon], np.int32)


def _windowed_setup(case, exact_random):
    plan = _plan(case)
    q, k, v = (x.astype(np.float32) for x in _inputs(exact_random, plan, (2,), 2, 6, 3))
    q_blocks = _tile(*plan.out_shape, 2, 2)
    k_blocks = _tile(*plan.in_shape, 2, 3)
    return plan, q, k, v, q_blocks, k_blocks


@pytest.mark.parametrize("case", WINDOW_CASES, ids=_case_id)
def test_windowed_forward_merges_to_serial(platform, case, rng, exact_random, rel_error):
    """Query blocks x key blocks (with padding): partials match the windowed reference and
    their log-sum-exp merge equals the serial result."""
    plan, q, k, v, q_blocks, k_blocks = _windowed_setup(case, exact_random)
    scale = 0.4
    serial_out, serial_lse = _ffi.ffi_forward(
        q, k, v, plan, full_window(plan), plan.tables.forward_row_order, scale=scale
    )
    reference = jax.jit(lambda q, k, v, window: reference_local_forward(q, k, v, plan, window, scale=scale))
    out = np.zeros(serial_out.shape)
    lse = np.zeros(serial_lse.shape)
    for qb in q_blocks:
        ql = qb.extract(q, rng)
        order = local_row_order(plan, "forward", qb.lat0, qb.local_shape[0])
        partial_out, partial_lse = [], []
        for kb in k_blocks:
            kl, vl = kb.extract(k, rng), kb.extract(v, rng)
            window = _window(qb, kb)
            o, l = _ffi.ffi_forward(ql, kl, vl, plan, window, order, scale=scale, poison_results=True)
            o, l = np.asarray(o), np.asarray(l)
            assert not np.isnan(o).any() and not np.isnan(l).any()
            assert (qb.padding(o) == 0).all() and (qb.padding(l) == -np.inf).all()
            want_o, want_l = reference(*(jnp.asarray(x, jnp.float64) for x in (ql, kl, vl)), window)
            want_l = np.asarray(want_l)
            np.testing.assert_array_equal(l == -np.inf, want_l == -np.inf)  # same queries without neighbours
            finite = np.isfinite(want_l)
            assert not finite.any() or rel_error(l[finite], want_l[finite]) <= 1e-5
            assert rel_error(o, want_o) <= 1e-5 or np.abs(want_o).max() == 0 == np.abs(o).max()
            partial_out.append(o)
            partial_lse.append(l)
        merged_lse = np.logaddexp.reduce(np.stack(partial_lse), axis=0)  # -inf only on padding
        weights = np.exp(np.stack(partial_lse) - np.where(np.isfinite(merged_lse), merged_lse, 0))[..., None]
        qb.insert(out, np.sum(weights * np.stack(partial_out), axis=0))
        qb.insert(lse, merged_lse)
    assert rel_error(out, serial_out) <= 1e-5
    assert rel_error(lse, serial_lse) <= 1e-5


@pytest.mark.parametrize("case", WINDOW_CASES, ids=_case_id)
def test_windowed_backward_sums_to_serial(platform, case, rng, exact_random, rel_error):
    """dq summed over key blocks and dk/dv over query blocks, with the global lse and
    delta, equal the serial gradients; padding results are zero."""
    plan, q, k, v, q_blocks, k_blocks = _windowed_setup(case, exact_random)
    scale = 0.4
    window = full_window(plan)
    out, lse = _ffi.ffi_forward(q, k, v, plan, window, plan.tables.forward_row_order, scale=scale)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    delta = np.sum(dout * np.asarray(out), axis=-1)
    lse = np.asarray(lse)
    args = (lse, delta, plan, window)
    serial_dq = _ffi.ffi_backward_dq(q, k, v, dout, *args, plan.tables.forward_row_order, scale=scale)
    serial_dk, serial_dv = _ffi.ffi_backward_dkv(q, k, v, dout, *args, plan.tables.backward_row_order, scale=scale)

    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for qb in q_blocks:
        ql, doutl, lsel, deltal = (qb.extract(x, rng).astype(np.float32) for x in (q, dout, lse, delta))
        q_order = local_row_order(plan, "forward", qb.lat0, qb.local_shape[0])
        for kb in k_blocks:
            kl, vl = kb.extract(k, rng), kb.extract(v, rng)
            k_order = local_row_order(plan, "backward", kb.lat0, kb.local_shape[0])
            local = (ql, kl, vl, doutl, lsel, deltal, plan, _window(qb, kb))
            dq_part = np.asarray(_ffi.ffi_backward_dq(*local, q_order, scale=scale, poison_results=True))
            dk_part, dv_part = (
                np.asarray(x) for x in _ffi.ffi_backward_dkv(*local, k_order, scale=scale, poison_results=True)
            )
            for part, block in ((dq_part, qb), (dk_part, kb), (dv_part, kb)):
                assert not np.isnan(part).any() and (block.padding(part) == 0).all()
            qb.insert(dq, dq_part)
            kb.insert(dk, dk_part)
            kb.insert(dv, dv_part)
    assert rel_error(dq, serial_dq) <= 1e-5
    assert rel_error(dk, serial_dk) <= 1e-5
    assert rel_error(dv, serial_dv) <= 1e-5


# ----------------------------------------------------------------------------- large (GPU)

LARGE_CASES = [
    ((721, 1440), (721, 1440), EQ, EQ, None),  # quarter degree, default cutoff
    ((91, 180), (91, 180), EQ, EQ, 0.2),  # polar-heavy: rows of up to thousands of neighbours
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", LARGE_CASES, ids=_case_id)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_large_configs_match_reference(case, dtype, exact_random, rel_error, tolerance):
    plan = _plan(case)
    q, k, v = (jnp.asarray(x, dtype) for x in _inputs(exact_random, plan, (1,), 1, 32, 32))
    dout = jnp.asarray(exact_random(1, *plan.out_shape, 1, 32), dtype)

    def run(implementation, *args):
        def attention(q, k, v):
            return neighborhood_attention(q, k, v, plan, implementation=implementation, return_residual=True)

        (out, lse), vjp = jax.vjp(attention, *args)
        return out, lse, *vjp((dout.astype(out.dtype), jnp.zeros_like(lse)))

    got = jax.jit(lambda *a: run("ffi", *a))(q, k, v)
    want = jax.jit(lambda *a: run("reference", *a))(*(x.astype(jnp.float64) for x in (q, k, v)))
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert rel_error(g, w) <= (1e-5 if name == "lse" else tolerance(dtype)), name


def test_modules_report_the_kernels_limits():
    """Every built module reports the limits of cuda/common/kernel_limits.h (and the CUDA one its arc kernels'
    head-dim bound), which Python's checks and messages read."""
    from jax_s2attn import _native

    reports = [m.build_info()["limits"] for m, _ in _native.MODULES.values() if m is not None]
    for limits in reports:
        assert tuple(limits["arc_dtypes"]) == ("float32", "bfloat16", "float16")
        assert tuple(limits["scheduled_dtypes"]) == ("bfloat16", "float16")
        assert tuple(limits["scheduled_head_dims"]) == (32, 64, 128)
        assert (limits["stencil_max_other_rows"], limits["stencil_max_half"]) == (4, 3)
    limits = _native.kernel_limits()
    assert [d.name for d in limits.scheduled_dtypes] == ["bfloat16", "float16"]
    assert limits.scheduled_head_dims == (32, 64, 128) and limits.stencil_max_half == 3
    # 48 KiB of shared memory hold two vectors of Dk + Dv floats per warp.
    assert limits.cuda_arc_max_head_dims == (6144 if _native.HAS_CUDA_EXT else None)
    if _native.HAS_CUDA_EXT:  # what Python compares with the devices' compute capabilities (_ffi.has_kernels_for)
        architectures = _native.MODULES["cuda"][0].build_info()["limits"]["cuda_architectures"]
        assert architectures and all(a.strip() for a in architectures.split(","))
