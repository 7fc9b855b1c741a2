"""Pure-JAX neighbourhood attention between two ring grids (flat fields, any backend and float dtype).

The definition on ring grids, and their oracle: fields are ``[B, npoints, H, D]`` in the grids' ring order
(:class:`~jax_s2attn.grids.RingGrid`), neighbourhoods are :func:`~jax_s2attn.ring_plan.ring_arcs`', the
quadrature weights inside the softmax the input grid's point weights. Queries are enumerated as in
:func:`~jax_s2attn.ops.reference.reference_attention`: in buckets of similar neighbourhood size, each in chunks
under a fixed element budget, rematerialised in the backward pass.

A query's *pattern* is its ring and its residue modulo the ring's period ``n_a / gcd(n_a, n_b over the ring's
key rings)``: queries of one pattern see the same arcs, moved on by a whole number of each key ring's points per
period (:class:`RingPatterns`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..grids import RingGrid
from ..ring_plan import RingPatterns, RingPlan
from .reference import (DEFAULT_CHUNK_ELEMENTS, _arc_slots, _chunk_size, _gather, _logits, _softmax_attend,
                        scatter_chunks)  # fmt: skip

__all__ = ["reference_ring_attention"]


def reference_ring_attention(query, key, value, plan: RingPlan, scale: float, *,
                             chunk_elements: int = DEFAULT_CHUNK_ELEMENTS):  # fmt: skip
    """``(out, lse)`` of neighbourhood attention from ``plan.grid_in`` (``key [B, npoints_in, H, Dk]``, ``value
    [B, npoints_in, H, Dv]``) to ``plan.grid_out`` (``query [B, npoints_out, H, Dk]``): ``out [B, npoints_out,
    H, Dv]`` in the inputs' dtype, ``lse [B, npoints_out, H]`` in float32 (float64 for float64 inputs). Inputs
    must already be validated."""
    dtype = query.dtype
    compute = jnp.promote_types(dtype, jnp.float32)
    batch, npoints_out, heads, dk = query.shape
    dv = value.shape[-1]
    q, k, v = (jnp.asarray(x, compute) for x in (query, key, value))
    grid_in, table = plan.grid_in, plan.patterns
    log_weights = jnp.log(jnp.asarray(2.0 * np.pi * grid_in.weights / grid_in.nlon, compute))
    out = jnp.zeros((batch, npoints_out, heads, dv), compute)
    lse = jnp.zeros((batch, npoints_out, heads), compute)
    for width, points, pattern, position, max_arcs in _buckets(plan.grid_out, table):
        count = points.size
        chunk = _chunk_size(count, batch * heads * (dk + dv) * width, chunk_elements)
        points, pattern, position = (jnp.asarray(x) for x in (points, pattern, position))

        @jax.checkpoint
        def one_chunk(begin, width=width, count=count, chunk=chunk, max_arcs=max_arcs, points=points,
                      pattern=pattern, position=position):  # fmt: skip
            t = jnp.minimum(begin + jnp.arange(chunk), count - 1)
            key_index, ring, valid = _neighbours(table, pattern[t], position[t], max_arcs, width)
            logits = _logits(q[:, points[t]], k, key_index, ring, valid, log_weights, scale)
            return points[t], *_softmax_attend(logits, _gather(v, key_index, valid))

        out, lse = scatter_chunks(one_chunk, count, chunk, out, lse)
    return out.astype(dtype), lse


def _buckets(grid_out: RingGrid, table: RingPatterns):
    """Per power-of-two neighbourhood width: the queries of that width (ring-order indices), their patterns and
    positions, and the most arcs of any of their patterns (a plan's every query has a neighbour)."""
    ring = np.repeat(np.arange(grid_out.nrings), grid_out.nlon)
    i = np.arange(grid_out.npoints) - grid_out.ring_offsets[ring]
    pattern = table.ring_patterns[ring] + i % table.period[ring]
    position = i // table.period[ring]
    lengths = table.lengths[pattern]
    arcs_per_pattern = np.diff(table.offsets)
    widths = 1 << np.ceil(np.log2(lengths)).astype(np.int64)
    return [
        (int(width), points, pattern[points], position[points], int(arcs_per_pattern[pattern[points]].max()))
        for width in np.unique(widths)
        for points in [np.flatnonzero(widths == width)]
    ]


def _neighbours(table: RingPatterns, pattern, position, max_arcs: int, width: int):
    """``(key_index, key_ring, valid)`` of the neighbour slots of queries ``(pattern, position)``, each ``[c,
    width]``."""
    # Arcs (key ring, first point of the ring, start, length, nlon, shift).
    fields, offset, valid = _arc_slots(jnp.asarray(table.offsets), jnp.asarray(table.arcs), pattern, max_arcs,
                                       width, 3)  # fmt: skip
    lon = (fields[..., 2] + offset + fields[..., 5] * position[:, None]) % fields[..., 4]
    return fields[..., 1] + lon, fields[..., 0], valid
