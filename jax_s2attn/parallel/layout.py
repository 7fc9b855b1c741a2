"""How a neighbourhood plan's grids are split over a (latitude, longitude) device mesh.

Host-side and static: everything here is numpy or Python ints, computed once per
(plan, mesh shape) and cached.

Every grid axis is cut into ``parts`` contiguous blocks of ``block = ceil(n / parts)``
points; the last blocks may be short (or, for small grids, empty). This is exactly
how JAX shards an array padded at the end to ``parts * block``, so callers can keep
their arrays padded (e.g. 721 latitudes as 724 on 4 shards) and evenly sharded
between layers, and the op needs no re-layout at all.

Longitudes: the coarser grid is cut and the finer one takes exactly ``factor``
times each coarse block (``factor = nlon_fine // nlon_coarse``), so every shard
sees the same longitude ratio (torch-harmonics' uniform-pscale invariant holds by
construction).

Latitudes: each grid is cut on its own; a shard additionally needs the key rows
its queries reach beyond its own block (the latitude halo), read off the plan's
forward arc table for the actual split. Halos come from the adjacent shards only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..plan import NeighborhoodPlan
from ..schedule import WalkWindow, build_schedule, join_schedules

__all__ = ["AxisSplit", "ShardLayout", "schedules_of_window", "shard_layout", "window_schedules"]


@dataclasses.dataclass(frozen=True)
class AxisSplit:
    """One grid axis of ``size`` points cut into ``parts`` blocks of ``block`` slots.

    Shard ``i`` holds global points ``i*block ..`` in its first ``counts[i]`` slots;
    the remaining slots (only in the last shards) are padding.
    """

    size: int
    block: int
    parts: int

    @classmethod
    def contiguous(cls, size: int, parts: int) -> AxisSplit:
        return cls(size, -(-size // parts), parts)

    @property
    def padded_size(self) -> int:
        """Length of the blocked (end-padded) axis."""
        return self.parts * self.block

    @property
    def starts(self) -> tuple[int, ...]:
        """Global index of each shard's first point (the axis end for shards of padding only)."""
        return tuple(min(i * self.block, self.size) for i in range(self.parts))

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(min(self.block, max(0, self.size - start)) for start in self.starts)

    def scaled(self, factor: int) -> AxisSplit:
        """The same cut on a grid ``factor`` times finer (each block ``factor`` times longer)."""
        return AxisSplit(self.size * factor, self.block * factor, self.parts)

    def to_blocks(self, x, axis: int):
        """Global ``x`` (``size`` along ``axis``) -> blocked layout, zero padded at the end."""
        widths = [(0, 0)] * x.ndim
        widths[axis % x.ndim] = (0, self.padded_size - self.size)
        return jnp.pad(x, widths) if self.padded_size != self.size else x

    def from_blocks(self, x, axis: int):
        """Blocked layout -> global array (drops the padding)."""
        return jax.lax.slice_in_dim(x, 0, self.size, axis=axis) if self.padded_size != self.size else x


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """The split of one plan over ``lat_parts x lon_parts`` shards (hashable, static).

    Attributes:
      q_lat, q_lon: split of the query/output grid.
      k_lat, k_lon: split of the key/input grid (``k_lat`` without halo).
      halo_top, halo_bottom: per latitude shard, how many key rows beyond its own block
        its queries need on the north (smaller row) and south side; 0 at the poles.
      lat_axis, lon_axis: mesh axis names (for messages and collectives).
    """

    q_lat: AxisSplit
    q_lon: AxisSplit
    k_lat: AxisSplit
    k_lon: AxisSplit
    halo_top: tuple[int, ...]
    halo_bottom: tuple[int, ...]
    lat_axis: str
    lon_axis: str

    @property
    def radius_top(self) -> int:
        """Rows every shard sends south (the largest north halo)."""
        return max(self.halo_top)

    @property
    def radius_bottom(self) -> int:
        """Rows every shard sends north (the largest south halo)."""
        return max(self.halo_bottom)

    @property
    def k_ext_block(self) -> int:
        """Rows of a shard's halo-extended key block (real rows first)."""
        return self.radius_top + self.k_lat.block + self.radius_bottom

    @functools.cached_property
    def windows(self) -> np.ndarray:
        """Every kernel window of the layout, int32 ``[lat parts * lon parts * lon parts, 8]``: row
        :meth:`window_index` ``(lat_index, lon_index, chunk_index)`` is :meth:`window`'s."""
        rows = []
        for lat in range(self.q_lat.parts):
            top, bottom = self.halo_top[lat], self.halo_bottom[lat]
            for lon in range(self.q_lon.parts):
                for chunk in range(self.k_lon.parts):
                    rows.append((self.q_lat.starts[lat], self.q_lon.starts[lon], self.q_lat.counts[lat],
                                 self.q_lon.counts[lon], self.k_lat.starts[lat] - top, self.k_lon.starts[chunk],
                                 top + self.k_lat.counts[lat] + bottom, self.k_lon.counts[chunk]))  # fmt: skip
        table = np.asarray(rows, np.int32)
        table.setflags(write=False)
        return table

    def window_index(self, lat_index, lon_index, chunk_index):
        """Row of :attr:`windows` of shard ``(lat_index, lon_index)`` holding key chunk ``chunk_index`` (the
        indices may be traced)."""
        return (lat_index * self.q_lon.parts + lon_index) * self.k_lon.parts + chunk_index

    def window(self, lat_index, lon_index, chunk_index):
        """The kernel window of shard ``(lat_index, lon_index)`` holding key chunk ``chunk_index``.

        ``(q_lat0, q_lon0, q_nlat, q_nlon, k_lat0, k_lon0, k_nlat, k_nlon)`` as int32 ``[8]``:
        the shard's queries, and the halo-extended key rows of its latitude shard on the
        longitudes of longitude shard ``chunk_index``. Indices may be traced.
        """
        return jnp.asarray(self.windows)[self.window_index(lat_index, lon_index, chunk_index)]


