"""Latitude halo exchange of key/value blocks between neighbouring latitude shards.

Runs inside ``shard_map`` over the layout's latitude mesh axis. Each shard sends
its last ``radius_top`` real rows south and its first ``radius_bottom`` rows north
with ``lax.ppermute`` (nearest neighbours only; the pole shards receive nothing),
then keeps exactly the rows its queries need: the extended block holds global key
rows ``k_lat0 .. k_lat0 + k_nlat - 1`` contiguously in its first slots, padding after,
as the kernel windows require.

The exchange is linear and built from ``ppermute``, slices and a gather, so its
adjoint comes from JAX's transposition rules: gradients of halo rows travel back
along the reversed permutation and are added to their owners' rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .layout import ShardLayout

__all__ = ["exchange_halo"]


def exchange_halo(blocks, layout: ShardLayout, axis: int = -4):
    """Extend local key-grid blocks by their latitude halo.

    Args:
      blocks: an array or a pytree of arrays (e.g. ``(key, value)``), each this shard's
        block with ``layout.k_lat.block`` rows along ``axis`` (real rows first).
      layout: the split; ``layout.lat_axis`` must be a manual axis of the enclosing ``shard_map``.
      axis: the latitude axis.

    Returns:
      The same structure, each with ``layout.k_ext_block`` rows along ``axis``: the
      halo-extended rows first, zeros after.
    """
    return jax.tree.map(lambda x: _extend(x, layout, axis % x.ndim), blocks)


def _extend(x, layout: ShardLayout, axis: int):
    up, down = layout.radius_top, layout.radius_bottom
    if up == 0 and down == 0:
        return x
    name, parts, block = layout.lat_axis, layout.k_lat.parts, layout.k_lat.block
    shard = jax.lax.axis_index(name)
    count = jnp.asarray(np.asarray(layout.k_lat.counts, np.int32))[shard]
    top = jnp.asarray(np.asarray(layout.halo_top, np.int32))[shard]
    bottom = jnp.asarray(np.asarray(layout.halo_bottom, np.int32))[shard]

    # The last `up` real rows go south; a short shard sends leading zeros, which no
    # receiver reads (a shard's north halo never exceeds its northern neighbour's rows).
    zeros = jnp.zeros((*x.shape[:axis], up, *x.shape[axis + 1 :]), x.dtype)
    southward = jax.lax.dynamic_slice_in_dim(jnp.concatenate([zeros, x], axis=axis), count, up, axis)
    northward = jax.lax.slice_in_dim(x, 0, down, axis=axis)
    from_north = jax.lax.ppermute(southward, name, [(i, i + 1) for i in range(parts - 1)])
    from_south = jax.lax.ppermute(northward, name, [(i + 1, i) for i in range(parts - 1)])
    stacked = jnp.concatenate([from_north, x, from_south], axis=axis)

    # Slot j of the result <- row `source[j]` of `stacked`: the needed north rows, the own
    # real rows, the needed south rows, then padding (an out-of-range source, filled with 0).
    slot = jnp.arange(layout.k_ext_block, dtype=jnp.int32)
    source = jnp.where(
        slot < top,
        up - top + slot,
        jnp.where(
            slot < top + count,
            up + slot - top,
            jnp.where(slot < top + count + bottom, up + block + slot - top - count, stacked.shape[axis]),
        ),
    )
    return jnp.take(stacked, source, axis=axis, mode="fill", fill_value=0)
