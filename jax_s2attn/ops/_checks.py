"""Trace-time validation of user inputs (every user-facing message lives here) and the
meaning of ``implementation``: which kernel runs where."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ..plan import NeighborhoodPlan
from . import _ffi

#: Values of ``implementation`` besides ``None`` (pick per platform, dtype and head dims).
IMPLEMENTATIONS = ("reference", "ffi", "ffi-arc", "ffi-tiled")
#: The native kernel each forced ``implementation`` runs ("ffi" chooses per platform).
_FORCED_KERNELS = {"ffi-arc": "arc", "ffi-tiled": "tiled"}
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
        return _ffi.tiled_unavailable_reason(platform, dtype, dk, dv)
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
        fix = "Use implementation='ffi' (the tiled kernels where they can run, the arc kernels elsewhere) or 'ffi-arc'."
    else:
        fix = "Use implementation=None or 'reference' (pure JAX: any platform, float64 included)."
    raise ValueError(f"implementation={implementation!r} cannot run {where}: {reason}. {fix}")


def kernel_for(implementation, platform: str | None, dtype, dk: int, dv: int) -> str:
    """What a checked ``implementation`` runs on ``platform``: ``"reference"`` (pure JAX) or
    the native kernel ``"arc"`` or ``"tiled"``.

    ``None`` takes the native kernels where they can run, the reference elsewhere
    (``platform=None``: a platform without native kernels) and for float64; ``"ffi"``
    the tiled kernels where they can run (CUDA, 16-bit inputs, ``Dk == Dv`` in 32/64/128)
    and the arc kernels elsewhere; ``"ffi-arc"``/``"ffi-tiled"`` force one kernel.
    """
    if implementation == "reference":
        return "reference"
    if implementation in _FORCED_KERNELS:
        return _FORCED_KERNELS[implementation]
    if implementation is None and _native_reason("ffi", platform, dtype, dk, dv) is not None:
        return "reference"
    return _ffi.choose_kernel(platform, dtype, dk, dv)


def check_arrays(query, key, value) -> None:
    """query, key and value are float arrays of rank >= 4 sharing one dtype."""
    arrays = {"query": query, "key": key, "value": value}
    for name, x in arrays.items():
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}.")
        if x.ndim < 4:
            raise ValueError(
                f"{name} must have shape [..., nlat, nlon, heads, head_dim] (rank >= 4), got shape {tuple(x.shape)}."
            )
        if not any(x.dtype == d for d in _FLOAT_DTYPES):
            raise TypeError(f"{name} has dtype {x.dtype}; supported dtypes are float16, bfloat16, float32, float64.")
    dtypes = {name: x.dtype for name, x in arrays.items()}
    if len(set(dtypes.values())) > 1:
        raise TypeError(
            "query, key and value must share one dtype, got "
            + ", ".join(f"{n}={d}" for n, d in dtypes.items())
            + "; cast them first (e.g. key.astype(query.dtype))."
        )


def check_inputs(query, key, value, plan) -> tuple[tuple[int, ...], int, int, int]:
    """Validate shapes and dtypes against ``plan``; return ``(batch_shape, heads, Dk, Dv)``."""
    if not isinstance(plan, NeighborhoodPlan):
        raise TypeError(f"plan must be a jax_s2attn.NeighborhoodPlan, got {type(plan).__name__}.")
    check_arrays(query, key, value)
    arrays = {"query": query, "key": key, "value": value}
    batch = tuple(query.shape[:-4])
    heads, dk = query.shape[-2], query.shape[-1]
    dv = value.shape[-1]
    expected = {
        "query": (*batch, plan.nlat_out, plan.nlon_out, heads, dk),
        "key": (*batch, plan.nlat_in, plan.nlon_in, heads, dk),
        "value": (*batch, plan.nlat_in, plan.nlon_in, heads, dv),
    }
    for name, shape in expected.items():
        if tuple(arrays[name].shape) != shape:
            raise ValueError(
                f"{name} has shape {tuple(arrays[name].shape)} but this plan (in_shape={plan.in_shape}, "
                f"out_shape={plan.out_shape}) and query {tuple(query.shape)} need {name} of shape {shape} "
                "([batch..., nlat, nlon, heads, head_dim]; key/value on the input grid, query on the output grid)."
            )
    return batch, heads, dk, dv


def check_scale(scale, dk: int) -> float:
    if scale is None:
        return 1.0 / float(np.sqrt(dk))
    try:
        return float(scale)
    except TypeError:
        raise TypeError(f"scale must be a Python or numpy scalar, got {type(scale).__name__}.") from None
