"""Misuse of the native path: trace-time errors of the op, INVALID_ARGUMENT from the handlers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_s2attn import NeighborhoodPlan, neighborhood_attention
from jax_s2attn.ops import _ffi
from jax_s2attn.ops.local import full_window

native = pytest.mark.skipif(not _ffi.HAS_CPU_EXT, reason="native CPU module not built")


@pytest.fixture
def plan():
    return NeighborhoodPlan((12, 24), (6, 12))  # downsampling: tables differ per direction


def _arrays(plan, heads=2, dk=4, dv=3, dtype=np.float32):
    rng = np.random.default_rng(0)
    return (
        rng.standard_normal((2, *plan.out_shape, heads, dk)).astype(dtype),
        rng.standard_normal((2, *plan.in_shape, heads, dk)).astype(dtype),
        rng.standard_normal((2, *plan.in_shape, heads, dv)).astype(dtype),
    )


# ----------------------------------------------------------------------------- trace time


@native
def test_forcing_ffi_with_float64_is_a_value_error(plan):
    q, k, v = _arrays(plan, dtype=np.float64)
    with pytest.raises(ValueError, match="float64"):
        neighborhood_attention(q, k, v, plan, implementation="ffi")
    out = neighborhood_attention(q, k, v, plan)  # the default routes float64 to the reference
    assert out.dtype == jnp.float64


def test_forcing_ffi_without_a_native_module_names_the_reason(plan, monkeypatch):
    monkeypatch.setitem(_ffi.MODULES, "cpu", (None, "_s2attn_cpu is not built (test)"))
    q, k, v = _arrays(plan)
    with pytest.raises(ValueError, match=r"cannot run on cpu: _s2attn_cpu is not built \(test\)"):
        neighborhood_attention(jax.device_put(q, jax.devices("cpu")[0]), k, v, plan, implementation="ffi")


@native
def test_mixed_dtypes_are_a_type_error(plan):
    q, k, v = _arrays(plan)
    with pytest.raises(TypeError, match="share one dtype"):
        neighborhood_attention(q, k.astype(jnp.bfloat16), v, plan, implementation="ffi")


@native
def test_wrong_shapes_are_value_errors_before_any_kernel(plan):
    q, k, v = _arrays(plan)
    with pytest.raises(ValueError, match="key has shape"):
        jax.jit(lambda q, k, v: neighborhood_attention(q, k, v, plan, implementation="ffi"))(q, k[:, :-1], v)


def test_ffi_call_needs_a_query_grid(plan):
    q, k, v = _arrays(plan)
    with pytest.raises(ValueError, match="query must have shape"):
        _ffi.ffi_forward(q[0, 0], k, v, plan, full_window(plan), plan.tables.forward_row_order, scale=0.5)


# ----------------------------------------------------------------------------- handlers


def _with_table(plan, **tables):
    """The plan with some device tables replaced (what a corrupted pytree would carry)."""
    return jax.tree.unflatten(jax.tree.structure(plan), list(plan.tables._replace(**tables)))


def _forward_args(plan):
    q, k, v = _arrays(plan)
    return dict(query=q, key=k, value=v, plan=plan, window=full_window(plan), row_order=plan.tables.forward_row_order)


# name -> (change to the forward call, expected message). Shapes and dtypes are checked
# by every platform's handler; table contents only where tables are host memory (CPU).
SHAPE_ERRORS = {
    "heads": (lambda a: {"key": a["key"][..., :1, :]}, "same number of heads"),
    "head_dim": (lambda a: {"key": a["key"][..., :3]}, "same head dim"),
    "value_grid": (lambda a: {"value": a["value"][:, :, :-1]}, "k and v must cover the same grid block"),
    "batch": (lambda a: {"value": a["value"][:1]}, r"same leading \(batch\) dims"),
    "rank": (lambda a: {"key": a["key"][0, 0]}, "k must have rank >= 4"),
    "dtype": (lambda a: {k: a[k].astype(np.float64) for k in ("query", "key", "value")}, "float32, bfloat16 or float16"),
    "mixed_dtype": (lambda a: {"key": a["key"].astype(jnp.bfloat16)}, "share one dtype"),
    "window_size": (lambda a: {"window": a["window"][:7]}, "window has 7 elements"),
    "row_order_size": (lambda a: {"row_order": a["row_order"][:-1]}, "row_order has 5 elements"),
    "offsets_size": (lambda a: {"plan": _with_table(a["plan"], forward_offsets=a["plan"].tables.backward_offsets)},
                     "arc_offsets has"),
}
CONTENT_ERRORS = {
    "window_outside_grid": (lambda a: {"window": np.array([0, 0, 6, 12, 1, 0, 12, 24], np.int32)}, "window: key block"),
    "window_beyond_local_block": (lambda a: {"window": np.array([0, 0, 7, 12, 0, 0, 12, 24], np.int32)},
                                  "window: query block"),
    "negative_window": (lambda a: {"window": np.array([0, -1, 6, 12, 0, 0, 12, 24], np.int32)}, "window: query block"),
    "row_order": (lambda a: {"row_order": np.zeros(6, np.int32)}, "row_order must be a permutation"),
    "arc_outside_grid": (
        lambda a: {"plan": _with_table(a["plan"], forward_arcs=a["plan"].tables.forward_arcs.at[0, 1].set(24))},
        "arc 0 = .* is outside the 12x24 grid",
    ),
    "offsets_decreasing": (
        lambda a: {"plan": _with_table(a["plan"], forward_offsets=a["plan"].tables.forward_offsets.at[1].set(-1))},
        "non-decreasing",
    ),
}


def _expect_invalid_argument(call, message):
    with pytest.raises(jax.errors.JaxRuntimeError, match=f"(?s)INVALID_ARGUMENT: .*{message}"):
        jax.block_until_ready(call())


@native
@pytest.mark.parametrize("name", sorted(SHAPE_ERRORS))
def test_forward_handler_rejects_bad_shapes(platform, plan, name):
    args = _forward_args(plan)
    change, message = SHAPE_ERRORS[name]
    args.update(change(args))
    _expect_invalid_argument(lambda: _ffi.ffi_forward(**args, scale=0.5), message)


@native
@pytest.mark.parametrize("name", sorted(CONTENT_ERRORS))
def test_cpu_handler_rejects_bad_tables(plan, name):
    args = _forward_args(plan)
    change, message = CONTENT_ERRORS[name]
    args.update(change(args))
    _expect_invalid_argument(lambda: _ffi.ffi_forward(**args, scale=0.5), message)


def _backward_args(plan):
    q, k, v = _arrays(plan)
    out, lse = _ffi.ffi_forward(q, k, v, plan, full_window(plan), plan.tables.forward_row_order, scale=0.5)
    dout = np.ones(out.shape, np.float32)
    delta = np.sum(dout * np.asarray(out), axis=-1)
    return dict(query=q, key=k, value=v, dout=dout, lse=lse, delta=delta, plan=plan, window=full_window(plan))


BACKWARD_ERRORS = {
    "dout_dtype": (lambda a: {"dout": a["dout"].astype(jnp.float16)}, "dout must have the dtype of q"),
    "dout_shape": (lambda a: {"dout": a["dout"][..., :2]}, "dout has the wrong shape"),
    "lse_shape": (lambda a: {"lse": a["lse"][:, :, :-1]}, "lse has the wrong shape"),
    "delta_shape": (lambda a: {"delta": a["delta"][..., None]}, "delta has the wrong shape"),
    "lse_dtype": (lambda a: {"lse": a["lse"].astype(jnp.bfloat16)}, "Wrong buffer dtype"),
}


@native
@pytest.mark.parametrize("name", sorted(BACKWARD_ERRORS))
@pytest.mark.parametrize("target", ["dq", "dkv"])
def test_backward_handlers_reject_bad_operands(platform, plan, name, target):
    args = _backward_args(plan)
    change, message = BACKWARD_ERRORS[name]
    args.update(change(args))
    if target == "dq":
        call = lambda: _ffi.ffi_backward_dq(**args, row_order=plan.tables.forward_row_order, scale=0.5)  # noqa: E731
    else:
        call = lambda: _ffi.ffi_backward_dkv(**args, row_order=plan.tables.backward_row_order, scale=0.5)  # noqa: E731
    _expect_invalid_argument(call, message)


def test_cuda_head_dim_limit_is_known_before_lowering():
    if not _ffi.HAS_CUDA_EXT:
        pytest.skip("the CUDA module is not built")
    assert _ffi.unavailable_reason("cuda", 64, 64) is None
    assert "Dk + Dv <= 6144" in _ffi.unavailable_reason("cuda", 4000, 4000)


@native
@pytest.mark.parametrize("target", ["forward", "dq", "dkv"])
def test_scheduled_result_dtypes_are_checked_before_lowering(plan, target):
    """The scheduled targets write float32 or the activations' dtype, named before anything is lowered."""
    q, k, v = _arrays(plan, dk=64, dv=64, dtype=jnp.bfloat16)
    common = dict(query=q, key=k, value=v, plan=plan, scale=0.5)
    if target == "forward":
        call, name, args = _ffi.ffi_scheduled_forward, "out_dtype", dict(out_dtype=jnp.float16)
    else:
        rows = np.zeros(q.shape[:-1], np.float32)
        dout = np.ones((*q.shape[:-1], v.shape[-1]), jnp.bfloat16)
        call = _ffi.ffi_scheduled_dq if target == "dq" else _ffi.ffi_scheduled_dkv
        name, args = "gradient_dtype", dict(dout=dout, lse=rows, delta=rows, gradient_dtype=jnp.float16)
    with pytest.raises(ValueError, match=rf"{name} must be float32 or bfloat16 \(the dtype of query\), got float16"):
        call(**common, **args)


