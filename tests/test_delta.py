"""The delta target: ``sum(dout * out, -1) - dlse`` against float64, fully written, the same
bits in every compiled program, and its errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_s2attn.ops import _ffi
from jax_s2attn.ops.local import local_delta

pytestmark = pytest.mark.skipif(not _ffi.HAS_CPU_EXT, reason="native CPU module not built")

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]

# (batch dims, nlat, nlon, heads, Dv)
SHAPES = [
    ((), 3, 4, 1, 1),
    ((2,), 3, 5, 4, 5),
    ((1, 2), 2, 3, 4, 64),
    ((3,), 2, 2, 1, 130),
]


def _operands(rng, exact_random, batch, nlat, nlon, heads, dv):
    """dout exactly representable in every dtype (so one float64 oracle serves all), out and
    dlse arbitrary float32."""
    dout = exact_random(*batch, nlat, nlon, heads, dv)
    out = rng.standard_normal((*batch, nlat, nlon, heads, dv)).astype(np.float32)
    dlse = rng.standard_normal((*batch, nlat, nlon, heads)).astype(np.float32)
    return dout, out, dlse


def _oracle(dout, out, dlse):
    return np.sum(np.float64(dout) * np.float64(out), axis=-1) - np.float64(dlse)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_delta_matches_float64(platform, shape, dtype, rng, exact_random, rel_error):
    dout, out, dlse = _operands(rng, exact_random, *shape)
    # Results start as NaN: an element the kernel leaves unwritten fails the comparison.
    got = _ffi.ffi_delta(jnp.asarray(dout, dtype), out, dlse, poison_results=True)
    assert got.dtype == jnp.float32 and got.shape == dlse.shape
    # dout is exact in every dtype, so only the float32 sum rounds.
    assert rel_error(got, _oracle(dout, out, dlse)) <= 1e-6


def test_delta_without_dlse_is_the_plain_sum(rng, exact_random, rel_error):
    dout, out, _ = _operands(rng, exact_random, (2,), 3, 4, 2, 7)
    got = _ffi.ffi_delta(jnp.asarray(dout, jnp.bfloat16), out)
    assert rel_error(got, np.sum(np.float64(dout) * out, axis=-1)) <= 1e-6


@pytest.mark.parametrize("kernel", _ffi.KERNELS)
def test_local_delta_of_native_kernels_matches_the_reference(rng, exact_random, kernel, rel_error):
    dout, out, dlse = _operands(rng, exact_random, (2,), 3, 4, 2, 9)
    dout = jnp.asarray(dout, jnp.float16)
    want = local_delta(dout, out, dlse, kernel="reference")
    assert rel_error(local_delta(dout, out, dlse, kernel=kernel), want) <= 1e-6
    assert rel_error(local_delta(dout, out, kernel=kernel), np.sum(np.float64(dout) * out, axis=-1)) <= 1e-6


def test_head_dim_zero_gives_minus_dlse(platform, rng):
    dlse = rng.standard_normal((2, 3, 4, 2)).astype(np.float32)
    empty = np.zeros((2, 3, 4, 2, 0), np.float32)
    got = _ffi.ffi_delta(empty.astype(jnp.float16), empty, dlse, poison_results=True)
    np.testing.assert_array_equal(np.asarray(got), -dlse)


@pytest.mark.parametrize("shape", [(0, 3, 4, 2, 5), (3, 0, 4, 2, 5), (3, 4, 2, 0, 5)], ids=str)
def test_empty_arrays(platform, shape):
    dout = jnp.ones(shape, jnp.bfloat16)
    got = _ffi.ffi_delta(dout, jnp.ones(shape, jnp.float32), jnp.ones(shape[:-1], jnp.float32))
    assert got.shape == shape[:-1] and got.dtype == jnp.float32


def test_vmap_matches_the_batched_call(rng, exact_random):
    dout, out, dlse = _operands(rng, exact_random, (3,), 2, 4, 2, 6)
    dout = jnp.asarray(dout, jnp.float16)
    mapped = jax.vmap(_ffi.ffi_delta, in_axes=(0, 0, None))(dout, out, dlse[0])
    batched = _ffi.ffi_delta(dout, out, np.broadcast_to(dlse[0], dlse.shape))
    np.testing.assert_array_equal(np.asarray(mapped), np.asarray(batched))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_delta_is_the_same_bits_in_different_programs(platform, dtype, rng, exact_random):
    """The reason the target exists: a jnp reduction is fused differently per program (e.g.
    with the output's convert, as in the op's backward); the target's order is fixed."""
    dout, out, dlse = _operands(rng, exact_random, (2,), 6, 12, 4, 64)
    dout = jnp.asarray(dout, dtype)
    alone = jax.jit(_ffi.ffi_delta)(dout, out, dlse)

    def with_fused_neighbours(dout, out, dlse):
        delta = _ffi.ffi_delta(dout, out, dlse)
        return delta, out.astype(dtype), jnp.sum(out * 2.0, axis=-1)

    fused, *_ = jax.jit(with_fused_neighbours)(dout, jnp.array(out, copy=True), dlse)
    eager = _ffi.ffi_delta(dout, out, dlse)
    for other in (fused, eager):
        np.testing.assert_array_equal(np.asarray(alone).view(np.uint32), np.asarray(other).view(np.uint32))


