"""Neighbourhood attention over a device mesh: latitude halo + longitude ring under ``shard_map``.

:func:`sharded_neighborhood_attention` is the entry point (also for the Flax
modules); :mod:`.layout` splits the grids, :mod:`.halo` exchanges latitude halos
and :mod:`.ring` runs the longitude ring, forward and backward.
"""

from .layout import ShardLayout, shard_layout
from .sharded import padded_grid_shapes, sharded_neighborhood_attention

__all__ = ["ShardLayout", "padded_grid_shapes", "shard_layout", "sharded_neighborhood_attention"]