@native
def test_the_scheduled_forward_refuses_a_float32_copy_beside_a_float32_out(plan):
    """float32_out=True (out also in float32, the third result) needs an out in the activations' dtype: a ValueError
    naming both arguments, before anything is lowered."""
    q, k, v = _arrays(plan, dk=64, dv=64, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match=r"float32_out=True needs out_dtype=bfloat16 .* got out_dtype=float32"):
        _ffi.ffi_scheduled_forward(q, k, v, plan, scale=0.5, float32_out=True)


# (change of the arguments, error, message) for the scheduled dq that forms delta.
DQ_DELTA_ERRORS = {
    "gradient-dtype": (lambda a: dict(gradient_dtype=jnp.float16), ValueError, "gradient_dtype must be float32 or bf"),
    "out-dtype": (lambda a: dict(out=a["out"].astype(jnp.bfloat16)), ValueError, "out must be float32 .* got bfloat16"),
    "out-shape": (lambda a: dict(out=a["out"][..., :-1]), ValueError, "out must be float32 with the shape of dout"),
    "dlse-shape": (lambda a: dict(dlse=a["dlse"][..., :1]), ValueError, r"dlse must be float32 of shape \(2, 6, 12, 2"),
    "dout-dtype": (lambda a: dict(dout=a["dout"].astype(np.float64)), TypeError, "dout must be float32, bfloat16 or"),
}


