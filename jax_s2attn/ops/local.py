"""Attention of a local block of queries over a window of keys: the building block
of the serial op's native path and of the sharded op (:mod:`jax_s2attn.parallel`).

Each function runs one ``kernel``: ``"reference"`` (pure JAX) or a native kernel family,
``"arc"`` or ``"scheduled"`` (:data:`jax_s2attn.ops._ffi.KERNELS`; the caller checks that it can run; the
scheduled kernels also take the window's schedules, :class:`~jax_s2attn.ops._ffi.WindowSchedules`, in place of
``row_order``), all with identical semantics, documented in ``cuda/README.md``:
forward results over a key window merge exactly through their log-sum-exp, and
the backward pieces are additive over key windows (dq) and query windows (dk, dv)
given the *global* ``lse`` and ``delta = sum(dout * out)``.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..plan import NeighborhoodPlan
from . import _ffi, reference
from ._ffi import full_window

__all__ = [
    "full_window",
    "local_row_order",
    "local_forward",
    "local_backward_dq",
    "local_backward_dkv",
    "local_delta",
]


def local_row_order(plan: NeighborhoodPlan, walk: str, lat0, nrows: int):
    """Local rows ``0..nrows-1`` of a block starting at global row ``lat0``, in the plan's order (longest first).

    ``walk`` is ``"forward"`` (query rows; forward and dq) or ``"backward"`` (key
    rows; dk/dv). ``lat0`` may be traced (it differs per device under ``shard_map``);
    rows past the grid's edge (padding) go last.
    """
    if walk not in ("forward", "backward"):
        raise ValueError(f"walk must be 'forward' or 'backward', got {walk!r}.")
    order = plan.tables.forward_row_order if walk == "forward" else plan.tables.backward_row_order
    nlat = order.shape[-1]
    rank = jnp.zeros(nlat, jnp.int32).at[order].set(jnp.arange(nlat, dtype=jnp.int32))
    rows = lat0 + jnp.arange(nrows, dtype=jnp.int32)
    rank_local = jnp.where(rows < nlat, rank[jnp.clip(rows, 0, nlat - 1)], nlat + rows)
    return jnp.argsort(rank_local).astype(jnp.int32)


def _check_kernel(kernel: str) -> None:
    if kernel != "reference" and kernel not in _ffi.KERNELS:
        raise ValueError(f"kernel must be 'reference' or one of {_ffi.KERNELS}, got {kernel!r}.")


def _local_op(kernel: str, reference_op, arc_op, scheduled_op, schedules):
    """``reference_op`` for ``"reference"``, ``scheduled_op`` (on ``schedules``, without a row order) for
    ``"scheduled"``, ``arc_op`` for ``"arc"``."""
    _check_kernel(kernel)
    if kernel == "reference":
        return reference_op
    if kernel == "scheduled":
        if schedules is None:
            raise ValueError("kernel='scheduled' needs the window's schedules (schedules=WindowSchedules(...)).")

        def scheduled(*args, scale):
            *operands, window, _ = args  # the schedule orders the work: no row order
            return scheduled_op(*operands, window=window, schedules=schedules, scale=scale)

        return scheduled
    return arc_op


def local_forward(query, key, value, plan, window, row_order, *, scale: float, kernel: str, schedules=None):
    """``(out, lse)`` in float32 of ``query`` over the keys inside ``window``."""
    fn = _local_op(kernel, reference.reference_local_forward, _ffi.ffi_forward, _ffi.ffi_scheduled_forward, schedules)
    return fn(query, key, value, plan, window, row_order, scale=scale)


def local_backward_dq(
    query, key, value, dout, lse, delta, plan, window, row_order, *, scale: float, kernel: str, schedules=None
):  # fmt: skip
    """dq (float32) from the keys inside ``window``, given global ``lse`` and ``delta``.

    float32 because the callers sum these partial
    gradients over key blocks: rounding each partial to 16 bits would lose precision."""
    fn = _local_op(kernel, reference.reference_local_backward_dq, _ffi.ffi_backward_dq, _ffi.ffi_scheduled_dq,
                   schedules)  # fmt: skip
    return fn(query, key, value, dout, lse, delta, plan, window, row_order, scale=scale)


def local_backward_dkv(
    query, key, value, dout, lse, delta, plan, window, row_order, *, scale: float, kernel: str, schedules=None
):  # fmt: skip
    """``(dk, dv)`` (float32) from the queries inside ``window``, given global ``lse`` and ``delta``."""
    fn = _local_op(kernel, reference.reference_local_backward_dkv, _ffi.ffi_backward_dkv, _ffi.ffi_scheduled_dkv,
                   schedules)  # fmt: skip
    return fn(query, key, value, dout, lse, delta, plan, window, row_order, scale=scale)


def _reference_delta(dout, out, dlse):
    delta = jnp.sum(dout.astype(jnp.float32) * out, axis=-1)
    return delta if dlse is None else delta - dlse


def local_delta(dout, out, dlse=None, *, kernel: str):
    """``delta = sum(dout * out, -1) - dlse`` (float32) of the backward pieces, from the float32
    ``out``; ``dlse`` None means zero. The native kernels sum in a fixed order (one delta target
    serves both kernel families), so ``delta`` (and with it the gradients) is the same bits in
    every compiled program."""
    _check_kernel(kernel)
    return _reference_delta(dout, out, dlse) if kernel == "reference" else _ffi.ffi_delta(dout, out, dlse)
