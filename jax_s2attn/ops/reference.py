"""Pure-JAX neighbourhood attention: the definition of the op and the fallback path.

Runs on any backend and in any float dtype (float64 included) and is
differentiated by JAX itself. Every function walks the plan's *forward* arc table
from each query, gathering the neighbours' keys and values in chunks whose size
stays under a fixed element budget; each chunk is rematerialised in the
backward pass, so no array of all (query, neighbour) pairs ever exists.

Two ways to enumerate queries:

* serial (:func:`reference_attention`): output points are grouped in buckets of
  similar neighbourhood size (padding to the next power of two wastes at most
  half the work);
* windowed (:func:`reference_local_forward` and the backward pieces): a local
  block of queries whose global position is only known at run time (under
  ``shard_map``), attending to a window of keys; every query is padded to the
  plan's largest neighbourhood. This mirrors the native kernels' contract
  (``cuda/README.md``) and is their oracle.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..plan import NeighborhoodPlan

__all__ = [
    "reference_attention",
    "reference_local_forward",
    "reference_local_backward_dq",
    "reference_local_backward_dkv",
]

#: Elements of gathered key/value data held per chunk (64 MiB in float32).
DEFAULT_CHUNK_ELEMENTS = 1 << 24


class _Bucket(NamedTuple):
    patterns: np.ndarray  # [n] query patterns in this bucket
    max_arcs: int  # most arcs of any pattern in the bucket
    width: int  # neighbour slots per query (power of two)


@functools.lru_cache(maxsize=64)
def _buckets(plan: NeighborhoodPlan) -> tuple[_Bucket, ...]:
    table = plan.forward_arcs
    lengths = table.pattern_lengths
    arcs_per_pattern = np.diff(table.offsets)
    widths = 1 << np.ceil(np.log2(np.maximum(lengths, 1))).astype(np.int64)
    return tuple(
        _Bucket(patterns.astype(np.int32), int(arcs_per_pattern[patterns].max()), int(width))
        for width in np.unique(widths)
        for patterns in [np.flatnonzero(widths == width)]
    )


def _chunk_size(count: int, per_query: int, chunk_elements: int) -> int:
    return int(min(max(count, 1), max(1, chunk_elements // max(1, per_query))))


def _arc_slots(offsets, arcs, pattern, max_arcs: int, width: int, length_column: int):
    """Each query's ``width`` neighbour slots laid in order over the arcs of its pattern, ``arcs[offsets[p] :
    offsets[p + 1]]`` (rows whose column ``length_column`` is the arc's length; at most ``max_arcs`` a pattern).

    Returns ``(fields, offset, valid)``: the row of each slot's arc ``[c, width, columns]``, the slot's place in
    that arc ``[c, width]``, and whether the slot is a neighbour at all (not padding).
    """
    start, stop = offsets[pattern], offsets[pattern + 1]
    slots = start[:, None] + jnp.arange(max_arcs)[None, :]
    present = slots < stop[:, None]
    arc = arcs[jnp.where(present, slots, 0)]  # [c, A, columns]
    length = jnp.where(present, arc[..., length_column], 0)
    ends = jnp.cumsum(length, axis=-1)
    slot = jnp.arange(width)
    which = jnp.minimum(jnp.sum(ends[:, None, :] <= slot[None, :, None], axis=-1), max_arcs - 1)
    fields = jnp.take_along_axis(arc, which[..., None], axis=1)
    offset = slot[None, :] - jnp.take_along_axis(ends - length, which, axis=-1)
    valid = slot[None, :] < ends[:, -1:]
    return fields, offset, valid


def _neighbours(plan, pattern, position, max_arcs: int, width: int, key_window=None):
    """Neighbour slots of queries ``(pattern, position)``, each ``[c]``.

    Returns ``(key_index, row, valid)``, each ``[c, width]``: flat index into the
    key arrays, global key latitude, and whether the slot is a real neighbour
    (inside ``key_window = (lat0, lon0, nlat, nlon, local_nlat, local_nlon)`` if given).
    """
    table, tables = plan.forward_arcs, plan.tables
    nlon_k = plan.nlon_in
    # Arcs (row, lo, len).
    fields, offset, valid = _arc_slots(tables.forward_offsets, tables.forward_arcs, pattern, max_arcs, width, 2)
    row, lo = fields[..., 0], fields[..., 1]
    lon = (lo + offset + table.shift * position[:, None]) % nlon_k
    if key_window is None:
        return row * nlon_k + lon, row, valid
    lat0, lon0, nlat, nlon, local_nlat, local_nlon = key_window
    local_row, local_lon = row - lat0, lon - lon0
    valid &= (local_row >= 0) & (local_row < nlat) & (local_lon >= 0) & (local_lon < nlon)
    key_index = jnp.clip(local_row, 0, local_nlat - 1) * local_nlon + jnp.clip(local_lon, 0, local_nlon - 1)
    return key_index, row, valid


def _log_weights(plan: NeighborhoodPlan, compute):
    """``log w`` per input latitude in the ``compute`` dtype: float64 weights for float64, exactly."""
    return jnp.log(jnp.asarray(plan.quadrature_weights(compute), compute))


def _gather(x, key_index, valid):
    """``x[:, key_index]`` ``[B, c, L, H, D]`` with zeros in the slots that are not neighbours.

    A padding slot points at some real key; zeroing it (not only its weight) keeps a NaN or inf
    there out of the products of queries that do not have that key as a neighbour, forward and
    backward (0 * NaN is NaN).
    """
    return jnp.where(valid[None, :, :, None, None], x[:, key_index], jnp.zeros((), x.dtype))


def _logits(qc, k, key_index, row, valid, logw, scale):
    """``scale*q.k + log w`` of each query's neighbour slots, ``-inf`` off the neighbourhood."""
    kc = _gather(k, key_index, valid)  # [B, c, L, H, Dk]
    logits = jnp.einsum("bchd,bclhd->bchl", qc, kc) * scale + logw[row][None, :, None, :]
    return jnp.where(valid[None, :, None, :], logits, -jnp.inf)


def _softmax_attend(logits, vc):
    """``(out, lse)`` of masked logits ``[B, c, H, L]``; ``(0, -inf)`` for an empty row.

    Only an empty row is special-cased (exactly): a NaN or inf logit makes its row's total, lse and
    output NaN, and so the gradients of every key of the row, as the formula does.
    """
    peak = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    peak = jnp.where(jnp.isneginf(peak), 0.0, peak)
    weights = jnp.exp(logits - peak)
    total = jnp.sum(weights, axis=-1)
    empty = total == 0
    safe_total = jnp.where(empty, 1.0, total)
    out = jnp.einsum("bchl,bclhd->bchd", weights, vc) / safe_total[..., None]
    lse = jnp.where(empty, -jnp.inf, peak[..., 0] + jnp.log(safe_total))
    return out, lse


def _flatten(x, compute):
    return jnp.asarray(x, compute).reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def scatter_chunks(one_chunk, count: int, chunk: int, out, lse):
    """``out`` and ``lse`` (``[B, queries, H, Dv]``, ``[B, queries, H]``) with the results of ``count`` queries
    set, ``chunk`` at a time: ``one_chunk(begin)`` returns ``(query_index [chunk], out [B, chunk, H, Dv], lse [B,
    chunk, H])`` of the queries ``begin .. begin + chunk`` (clamped to the last)."""
    index, o, l = jax.lax.map(one_chunk, jnp.arange(-(-count // chunk)) * chunk)
    # [chunks, (B,) chunk, ...] -> [(B,) chunks*chunk, ...]; the clamped tail repeats a query.
    index = index.reshape(-1)[:count]
    o = jnp.moveaxis(o, 0, 1).reshape(*out.shape[:1], -1, *out.shape[2:])[:, :count]
    l = jnp.moveaxis(l, 0, 1).reshape(*lse.shape[:1], -1, *lse.shape[2:])[:, :count]
    return out.at[:, index].set(o, unique_indices=True), lse.at[:, index].set(l, unique_indices=True)


def reference_attention(
    query, key, value, plan: NeighborhoodPlan, scale: float, *, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS
):
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
    batch, nlat_q, nlon_q, heads, dk = query.shape
    dv = value.shape[-1]
    q, k, v = (_flatten(x, compute) for x in (query, key, value))
    logw = _log_weights(plan, compute)
    table = plan.forward_arcs
    positions = nlon_q // table.residues  # outputs sharing one pattern
    out = jnp.zeros((batch, nlat_q * nlon_q, heads, dv), compute)
    lse = jnp.zeros((batch, nlat_q * nlon_q, heads), compute)
    for bucket in _buckets(plan._host):
        count = bucket.patterns.size * positions
        chunk = _chunk_size(count, batch * heads * (dk + dv) * bucket.width, chunk_elements)
        patterns = jnp.asarray(bucket.patterns)

        @jax.checkpoint
        def one_chunk(begin, bucket=bucket, count=count, chunk=chunk, patterns=patterns):
            t = jnp.minimum(begin + jnp.arange(chunk), count - 1)
            pattern, position = patterns[t // positions], t % positions
            residue = pattern % table.residues
            query_index = (pattern // table.residues) * nlon_q + position * table.residues + residue
            key_index, row, valid = _neighbours(plan, pattern, position, bucket.max_arcs, bucket.width)
            logits = _logits(q[:, query_index], k, key_index, row, valid, logw, scale)
            return query_index, *_softmax_attend(logits, _gather(v, key_index, valid))

        out, lse = scatter_chunks(one_chunk, count, chunk, out, lse)
    out = out.reshape(batch, nlat_q, nlon_q, heads, dv).astype(dtype)
    return out, lse.reshape(batch, nlat_q, nlon_q, heads)


def _windowed_map(fn, plan, query, key, window, per_slot, chunk_elements):
    """Apply ``fn(chunk_query_index, key_index, row, valid)`` over the local query block.

    Local query ``t`` is global point ``(q_lat0 + t // nlon_local, q_lon0 + t % nlon_local)``;
    padding queries get no valid slot. Returns the stacked results of ``fn``.
    """
    table = plan.forward_arcs
    batch, nq_lat, nq_lon = query.shape[:3]
    nk_lat, nk_lon = key.shape[1:3]
    window = jnp.asarray(window, jnp.int32).reshape(-1)[:8]
    q_lat0, q_lon0, q_nlat, q_nlon = window[0], window[1], window[2], window[3]
    key_window = (window[4], window[5], window[6], window[7], nk_lat, nk_lon)
    count = nq_lat * nq_lon
    width = plan.max_neighbors
    max_arcs = int(np.diff(table.offsets).max())
    chunk = _chunk_size(count, batch * per_slot * width, chunk_elements)

    @jax.checkpoint
    def one_chunk(begin):
        t = begin + jnp.arange(chunk)
        i, j = t // nq_lon, t % nq_lon
        real = (t < count) & (i < q_nlat) & (j < q_nlon)
        h = jnp.clip(q_lat0 + i, 0, plan.nlat_out - 1)
        w = jnp.clip(q_lon0 + j, 0, plan.nlon_out - 1)
        pattern = h * table.residues + w % table.residues
        key_index, row, valid = _neighbours(plan, pattern, w // table.residues, max_arcs, width, key_window)
        return fn(jnp.minimum(t, count - 1), key_index, row, valid & real[:, None])

    return jax.lax.map(one_chunk, jnp.arange(-(-count // chunk)) * chunk), count


def _unchunk(x, batch, count):
    """``[chunks, B, chunk, ...] -> [B, count, ...]``."""
    return jnp.moveaxis(x, 0, 1).reshape(batch, -1, *x.shape[3:])[:, :count]


def reference_local_forward(query, key, value, plan, window, row_order=None, *, scale, chunk_elements=DEFAULT_CHUNK_ELEMENTS):
    """Windowed forward of the native contract (``cuda/README.md``) in plain JAX.

    ``query [B, nq_lat, nq_lon, H, Dk]`` is a local block of the output grid and
    ``key``/``value`` a local block of the input grid, placed by ``window``
    (int32 ``[8]``). ``row_order`` is accepted for signature parity and ignored.

    Returns float32 ``out [B, nq_lat, nq_lon, H, Dv]`` and ``lse [B, nq_lat, nq_lon, H]``
    over the neighbours inside the key window; ``(0, -inf)`` where there are none
    (float64 instead of float32 for float64 inputs).
    """
    del row_order
    compute = jnp.promote_types(query.dtype, jnp.float32)
    batch, nq_lat, nq_lon, heads, dk = query.shape
    dv = value.shape[-1]
    q, k, v = (_flatten(x, compute) for x in (query, key, value))
    logw = _log_weights(plan, compute)

    def attend(query_index, key_index, row, valid):
        logits = _logits(q[:, query_index], k, key_index, row, valid, logw, scale)
        return _softmax_attend(logits, _gather(v, key_index, valid))

    (out, lse), count = _windowed_map(attend, plan, query, key, window, heads * (dk + dv), chunk_elements)
    out = _unchunk(out, batch, count).reshape(batch, nq_lat, nq_lon, heads, dv)
    return out, _unchunk(lse, batch, count).reshape(batch, nq_lat, nq_lon, heads)


def _backward_functional(query, key, value, dout, lse, delta, plan, window, scale, chunk_elements):
    """``sum_{o,j} p_oj (dout_o.v_j - delta_o)`` with ``lse`` and ``delta`` held fixed.

    Its gradients are exactly the contract's dq, dk and dv: ``d/dv_j = sum_o p_oj dout_o``,
    ``d/dk_j = scale sum_o p_oj (dout_o.v_j - delta_o) q_o`` and likewise for ``q_o``.
    """
    compute = jnp.promote_types(query.dtype, jnp.float32)
    batch, _, _, heads, dk = query.shape
    dv = value.shape[-1]
    q, k, v, g = (_flatten(x, compute) for x in (query, key, value, dout))
    lse = lse.astype(compute).reshape(batch, -1, heads)
    delta = delta.astype(compute).reshape(batch, -1, heads)
    logw = _log_weights(plan, compute)

    def term(query_index, key_index, row, valid):
        vc = _gather(v, key_index, valid)
        logits = _logits(q[:, query_index], k, key_index, row, valid, logw, scale)
        norm = lse[:, query_index]
        # A query without neighbours (lse = -inf) has no terms; a NaN lse stays NaN, as the formula makes it.
        real = ~jnp.isneginf(norm)[..., None]
        p = jnp.where(real, jnp.exp(logits - jnp.where(real, norm[..., None], 0.0)), 0.0)
        gv = jnp.einsum("bchd,bclhd->bchl", g[:, query_index], vc)
        return jnp.sum(p * (gv - delta[:, query_index][..., None]))

    per_slot = heads * (2 * dk + 2 * dv)
    terms, _ = _windowed_map(term, plan, query, key, window, per_slot, chunk_elements)
    return jnp.sum(terms)


def _local_grad(argnums, query, key, value, dout, lse, delta, plan, window, scale, chunk_elements):
    compute = jnp.promote_types(query.dtype, jnp.float32)
    args = [x.astype(compute) for x in (query, key, value)]

    def functional(q, k, v):
        return _backward_functional(q, k, v, dout, lse, delta, plan, window, scale, chunk_elements)

    return jax.grad(functional, argnums=argnums)(*args)


def reference_local_backward_dq(query, key, value, dout, lse, delta, plan, window, row_order=None, *, scale, chunk_elements=DEFAULT_CHUNK_ELEMENTS):
    """Windowed dq of the native contract in plain JAX (float32, float64 for float64 inputs)."""
    del row_order
    return _local_grad(0, query, key, value, dout, lse, delta, plan, window, scale, chunk_elements)


def reference_local_backward_dkv(query, key, value, dout, lse, delta, plan, window, row_order=None, *, scale, chunk_elements=DEFAULT_CHUNK_ELEMENTS):
    """Windowed ``(dk, dv)`` of the native contract in plain JAX."""
    del row_order
    return _local_grad((1, 2), query, key, value, dout, lse, delta, plan, window, scale, chunk_elements)
