"""The sharded op: global arrays in, ``shard_map`` over a (lat, lon[, batch]) mesh inside."""

from __future__ import annotations

import functools
import math

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ..ops import _checks
from ..ops._ffi import native_backends
from ..plan import NeighborhoodPlan
from .halo import exchange_halo
from .layout import ShardLayout, shard_layout
from .ring import RingConfig, ring_attention

__all__ = ["sharded_neighborhood_attention"]

# Axes of an activation ``[B..., nlat, nlon, H, D]``, counted from the end.
_LAT, _LON = -4, -3


def _check_mesh(mesh, lat_axis, lon_axis, batch_axis, batch_shape) -> None:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (e.g. jax.make_mesh), got {type(mesh).__name__}.")
    names = {"lat_axis": lat_axis, "lon_axis": lon_axis, "batch_axis": batch_axis}
    for arg, name in names.items():
        if name is not None and name not in mesh.axis_names:
            raise ValueError(f"{arg}={name!r} is not an axis of the mesh; its axes are {mesh.axis_names}.")
    used = [n for n in names.values() if n is not None]
    if len(set(used)) != len(used):
        raise ValueError(f"lat_axis, lon_axis and batch_axis must be distinct mesh axes, got {names}.")
    if batch_axis is not None:
        parts = mesh.shape[batch_axis]
        if not batch_shape or batch_shape[0] % parts:
            raise ValueError(
                f"batch_axis={batch_axis!r} splits the first batch dimension over {parts} devices, but the "
                f"batch shape is {batch_shape}: it needs a leading batch dimension divisible by {parts} "
                "(or pass batch_axis=None)."
            )


def _resolve_implementation(implementation, mesh) -> str:
    if implementation is not None:
        return implementation
    platform = mesh.devices.flat[0].platform
    return "ffi" if native_backends().get("cuda" if platform == "gpu" else platform, False) else "reference"


def _place(x, mesh: Mesh, spec: PartitionSpec):
    """Give ``x`` the sharding ``shard_map`` expects: explicit mesh axes need it in the type."""
    explicit = {n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit}
    if not explicit:
        return x  # Auto axes: shard_map reshards by itself.
    keep = lambda part: part if part in explicit else None  # noqa: E731
    return jax.sharding.reshard(x, NamedSharding(mesh, PartitionSpec(*(keep(p) for p in spec))))


def _shard_body(query, key, value, plan, *, config: RingConfig):
    """Per device: flatten batch axes, exchange the key/value halo, run the ring."""
    batch = query.shape[:_LAT]
    flat = lambda x: x.reshape(math.prod(batch), *x.shape[_LAT:])  # noqa: E731
    key, value = exchange_halo((flat(key), flat(value)), config.layout, axis=_LAT)
    out = ring_attention(config, flat(query), key, value, plan)
    return out.reshape(*batch, *out.shape[1:])


def sharded_neighborhood_attention(
    query,
    key,
    value,
    plan: NeighborhoodPlan,
    *,
    mesh: Mesh,
    lat_axis: str = "lat",
    lon_axis: str = "lon",
    batch_axis: str | None = None,
    scale: float | None = None,
    implementation: str | None = None,
):
    """:func:`jax_s2attn.neighborhood_attention` with the sphere split over a device mesh.

    Latitudes are split over mesh axis ``lat_axis`` and longitudes over ``lon_axis``
    (both grids; the finer longitude grid in blocks that match the coarser one's),
    and optionally the first batch dimension over ``batch_axis``. Each device
    receives the key/value rows its queries need from the adjacent latitude shards
    (halo exchange) and sees every longitude chunk of keys pass by on a ring; no
    device ever holds more than one chunk of keys, values or their gradients.
    Differentiable (the backward pass runs the ring again), usable inside ``jit``
    with inputs of any sharding; other mesh axes replicate the computation.

    Latitude and longitude counts need not divide the mesh: shards are balanced
    and padded internally, at the cost of a re-layout of inputs and output.

    Args:
      query, key, value, plan, scale: as for :func:`jax_s2attn.neighborhood_attention`.
      mesh: the device mesh (``jax.make_mesh``; explicit or auto axis types).
      lat_axis, lon_axis: mesh axes that split latitudes and longitudes (size 1 is fine).
      batch_axis: mesh axis that splits the first batch dimension, or ``None``.
      implementation: the per-device kernels, ``"reference"`` (pure JAX) or ``"ffi"``
        (native); ``None`` picks the native kernels when built for the mesh's platform.

    Returns:
      ``out [B..., nlat_out, nlon_out, H, Dv]`` in the input dtype, sharded
      ``P(batch_axis, ..., lat_axis, lon_axis)`` when the grid divides the mesh.

    Raises:
      ValueError: naming the mesh axis and a size that works, when the grid cannot be
        split over it (a shard without points, or a latitude halo deeper than a shard).
    """
    _checks.check_implementation(implementation)
    batch, _, dk, _ = _checks.check_inputs(query, key, value, plan)
    scale = _checks.check_scale(scale, dk)
    _check_mesh(mesh, lat_axis, lon_axis, batch_axis, batch)
    layout = shard_layout(plan, mesh.shape[lat_axis], mesh.shape[lon_axis], lat_axis, lon_axis)
    config = RingConfig(layout, scale, _resolve_implementation(implementation, mesh))

    batch_spec = ((batch_axis,) + (None,) * (len(batch) - 1)) if batch else ()
    spec = PartitionSpec(*batch_spec, lat_axis, lon_axis)
    query = _to_blocks(query, layout.q_lat, layout.q_lon)
    key, value = (_to_blocks(x, layout.k_lat, layout.k_lon) for x in (key, value))
    query, key, value = (_place(x, mesh, spec) for x in (query, key, value))
    body = functools.partial(_shard_body, config=config)
    out = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec, PartitionSpec()), out_specs=spec)(
        query, key, value, plan
    )
    if layout.q_lat.padded or layout.q_lon.padded:
        # An axis the mesh does not divide cannot stay sharded: gather it before dropping the padding.
        lat_part = None if layout.q_lat.padded else lat_axis
        lon_part = None if layout.q_lon.padded else lon_axis
        out = _place(out, mesh, PartitionSpec(*batch_spec, lat_part, lon_part))
    return layout.q_lon.from_blocks(layout.q_lat.from_blocks(out, _LAT), _LON)


def _to_blocks(x, lat, lon):
    return lon.to_blocks(lat.to_blocks(x, _LAT), _LON)
