"""Trace-time validation of user inputs (every user-facing message lives here) and the
meaning of ``implementation``: which kernel runs where."""

from __future__ import annotations

import contextlib
import threading
import warnings

import jax.numpy as jnp
import numpy as np

from .. import _validate
from ..plan import NeighborhoodPlan
from ..ring_plan import RingPlan
from . import _ffi

#: Values of ``implementation`` besides ``None`` (pick per platform, dtype and head dims).
IMPLEMENTATIONS = ("reference", "ffi", "ffi-arc", "ffi-tiled")
#: The native kernel each forced ``implementation`` runs ("ffi" chooses per platform).
_FORCED_KERNELS = {"ffi-arc": "arc", "ffi-tiled": "scheduled"}
_FLOAT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)


def check_implementation(implementation) -> None:
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation={implementation!r} is not supported; use None (pick the fastest available), "
            + ", ".join(repr(i) for i in IMPLEMENTATIONS[:-1])
            + f" or {IMPLEMENTATIONS[-1]!r}."
        )


def _native_reason(implementation: str, platform: str | None, dtype, dk: int, dv: int) -> str | None:
    """Why the native kernels ``implementation`` (one of the "ffi" values) needs cannot run."""
    if implementation == "ffi-tiled":
        return _ffi.scheduled_unavailable_reason(platform, dtype, dk, dv)
    arc_dtypes = () if _ffi.kernel_limits() is None else _ffi.kernel_limits().arc_dtypes
    if arc_dtypes and jnp.dtype(dtype) not in arc_dtypes:
        names = _ffi.dtype_names(arc_dtypes)
        return f"the native kernels accumulate in float32 and take {names} inputs, got {jnp.dtype(dtype).name}"
    return _ffi.unavailable_reason(platform, dk, dv)


def check_runnable(implementation, platform: str, dtype, dk: int, dv: int, *, where: str) -> None:
    """A forced native ``implementation`` ("ffi", "ffi-arc", "ffi-tiled") must be able to run
    inputs of ``dtype`` and head dims ``dk``/``dv`` on ``platform``; ``where`` completes
    "cannot run ..." in the message (e.g. "on cpu")."""
    if implementation is None or implementation == "reference":
        return
    reason = _native_reason(implementation, platform, dtype, dk, dv)
    if reason is None:
        return
    if implementation == "ffi-tiled":
        fix = "Use implementation='ffi' (the tensor cores where they can run, the arc kernels elsewhere) or 'ffi-arc'."
    else:
        fix = "Use implementation=None or 'reference' (pure JAX: any platform, float64 included)."
    raise ValueError(f"implementation={implementation!r} cannot run {where}: {reason}. {fix}")


def kernel_for(implementation, platform: str | None, dtype, dk: int, dv: int) -> str:
    """What a checked ``implementation`` runs on ``platform``: ``"reference"`` (pure JAX) or
    the native kernel ``"arc"`` or ``"scheduled"``.

    ``None`` takes the native kernels where they can run, the reference elsewhere
    (``platform=None``: a platform without native kernels) and for float64; ``"ffi"``
    the tensor-core kernels where they can run (an sm_90 GPU with a build for sm_90a, 16-bit inputs,
    ``Dk == Dv`` in 32/64/128) and the arc kernels elsewhere; ``"ffi-arc"`` forces the arc kernels,
    ``"ffi-tiled"`` the tensor cores.
    """
    if implementation == "reference":
        return "reference"
    if implementation in _FORCED_KERNELS:
        return _FORCED_KERNELS[implementation]
    if implementation is None and _native_reason("ffi", platform, dtype, dk, dv) is not None:
        return "reference"
    return _ffi.choose_kernel(platform, dtype, dk, dv)


