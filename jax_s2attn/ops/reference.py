"""Pure-JAX neighbourhood attention: the definition of the op and the fallback path.

Runs on any backend and in any float dtype (float64 included) and is
differentiated by JAX itself. Output points are processed in buckets of
similar neighbourhood size (padding to the next power of two wastes at most
half the work) and, inside a bucket, in chunks whose gathered keys and values
stay under a fixed element budget, so no array of all (query, neighbour) pairs
is ever materialised — neither in the forward nor, thanks to rematerialisation
of each chunk, in the backward pass.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..plan import NeighborhoodPlan

__all__ = ["reference_attention"]

#: Elements of gathered key/value data held per chunk (64 MiB in float32).
DEFAULT_CHUNK_ELEMENTS = 1 << 24


class _Bucket(NamedTuple):
    patterns: np.ndarray  # [n] query patterns in this bucket
    arc_slots: np.ndarray  # [n, max_arcs] rows of the forward arc table, -1 padded
    width: int  # neighbour slots per query (power of two)


@functools.lru_cache(maxsize=64)
def _buckets(plan: NeighborhoodPlan) -> tuple[_Bucket, ...]:
    table = plan.forward_arcs
    lengths = table.pattern_lengths
    widths = 1 << np.ceil(np.log2(np.maximum(lengths, 1))).astype(np.int64)
    buckets = []
    for width in np.unique(widths):
        patterns = np.flatnonzero(widths == width)
        starts, stops = table.offsets[patterns], table.offsets[patterns + 1]
        slots = starts[:, None] + np.arange((stops - starts).max())[None, :]
        slots = np.where(slots < stops[:, None], slots, -1)
        buckets.append(_Bucket(patterns.astype(np.int32), slots.astype(np.int32), int(width)))
    return tuple(buckets)


def _bucket_attention(q, k, v, logw, arcs, plan, bucket, scale, chunk_elements):
    """Attention for every output point of one bucket.

    Returns flat query indices ``[n]`` and ``(out [B, n, H, Dv], lse [B, n, H])``.
    """
    table = plan.forward_arcs
    nlon_k, nlon_q = plan.nlon_in, plan.nlon_out
    positions = nlon_q // table.residues  # outputs sharing one pattern
    batch, _, heads, dk = q.shape
    dv = v.shape[-1]
    count = bucket.patterns.size * positions
    per_query = max(1, batch * heads * (dk + dv) * bucket.width)
    chunk = int(min(count, max(1, chunk_elements // per_query)))
    num_chunks = -(-count // chunk)
    patterns = jnp.asarray(bucket.patterns)
    arc_slots = jnp.asarray(bucket.arc_slots)
    slot = jnp.arange(bucket.width)

    @jax.checkpoint
    def one_chunk(start):
        t = jnp.minimum(start + jnp.arange(chunk), count - 1)
        local, position = t // positions, t % positions
        pattern = patterns[local]
        query_index = (pattern // table.residues) * nlon_q + position * table.residues + pattern % table.residues
        slots = arc_slots[local]
        arc = arcs[jnp.maximum(slots, 0)]  # [c, A, 3]
        length = jnp.where(slots >= 0, arc[..., 2], 0)
        ends = jnp.cumsum(length, axis=-1)  # [c, A]
        which = jnp.sum(ends[:, None, :] <= slot[None, :, None], axis=-1)  # [c, L]
        which = jnp.minimum(which, ends.shape[-1] - 1)
        row = jnp.take_along_axis(arc[..., 0], which, axis=-1)
        lo = jnp.take_along_axis(arc[..., 1], which, axis=-1)
        offset = slot[None, :] - jnp.take_along_axis(ends - length, which, axis=-1)
        lon = (lo + offset + table.shift * position[:, None]) % nlon_k
        key_index = row * nlon_k + lon
        valid = slot[None, :] < ends[:, -1:]

        qc = q[:, query_index]  # [B, c, H, Dk]
        kc = k[:, key_index]  # [B, c, L, H, Dk]
        vc = v[:, key_index]
        logits = jnp.einsum("bchd,bclhd->bchl", qc, kc) * scale + logw[row][None, :, None, :]
        logits = jnp.where(valid[None, :, None, :], logits, -jnp.inf)
        peak = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
        weights = jnp.exp(logits - peak)
        total = jnp.sum(weights, axis=-1)
        out = jnp.einsum("bchl,bclhd->bchd", weights, vc) / total[..., None]
        lse = peak[..., 0] + jnp.log(total)
        return query_index, out, lse

    index, out, lse = jax.lax.map(one_chunk, jnp.arange(num_chunks) * chunk)
    # [num_chunks, (B,) chunk, ...] -> [(B,) num_chunks*chunk, ...], then drop the clamped tail.
    index = index.reshape(-1)[:count]
    out = jnp.moveaxis(out, 0, 1).reshape(batch, -1, heads, dv)[:, :count]
    lse = jnp.moveaxis(lse, 0, 1).reshape(batch, -1, heads)[:, :count]
    return index, out, lse


def reference_attention(query, key, value, plan: NeighborhoodPlan, scale, *, chunk_elements=DEFAULT_CHUNK_ELEMENTS):
    """Neighbourhood attention in plain JAX; see :func:`jax_s2attn.neighborhood_attention`.

    Inputs must already be validated and have one leading batch axis:
    ``query [B, nlat_out, nlon_out, H, Dk]``, ``key [B, nlat_in, nlon_in, H, Dk]``,
    ``value [B, nlat_in, nlon_in, H, Dv]``.

    Returns:
      ``(out, lse)``: ``out [B, nlat_out, nlon_out, H, Dv]`` in the input dtype and the
      natural-log normaliser ``lse = log sum_j w_j exp(s_j)`` ``[B, nlat_out, nlon_out, H]``
      in float32 (float64 for float64 inputs).
    """
    dtype = query.dtype
    compute = jnp.promote_types(dtype, jnp.float32)
    batch, nlat_q, nlon_q, heads, _ = query.shape
    dv = value.shape[-1]
    q = query.astype(compute).reshape(batch, nlat_q * nlon_q, heads, -1)
    k = key.astype(compute).reshape(batch, plan.nlat_in * plan.nlon_in, heads, -1)
    v = value.astype(compute).reshape(batch, plan.nlat_in * plan.nlon_in, heads, dv)
    tables = plan.tables
    logw = jnp.log(tables.quad_weights.astype(compute))
    out = jnp.zeros((batch, nlat_q * nlon_q, heads, dv), compute)
    lse = jnp.zeros((batch, nlat_q * nlon_q, heads), compute)
    for bucket in _buckets(plan._host):
        index, o, l = _bucket_attention(q, k, v, logw, tables.forward_arcs, plan, bucket, scale, chunk_elements)
        out = out.at[:, index].set(o, unique_indices=True)
        lse = lse.at[:, index].set(l, unique_indices=True)
    out = out.reshape(batch, nlat_q, nlon_q, heads, dv).astype(dtype)
    return out, lse.reshape(batch, nlat_q, nlon_q, heads)
