"""Global attention on the sphere (torch-harmonics' ``AttentionS2``) via ``jax.nn.dot_product_attention``.

Every output point attends to every input point; the quadrature weight of the
key's latitude multiplies the exponential inside the softmax, i.e. ``log w``
is an additive per-key bias. Two paths:

* ``"xla"``: ``jax.nn.dot_product_attention(..., bias=log w, implementation="xla")``.
  Any backend and dtype. It materialises the logits: ``4*B*H*T*S`` bytes
  (float32) for ``T = nlat_out*nlon_out`` queries and ``S = nlat_in*nlon_in``
  keys, and the backward pass holds as much again. Per batch element and
  head: 268 MB at 64x128, 1.07 GB at 91x180, 16.8 GB at 180x360. Note that
  jax computes this softmax in float32 even for float64 inputs.
* ``"cudnn"`` (GPUs, float16/bfloat16): flash attention, memory linear in
  ``T + S``. cuDNN rejects a broadcast ``[1, 1, 1, S]`` bias, and a
  materialised ``[1, 1, T, S]`` one costs quadratic memory and a 2.4x slower
  backward, so the bias is folded into the dot product instead: two extra
  channels carry ``log w`` split into a high and a low part (so the 8-bit
  mantissa of bfloat16 does not round the weights), the query gets the
  matching constant channels, and all head dims are zero-padded to a multiple
  of 8.

``implementation=None`` takes ``"cudnn"`` on a GPU for float16/bfloat16 inputs
whose padded head dim cuDNN accepts (<= 128), ``"xla"`` otherwise.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ..grids import RingGrid, quadrature_weights
from ..plan import NeighborhoodPlan
from ._checks import check_arrays, check_plan, check_scale

__all__ = ["attention_s2", "quadrature_weights"]

IMPLEMENTATIONS = ("xla", "cudnn")

#: Log-weight given to a key whose quadrature weight is exactly 0. Finite (a
#: -inf bias gives NaN rows and breaks the folded cuDNN path) and still small
#: enough for float16 after the split; exp(-1e4) is 0 in every float dtype.
LOG_ZERO_WEIGHT = -1.0e4

_CUDNN_DTYPES = (jnp.float16, jnp.bfloat16)
_CUDNN_MAX_HEAD_DIM = 128
_CUDNN_HEAD_DIM_MULTIPLE = 8
_FOLD_CHANNELS = 2  # high and low part of log w


def attention_s2(
    query,
    key,
    value,
    quad_weights,
    *,
    scale: float | None = None,
    implementation: str | None = None,
):
    """Attention of every output point over all input points, weighted by quadrature.

    Shape legend: ``B...`` any leading batch axes, ``H`` heads, ``Dk``/``Dv``
    key and value head dims.

    ``out[o] = sum_j w_j exp(s_j) v_j / sum_j w_j exp(s_j)`` over **all** input
    points ``j``, ``s_j = scale * q_o . k_j``, ``w_j`` the weight of ``j``'s
    latitude. Equals :func:`jax_s2attn.neighborhood_attention` with a plan whose
    ``theta_cutoff >= pi``. See the module docstring for the memory each path needs.

    Args:
      query: ``[B..., nlat_out, nlon_out, H, Dk]`` (``quad_weights`` a ring grid: ``[B..., npoints_out, H, Dk]``,
        the output grid's points in ring order).
      key: ``[B..., nlat_in, nlon_in, H, Dk]`` (a ring grid: ``[B..., npoints_in, H, Dk]``).
      value: ``[B..., nlat_in, nlon_in, H, Dv]`` (``[B..., npoints_in, H, Dv]``); one float dtype for all three.
      quad_weights: per-latitude weights of the input grid, ``[nlat_in]`` (e.g.
        :func:`quadrature_weights`), or a :class:`~jax_s2attn.NeighborhoodPlan`
        whose input grid is the key grid (its weights are used), or the input grid as a
        :class:`~jax_s2attn.RingGrid` (its point weights; fields are then flat). Only the
        latitude profile matters: a common factor cancels. A weight of 0 removes
        the key. Weights known when traced (numpy, or concrete arrays) must be
        finite and non-negative with one positive (a ``ValueError`` otherwise);
        traced ones that are NaN or negative make every output NaN.
      scale: logit scale, default ``1/sqrt(Dk)``.
      implementation: ``"xla"``, ``"cudnn"`` or ``None`` (pick, see the module docstring).

    Returns:
      ``[B..., nlat_out, nlon_out, H, Dv]`` (``[B..., npoints_out, H, Dv]``) in the input dtype.
    """
    check_implementation(implementation)
    if isinstance(quad_weights, RingGrid):
        batch, heads, dk, dv = _check_ring_inputs(query, key, value, quad_weights)
        weights, points_per_weight = quad_weights.point_weights(), 1
    else:
        if isinstance(quad_weights, NeighborhoodPlan):
            check_plan(quad_weights)
            quad_weights = quad_weights.quad_weights
        batch, heads, dk, dv = _check_inputs(query, key, value, quad_weights)
        weights, points_per_weight = quad_weights, key.shape[-3]
    scale = check_scale(scale, dk)
    dtype = query.dtype
    folded_dim = _round_up(max(dk + _FOLD_CHANNELS, dv), _CUDNN_HEAD_DIM_MULTIPLE)
    if implementation is None:
        use_cudnn = (
            jax.default_backend() == "gpu"
            and any(dtype == d for d in _CUDNN_DTYPES)
            and folded_dim <= _CUDNN_MAX_HEAD_DIM
        )
        implementation = "cudnn" if use_cudnn else "xla"
    if implementation == "cudnn" and not any(dtype == d for d in _CUDNN_DTYPES):
        raise TypeError(
            f"implementation='cudnn' needs float16 or bfloat16 inputs, got {dtype}; "
            "cast them or use implementation='xla'."
        )

    flat = math.prod(batch)
    if flat * heads == 0:  # an empty batch axis or no heads: nothing to compute
        return jnp.zeros((*query.shape[:-1], dv), dtype)
    q = query.reshape(flat, -1, heads, dk)
    k = key.reshape(flat, -1, heads, dk)
    v = value.reshape(flat, -1, heads, dv)
    log_w = _log_weights(weights, points_per_weight)
    if implementation == "cudnn":
        out = _attention_cudnn_folded(q, k, v, log_w, scale, folded_dim)
    else:
        out = _attention_xla(q, k, v, log_w, scale)
    return out.reshape(*query.shape[:-1], dv)


def check_implementation(implementation) -> None:
    """``implementation`` is None or one of :data:`IMPLEMENTATIONS`."""
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation={implementation!r} is not supported by attention_s2; use None (pick), 'xla' or 'cudnn'."
        )


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _pad_head_dim(x, size: int):
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])


def _log_weights(weights, nlon_in: int):
    """``log w`` per key ``[len(weights) * nlon_in]`` (each weight repeated ``nlon_in`` times: a latitude's, or
    a point's once), float32, shifted so its maximum is 0.

    The shift cancels in the softmax and keeps the values near 0, where a
    low-precision copy of them is most accurate.
    """
    w = jnp.asarray(weights, jnp.float32)
    # 0 removes a key; a NaN or negative weight (only possible when traced) is NaN, as the formula makes it.
    log_w = jnp.where(w > 0, jnp.log(jnp.where(w > 0, w, 1.0)), jnp.where(w == 0, LOG_ZERO_WEIGHT, jnp.nan))
    log_w = log_w - jnp.max(log_w)
    return jnp.repeat(log_w, nlon_in)


def _attention_xla(q, k, v, log_w, scale):
    # jax.nn.dot_product_attention needs one head dim for q, k and v: zero
    # channels change neither q.k nor the kept part of the output.
    dk, dv = q.shape[-1], v.shape[-1]
    size = max(dk, dv)
    bias = log_w.astype(jnp.promote_types(q.dtype, jnp.float32))[None, None, None, :]
    out = jax.nn.dot_product_attention(
        _pad_head_dim(q, size),
        _pad_head_dim(k, size),
        _pad_head_dim(v, size),
        bias=bias,
        scale=scale,
        implementation="xla",
    )
    return out[..., :dv]


def _fold_log_weights(q, k, v, log_w, scale, folded_dim):
    """``(q', k', v')`` with ``scale * q'.k' = scale * q.k + log_w``, head dims zero-padded to ``folded_dim``.

    ``q' = [q, r, r]`` and ``k' = [k, hi, lo]`` with ``r = 1/scale`` rounded to
    the input dtype and ``hi + lo = log_w / (scale * r)`` to float32 accuracy;
    the dot product is accumulated in float32 by cuDNN.
    """
    dtype = q.dtype
    r = jnp.asarray(1.0 / scale, dtype)
    target = log_w / (jnp.float32(scale) * r.astype(jnp.float32))
    hi = target.astype(dtype)
    lo = (target - hi.astype(jnp.float32)).astype(dtype)
    extra_k = jnp.broadcast_to(jnp.stack([hi, lo], axis=-1)[None, :, None, :], (*k.shape[:-1], _FOLD_CHANNELS))
    extra_q = jnp.broadcast_to(r, (*q.shape[:-1], _FOLD_CHANNELS))
    return (
        _pad_head_dim(jnp.concatenate([q, extra_q], axis=-1), folded_dim),
        _pad_head_dim(jnp.concatenate([k, extra_k], axis=-1), folded_dim),
        _pad_head_dim(v, folded_dim),
    )


def _attention_cudnn_folded(q, k, v, log_w, scale, folded_dim):
    folded = _fold_log_weights(q, k, v, log_w, scale, folded_dim)
    out = jax.nn.dot_product_attention(*folded, scale=scale, implementation="cudnn")
    return out[..., : v.shape[-1]]


def _check_inputs(query, key, value, weights) -> tuple[tuple[int, ...], int, int, int]:
    """Validate shapes and dtypes; return ``(batch_shape, heads, Dk, Dv)``."""
    check_arrays(query, key, value)
    arrays = {"query": query, "key": key, "value": value}
    batch, heads, dk = tuple(query.shape[:-4]), query.shape[-2], query.shape[-1]
    nlat_in, nlon_in = key.shape[-4:-2]
    dv = value.shape[-1]
    expected = {"key": (*batch, nlat_in, nlon_in, heads, dk), "value": (*batch, nlat_in, nlon_in, heads, dv)}
    for name, shape in expected.items():
        if tuple(arrays[name].shape) != shape:
            raise ValueError(
                f"{name} has shape {tuple(arrays[name].shape)}, expected {shape} given query {tuple(query.shape)} "
                "and key: key and value share the input grid, and batch axes and heads match the query."
            )
    _check_weights(weights, nlat_in)
    return batch, heads, dk, dv


def _check_ring_inputs(query, key, value, grid: RingGrid) -> tuple[tuple[int, ...], int, int, int]:
    """Validate flat fields on the ring grid ``grid`` of the keys; return ``(batch_shape, heads, Dk, Dv)``."""
    check_arrays(query, key, value, "[..., npoints, heads, head_dim]", rank=3)
    batch, heads, dk, dv = tuple(query.shape[:-3]), query.shape[-2], query.shape[-1], value.shape[-1]
    expected = {"key": (*batch, grid.npoints, heads, dk), "value": (*batch, grid.npoints, heads, dv)}
    for name, x in (("key", key), ("value", value)):
        if tuple(x.shape) != expected[name]:
            raise ValueError(
                f"{name} has shape {tuple(x.shape)}, expected {expected[name]}: {name} lies on the input grid "
                f"{grid.name} ({grid.npoints} points in ring order), batch axes and heads as the query's "
                f"{tuple(query.shape)}."
            )
    return batch, heads, dk, dv


def _check_weights(weights, nlat_in: int) -> None:
    """One real weight per input latitude; where the values are known now, finite, >= 0, one > 0."""
    fix = "pass one weight per input latitude, e.g. jax_s2attn.ops.global_attention.quadrature_weights(shape, grid)"
    dtype = getattr(weights, "dtype", None)
    if dtype is None:
        try:
            weights = np.asarray(weights, np.float64)
        except (TypeError, ValueError):
            kind = type(weights).__name__
            raise TypeError(f"quad_weights must be an array of real numbers, got {kind}; {fix}.") from None
    elif not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
        raise TypeError(f"quad_weights must be real (float or integer), got dtype {dtype}; {fix}.")
    if tuple(jnp.shape(weights)) != (nlat_in,):
        raise ValueError(f"quad_weights has shape {tuple(jnp.shape(weights))}, expected ({nlat_in},); {fix}.")
    try:
        values = np.asarray(weights, np.float64)
    except Exception:  # traced (jax.errors.ConcretizationTypeError and kin): checked by the formula instead
        return
    if not np.isfinite(values).all() or (values < 0).any() or not (values > 0).any():
        bad = np.flatnonzero(~np.isfinite(values) | (values < 0))
        what = f"latitude {int(bad[0])} has weight {values[bad[0]]!r}" if bad.size else "every weight is 0"
        raise ValueError(f"quad_weights must be finite and non-negative with at least one positive: {what}; {fix}.")