def check_arrays(query, key, value, layout: str = "[..., nlat, nlon, heads, head_dim]", rank: int = 4) -> None:
    """query, key and value are float arrays of rank >= ``rank`` (their ``layout``) with head dims >= 1, sharing
    one dtype."""
    arrays = {"query": query, "key": key, "value": value}
    for name, x in arrays.items():
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}.")
        if x.ndim < rank:
            raise ValueError(f"{name} must have shape {layout} (rank >= {rank}), got shape {tuple(x.shape)}.")
        if not any(x.dtype == d for d in _FLOAT_DTYPES):
            raise TypeError(f"{name} has dtype {x.dtype}; supported dtypes are float16, bfloat16, float32, float64.")
        if x.shape[-1] < 1:
            raise ValueError(f"{name} has head_dim 0 (shape {tuple(x.shape)}); heads need at least one channel.")
    dtypes = {name: x.dtype for name, x in arrays.items()}
    if len(set(dtypes.values())) > 1:
        raise TypeError(
            "query, key and value must share one dtype, got "
            + ", ".join(f"{n}={d}" for n, d in dtypes.items())
            + "; cast them first (e.g. key.astype(query.dtype))."
        )


def check_ring_inputs(query, key, value, plan: RingPlan) -> tuple[tuple[int, ...], int, int, int]:
    """Validate flat fields against a ring-grid ``plan``; return ``(batch_shape, heads, Dk, Dv)``."""
    layout = "[..., npoints, heads, head_dim]"
    check_arrays(query, key, value, layout, rank=3)
    if query.shape[-3] != plan.npoints_out:
        raise ValueError(
            f"query has shape {tuple(query.shape)}: its point axis (-3) must hold the plan's {plan.npoints_out} "
            f"output points of {plan.grid_out.name} in ring order ({layout})."
        )
    batch, (heads, dk), dv = tuple(query.shape[:-3]), query.shape[-2:], value.shape[-1]
    expected = {"key": (*batch, plan.npoints_in, heads, dk), "value": (*batch, plan.npoints_in, heads, dv)}
    for name, x in (("key", key), ("value", value)):
        if tuple(x.shape) != expected[name]:
            raise ValueError(
                f"{name} has shape {tuple(x.shape)}, expected {expected[name]}: {name} lies on the plan's input grid "
                f"{plan.grid_in.name} ({plan.npoints_in} points in ring order) with query's batch axes {batch} and "
                f"heads ({heads})" + (f" and head_dim ({dk})" if name == "key" else "") + f" ({layout})."
            )
    return batch, heads, dk, dv


def check_ring_runnable(implementation, platform: str, dtype, dk: int, dv: int) -> None:
    """A forced native ``implementation`` must be able to run a ring-grid plan's inputs of ``dtype`` and head dims
    ``dk``/``dv`` on ``platform``: ``"ffi"`` and ``"ffi-arc"`` the ring kernels, ``"ffi-tiled"`` the scheduled
    tensor-core kernels."""
    if implementation is None or implementation == "reference":
        return
    if implementation == "ffi-tiled":
        reason = _ffi.scheduled_unavailable_reason(platform, dtype, dk, dv)
    else:
        reason = _ffi.ring_unavailable_reason(platform, dtype, dk, dv)
    if reason is not None:
        raise ValueError(
            f"implementation={implementation!r} cannot run a RingPlan on {platform}: {reason}. Use "
            "implementation=None (the fastest kernels that can run) or 'reference' (pure JAX: any platform, "
            "float64 included)."
        )


def ring_kernel_for(implementation, platform: str, dtype, dk: int, dv: int) -> str:
    """What a checked ``implementation`` runs on a ring-grid plan on ``platform``: ``"scheduled"`` (the
    tensor-core kernels on the plan's ring block schedules), ``"arc"`` (the ring kernels) or ``"reference"``.
    ``None`` and ``"ffi"`` take the scheduled kernels where they and the ring kernels (the same CUDA module) can
    run, else the ring kernels (``None``: the reference where the ring kernels cannot run); ``"ffi-arc"`` forces
    the ring kernels, ``"ffi-tiled"`` the scheduled ones."""
    if implementation == "reference":
        return "reference"
    if implementation == "ffi-tiled":
        return "scheduled"
    if implementation is None and _ffi.ring_unavailable_reason(platform, dtype, dk, dv) is not None:
        return "reference"
    if implementation != "ffi-arc" and _ffi.scheduled_unavailable_reason(platform, dtype, dk, dv) is None:
        return "scheduled"
    return "arc"


