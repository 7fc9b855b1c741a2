"""Public neighbourhood-attention op: validation, backend choice, and the native custom VJP."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from .. import _validate
from ..plan import NeighborhoodPlan
from ..ring_plan import RingPlan
from . import _checks, _ffi
from .local import full_window
from .reference import reference_attention
from .ring_reference import reference_ring_attention

__all__ = ["RESIDUAL_NAME", "neighborhood_attention"]

#: ``checkpoint_name`` of the tensors the native forward saves for its backward pass
#: (query, key, value, output, lse; the output in float32, and on the scheduled kernels also in the
#: activations' dtype, which they write beside it). Under ``jax.checkpoint`` use
#: ``policy=jax.checkpoint_policies.save_only_these_names(RESIDUAL_NAME)`` so the
#: native forward is not run a second time in the backward pass.
RESIDUAL_NAME = "s2attn_residual"

#: Points per batch entry (rows x longitudes x heads) of a walk's stencil pairs from which the op's tensor-core
#: kernels of that walk leave the pairs to the stencil kernels. A tensor-core kernel and its stencil
#: kernel run one after the other, so the stencil rows pay only when their work outweighs the tensor-core
#: kernel's tail on the other (polar) rows: beside the scheduled kernels (benchmarks/stencil_gate.py, an H100),
#: forward+backward lost 10 % at 53k points (180x360, one head) and gained 14 % at 107k (two heads) and 17-30 %
#: from 160k (docs/performance.md, "Stencil kernels for rows of short arcs"). Batch dims do not count, so
#: that vmap and batch dims pick the same kernels (and give the same bits).
STENCIL_MIN_POINTS = 1 << 16

#: Mean neighbours per output point from which the op runs the scheduled tensor-core kernels between ring grids
#: (below it the ring kernels: there are no stencil kernels for ring grids, and on tiles of 64 points the scheduled
#: kernels multiply mostly columns outside such short arcs; docs/ring-grids.md).
RING_SCHEDULED_MIN_NEIGHBORS = 32


def neighborhood_attention(
    query,
    key,
    value,
    plan: NeighborhoodPlan | RingPlan,
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
      query: ``[B..., nlat_out, nlon_out, H, Dk]`` (with a :class:`~jax_s2attn.RingPlan` ``[B..., npoints_out,
        H, Dk]``).
      key: ``[B..., nlat_in, nlon_in, H, Dk]`` (``[B..., npoints_in, H, Dk]``).
      value: ``[B..., nlat_in, nlon_in, H, Dv]`` (``[B..., npoints_in, H, Dv]``); one dtype for all three
        (float16, bfloat16, float32 or float64).
      plan: the :class:`~jax_s2attn.NeighborhoodPlan` from the input to the output grid.
        Pass it as an ordinary ``jit`` argument to keep its tables out of the
        compiled program; as a static argument or a closure it also works. Between ring grids
        (HEALPix, reduced Gaussian, any longitude counts) a :class:`~jax_s2attn.RingPlan`: fields are then
        flat, ``[B..., npoints, H, D]`` in ring order, and the scheduled kernels (on the plan's ring block
        schedules, :func:`~jax_s2attn.ring_schedule.ring_block_schedule`), the ring kernels or the reference
        compute them.
      scale: logit scale, default ``1/sqrt(Dk)`` (as ``jax.nn.dot_product_attention``).
      implementation: which kernels compute it (see "Implementations" below):
        ``None`` (default), ``"reference"``, ``"ffi"``, ``"ffi-arc"`` or ``"ffi-tiled"`` (the tensor cores).
      return_residual: also return the log-sum-exp ``log sum_j w_j exp(s_j)``.

    Returns:
      ``out [B..., nlat_out, nlon_out, H, Dv]`` in the input dtype, and with
      ``return_residual=True`` also ``lse [B..., nlat_out, nlon_out, H]`` (float32,
      float64 for float64 inputs); with a ``RingPlan`` the grid axes are the one point axis.

    Differentiable in ``query``, ``key`` and ``value`` (and through ``lse``). The
    native backward pass is deterministic; its saved tensors are named
    :data:`RESIDUAL_NAME` for ``jax.checkpoint`` policies.

    Implementations:
      * ``"reference"``: pure JAX, any backend and dtype (the only one computing in float64).
      * arc kernels (native, CPU and CUDA): each output point walks the arc segments of
        its neighbourhood on the CPU or on CUDA cores; float16, bfloat16 and float32
        inputs, any head dims (on CUDA ``Dk + Dv <= 6144``), float32 accumulation, exact
        to float32 round-off. The general native path; between ring grids the ring kernels, the same
        arithmetic on the plan's ring patterns.
      * scheduled kernels (native, CUDA sm_90: H100, H200; the tensor-core path): wgmma on the plan's block
        schedules (:meth:`~jax_s2attn.NeighborhoodPlan.block_schedule`, built once per plan on the host);
        bfloat16 and float16 inputs with ``Dk == Dv`` of 32, 64 or 128, and between ring grids on the plan's ring
        block schedules (:func:`~jax_s2attn.ring_schedule.ring_block_schedule`, from
        :data:`RING_SCHEDULED_MIN_NEIGHBORS` neighbours per output point). Probabilities and score gradients are
        rounded to the input dtype before their products, as in flash attention, so results meet the 16-bit bar
        (1e-2 relative to float64) rather than float32 round-off; out is divided by the row sums of the rounded
        probabilities, so that the backward's delta (from a float32 out when differentiated) stays consistent on
        smooth fields; ``lse`` stays float32-exact. They leave rows of short arcs to CUDA-core stencil kernels
        (float32 throughout) from :data:`STENCIL_MIN_POINTS` such points. Much faster where they apply.

      ``implementation="ffi"`` runs the tensor-core kernels where they apply and the arc kernels everywhere
      else; ``"ffi-arc"`` forces the arc kernels and ``"ffi-tiled"`` the tensor cores. Any ``"ffi*"`` raises a
      ``ValueError`` naming the reason when its kernels cannot run on the inputs' platform (no native module,
      float64, or for ``"ffi-tiled"`` not an sm_90 GPU with a build for sm_90a, not 16-bit, other head dims).
      ``None`` is ``"ffi"`` on
      every platform whose native module is built (:func:`jax_s2attn.native_backends`)
      and ``"reference"`` elsewhere and for float64 inputs. With ``None`` the choice per
      platform is made when the computation is lowered, so a program exported for CUDA
      from a CPU-only machine still uses the CUDA kernels (tensor-core or arc); the forced
      ``"ffi*"`` values check the platform of the inputs instead.
    """
    _checks.check_implementation(implementation)
    if isinstance(plan, RingPlan):
        return _ring_attention(query, key, value, plan, scale, implementation, return_residual)
    _, _, dk, dv = _checks.check_inputs(query, key, value, plan)
    scale = _checks.check_scale(scale, dk)
    return_residual = _validate.boolean(return_residual, "return_residual")
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    platform = _platform_of(query)
    _checks.check_runnable(implementation, platform, query.dtype, dk, dv, where=f"on {platform}")
    _checks.warn_if_falling_back(implementation, platform, query.dtype)
    if query.size == 0:  # a batch axis or the heads are empty (grids and head dims never are)
        out, lse = _empty_results(query, value)
    else:
        with _checks.forward_mode_message():
            out, lse = _attention(query, key, value, plan, scale=scale, implementation=implementation)
    return (out, lse) if return_residual else out


