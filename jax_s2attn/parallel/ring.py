"""Longitude ring: attention of a shard's queries over every longitude chunk of its keys.

Runs inside ``shard_map`` over the layout's latitude and longitude mesh axes. The
``P`` longitude shards form a ring; at step ``s`` shard ``r`` holds the (halo-extended)
key/value chunk of shard ``(r + s) mod P``. Each step first issues the ``ppermute``
that passes the chunk to shard ``r - 1`` and then computes on it, so the transfer can
overlap the kernel.

Forward: every step returns a partial ``(out, lse)`` over the keys of its chunk; the
partials merge exactly through their log-sum-exp in float32.

Backward (a ``custom_vjp``): ``delta = sum(dout * out)`` from the merged float32
output, then the ring again. ``dq`` accumulates locally; the ``dk``/``dv`` accumulators
travel with their chunk and a final hop brings them home (a ring reduce-scatter):
no device ever holds keys, values or gradients of more than one chunk.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from ..ops import RESIDUAL_NAME, _ffi, local
from .layout import ShardLayout, window_schedules

__all__ = ["RingConfig", "merge_partials", "ring_attention"]


@dataclasses.dataclass(frozen=True)
class RingConfig:
    """Static parameters of the ring (hashable); ``kernel`` is what each step runs:
    ``"reference"``, ``"arc"`` or ``"scheduled"`` (see :mod:`jax_s2attn.ops.local`)."""

    layout: ShardLayout
    scale: float
    kernel: str


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Combine two partial attention results over disjoint key sets.

    ``out_*`` ``[..., Dv]`` are normalised partial outputs and ``lse_*`` ``[...]`` their
    log-sum-exps (``-inf`` where a partial saw no key). Exact, float32, and free of
    NaNs when both sides are empty (the result is then ``0`` and ``-inf``); a NaN side
    makes the result NaN.
    """
    peak = jnp.maximum(lse_a, lse_b)
    peak = jnp.where(jnp.isneginf(peak), 0.0, peak)
    weight_a, weight_b = jnp.exp(lse_a - peak), jnp.exp(lse_b - peak)
    total = weight_a + weight_b
    out = (out_a * weight_a[..., None] + out_b * weight_b[..., None]) / jnp.where(total == 0, 1.0, total)[..., None]
    return out, peak + jnp.log(total)