def check_plan(plan) -> None:
    """``plan`` is a :class:`NeighborhoodPlan` whose device tables are intact."""
    if isinstance(plan, RingPlan):
        raise TypeError(
            "plan is a RingPlan: this takes the regular grids of a jax_s2attn.NeighborhoodPlan; attention between "
            "ring grids runs serially through jax_s2attn.neighborhood_attention, and over a mesh through "
            "jax_s2attn.parallel.sharded_ring_attention."
        )
    if not isinstance(plan, NeighborhoodPlan):
        raise TypeError(
            f"plan must be a jax_s2attn.NeighborhoodPlan (e.g. NeighborhoodPlan(in_shape, out_shape)), "
            f"got {type(plan).__name__}."
        )
    plan.check_tables()


def check_inputs(query, key, value, plan) -> tuple[tuple[int, ...], int, int, int]:
    """Validate shapes and dtypes against ``plan``; return ``(batch_shape, heads, Dk, Dv)``."""
    check_plan(plan)
    check_arrays(query, key, value)
    layout = "[batch..., nlat, nlon, heads, head_dim]"
    if tuple(query.shape[-4:-2]) != plan.out_shape:
        raise ValueError(
            f"query has shape {tuple(query.shape)}: its grid axes (-4, -3) must be the plan's output grid "
            f"{plan.out_shape} ({layout}; this plan: in_shape={plan.in_shape}, out_shape={plan.out_shape})."
        )
    batch, (heads, dk), dv = tuple(query.shape[:-4]), query.shape[-2:], value.shape[-1]
    arrays = {"key": key, "value": value}
    expected = {
        "key": (*batch, plan.nlat_in, plan.nlon_in, heads, dk),
        "value": (*batch, plan.nlat_in, plan.nlon_in, heads, dv),
    }
    for name, shape in expected.items():
        if tuple(arrays[name].shape) != shape:
            raise ValueError(
                f"{name} has shape {tuple(arrays[name].shape)}, expected {shape}: {name} lies on the plan's input "
                f"grid {plan.in_shape} with query's batch axes {batch} and heads ({heads})"
                + (f" and head_dim ({dk})" if name == "key" else "")
                + f" ({layout})."
            )
    return batch, heads, dk, dv


def check_scale(scale, dk: int) -> float:
    """The logit scale: ``1/sqrt(dk)`` for None, else a finite positive number."""
    if scale is None:
        return 1.0 / float(np.sqrt(dk))
    return _validate.positive_finite(scale, "scale", hint="; pass e.g. 1/sqrt(head_dim), or None for that default")


_warned_fallbacks: set[str] = set()
_warn_lock = threading.Lock()


class NativeFallbackWarning(UserWarning):
    """``implementation=None`` runs the pure-JAX reference because no native kernels are usable."""


def warn_if_falling_back(implementation, platform: str, dtype) -> None:
    """Warn once per platform when ``implementation=None`` takes the reference for lack of native kernels
    (not for float64, which only the reference computes)."""
    if implementation is not None or jnp.dtype(dtype) == jnp.float64:
        return
    reason = _ffi.unavailable_reason(platform)
    if reason is None:
        return
    with _warn_lock:
        if platform in _warned_fallbacks:
            return
        _warned_fallbacks.add(platform)
    warnings.warn(
        f"jax_s2attn runs the pure-JAX reference on {platform} (several times slower than the native kernels): "
        f"{reason}. jax_s2attn.native_status() tells what is built; pass implementation='reference' to choose "
        "it explicitly (and silence this warning).",
        NativeFallbackWarning,
        stacklevel=3,
    )


#: The start of jax's message for forward-mode AD of a custom_vjp function (the native path).
_JAX_FORWARD_MODE_MESSAGE = "can't apply forward-mode autodiff (jvp) to a custom_vjp function"


@contextlib.contextmanager
def forward_mode_message():
    """Turn jax's error for forward-mode AD (``jvp``, ``jacfwd``, ``linearize``) of the native kernels,
    which are reverse-mode only, into one that names the way out."""
    try:
        yield
    except TypeError as e:
        if _JAX_FORWARD_MODE_MESSAGE not in str(e):
            raise
        raise TypeError(
            "the native kernels of jax_s2attn are differentiable in reverse mode only (jax.grad, jax.vjp); "
            "for forward-mode AD (jax.jvp, jax.jacfwd, jax.hessian) pass implementation='reference' (pure JAX, "
            "any order)."
        ) from e