def _ring_attention(query, key, value, plan: RingPlan, scale, implementation, return_residual):
    """neighborhood_attention on a ring-grid plan: flat fields, the scheduled kernels, the ring kernels or the
    pure-JAX reference."""
    _, _, dk, dv = _checks.check_ring_inputs(query, key, value, plan)
    scale = _checks.check_scale(scale, dk)
    return_residual = _validate.boolean(return_residual, "return_residual")
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    _checks.check_ring_runnable(implementation, _platform_of(query), query.dtype, dk, dv)
    if query.size == 0:
        out, lse = _empty_results(query, value)
    else:
        with _checks.forward_mode_message():
            out, lse = _ring_op(query, key, value, plan, scale=scale, implementation=implementation)
    return (out, lse) if return_residual else out


@functools.partial(jax.jit, static_argnames=("scale", "implementation"))
def _ring_op(query, key, value, plan, *, scale, implementation):
    """``(out, lse)`` with the batch axes flattened to one for the kernels: what ``implementation`` means on each
    platform (chosen when lowered), as :func:`_attention`."""
    batch = query.shape[:-3]
    q, k, v = (x.reshape(math.prod(batch), *x.shape[-3:]) for x in (query, key, value))
    dtype, dk, dv = query.dtype, query.shape[-1], value.shape[-1]
    functions = {
        "reference": functools.partial(_ring_reference, scale=scale),
        "arc": functools.partial(_ring_native, scale=scale),
        "scheduled": functools.partial(ring_scheduled, scale=scale),
    }
    kernels = {
        p: ring_family(plan, _checks.ring_kernel_for(implementation, p, dtype, dk, dv), implementation)
        for p in _ffi.NATIVE_PLATFORMS
    }
    if set(kernels.values()) == {"reference"}:
        out, lse = functions["reference"](q, k, v, plan)
    else:
        branches = {platform: functions[kernel] for platform, kernel in kernels.items()}
        out, lse = jax.lax.platform_dependent(q, k, v, plan, default=functions["reference"], **branches)
    return out.reshape(*batch, *out.shape[1:]), lse.reshape(*batch, *lse.shape[1:])


