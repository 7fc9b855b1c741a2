"""How a neighbourhood plan's grids are split over a (latitude, longitude) device mesh.

Host-side and static: everything here is numpy or Python ints, computed once per
(plan, mesh shape) and cached.

Splits are balanced (torch-harmonics' ``compute_split_shapes``): ``n`` points over
``p`` shards give the first ``n % p`` shards one point more. Every shard stores a
block of the largest count, real points first and padding after, so uneven
splits need no special case downstream.

Longitudes: the coarser grid is split and the finer one takes exactly ``factor``
times each coarse block (``factor = nlon_fine // nlon_coarse``), so every shard
sees the same longitude ratio (torch-harmonics' uniform-pscale invariant holds by
construction).

Latitudes: the query grid is split balanced and the key grid along the same
colatitudes (the key rows north of the midpoint between two query shards go to
the northern one), so for self-attention both splits coincide and for resampling
the shards cover the same band of the sphere. A shard additionally needs the key
rows its queries reach beyond its own block (the latitude halo), read off the
plan's forward arc table for the actual split.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..plan import NeighborhoodPlan

__all__ = ["AxisSplit", "ShardLayout", "balanced_counts", "shard_layout"]


def balanced_counts(n: int, parts: int) -> tuple[int, ...]:
    """Points per shard when ``n`` points are split over ``parts`` shards (first shards larger)."""
    base, extra = divmod(n, parts)
    return tuple(base + 1 if i < extra else base for i in range(parts))


@dataclasses.dataclass(frozen=True)
class AxisSplit:
    """One grid axis of ``size`` points split into blocks of ``block`` slots (real points first).

    Shard ``i`` holds global points ``starts[i] .. starts[i] + counts[i] - 1`` in its
    first ``counts[i]`` slots; the remaining slots are zero padding.
    """

    size: int
    counts: tuple[int, ...]

    @property
    def parts(self) -> int:
        return len(self.counts)

    @property
    def starts(self) -> tuple[int, ...]:
        return tuple(int(s) for s in np.cumsum((0,) + self.counts[:-1]))

    @property
    def block(self) -> int:
        return max(self.counts)

    @property
    def padded(self) -> bool:
        """Whether the blocked layout differs from the plain global array."""
        return self.parts * self.block != self.size

    def scaled(self, factor: int) -> AxisSplit:
        """The same split on a grid ``factor`` times finer (each block ``factor`` times longer)."""
        return AxisSplit(self.size * factor, tuple(c * factor for c in self.counts))

    def to_blocks(self, x, axis: int):
        """Global ``x`` (``size`` along ``axis``) -> blocked layout (``parts * block``), zero padded."""
        if not self.padded:
            return x
        axis = axis % x.ndim
        widths = lambda count: [(0, self.block - count) if a == axis else (0, 0) for a in range(x.ndim)]  # noqa: E731
        pieces = [
            jnp.pad(jax.lax.slice_in_dim(x, start, start + count, axis=axis), widths(count))
            for start, count in zip(self.starts, self.counts)
        ]
        return jnp.concatenate(pieces, axis=axis)

    def from_blocks(self, x, axis: int):
        """Blocked layout -> global array (drops the padding); inverse of :meth:`to_blocks`."""
        if not self.padded:
            return x
        pieces = [
            jax.lax.slice_in_dim(x, shard * self.block, shard * self.block + count, axis=axis)
            for shard, count in enumerate(self.counts)
        ]
        return jnp.concatenate(pieces, axis=axis)


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

    def window(self, lat_index, lon_index, chunk_index):
        """The kernel window of shard ``(lat_index, lon_index)`` holding key chunk ``chunk_index``.

        ``(q_lat0, q_lon0, q_nlat, q_nlon, k_lat0, k_lon0, k_nlat, k_nlon)`` as int32 ``[8]``:
        the shard's queries, and the halo-extended key rows of its latitude shard on the
        longitudes of longitude shard ``chunk_index``. Indices may be traced.
        """
        table = lambda values: jnp.asarray(np.asarray(values, dtype=np.int32))  # noqa: E731
        top, bottom = table(self.halo_top)[lat_index], table(self.halo_bottom)[lat_index]
        k_nlat = table(self.k_lat.counts)[lat_index]
        return jnp.stack(
            [
                table(self.q_lat.starts)[lat_index],
                table(self.q_lon.starts)[lon_index],
                table(self.q_lat.counts)[lat_index],
                table(self.q_lon.counts)[lon_index],
                table(self.k_lat.starts)[lat_index] - top,
                table(self.k_lon.starts)[chunk_index],
                top + k_nlat + bottom,
                table(self.k_lon.counts)[chunk_index],
            ]
        )


def _check_parts(n: int, parts: int, grid: str, axis_name: str, mesh_dim: str) -> None:
    if n < parts:
        raise ValueError(
            f"mesh axis {axis_name!r} has {parts} devices but the {grid} grid has only {n} {mesh_dim}: "
            f"every shard needs at least one. Use at most {n} devices along {axis_name!r} "
            "(put the others on another mesh axis, e.g. the batch axis)."
        )


def _raise_lat_split(plan: NeighborhoodPlan, parts: int, lat_axis: str, lon_axis: str):
    fitting = max(p for p in range(1, parts) if _lat_split_fits(plan, p))
    if parts > plan.nlat_out:
        reason = f"the output grid has only {plan.nlat_out} latitudes"
    else:
        q_lat, k_lat = _lat_splits(plan, parts)
        if min(k_lat.counts) == 0:
            reason = f"a shard would get none of the {plan.nlat_in} input latitudes"
        else:
            radius = max(sum(_halos(plan, q_lat, k_lat), ()))
            reason = (
                f"the neighbourhoods (theta_cutoff={plan.theta_cutoff:.4g}) reach {radius} input rows beyond a "
                f"shard, but the smallest shard holds only {min(k_lat.counts)} of the {plan.nlat_in} input "
                "latitudes and halos come from the adjacent shards only"
            )
    raise ValueError(
        f"cannot split latitudes over mesh axis {lat_axis!r} ({parts} devices): {reason}. Use at most "
        f"{fitting} devices along {lat_axis!r} (put the others on {lon_axis!r} or the batch axis)."
    )


def _needed_key_rows(plan: NeighborhoodPlan, q_start: int, q_stop: int) -> tuple[int, int]:
    """First and last key row read by query rows ``q_start .. q_stop-1`` (from the arc table)."""
    table = plan.forward_arcs
    lo, hi = table.offsets[q_start * table.residues], table.offsets[q_stop * table.residues]
    rows = table.arcs[lo:hi, 0]
    return int(rows.min()), int(rows.max())


def _halos(plan: NeighborhoodPlan, q_lat: AxisSplit, k_lat: AxisSplit) -> tuple[tuple[int, ...], tuple[int, ...]]:
    top, bottom = [], []
    for q0, qn, k0, kn in zip(q_lat.starts, q_lat.counts, k_lat.starts, k_lat.counts):
        first, last = _needed_key_rows(plan, q0, q0 + qn)
        top.append(max(0, k0 - first))
        bottom.append(max(0, last - (k0 + kn - 1)))
    return tuple(top), tuple(bottom)


def _lat_splits(plan: NeighborhoodPlan, parts: int) -> tuple[AxisSplit, AxisSplit]:
    """Balanced query split and the key split along the same colatitudes."""
    q_lat = AxisSplit(plan.nlat_out, balanced_counts(plan.nlat_out, parts))
    starts = np.asarray(q_lat.starts[1:], dtype=np.int64)
    middles = 0.5 * (plan.theta_out[starts - 1] + plan.theta_out[starts])
    bounds = np.concatenate([[0], np.searchsorted(plan.theta_in, middles, side="left"), [plan.nlat_in]])
    return q_lat, AxisSplit(plan.nlat_in, tuple(int(c) for c in np.diff(bounds)))


def _lat_split_fits(plan: NeighborhoodPlan, parts: int) -> bool:
    if parts > plan.nlat_out:
        return False
    q_lat, k_lat = _lat_splits(plan, parts)
    if min(k_lat.counts) == 0:
        return False
    top, bottom = _halos(plan, q_lat, k_lat)
    return max(top + bottom) <= min(k_lat.counts)


@functools.lru_cache(maxsize=64)
def shard_layout(plan: NeighborhoodPlan, lat_parts: int, lon_parts: int, lat_axis: str = "lat", lon_axis: str = "lon") -> ShardLayout:
    """Split ``plan``'s grids over ``lat_parts`` latitude and ``lon_parts`` longitude shards.

    Raises:
      ValueError: naming the mesh axis and a size that works, when a shard would be
        empty or a latitude halo would reach past the neighbouring shard (the halo
        exchange is nearest-neighbour).
    """
    plan = plan._host
    coarse, fine = sorted((plan.nlon_in, plan.nlon_out))
    _check_parts(coarse, lon_parts, "coarser", lon_axis, "longitudes")
    if not _lat_split_fits(plan, lat_parts):
        _raise_lat_split(plan, lat_parts, lat_axis, lon_axis)

    q_lat, k_lat = _lat_splits(plan, lat_parts)
    coarse_lon = AxisSplit(coarse, balanced_counts(coarse, lon_parts))
    if plan.nlon_in >= plan.nlon_out:
        q_lon, k_lon = coarse_lon, coarse_lon.scaled(fine // coarse)
    else:
        q_lon, k_lon = coarse_lon.scaled(fine // coarse), coarse_lon

    top, bottom = _halos(plan, q_lat, k_lat)
    return ShardLayout(q_lat, q_lon, k_lat, k_lon, top, bottom, lat_axis, lon_axis)