def _varying_like(x, like):
    """``x`` typed as varying over the same mesh axes as ``like`` (for loop carries)."""
    varying = lambda a: jax.typeof(a).manual_axis_type.varying  # noqa: E731
    missing = tuple(varying(like) - varying(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


class _Ring:
    """The schedule of this shard: which chunk it holds at each step, and how chunks move."""

    def __init__(self, config: RingConfig):
        layout = config.layout
        self.config = config
        self.parts = layout.k_lon.parts
        self.lat_index = jax.lax.axis_index(layout.lat_axis)
        self.lon_index = jax.lax.axis_index(layout.lon_axis)

    def window(self, step):
        return self.config.layout.window(self.lat_index, self.lon_index, self.chunk(step))

    def chunk(self, step):
        return (self.lon_index + step) % self.parts

    def local_kwargs(self, plan, step) -> dict:
        """The local ops' keyword arguments at ``step``: the scheduled kernels also take the step's window
        schedules."""
        kwargs = {"scale": self.config.scale, "kernel": self.config.kernel}
        if self.config.kernel == "scheduled":
            tile_shape = _ffi.kernel_limits().scheduled_shape
            forward, backward = window_schedules(plan, self.config.layout, *tile_shape)
            index = self.config.layout.window_index(self.lat_index, self.lon_index, self.chunk(step))
            kwargs["schedules"] = _ffi.WindowSchedules(forward, backward, index)
        return kwargs

    def pass_on(self, tree):
        """Send ``tree`` one hop backwards round the ring (to shard ``r - 1``)."""
        perm = [(i, (i - 1) % self.parts) for i in range(self.parts)]
        return jax.lax.ppermute(tree, self.config.layout.lon_axis, perm)

    def run(self, carry, compute):
        """Fold ``compute(state, chunk, step) -> state`` over the ``parts`` chunks.

        ``carry = (chunk, state)``: the chunk moves on before each step's compute
        (except after the last step); the state stays on this shard.
        """
        chunk, state = carry
        if self.parts > 1:

            def body(carry, step):
                chunk, state = carry
                following = self.pass_on(chunk)
                return (following, compute(state, chunk, step)), None

            (chunk, state), _ = jax.lax.scan(body, (chunk, state), jnp.arange(self.parts - 1))
        return compute(state, chunk, self.parts - 1)


def _forward(config: RingConfig, query, key, value, plan):
    ring = _Ring(config)
    q_rows = local.local_row_order(plan, "forward", ring.window(0)[0], query.shape[1])

    def step(state, chunk, s):
        k, v = chunk
        out, lse = local.local_forward(query, k, v, plan, ring.window(s), q_rows, **ring.local_kwargs(plan, s))
        return merge_partials(*state, out, lse)

    out0 = jnp.zeros((*query.shape[:-1], value.shape[-1]), jnp.float32)
    lse0 = jnp.full(query.shape[:-1], -jnp.inf, jnp.float32)
    state = (_varying_like(out0, query), _varying_like(lse0, query))
    return ring.run(((key, value), state), step)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def ring_attention(config: RingConfig, query, key, value, plan):
    """Attention of this shard's queries over the keys of all longitude chunks.

    Args:
      config: layout, scale and local kernel.
      query: ``[B, q_lat.block, q_lon.block, H, Dk]`` this shard's queries.
      key, value: ``[B, k_ext_block, k_lon.block, H, D]`` this shard's halo-extended keys.
      plan: the global :class:`~jax_s2attn.NeighborhoodPlan` (tables replicated).

    Returns:
      ``out`` like ``query`` but with ``Dv`` channels, in the query dtype (zeros in padding).
    """
    out, _ = _forward(config, query, key, value, plan)
    return out.astype(query.dtype)


def _ring_fwd(config, query, key, value, plan):
    out, lse = _forward(config, query, key, value, plan)
    # Residuals named like the serial op's, so one checkpoint policy
    # (save_only_these_names(RESIDUAL_NAME)) keeps the forward ring from running again;
    # the output is computed from the named values so the policy can rebuild it too.
    saved = tuple(checkpoint_name(x, RESIDUAL_NAME) for x in (query, key, value, out, lse))
    return saved[3].astype(query.dtype), (*saved[:3], plan, *saved[3:])


def _ring_bwd(config, residuals, dout):
    query, key, value, plan, out, lse = residuals
    ring = _Ring(config)
    window = ring.window(0)
    q_rows = local.local_row_order(plan, "forward", window[0], query.shape[1])
    k_rows = local.local_row_order(plan, "backward", window[4], key.shape[1])
    delta = local.local_delta(dout, out, kernel=config.kernel)

    def step(state, chunk, s):
        (k, v), (dq, dk, dv) = chunk, state
        w, kwargs = ring.window(s), ring.local_kwargs(plan, s)
        dq = dq + local.local_backward_dq(query, k, v, dout, lse, delta, plan, w, q_rows, **kwargs)
        dk_s, dv_s = local.local_backward_dkv(query, k, v, dout, lse, delta, plan, w, k_rows, **kwargs)
        return dq, dk + dk_s, dv + dv_s

    def step_and_pass(state, chunk, s):
        # The key/value gradients belong to the chunk: they follow it round the ring, and
        # the hop after the last step takes them home.
        dq, dk, dv = step(state, chunk, s)
        return (dq, *ring.pass_on((dk, dv)))

    zeros = lambda like: _varying_like(jnp.zeros(like.shape, jnp.float32), like)  # noqa: E731
    state = (zeros(query), zeros(key), zeros(value))
    dq, dk, dv = ring.run(((key, value), state), step_and_pass if ring.parts > 1 else step)
    return dq.astype(query.dtype), dk.astype(key.dtype), dv.astype(value.dtype), None


ring_attention.defvjp(_ring_fwd, _ring_bwd)
