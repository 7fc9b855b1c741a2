"""Public neighbourhood-attention op: validation, backend choice and batching."""

from __future__ import annotations

import math

from ..plan import NeighborhoodPlan
from . import _checks
from .reference import reference_attention

__all__ = ["neighborhood_attention"]


def neighborhood_attention(
    query,
    key,
    value,
    plan: NeighborhoodPlan,
    *,
    scale: float | None = None,
    implementation: str | None = None,
    return_residual: bool = False,
):
    """Attention of each output point over its geodesic neighbourhood on the sphere.

    Shape legend: ``B...`` any leading batch axes, ``H`` heads, ``Dk``/``Dv``
    key and value head dims, grid sizes from ``plan``.

    ``out[o] = sum_j w_j exp(s_j) v_j / sum_j w_j exp(s_j)`` over the plan's
    neighbours ``j`` of output point ``o``, with ``s_j = scale * q_o . k_j`` and
    ``w_j`` the quadrature weight of ``j``'s latitude (``plan.quad_weights``).
    Computed stably (max-subtracted) with float32 or wider accumulation.

    Args:
      query: ``[B..., nlat_out, nlon_out, H, Dk]``.
      key: ``[B..., nlat_in, nlon_in, H, Dk]``.
      value: ``[B..., nlat_in, nlon_in, H, Dv]``; one dtype for all three
        (float16, bfloat16, float32 or float64).
      plan: the :class:`~jax_s2attn.NeighborhoodPlan` from the input to the output grid.
        Pass it as an ordinary ``jit`` argument to keep its tables out of the
        compiled program; as a static argument or a closure it also works.
      scale: logit scale, default ``1/sqrt(Dk)`` (as ``jax.nn.dot_product_attention``).
      implementation: ``"reference"`` (pure JAX, any backend and dtype),
        ``"ffi"`` (native kernels) or ``None`` to pick the fastest available.
      return_residual: also return the log-sum-exp ``log sum_j w_j exp(s_j)``.

    Returns:
      ``out [B..., nlat_out, nlon_out, H, Dv]`` in the input dtype, and with
      ``return_residual=True`` also ``lse [B..., nlat_out, nlon_out, H]`` (float32,
      float64 for float64 inputs).
    """
    _checks.check_implementation(implementation)
    batch, heads, dk, dv = _checks.check_inputs(query, key, value, plan)
    scale = _checks.check_scale(scale, dk)
    if implementation == "ffi":
        raise ValueError(
            "implementation='ffi' is not available: native attention kernels are not part of this build; "
            "use implementation=None or 'reference'."
        )
    flat = math.prod(batch)
    q = query.reshape(flat, *query.shape[-4:])
    k = key.reshape(flat, *key.shape[-4:])
    v = value.reshape(flat, *value.shape[-4:])
    out, lse = reference_attention(q, k, v, plan, scale)
    out = out.reshape(*batch, *out.shape[1:])
    lse = lse.reshape(*batch, *lse.shape[1:])
    return (out, lse) if return_residual else out