# ----------------------------------------------------------------------------- errors

SHAPE = (2, 3, 4, 2, 5)


@pytest.mark.parametrize(
    "dout, out, dlse, error, message",
    [
        ((3, 4, 2), SHAPE, SHAPE[:-1], ValueError, "dout must have shape"),
        (SHAPE, (2, 3, 4, 2, 6), SHAPE[:-1], ValueError, "out must be float32 with the shape of dout"),
        (SHAPE, SHAPE, (2, 3, 4, 1), ValueError, r"dlse must be float32 of shape \(2, 3, 4, 2\)"),
        (SHAPE, SHAPE, SHAPE, ValueError, "dlse must be float32"),
    ],
)
def test_wrong_shapes_are_value_errors(dout, out, dlse, error, message):
    with pytest.raises(error, match=message):
        _ffi.ffi_delta(jnp.ones(dout, jnp.bfloat16), jnp.ones(out, jnp.float32), jnp.ones(dlse, jnp.float32))


def test_wrong_dtypes_are_type_and_value_errors():
    f32 = jnp.float32
    with pytest.raises(TypeError, match="dout must be float32, bfloat16 or float16, got float64"):
        _ffi.ffi_delta(jnp.ones(SHAPE, jnp.float64), jnp.ones(SHAPE, f32), jnp.ones(SHAPE[:-1], f32))
    with pytest.raises(ValueError, match="out must be float32 .* got bfloat16"):
        _ffi.ffi_delta(jnp.ones(SHAPE, f32), jnp.ones(SHAPE, jnp.bfloat16), jnp.ones(SHAPE[:-1], f32))
    with pytest.raises(ValueError, match="dlse must be float32 .* got float16"):
        _ffi.ffi_delta(jnp.ones(SHAPE, f32), jnp.ones(SHAPE, f32), jnp.ones(SHAPE[:-1], jnp.float16))


def _raw_delta(dout, out, dlse, result_shape):
    """The target called directly, past the wrapper's checks."""
    _ffi.ensure_registered()
    call = jax.ffi.ffi_call(_ffi.DELTA_TARGET, jax.ShapeDtypeStruct(result_shape, jnp.float32))
    return call(dout, out, dlse)


@pytest.mark.parametrize(
    "out, dlse, result, message",
    [
        ((2, 3, 4, 2, 6), SHAPE[:-1], SHAPE[:-1], r"out has the wrong shape: expected \[batch..., 3, 4, 2, 5\]"),
        ((3, 3, 4, 2, 5), SHAPE[:-1], SHAPE[:-1], "out has the wrong shape.*batch dims of dout \\(2 in all\\)"),
        (SHAPE, (2, 3, 4), SHAPE[:-1], "dlse has the wrong shape"),
        (SHAPE, SHAPE[:-1], (2, 3, 4, 3), "delta has the wrong shape"),
    ],
)
def test_cpu_handler_rejects_bad_shapes(out, dlse, result, message):
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        call = lambda: _raw_delta(  # noqa: E731
            jnp.ones(SHAPE, jnp.float16), jnp.ones(out, jnp.float32), jnp.ones(dlse, jnp.float32), result
        )
        with pytest.raises(jax.errors.JaxRuntimeError, match=f"(?s)INVALID_ARGUMENT: .*{message}"):
            jax.block_until_ready(call())


def test_cpu_handler_rejects_an_integer_dout():
    with jax.default_device(jax.devices("cpu")[0]):
        call = lambda: _raw_delta(  # noqa: E731
            jnp.ones(SHAPE, jnp.int32), jnp.ones(SHAPE, jnp.float32), jnp.ones(SHAPE[:-1], jnp.float32), SHAPE[:-1]
        )
        with pytest.raises(jax.errors.JaxRuntimeError, match="INVALID_ARGUMENT: .*dout must be float32"):
            jax.block_until_ready(call())