def ring_family(plan: RingPlan, kernel: str, implementation: str | None) -> str:
    """``kernel`` as the op runs it on ``plan``: the scheduled kernels from :data:`RING_SCHEDULED_MIN_NEIGHBORS`
    neighbours per output point or when forced (``"ffi-tiled"``), the ring kernels below, where the scheduled
    ones multiply mostly columns outside the arcs (any other kernel as it is)."""
    few = plan.num_pairs < RING_SCHEDULED_MIN_NEIGHBORS * plan.npoints_out
    return "arc" if kernel == "scheduled" and few and implementation != "ffi-tiled" else kernel


def _ring_reference(query, key, value, plan, *, scale):
    return reference_ring_attention(query, key, value, plan, scale)


def _ring_native(query, key, value, plan, scale):
    """``(out in the input dtype, lse float32)`` from the ring kernels (``[B, npoints, H, D]`` fields) on ``plan``'s
    two walks."""
    forward, forward_sizes = _ffi.ring_walk_tables(plan, "queries")
    backward, backward_sizes = _ffi.ring_walk_tables(plan, "keys")
    return ring_walks(query, key, value, forward, backward, (forward_sizes, backward_sizes), scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def ring_walks(query, key, value, forward, backward, sizes, scale):
    """``(out in the input dtype, lse float32)`` of the ring targets walking the queries' tables ``forward`` (the
    forward and dq) and the keys' tables ``backward`` (dk/dv), with ``sizes`` their
    :class:`~jax_s2attn.ops._ffi.RingWalkSizes`: a :class:`~jax_s2attn.RingPlan`'s (:func:`_ring_native`) or a
    shard's (the sharded op). The backward runs the dq and dk/dv targets."""
    out, lse = _ffi.ffi_ring_forward(query, key, value, forward, sizes[0], scale=scale)
    return out.astype(query.dtype), lse


def _ring_walks_forward(query, key, value, forward, backward, sizes, scale):
    out, lse = _ffi.ffi_ring_forward(query, key, value, forward, sizes[0], scale=scale)
    saved = tuple(checkpoint_name(x, RESIDUAL_NAME) for x in (query, key, value, out, lse))
    return (saved[3].astype(query.dtype), saved[4]), (saved, forward, backward)


def _ring_walks_backward(sizes, scale, residuals, cotangents):
    (query, key, value, out, lse), forward, backward = residuals
    dout, dlse = cotangents
    delta = _ffi.ffi_delta(dout, out, dlse)  # from the float32 out, in a fixed order
    dq = _ffi.ffi_ring_backward_dq(query, key, value, dout, lse, delta, forward, sizes[0], scale=scale)
    dk, dv = _ffi.ffi_ring_backward_dkv(query, key, value, dout, lse, delta, backward, sizes[1], scale=scale)
    tables_cotangent = jax.tree.map(_zero_cotangent, (forward, backward))
    return dq.astype(query.dtype), dk.astype(key.dtype), dv.astype(value.dtype), *tables_cotangent


ring_walks.defvjp(_ring_walks_forward, _ring_walks_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def ring_scheduled(query, key, value, plan, scale):
    """``(out in the input dtype, lse float32)`` of the scheduled tensor-core kernels on ``plan``'s ring block
    schedules (``[B, npoints, H, D]`` fields, 16-bit); the backward runs the scheduled dq that forms delta from the
    float32 out, then dk/dv, as on regular grids."""
    return _ffi.ffi_ring_scheduled_forward(query, key, value, plan, scale=scale, out_dtype=query.dtype)


def _ring_scheduled_forward(query, key, value, plan, scale):
    out, lse = _ffi.ffi_ring_scheduled_forward(query, key, value, plan, scale=scale)  # float32 out, for delta
    saved = tuple(checkpoint_name(x, RESIDUAL_NAME) for x in (query, key, value, out, lse))
    return (saved[3].astype(query.dtype), saved[4]), saved


def _ring_scheduled_backward(plan, scale, residuals, cotangents):
    query, key, value, out, lse = residuals
    dout, dlse = cotangents
    gradients = dict(scale=scale, gradient_dtype=query.dtype)
    dq, delta = _ffi.ffi_ring_scheduled_dq_delta(query, key, value, dout, lse, out, dlse, plan, **gradients)
    dk, dv = _ffi.ffi_ring_scheduled_dkv(query, key, value, dout, lse, delta, plan, **gradients)
    return dq, dk, dv


ring_scheduled.defvjp(_ring_scheduled_forward, _ring_scheduled_backward)


def _empty_results(query, value):
    """``(out, lse)`` of a call with an empty batch axis or no heads: empty arrays of the op's result types."""
    lse_dtype = jnp.promote_types(query.dtype, jnp.float32)
    out = jnp.zeros((*query.shape[:-1], value.shape[-1]), query.dtype)
    return out, jnp.zeros(query.shape[:-1], lse_dtype)


def _platform_of(x) -> str:
    """jax platform name of a concrete array; the default backend for traced values."""
    try:
        platform = next(iter(x.devices())).platform
    except (AttributeError, jax.errors.ConcretizationTypeError):  # tracers and numpy arrays
        platform = jax.default_backend()
    return _ffi.ffi_platform(platform)


def _reference(query, key, value, plan, scale):
    batch = query.shape[:-4]
    flat = math.prod(batch)
    q = query.reshape(flat, *query.shape[-4:])
    k = key.reshape(flat, *key.shape[-4:])
    v = value.reshape(flat, *value.shape[-4:])
    out, lse = reference_attention(q, k, v, plan, scale)
    return out.reshape(*batch, *out.shape[1:]), lse.reshape(*batch, *lse.shape[1:])


@functools.partial(jax.jit, static_argnames=("scale", "implementation"))
def _attention(query, key, value, plan, *, scale, implementation):
    """Run what ``implementation`` means on each platform (chosen when lowered).

    Jitted, so that an eager call (a notebook, ``check_grads`` without ``jit``) compiles once per
    shape instead of dispatching every operation of the reference path one by one; inside a
    caller's ``jit`` it is inlined.
    """
    dtype, dk, dv = query.dtype, query.shape[-1], value.shape[-1]
    kernels = {p: _checks.kernel_for(implementation, p, dtype, dk, dv) for p in _ffi.NATIVE_PLATFORMS}
    default = _checks.kernel_for(implementation, None, dtype, dk, dv)  # platforms without native kernels
    # One function object per kernel: platform_dependent traces a shared branch only once.
    functions = {
        kernel: functools.partial(_reference, scale=scale)
        if kernel == "reference"
        else functools.partial(_native_attention, scale=scale, kernel=kernel)
        for kernel in {default, *kernels.values()}
    }
    if len(functions) == 1:
        return functions[default](query, key, value, plan)
    branches = {platform: functions[kernel] for platform, kernel in kernels.items()}
    return jax.lax.platform_dependent(query, key, value, plan, default=functions[default], **branches)


# ----------------------------------------------------------------------------- native path


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _native_attention(query, key, value, plan, scale, kernel):
    """``(out in the input dtype, lse float32)`` from the native ``kernel`` ("arc" or "scheduled"), whole grids;
    the backward pass runs the same kernel family. The scheduled forward writes out in the input dtype itself (no
    float32 out, no cast after it); differentiated, also a float32 out for delta (:func:`_native_forward`)."""
    out, lse, _ = _whole_grid_forward(query, key, value, plan, scale, kernel, differentiated=False)
    return out, lse


def _whole_grid_forward(query, key, value, plan, scale, kernel, differentiated):
    """``(out, lse, out32)`` of ``kernel`` on whole grids: out in the input dtype, and where ``differentiated`` the
    float32 out the backward forms delta from (else None). The scheduled forward writes both itself (beside the
    stencil rows out32 holds the scheduled rows only: the stencil dq forms its rows' delta from its own
    probabilities); the arc forward writes float32, cast after it."""
    if kernel == "scheduled":
        stencil = uses_stencil_rows(plan, query, kernel)
        results = _ffi.ffi_scheduled_forward(query, key, value, plan, scale=scale, out_dtype=query.dtype,
                                             float32_out=differentiated, stencil=stencil)  # fmt: skip
        return results if differentiated else (*results, None)
    out32, lse = _ffi.ffi_forward(query, key, value, plan, full_window(plan), plan.tables.forward_row_order,
                                  scale=scale)  # fmt: skip
    return out32.astype(query.dtype), lse, out32


def uses_stencil_rows(plan: NeighborhoodPlan, query, kernel: str, walk: str = "forward") -> bool:
    """Whether the op on ``kernel`` leaves ``plan``'s stencil pairs of ``walk`` ("forward": its forward and dq;
    "backward": its dk/dv) to the stencil kernels for queries shaped like ``query``: on the scheduled kernels, from
    :data:`STENCIL_MIN_POINTS` points per batch entry (rows x longitudes x heads) of the pairs of whole tiles of
    their schedule (:func:`~jax_s2attn.ops._ffi.stencil_schedule`)."""
    if kernel != "scheduled":
        return False
    pairs = _ffi.stencil_schedule(plan, walk).pairs
    points = 2 * len(pairs) * (plan.nlon_out if walk == "forward" else plan.nlon_in) * query.shape[-2]
    return points >= STENCIL_MIN_POINTS


def _native_forward(query, key, value, plan, scale, kernel):
    # The backward forms delta from out, which a rounded out is too coarse for: both families keep it in float32.
    out, lse, out32 = _whole_grid_forward(query, key, value, plan, scale, kernel, differentiated=True)
    # The outputs are computed from the named values so that a checkpoint policy saving the names can rebuild them
    # too (they feed the caller's own backward pass): the scheduled kernels' out is named itself, the arc kernels'
    # is the cast of the named float32 out.
    saved = tuple(checkpoint_name(x, RESIDUAL_NAME) for x in (query, key, value, out32, lse))
    out32, lse = saved[3:]
    out = checkpoint_name(out, RESIDUAL_NAME) if kernel == "scheduled" else out32.astype(query.dtype)
    return (out, lse), (saved, plan)


def _native_backward(scale, kernel, residuals, cotangents):
    (query, key, value, out, lse), plan = residuals
    dout, dlse = cotangents
    # delta from the unrounded (float32) output, never from a rounded one. A cotangent of lse adds dlse * p_j to
    # every score gradient, exactly as lowering delta by dlse does. The native targets sum in a fixed order: the
    # gradients are the same bits in every program. The scheduled dq kernels form delta at their entry (one pass
    # over dout and out fewer; beside them the stencil dq forms its rows' from its own probabilities, reading no
    # out) and write the gradients in the activations' dtype (the bits a cast gives, half the bytes); the arc
    # kernels take delta from the delta target.
    if kernel == "scheduled":
        gradients = dict(scale=scale, gradient_dtype=query.dtype)
        dq, delta = _ffi.ffi_scheduled_dq_delta(query, key, value, dout, lse, out, dlse, plan, **gradients,
                                                stencil=uses_stencil_rows(plan, query, kernel))  # fmt: skip
        dk, dv = _ffi.ffi_scheduled_dkv(query, key, value, dout, lse, delta, plan, **gradients,
                                        stencil=uses_stencil_rows(plan, query, kernel, "backward"))  # fmt: skip
    else:
        dq, dk, dv = _arc_backward(query, key, value, out, lse, plan, dout, dlse, scale)
    plan_cotangent = jax.tree.map(_zero_cotangent, plan)
    return dq.astype(query.dtype), dk.astype(key.dtype), dv.astype(value.dtype), plan_cotangent


def _arc_backward(query, key, value, out, lse, plan, dout, dlse, scale):
    """dq, dk and dv of the arc kernels (the plan's tables, whole-grid windows), float32."""
    window, tables = full_window(plan), plan.tables
    delta = _ffi.ffi_delta(dout, out, dlse)
    dq = _ffi.ffi_backward_dq(query, key, value, dout, lse, delta, plan, window, tables.forward_row_order, scale=scale)
    dk, dv = _ffi.ffi_backward_dkv(
        query, key, value, dout, lse, delta, plan, window, tables.backward_row_order, scale=scale
    )
    return dq, dk, dv


def _zero_cotangent(table):
    if jnp.issubdtype(table.dtype, jnp.floating):
        return jnp.zeros_like(table)
    return np.zeros(table.shape, dtype=jax.dtypes.float0)


_native_attention.defvjp(_native_forward, _native_backward)