@native
@pytest.mark.parametrize("name", DQ_DELTA_ERRORS)
def test_dq_that_forms_delta_checks_its_operands_before_lowering(plan, name):
    """The scheduled dq that forms delta takes out and dlse as the delta target does, checked in Python:
    a handler's error would crash jax 0.11.2's GPU runtime."""
    q, k, v = _arrays(plan, dk=64, dv=64, dtype=jnp.bfloat16)
    rows = np.zeros(q.shape[:-1], np.float32)
    args = dict(query=q, key=k, value=v, dout=np.ones((*q.shape[:-1], v.shape[-1]), jnp.bfloat16), lse=rows,
                out=np.ones((*q.shape[:-1], v.shape[-1]), np.float32), dlse=rows, plan=plan, scale=0.5)  # fmt: skip
    change, error, message = DQ_DELTA_ERRORS[name]
    with pytest.raises(error, match=message):
        _ffi.ffi_scheduled_dq_delta(**(args | change(args)))


@native
@pytest.mark.parametrize("target", ["forward", "dq", "dkv"])
def test_arc_handlers_refuse_16_bit_results(platform, plan, target, monkeypatch):
    """The handlers' own check on the results' types (the Python wrappers ask for float32 only)."""
    args = _backward_args(plan)
    rank, result_type = len(args["query"].shape), _ffi._result_type
    monkeypatch.setattr(_ffi, "_result_type", lambda like, shape, dtype: result_type(
        like, shape, jnp.float16 if len(shape) == rank else dtype))  # fmt: skip
    if target == "forward":
        call = lambda: _ffi.ffi_forward(args["query"], args["key"], args["value"], plan, args["window"],  # noqa: E731
                                        plan.tables.forward_row_order, scale=0.5)  # fmt: skip
    elif target == "dq":
        call = lambda: _ffi.ffi_backward_dq(**args, row_order=plan.tables.forward_row_order, scale=0.5)  # noqa: E731
    else:
        call = lambda: _ffi.ffi_backward_dkv(**args, row_order=plan.tables.backward_row_order, scale=0.5)  # noqa: E731
    message = r"must be float32 \(16-bit results come from the scheduled and stencil targets\), got float16"
    _expect_invalid_argument(call, message)


@native
def test_handlers_refuse_mixed_gradient_types(platform, plan, monkeypatch):
    """dk float32 with dv float16: the handler names both (the Python wrappers never ask for it)."""
    args = _backward_args(plan)
    value_shape, result_type = tuple(args["value"].shape), _ffi._result_type
    monkeypatch.setattr(_ffi, "_result_type", lambda like, shape, dtype: result_type(
        like, shape, jnp.float16 if tuple(shape) == value_shape else dtype))  # fmt: skip
    call = lambda: _ffi.ffi_backward_dkv(**args, row_order=plan.tables.backward_row_order, scale=0.5)  # noqa: E731
    _expect_invalid_argument(call, "dk and dv must be float32 .*, got float32 and float16")
