"""Flax NNX attention layers on the sphere: ``NeighborhoodAttentionS2`` and ``AttentionS2``.

Shape legend: ``B...`` any leading batch axes, ``C`` channels; grids are
``(nlat, nlon)`` with colatitude ascending (north pole first) as in
torch-harmonics. Modules are channels-last: query ``[B..., nlat_out, nlon_out,
in_features]``, key/value ``[B..., nlat_in, nlon_in, in_features]``, output
``[B..., nlat_out, nlon_out, out_features]``. Between ring grids (:class:`~jax_s2attn.RingGrid` objects or their
names, :meth:`~jax_s2attn.RingGrid.named`, as ``grid_in`` and ``grid_out``) fields are flat: ``[B..., npoints, features]`` in ring order, and the plan a
:class:`~jax_s2attn.RingPlan` (its tables are host constants of the program).

The math is torch-harmonics' ``NeighborhoodAttentionS2`` / ``AttentionS2``,
with Flax argument names: ``in_features``
(``in_channels``), ``qk_features`` (``k_channels``), ``out_features``
(``out_channels``), ``use_bias`` (``bias``), ``normalize_qk`` (``use_qknorm``).
Parameters are described in :mod:`jax_s2attn._layers`; a torch-harmonics
checkpoint is imported with :meth:`NeighborhoodAttentionS2.load_torch_harmonics_state_dict`.

The neighbourhood layer's plan is held in an :class:`S2Tables` variable: it is
part of the module's state, so under ``nnx.jit`` its device tables are arguments
of the compiled program, not constants folded into it, and an optimizer built
with ``wrt=nnx.Param`` never touches it. Its leaves are all int32 index tables,
so a mixed-precision cast of the floating leaves of a whole state leaves them
alone (a cast of every leaf is caught when the layer is called). The global
layer holds no tables: its quadrature weights (one per input latitude) are
constants of the program. To checkpoint a layer save ``nnx.state(layer,
nnx.Param)``; the tables are rebuilt by the constructor.

Example:

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from jax_s2attn.nnx import NeighborhoodAttentionS2
  >>> layer = NeighborhoodAttentionS2(8, (16, 32), (16, 32), num_heads=2, rngs=nnx.Rngs(0))
  >>> layer(jnp.ones((4, 16, 32, 8))).shape
  (4, 16, 32, 8)
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from . import _layers
from .grids import RingGrid, validate_grid
from .ops import _checks, global_attention
from .plan import NeighborhoodPlan
from .ring_plan import RingPlan

__all__ = ["AttentionS2", "NeighborhoodAttentionS2", "S2Tables"]


class S2Tables(nnx.Variable):
    """Non-trainable constants of a neighbourhood layer: its plan (int32 device tables)."""


class _SphericalAttention(nnx.Module):
    """Parameters, dtype policy and the call shared by both layers."""

    def __init__(self, spec: _layers.LayerSpec, *, dtype, param_dtype, precision, implementation, rngs, split=None):
        _layers.check_dtypes(dtype, param_dtype)
        self.spec = spec
        self.split = split  # _layers.MeshSplit of a layer on a device mesh, else None
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision
        self.implementation = implementation
        for p in _layers.param_specs(spec):
            setattr(self, p.name, nnx.Param(p.init(rngs.params(), p.shape, param_dtype)))

    def _attention_fn(self):
        """``attention(q, k, v, scale=...)`` on heads-last arrays."""
        raise NotImplementedError

    def __call__(self, query, key=None, value=None):
        """Attend from ``query`` (output grid) to ``key``/``value`` (input grid).

        Args:
          query: ``[B..., nlat_out, nlon_out, in_features]`` (between ring grids ``[B..., npoints_out,
            in_features]``).
          key: ``[B..., nlat_in, nlon_in, in_features]`` (``[B..., npoints_in, in_features]``), default ``query``.
          value: same shape as ``key``, default ``key``.

        With a ``mesh``, grid axes may instead come end-padded to the sizes of
        :func:`jax_s2attn.parallel.padded_grid_shapes` (see the layer's ``mesh``).

        Returns:
          ``[B..., nlat_out, nlon_out, out_features]`` (``[B..., npoints_out, out_features]``) in the
          computation dtype, grid axes as given for ``query``.
        """
        params = {p.name: getattr(self, p.name)[...] for p in _layers.param_specs(self.spec)}
        return _layers.attention_layer(
            params,
            query,
            key,
            value,
            spec=self.spec,
            attention=self._attention_fn(),
            dtype=self.dtype,
            precision=self.precision,
            padded_shapes=None if self.split is None else self.split.padded_shapes,
        )

    def load_torch_harmonics_state_dict(self, state_dict: Mapping) -> None:
        """Set the parameters from a torch-harmonics attention ``state_dict``.

        ``state_dict`` maps torch-harmonics names (``q_weights [qk, in, 1, 1]``,
        ``k_weights``, ``v_weights``, ``proj_weights``, ``q_bias``, ``k_bias``,
        ``v_bias``, ``proj_bias``, ``q_norm_weights``, ``k_norm_weights``; biases
        and norm weights only where the layer has them) to numpy arrays or CPU
        tensors, e.g. ``{k: v.numpy() for k, v in torch_layer.state_dict().items()}``.
        Raises ``ValueError`` naming any missing, unexpected or misshapen entry.
        """
        for name, array in _layers.params_from_torch_harmonics(state_dict, self.spec).items():
            getattr(self, name).set_value(jnp.asarray(array, self.param_dtype))


class NeighborhoodAttentionS2(_SphericalAttention):
    """Attention over geodesic neighbourhoods on the sphere (torch-harmonics' ``NeighborhoodAttentionS2``).

    Output point ``o`` attends to the input points within geodesic distance
    ``theta_cutoff`` of it, with the quadrature weight of each key's latitude
    inside the softmax. Works for self-attention (``in_shape == out_shape``),
    downsampling (``nlon_in`` a multiple of ``nlon_out``) and upsampling
    (``nlon_out`` a multiple of ``nlon_in``).

    Between ring grids (HEALPix, reduced Gaussian, lat-lon of any longitude count: pass
    :class:`~jax_s2attn.RingGrid` objects or their names, e.g. ``"healpix(256)"``, ``"O320"``,
    ``"equiangular(721, 1440)"``, as ``grid_in`` and ``grid_out`` and leave out the shapes) fields are flat,
    ``[B..., npoints, features]`` in ring order, the plan a :class:`~jax_s2attn.RingPlan`, and the op runs it as
    :func:`jax_s2attn.neighborhood_attention` does (the scheduled tensor-core kernels, the ring kernels or the
    reference), or over a ``mesh`` as :func:`jax_s2attn.parallel.sharded_ring_attention` does.

    Args:
      in_features: channels of query, key and value inputs.
      in_shape: ``(nlat_in, nlon_in)`` of key/value (between ring grids None, or ``(npoints_in,)``).
      out_shape: ``(nlat_out, nlon_out)`` of query and output (between ring grids None, or ``(npoints_out,)``).
      num_heads: heads; must divide ``qk_features`` and ``out_features``.
      qk_features: channels of the projected queries/keys, default ``in_features``.
      out_features: channels of values and output, default ``in_features``.
      grid_in, grid_out: latitude grids (``"equiangular"``, ``"legendre-gauss"``,
        ``"lobatto"``, ``"equiangular-trapezoidal"``), or two ring grids: :class:`~jax_s2attn.RingGrid` objects
        or their names (:meth:`~jax_s2attn.RingGrid.named`).
      theta_cutoff: neighbourhood radius (radians); default the largest latitude
        spacing of the output grid (of the input grid when upsampling). Between ring grids required unless
        both are regular grids whose longitude counts divide one another (:class:`~jax_s2attn.RingPlan`).
      scale: logit scale, default ``1/sqrt(qk_features // num_heads)``.
      normalize_qk: RMS-normalise each head of q and k (multiplier ``1 + g``, g zero-initialised).
      use_bias: biases on the four projections.
      dtype: computation dtype; ``None`` promotes inputs and parameters. The
        attention itself accumulates in float32 (or wider).
      param_dtype: parameter storage dtype.
      precision: ``jax.lax.Precision`` of the projections.
      implementation: passed to :func:`jax_s2attn.neighborhood_attention`
        (``None``: fastest available, ``"reference"``, ``"ffi"``, ``"ffi-arc"``,
        ``"ffi-tiled"``) and, with a ``mesh``, to the sharded op.
      mesh: a ``jax.sharding.Mesh`` to split the attention over with
        :func:`jax_s2attn.parallel.sharded_neighborhood_attention` (same plan,
        scale and implementation); ``None`` runs it serially. The projections
        follow the inputs' sharding, e.g. ``NamedSharding(mesh, P(None, "lat", "lon"))``.
        Inputs take the true grid sizes (padded and gathered internally where the
        mesh does not divide a grid axis) or, to stay evenly sharded, those end-padded
        to :func:`jax_s2attn.parallel.padded_grid_shapes`; the output then keeps the
        padding, where it holds the output bias (ignore or slice it off). Between ring grids the rings are split
        over ``lat_axis`` by :func:`jax_s2attn.parallel.sharded_ring_attention` (the ring kernels:
        ``implementation`` ``None``, ``"ffi"`` or ``"ffi-arc"``) on the flat fields, moved into its block layout
        and back (``lon_axis`` replicates).
      lat_axis, lon_axis: mesh axes that split latitudes (between ring grids: the rings) and longitudes.
      batch_axis: mesh axis that splits the first batch dimension, or ``None``.
      rngs: ``nnx.Rngs`` for parameter initialisation.
    """

    def __init__(
        self,
        in_features: int,
        in_shape: tuple[int, int] | None = None,
        out_shape: tuple[int, int] | None = None,
        *,
        num_heads: int = 1,
        qk_features: int | None = None,
        out_features: int | None = None,
        grid_in: str | RingGrid = "equiangular",
        grid_out: str | RingGrid = "equiangular",
        theta_cutoff: float | None = None,
        scale: float | None = None,
        normalize_qk: bool = False,
        use_bias: bool = True,
        dtype=None,
        param_dtype=jnp.float32,
        precision=None,
        implementation: str | None = None,
        mesh: Mesh | None = None,
        lat_axis: str = "lat",
        lon_axis: str = "lon",
        batch_axis: str | None = None,
        rngs: nnx.Rngs,
    ):
        grid_in, grid_out = _layers.layer_grid(grid_in, "grid_in"), _layers.layer_grid(grid_out, "grid_out")
        rings = isinstance(grid_in, RingGrid) or isinstance(grid_out, RingGrid)
        if rings:
            plan = RingPlan(grid_in, grid_out, theta_cutoff)
            in_shape, out_shape = _layers.ring_layer_shapes(grid_in, grid_out, in_shape, out_shape)
        spec = _layers.layer_spec(
            in_features,
            in_shape,
            out_shape,
            num_heads=num_heads,
            qk_features=qk_features,
            out_features=out_features,
            scale=scale,
            normalize_qk=normalize_qk,
            use_bias=use_bias,
            flat=rings,
        )
        _checks.check_implementation(implementation)
        if not rings:
            plan = NeighborhoodPlan(spec.in_shape, spec.out_shape, grid_in, grid_out, theta_cutoff)
        super().__init__(
            spec,
            dtype=dtype,
            param_dtype=param_dtype,
            precision=precision,
            implementation=implementation,
            rngs=rngs,
            split=_layers.ring_mesh_split(plan, mesh, lat_axis, batch_axis, implementation)
            if rings
            else _layers.mesh_split(plan, mesh, lat_axis, lon_axis, batch_axis),
        )
        self.tables = S2Tables(plan)

    @property
    def plan(self) -> NeighborhoodPlan | RingPlan:
        """The layer's :class:`~jax_s2attn.NeighborhoodPlan` (a :class:`~jax_s2attn.RingPlan` between ring
        grids)."""
        return self.tables.get_value()

    def _attention_fn(self):
        return _layers.neighborhood_attention_fn(self.plan, self.implementation, self.split)


class AttentionS2(_SphericalAttention):
    """Global attention on the sphere (torch-harmonics' ``AttentionS2``).

    Every output point attends to every input point, the key's quadrature
    weight inside the softmax (:func:`jax_s2attn.ops.global_attention.attention_s2`).
    Same arguments and parameters as :class:`NeighborhoodAttentionS2` without
    ``theta_cutoff``; ``implementation`` is ``None``, ``"xla"`` or ``"cudnn"``.
    Memory: the ``"xla"`` path stores ``4*B*H*T*S`` bytes of logits
    (``T``/``S`` = output/input grid points), e.g. 1.07 GB per batch element and
    head at 91x180; the cuDNN path (GPU, 16-bit dtypes) is linear in ``T + S``.
    Between ring grids (two :class:`~jax_s2attn.RingGrid` objects or names, shapes left out) fields are flat and
    the keys' weights are ``grid_in``'s point weights.
    """

    def __init__(
        self,
        in_features: int,
        in_shape: tuple[int, int] | None = None,
        out_shape: tuple[int, int] | None = None,
        *,
        num_heads: int = 1,
        qk_features: int | None = None,
        out_features: int | None = None,
        grid_in: str | RingGrid = "equiangular",
        grid_out: str | RingGrid = "equiangular",
        scale: float | None = None,
        normalize_qk: bool = False,
        use_bias: bool = True,
        dtype=None,
        param_dtype=jnp.float32,
        precision=None,
        implementation: str | None = None,
        rngs: nnx.Rngs,
    ):
        grid_in, grid_out = _layers.layer_grid(grid_in, "grid_in"), _layers.layer_grid(grid_out, "grid_out")
        rings = isinstance(grid_in, RingGrid) or isinstance(grid_out, RingGrid)
        if rings:
            in_shape, out_shape = _layers.ring_layer_shapes(grid_in, grid_out, in_shape, out_shape)
        spec = _layers.layer_spec(
            in_features,
            in_shape,
            out_shape,
            num_heads=num_heads,
            qk_features=qk_features,
            out_features=out_features,
            scale=scale,
            normalize_qk=normalize_qk,
            use_bias=use_bias,
            flat=rings,
        )
        if not rings:
            validate_grid(grid_in, "grid_in")
            validate_grid(grid_out, "grid_out")
        global_attention.check_implementation(implementation)
        super().__init__(
            spec,
            dtype=dtype,
            param_dtype=param_dtype,
            precision=precision,
            implementation=implementation,
            rngs=rngs,
        )
        self.grid_in = grid_in

    def _attention_fn(self):
        return _layers.global_attention_fn(self.grid_in, self.spec.in_shape, self.implementation)