def window_schedules(plan: NeighborhoodPlan, layout: ShardLayout, tile_rows: int, tile_cols: int, chunk_cols: int):
    """The scheduled kernels' ``(forward, backward)`` :class:`~jax_s2attn.schedule.ScheduleSet` of every window of
    ``layout`` (in the order of :attr:`ShardLayout.windows`): the query blocks' tiles over the key blocks' chunks,
    and the halo-extended key blocks' tiles over the query blocks' chunks, in local coordinates. Built once per
    host plan (a plan whose tables are traced shares its host plan's), layout and shape."""
    return _window_schedules(plan._host, layout, tile_rows, tile_cols, chunk_cols)


@functools.lru_cache(maxsize=16)
def _window_schedules(plan: NeighborhoodPlan, layout: ShardLayout, tile_rows: int, tile_cols: int, chunk_cols: int):
    q_block = (layout.q_lat.block, layout.q_lon.block)
    k_block = (layout.k_ext_block, layout.k_lon.block)
    # One record per point for every window where any window needs it (padding longitudes): a set has one format.
    per_point = layout.q_lon.padded_size != layout.q_lon.size or layout.k_lon.padded_size != layout.k_lon.size
    pairs = [schedules_of_window(plan, window, q_block, k_block, tile_rows, tile_cols, chunk_cols, per_point)
             for window in layout.windows.tolist()]  # fmt: skip
    return join_schedules([f for f, _ in pairs]), join_schedules([b for _, b in pairs])


def schedules_of_window(
    plan: NeighborhoodPlan, window, q_block: tuple[int, int], k_block: tuple[int, int], tile_rows: int,
    tile_cols: int, chunk_cols: int, per_point_records: bool = False,
):  # fmt: skip
    """The ``(forward, backward)`` :class:`~jax_s2attn.schedule.BlockSchedule` of one kernel window (int ``[8]``:
    the query block ``(lat0, lon0, nlat, nlon)``, then the key block) whose local arrays are ``q_block`` and
    ``k_block`` (rows, longitudes; the real block first, then padding): the query tiles over the key chunks, and
    the key tiles over the query chunks, in local coordinates."""
    plan = plan._host
    queries, keys = tuple(int(x) for x in window[:4]), tuple(int(x) for x in window[4:])
    shape = dict(tile_rows=tile_rows, tile_cols=tile_cols, chunk_cols=chunk_cols, per_point_records=per_point_records)
    forward = build_schedule(plan.forward_segments, *plan.out_shape, window=WalkWindow(*queries, *q_block, *keys),
                             **shape)  # fmt: skip
    backward = build_schedule(plan.backward_segments, *plan.in_shape, window=WalkWindow(*keys, *k_block, *queries),
                              **shape)  # fmt: skip
    return forward, backward


