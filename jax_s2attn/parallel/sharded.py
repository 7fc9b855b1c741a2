"""The sharded op: global arrays in, ``shard_map`` over a (lat, lon[, batch]) mesh inside."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ..ops import _checks, _ffi
from ..plan import NeighborhoodPlan
from .halo import exchange_halo
from .layout import AxisSplit, ShardLayout, shard_layout
from .ring import RingConfig, ring_attention

__all__ = ["padded_grid_shapes", "sharded_neighborhood_attention"]

# Axes of an activation ``[B..., nlat, nlon, H, D]``, counted from the end.
_LAT, _LON = -4, -3


def _check_mesh(mesh, lat_axis, lon_axis, batch_axis) -> None:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh (e.g. from jax.make_mesh), got {type(mesh).__name__}.")
    names = {"lat_axis": lat_axis, "lon_axis": lon_axis, "batch_axis": batch_axis}
    for arg in ("lat_axis", "lon_axis"):
        if names[arg] is None:
            raise ValueError(
                f"{arg}=None: the sharded op splits latitudes and longitudes over two mesh axes; pass the name of a "
                f"mesh axis (one of size 1 splits nothing, e.g. jax.make_mesh((4, 1), ('lat', 'lon'))), or call "
                "jax_s2attn.neighborhood_attention for no split."
            )
    for arg, name in names.items():
        if name is not None and name not in mesh.axis_names:
            raise ValueError(f"{arg}={name!r} is not an axis of the mesh; its axes are {mesh.axis_names}.")
    used = [n for n in names.values() if n is not None]
    if len(set(used)) != len(used):
        raise ValueError(f"lat_axis, lon_axis and batch_axis must be distinct mesh axes, got {names}.")


def _check_batch(mesh, batch_axis, batch_shape) -> None:
    if batch_axis is None:
        return
    parts = mesh.shape[batch_axis]
    if not batch_shape or batch_shape[0] % parts:
        raise ValueError(
            f"batch_axis={batch_axis!r} splits the first batch dimension over {parts} devices, but the batch "
            f"shape is {batch_shape}: it needs a leading batch dimension divisible by {parts} (or pass "
            "batch_axis=None)."
        )


def _given_padded(x, lat: AxisSplit, lon: AxisSplit) -> tuple[bool, bool]:
    """Whether ``x`` arrives in the end-padded blocked layout along latitude / longitude."""
    if not hasattr(x, "shape") or len(x.shape) < 4:
        return False, False
    return tuple(
        split.padded_size != split.size and x.shape[axis] == split.padded_size
        for split, axis in ((lat, _LAT), (lon, _LON))
    )


def _unpadded_view(x, padded: tuple[bool, bool], lat: AxisSplit, lon: AxisSplit):
    """``x``'s shape with padded grid axes at their true size, for the serial op's checks."""
    if not any(padded):
        return x
    shape = list(x.shape)
    for is_padded, split, axis in zip(padded, (lat, lon), (_LAT, _LON)):
        if is_padded:
            shape[axis] = split.size
    return jax.ShapeDtypeStruct(tuple(shape), x.dtype)


def _mesh_kernel(implementation, mesh: Mesh, dtype, dk: int, dv: int) -> str:
    """What ``implementation`` runs per device on the mesh's platform ("reference", "arc" or
    "scheduled"), chosen as the serial op chooses it for that platform."""
    platform = _ffi.ffi_platform(mesh.devices.flat[0].platform)
    _checks.check_runnable(implementation, platform, dtype, dk, dv, where=f"on this {platform} mesh")
    _checks.warn_if_falling_back(implementation, platform, dtype)
    return _checks.kernel_for(implementation, platform, dtype, dk, dv)


def padded_grid_shapes(plan: NeighborhoodPlan, mesh: Mesh, lat_axis: str = "lat", lon_axis: str = "lon"):
    """Grid sizes at which arrays stay evenly sharded on ``mesh``: ``(out_shape, in_shape)``.

    Each is ``(nlat, nlon)`` rounded up to the block layout of
    :func:`sharded_neighborhood_attention`; equal to ``plan.out_shape`` / ``plan.in_shape``
    when the mesh divides them. Pad arrays at the end (south, east) to these sizes.
    """
    _checks.check_plan(plan)
    _check_mesh(mesh, lat_axis, lon_axis, None)
    layout = shard_layout(plan, mesh.shape[lat_axis], mesh.shape[lon_axis], lat_axis, lon_axis)
    return (
        (layout.q_lat.padded_size, layout.q_lon.padded_size),
        (layout.k_lat.padded_size, layout.k_lon.padded_size),
    )


def _place(x, mesh: Mesh, spec: PartitionSpec):
    """Give ``x`` the sharding ``shard_map`` expects: explicit mesh axes need it in the type."""
    explicit = {n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit}
    if not explicit:
        return x  # Auto axes: shard_map reshards by itself.
    keep = lambda part: part if part in explicit else None  # noqa: E731
    return jax.sharding.reshard(x, NamedSharding(mesh, PartitionSpec(*(keep(p) for p in spec))))


def _zero_padding(x, lat: AxisSplit, lon: AxisSplit, layout: ShardLayout):
    """Zero this shard's padding slots of a local block (callers may pad with anything)."""
    if lat.padded_size == lat.size and lon.padded_size == lon.size:
        return x
    rows = jnp.asarray(np.asarray(lat.counts, np.int32))[jax.lax.axis_index(layout.lat_axis)]
    cols = jnp.asarray(np.asarray(lon.counts, np.int32))[jax.lax.axis_index(layout.lon_axis)]
    real = (jnp.arange(lat.block) < rows)[:, None] & (jnp.arange(lon.block) < cols)[None, :]
    return jnp.where(real[:, :, None, None], x, jnp.zeros((), x.dtype))


