"""Attention of a local block of queries over a window of keys: the building block
of the serial op's native path and of the sharded op (:mod:`jax_s2attn.parallel`).

Each function has a pure-JAX (``"reference"``) and a native (``"ffi"``)
implementation with identical semantics, documented in ``cuda/README.md``:
forward results over a key window merge exactly through their log-sum-exp, and
the backward pieces are additive over key windows (dq) and query windows (dk, dv)
given the *global* ``lse`` and ``delta = sum(dout * out)``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ..plan import NeighborhoodPlan
from . import reference

__all__ = [
    "full_window",
    "local_row_order",
    "local_forward",
    "local_backward_dq",
    "local_backward_dkv",
]


def full_window(plan: NeighborhoodPlan) -> np.ndarray:
    """The window of a serial call: every query and every key, int32 ``[8]``."""
    return np.array([0, 0, *plan.out_shape, 0, 0, *plan.in_shape], dtype=np.int32)


def local_row_order(plan: NeighborhoodPlan, walk: str, lat0, nrows: int):
    """Local rows ``0..nrows-1`` of a block starting at global row ``lat0``, longest first.

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


def _implementation(name: str):
    if name == "reference":
        return reference
    if name == "ffi":
        from . import _ffi

        return _ffi
    raise ValueError(f"implementation must be 'reference' or 'ffi', got {name!r}.")


def local_forward(query, key, value, plan, window, row_order, *, scale: float, implementation: str):
    """``(out, lse)`` in float32 of ``query`` over the keys inside ``window``."""
    impl = _implementation(implementation)
    fn = impl.reference_local_forward if impl is reference else impl.ffi_forward
    return fn(query, key, value, plan, window, row_order, scale=scale)


def local_backward_dq(query, key, value, dout, lse, delta, plan, window, row_order, *, scale: float, implementation: str):
    """dq (float32) from the keys inside ``window``, given global ``lse`` and ``delta``."""
    impl = _implementation(implementation)
    fn = impl.reference_local_backward_dq if impl is reference else impl.ffi_backward_dq
    return fn(query, key, value, dout, lse, delta, plan, window, row_order, scale=scale)


def local_backward_dkv(query, key, value, dout, lse, delta, plan, window, row_order, *, scale: float, implementation: str):
    """``(dk, dv)`` (float32) from the queries inside ``window``, given global ``lse`` and ``delta``."""
    impl = _implementation(implementation)
    fn = impl.reference_local_backward_dkv if impl is reference else impl.ffi_backward_dkv
    return fn(query, key, value, dout, lse, delta, plan, window, row_order, scale=scale)
