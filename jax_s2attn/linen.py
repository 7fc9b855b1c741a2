"""Flax Linen attention layers on the sphere: ``NeighborhoodAttentionS2`` and ``AttentionS2``.

Same arguments, parameters and math as :mod:`jax_s2attn.nnx` (both call
:mod:`jax_s2attn._layers`); see there for shapes and the torch-harmonics name
mapping. Shape legend: ``B...`` batch axes; query ``[B..., nlat_out, nlon_out,
in_features]``, key/value ``[B..., nlat_in, nlon_in, in_features]``; between ring grids flat, ``[B..., npoints,
in_features]``.

The neighbourhood layer's plan lives in the ``"s2_tables"`` collection that
``init`` returns next to ``"params"``. Pass both collections to ``apply`` and
the tables are arguments of a jitted program; with ``"params"`` alone the layer
still works but embeds the tables as constants. The plan's leaves are int32, so a
cast of every floating leaf leaves them alone. The global layer has no tables
(its quadrature weights are constants of the program).

Example:

  >>> import jax, jax.numpy as jnp
  >>> from jax_s2attn.linen import NeighborhoodAttentionS2
  >>> layer = NeighborhoodAttentionS2(8, (16, 32), (16, 32), num_heads=2)
  >>> x = jnp.ones((4, 16, 32, 8))
  >>> variables = layer.init(jax.random.key(0), x)
  >>> sorted(variables)
  ['params', 's2_tables']
  >>> layer.apply(variables, x).shape
  (4, 16, 32, 8)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
from jax.sharding import Mesh

from . import _layers
from .grids import RingGrid, validate_grid
from .ops import _checks, global_attention
from .plan import NeighborhoodPlan
from .ring_plan import RingPlan

__all__ = ["AttentionS2", "NeighborhoodAttentionS2", "TABLES_COLLECTION", "load_torch_harmonics_state_dict"]

#: Variable collection holding each neighbourhood layer's plan.
TABLES_COLLECTION = "s2_tables"


class _SphericalAttention(nn.Module):
    """Fields, parameters and the call shared by both layers."""

    in_features: int
    in_shape: tuple[int, int] | None = None
    out_shape: tuple[int, int] | None = None
    _: dataclasses.KW_ONLY
    num_heads: int = 1
    qk_features: int | None = None
    out_features: int | None = None
    grid_in: str | RingGrid = "equiangular"
    grid_out: str | RingGrid = "equiangular"
    scale: float | None = None
    normalize_qk: bool = False
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    implementation: str | None = None

    def __post_init__(self):
        # Validates every argument at construction, as NNX does.
        _layers.check_dtypes(self.dtype, self.param_dtype)
        self._check_implementation()
        self.spec  # noqa: B018 (validates the structural arguments)
        self._mesh_split(self._host_tables())
        super().__post_init__()

    def _grids(self) -> tuple:
        """``(grid_in, grid_out)``, ring grids' names as their :class:`~jax_s2attn.RingGrid` objects."""
        return _layers.layer_grid(self.grid_in, "grid_in"), _layers.layer_grid(self.grid_out, "grid_out")

    def _rings(self) -> bool:
        """Whether the layer lies between ring grids (flat fields)."""
        return any(isinstance(grid, RingGrid) for grid in self._grids())

    def _grid_shapes(self) -> tuple:
        """``(in_shape, out_shape)``: the fields', or between ring grids their point counts."""
        if self._rings():
            return _layers.ring_layer_shapes(*self._grids(), self.in_shape, self.out_shape)
        return self.in_shape, self.out_shape

    @property
    def spec(self) -> _layers.LayerSpec:
        in_shape, out_shape = self._grid_shapes()
        return _layers.layer_spec(
            self.in_features,
            in_shape,
            out_shape,
            num_heads=self.num_heads,
            qk_features=self.qk_features,
            out_features=self.out_features,
            scale=self.scale,
            normalize_qk=self.normalize_qk,
            use_bias=self.use_bias,
            flat=self._rings(),
        )

    def _host_tables(self):
        """The layer's plan, built outside any trace; None for a layer without tables."""
        raise NotImplementedError

    def _check_implementation(self) -> None:
        raise NotImplementedError

    def _mesh_split(self, host_tables) -> _layers.MeshSplit | None:
        """How the attention is split over a device mesh; ``None``: it is not."""
        return None

    def _attention_fn(self, tables, split: _layers.MeshSplit | None):
        """``attention(q, k, v, scale=...)`` on heads-last arrays, bound to ``tables`` (and ``split``)."""
        raise NotImplementedError

    @nn.compact
    def __call__(self, query, key=None, value=None):
        """Attend from ``query`` (output grid) to ``key``/``value`` (input grid).

        Args:
          query: ``[B..., nlat_out, nlon_out, in_features]`` (between ring grids ``[B..., npoints_out,
            in_features]``).
          key: ``[B..., nlat_in, nlon_in, in_features]`` (``[B..., npoints_in, in_features]``), default ``query``.
          value: same shape as ``key``, default ``key``.

        With a ``mesh``, grid axes may instead come end-padded to the sizes of
        :func:`jax_s2attn.parallel.padded_grid_shapes`.

        Returns:
          ``[B..., nlat_out, nlon_out, out_features]`` in the computation dtype,
          grid axes as given for ``query``.
        """
        spec = self.spec
        params = {p.name: self.param(p.name, p.init, p.shape, self.param_dtype) for p in _layers.param_specs(spec)}
        tables = self._host_tables()
        split = self._mesh_split(tables)
        if tables is not None and (self.is_initializing() or self.has_variable(TABLES_COLLECTION, "tables")):
            tables = self.variable(TABLES_COLLECTION, "tables", lambda: tables).value
        return _layers.attention_layer(
            params,
            query,
            key,
            value,
            spec=spec,
            attention=self._attention_fn(tables, split),
            dtype=self.dtype,
            precision=self.precision,
            padded_shapes=None if split is None else split.padded_shapes,
        )


