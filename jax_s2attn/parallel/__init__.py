"""Neighbourhood attention over a device mesh: latitude halo + longitude ring under ``shard_map``; between ring
grids, ring ranges with a halo of neighbouring blocks (:mod:`.ring_shards`).

:func:`sharded_neighborhood_attention` is the entry point (also for the Flax
modules); :mod:`.layout` splits the grids, :mod:`.halo` exchanges latitude halos
and :mod:`.ring` runs the longitude ring, forward and backward.
"""

from .layout import ShardLayout, shard_layout
from .ring_shards import RingShardLayout, ring_shard_layout, sharded_ring_attention
from .sharded import padded_grid_shapes, sharded_neighborhood_attention

__all__ = [
    "RingShardLayout",
    "ShardLayout",
    "padded_grid_shapes",
    "ring_shard_layout",
    "shard_layout",
    "sharded_neighborhood_attention",
    "sharded_ring_attention",
]