def _needed_key_rows(plan: NeighborhoodPlan, q_start: int, q_stop: int) -> tuple[int, int]:
    """First and last key row read by query rows ``q_start .. q_stop-1`` (from the arc table)."""
    table = plan.forward_arcs
    lo, hi = table.offsets[q_start * table.residues], table.offsets[q_stop * table.residues]
    rows = table.arcs[lo:hi, 0]
    return int(rows.min()), int(rows.max())


def _lat_splits(plan: NeighborhoodPlan, parts: int):
    """``(q_lat, k_lat, halo_top, halo_bottom, overreaching)`` for ``parts`` latitude shards.

    ``overreaching`` is the first shard whose halo is larger than the adjacent shard
    it comes from, or ``None``.
    """
    q_lat = AxisSplit.contiguous(plan.nlat_out, parts)
    k_lat = AxisSplit.contiguous(plan.nlat_in, parts)
    top, bottom = [], []
    for q0, qn, k0, kn in zip(q_lat.starts, q_lat.counts, k_lat.starts, k_lat.counts):
        if qn == 0:  # a shard of padding only needs nothing
            top.append(0)
            bottom.append(0)
            continue
        first, last = _needed_key_rows(plan, q0, q0 + qn)
        top.append(max(0, k0 - first))
        bottom.append(max(0, last - (k0 + kn - 1)))
    # The poles need no halo (top[0] = bottom[-1] = 0), so the padding slots pad the lists.
    north, south = (0, *k_lat.counts[:-1]), (*k_lat.counts[1:], 0)
    over = [i for i in range(parts) if top[i] > north[i] or bottom[i] > south[i]]
    return q_lat, k_lat, tuple(top), tuple(bottom), over[0] if over else None


def _check_parts(n: int, parts: int, grid: str, axis_name: str, mesh_dim: str) -> None:
    if n < parts:
        raise ValueError(
            f"mesh axis {axis_name!r} has {parts} devices but the {grid} grid has only {n} {mesh_dim}. "
            f"Use at most {n} devices along {axis_name!r} (put the others on another mesh axis, e.g. the "
            "batch axis)."
        )


@functools.lru_cache(maxsize=64)
def shard_layout(
    plan: NeighborhoodPlan, lat_parts: int, lon_parts: int, lat_axis: str = "lat", lon_axis: str = "lon"
) -> ShardLayout:
    """Split ``plan``'s grids over ``lat_parts`` latitude and ``lon_parts`` longitude shards.

    Raises:
      ValueError: naming the mesh axis and a size that works, when the mesh axis has
        more devices than the grid has points, or a latitude halo would reach past the
        adjacent shard (the halo exchange is nearest-neighbour).
    """
    plan = plan._host
    _check_parts(min(plan.nlat_in, plan.nlat_out), lat_parts, "smaller", lat_axis, "latitudes")
    coarse, fine = sorted((plan.nlon_in, plan.nlon_out))
    _check_parts(coarse, lon_parts, "coarser", lon_axis, "longitudes")
    q_lat, k_lat, top, bottom, short = _lat_splits(plan, lat_parts)
    if short is not None:
        fitting = max(p for p in range(1, lat_parts) if _lat_splits(plan, p)[-1] is None)
        raise ValueError(
            f"cannot split latitudes over mesh axis {lat_axis!r} ({lat_parts} devices): the queries of shard "
            f"{short} reach {max(top[short], bottom[short])} input rows beyond its own, more than the adjacent "
            f"shard holds (input latitudes per shard: {k_lat.counts}; theta_cutoff={plan.theta_cutoff:.4g}), "
            f"and halos come from adjacent shards only. Use at most {fitting} devices along {lat_axis!r} "
            f"(put the others on {lon_axis!r} or the batch axis)."
        )
    coarse_lon = AxisSplit.contiguous(coarse, lon_parts)
    if plan.nlon_in >= plan.nlon_out:
        q_lon, k_lon = coarse_lon, coarse_lon.scaled(fine // coarse)
    else:
        q_lon, k_lon = coarse_lon.scaled(fine // coarse), coarse_lon
    return ShardLayout(q_lat, q_lon, k_lat, k_lon, top, bottom, lat_axis, lon_axis)