class NeighborhoodAttentionS2(_SphericalAttention):
    """Attention over geodesic neighbourhoods on the sphere; Linen twin of
    :class:`jax_s2attn.nnx.NeighborhoodAttentionS2` (same arguments, without ``rngs``; between ring grids
    ``grid_in`` and ``grid_out`` are :class:`~jax_s2attn.RingGrid` objects or their names and fields are flat).

    ``mesh``, ``lat_axis``, ``lon_axis``, ``batch_axis``: with a
    ``jax.sharding.Mesh`` the attention runs through
    :func:`jax_s2attn.parallel.sharded_neighborhood_attention` on it (see the NNX
    layer for the input sizes it takes); ``None`` runs it serially.
    """

    _: dataclasses.KW_ONLY
    theta_cutoff: float | None = None
    mesh: Mesh | None = None
    lat_axis: str = "lat"
    lon_axis: str = "lon"
    batch_axis: str | None = None

    def _ring_plan(self) -> RingPlan:
        return RingPlan(*self._grids(), self.theta_cutoff)

    def _host_tables(self) -> NeighborhoodPlan | RingPlan:
        if self._rings():
            return self._ring_plan()
        spec = self.spec
        return NeighborhoodPlan(spec.in_shape, spec.out_shape, self.grid_in, self.grid_out, self.theta_cutoff)

    def _check_implementation(self) -> None:
        _checks.check_implementation(self.implementation)

    def _mesh_split(self, plan) -> _layers.MeshSplit | _layers.RingMeshSplit | None:
        if isinstance(plan, RingPlan):
            return _layers.ring_mesh_split(plan, self.mesh, self.lat_axis, self.batch_axis, self.implementation)
        return _layers.mesh_split(plan, self.mesh, self.lat_axis, self.lon_axis, self.batch_axis)

    def _attention_fn(self, plan, split):
        return _layers.neighborhood_attention_fn(plan, self.implementation, split)


class AttentionS2(_SphericalAttention):
    """Global attention on the sphere; Linen twin of :class:`jax_s2attn.nnx.AttentionS2`."""

    def _host_tables(self):
        if not self._rings():
            validate_grid(self.grid_in, "grid_in")
            validate_grid(self.grid_out, "grid_out")
        return None

    def _check_implementation(self) -> None:
        global_attention.check_implementation(self.implementation)

    def _attention_fn(self, tables, split):
        return _layers.global_attention_fn(self._grids()[0], self.spec.in_shape, self.implementation)


def load_torch_harmonics_state_dict(module: _SphericalAttention, state_dict: Mapping) -> dict:
    """The ``"params"`` collection of ``module`` from a torch-harmonics ``state_dict``.

    Same input and checks as :meth:`jax_s2attn.nnx.NeighborhoodAttentionS2.load_torch_harmonics_state_dict`.
    Use as ``variables = {**variables, "params": load_torch_harmonics_state_dict(layer, state_dict)}``.
    """
    converted = _layers.params_from_torch_harmonics(state_dict, module.spec)
    return {name: jnp.asarray(array, module.param_dtype) for name, array in converted.items()}