def _shard_body(query, key, value, plan, *, config: RingConfig):
    """Per device: flatten batch axes, exchange the key/value halo, run the ring."""
    layout = config.layout
    batch = query.shape[:_LAT]
    flat = lambda x: x.reshape(math.prod(batch), *x.shape[_LAT:])  # noqa: E731
    query = _zero_padding(flat(query), layout.q_lat, layout.q_lon, layout)
    key, value = (_zero_padding(flat(x), layout.k_lat, layout.k_lon, layout) for x in (key, value))
    key, value = exchange_halo((key, value), layout, axis=_LAT)
    out = ring_attention(config, query, key, value, plan)
    # The padding of `out` is already zero; masking it also zeroes its cotangent.
    out = _zero_padding(out, layout.q_lat, layout.q_lon, layout)
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

    Latitudes are split over mesh axis ``lat_axis`` and longitudes over ``lon_axis``,
    optionally the first batch dimension over ``batch_axis``; other mesh axes replicate
    the computation. Each device receives the key/value rows its queries need from the
    adjacent latitude shards (halo exchange) and sees every longitude chunk of keys pass
    by on a ring; no device ever holds more than one chunk of keys, values or their
    gradients. Differentiable (the backward pass runs the ring again) and usable inside
    ``jit`` with inputs of any sharding.

    Grid sizes that a mesh axis does not divide: every grid axis is cut into blocks of
    ``ceil(n / devices)`` points (for longitudes, the finer grid in blocks ``nlon_fine //
    nlon_coarse`` times the coarser grid's), i.e. JAX's layout of the axis padded at the
    end to ``devices * block``. Arrays may be passed either at the true size (they are
    padded internally and the output is gathered along that axis, since JAX cannot shard
    it evenly) or already padded at the end to that size, e.g. 721 latitudes as 724 on 4
    devices; then nothing moves and the output comes back padded likewise, with zeros in
    the padding (whose inputs are ignored and get zero gradients).
    :func:`jax_s2attn.parallel.padded_grid_shapes` gives these sizes.

    Args:
      query, key, value, plan, scale: as for :func:`jax_s2attn.neighborhood_attention`
        (grid axes at their true or their padded size, see above).
      mesh: the device mesh (``jax.make_mesh``; explicit or auto axis types).
      lat_axis, lon_axis: mesh axes that split latitudes and longitudes (size 1 is fine).
      batch_axis: mesh axis that splits the first batch dimension, or ``None``.
      implementation: the per-device kernels, as for
        :func:`jax_s2attn.neighborhood_attention` on the mesh's platform: ``None``
        (native where built, the reference elsewhere and for float64), ``"reference"``,
        ``"ffi"`` (on CUDA the tensor-core kernels where they apply, else the arc kernels),
        ``"ffi-arc"`` or ``"ffi-tiled"``.

    Returns:
      ``out [B..., nlat_out, nlon_out, H, Dv]`` in the input dtype (grid axes as given
      for ``query``), sharded ``P(batch_axis, ..., lat_axis, lon_axis)`` where even.

    Raises:
      ValueError: naming the mesh axis and a size that works, when the grid cannot be
        split over it (more devices than points, or a latitude halo deeper than the
        adjacent shard).
    """
    _checks.check_implementation(implementation)
    _checks.check_plan(plan)
    _check_mesh(mesh, lat_axis, lon_axis, batch_axis)
    layout = shard_layout(plan, mesh.shape[lat_axis], mesh.shape[lon_axis], lat_axis, lon_axis)
    grids = [(layout.q_lat, layout.q_lon), (layout.k_lat, layout.k_lon), (layout.k_lat, layout.k_lon)]
    padded = [_given_padded(x, *grid) for x, grid in zip((query, key, value), grids)]
    views = [_unpadded_view(x, p, *grid) for x, p, grid in zip((query, key, value), padded, grids)]
    batch, _, dk, dv = _checks.check_inputs(*views, plan)
    scale = _checks.check_scale(scale, dk)
    _check_batch(mesh, batch_axis, batch)
    if math.prod(batch) * views[0].shape[-2] == 0:  # an empty batch axis or no heads: nothing to compute
        return jnp.zeros((*query.shape[:-1], dv), views[0].dtype)
    config = RingConfig(layout, scale, _mesh_kernel(implementation, mesh, views[0].dtype, dk, dv))

    def spec(lat_part, lon_part):
        return PartitionSpec(*((batch_axis,) + (None,) * (len(batch) - 1) if batch else ()), lat_part, lon_part)

    blocked = []
    for x, (lat, lon), (lat_padded, lon_padded) in zip((query, key, value), grids, padded):
        x = jnp.asarray(x)
        x = x if lat_padded else lat.to_blocks(x, _LAT)
        blocked.append(_place(x if lon_padded else lon.to_blocks(x, _LON), mesh, spec(lat_axis, lon_axis)))
    body = functools.partial(_shard_body, config=config)
    block_spec = spec(lat_axis, lon_axis)
    out = jax.shard_map(body, mesh=mesh, in_specs=(block_spec,) * 3 + (PartitionSpec(),), out_specs=block_spec)(
        *blocked, plan
    )

    # The output keeps the query's layout; an axis the mesh does not divide cannot stay
    # sharded at its true size, so it is gathered before the padding is dropped.
    unpad_lat, unpad_lon = (s.padded_size != s.size and not p for s, p in zip(grids[0], padded[0]))
    if unpad_lat or unpad_lon:
        out = _place(out, mesh, spec(None if unpad_lat else lat_axis, None if unpad_lon else lon_axis))
    out = layout.q_lat.from_blocks(out, _LAT) if unpad_lat else out
    return layout.q_lon.from_blocks(out, _LON) if unpad_lon else out
