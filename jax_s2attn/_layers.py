"""Functional core of the attention layers, shared by the NNX and Linen modules.

The modules only own parameters, the plan and dtype policy; everything else
(validation, parameter shapes and initialisers, projections, heads, RMS qk-norm,
the call of the attention op, torch-harmonics checkpoint conversion) lives here
so both front ends compute exactly the same thing.

Parameters (channel ``c`` of a projection belongs to head ``c // head_dim``):

=============== ================================== ==============================
name            shape                              torch-harmonics name
=============== ================================== ==============================
q_kernel        ``[in_features, qk_features]``     ``q_weights [qk, in, 1, 1]``
k_kernel        ``[in_features, qk_features]``     ``k_weights``
v_kernel        ``[in_features, out_features]``    ``v_weights [out, in, 1, 1]``
out_kernel      ``[out_features, out_features]``   ``proj_weights [out, out, 1, 1]``
q_bias, k_bias  ``[qk_features]``                  ``q_bias``, ``k_bias``
v_bias          ``[out_features]``                 ``v_bias``
out_bias        ``[out_features]``                 ``proj_bias``
q_norm_weight   ``[qk_features // num_heads]``     ``q_norm_weights``
k_norm_weight   ``[qk_features // num_heads]``     ``k_norm_weights``
=============== ================================== ==============================

Biases exist only with ``use_bias``, norm weights only with ``normalize_qk``.
The RMS norm multiplies by ``1 + *_norm_weight`` (zero-initialised), as
torch-harmonics does.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from . import _validate
from .grids import GRIDS, RingGrid, validate_shape
from .ops._checks import check_scale
from .ops.global_attention import attention_s2, quadrature_weights
from .ops.neighborhood import neighborhood_attention
from .parallel.ring_shards import _check_ring_mesh, ring_shard_layout, sharded_ring_attention
from .parallel.sharded import _check_mesh, padded_grid_shapes, sharded_neighborhood_attention
from .plan import NeighborhoodPlan
from .ring_plan import RingPlan

__all__ = [
    "LayerSpec",
    "MeshSplit",
    "ParamSpec",
    "RingMeshSplit",
    "attention_layer",
    "check_dtypes",
    "global_attention_fn",
    "layer_grid",
    "layer_spec",
    "mesh_split",
    "neighborhood_attention_fn",
    "param_specs",
    "params_from_torch_harmonics",
    "ring_layer_shapes",
    "ring_mesh_split",
    "rms_norm",
]

#: Our parameter name -> torch-harmonics state-dict name.
TORCH_NAMES = {
    "q_kernel": "q_weights",
    "k_kernel": "k_weights",
    "v_kernel": "v_weights",
    "out_kernel": "proj_weights",
    "q_bias": "q_bias",
    "k_bias": "k_bias",
    "v_bias": "v_bias",
    "out_bias": "proj_bias",
    "q_norm_weight": "q_norm_weights",
    "k_norm_weight": "k_norm_weights",
}


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """Validated, hashable structure of one attention layer (no arrays)."""

    in_features: int
    qk_features: int
    out_features: int
    num_heads: int
    in_shape: tuple[int, int]
    out_shape: tuple[int, int]
    scale: float
    normalize_qk: bool
    use_bias: bool

    @property
    def qk_head_dim(self) -> int:
        return self.qk_features // self.num_heads

    @property
    def v_head_dim(self) -> int:
        return self.out_features // self.num_heads


class ParamSpec(NamedTuple):
    name: str
    shape: tuple[int, ...]
    init: Callable  # jax initializer (key, shape, dtype) -> array


@dataclasses.dataclass(frozen=True)
class MeshSplit:
    """How a neighbourhood layer splits its attention over a device mesh.

    The arguments of :func:`jax_s2attn.parallel.sharded_neighborhood_attention`,
    validated against the layer's plan, and the end-padded grid sizes
    ``padded_shapes = (out_shape, in_shape)`` that layer inputs may also take.
    """

    mesh: Mesh
    lat_axis: str
    lon_axis: str
    batch_axis: str | None
    padded_shapes: tuple[tuple[int, int], tuple[int, int]]


def mesh_split(plan: NeighborhoodPlan, mesh, lat_axis="lat", lon_axis="lon", batch_axis=None) -> MeshSplit | None:
    """Validate a layer's mesh arguments (``None`` without a mesh); errors name the argument."""
    if mesh is None:
        return None
    _check_mesh(mesh, lat_axis, lon_axis, batch_axis)
    # Also raises, naming the mesh axis, when the grids cannot be split over it.
    padded = padded_grid_shapes(plan, mesh, lat_axis, lon_axis)
    return MeshSplit(mesh, lat_axis, lon_axis, batch_axis, padded)


@dataclasses.dataclass(frozen=True)
class RingMeshSplit:
    """How a neighbourhood layer between ring grids splits its attention over a device mesh: the arguments of
    :func:`jax_s2attn.parallel.sharded_ring_attention` (the rings over ``axis``, the layer's ``lat_axis``),
    validated against the layer's plan. Its inputs are the flat fields (``padded_shapes`` None)."""

    mesh: Mesh
    axis: str
    batch_axis: str | None
    padded_shapes: None = None


def ring_mesh_split(plan: RingPlan, mesh, lat_axis="lat", batch_axis=None,
                    implementation=None) -> RingMeshSplit | None:  # fmt: skip
    """Validate a ring layer's mesh arguments (``None`` without a mesh); errors name the argument."""
    if mesh is None:
        return None
    if implementation not in (None, "ffi", "ffi-arc"):
        raise ValueError(
            f"implementation={implementation!r}: a layer between ring grids on a mesh runs "
            "jax_s2attn.parallel.sharded_ring_attention on the ring kernels; pass implementation=None, 'ffi' or "
            "'ffi-arc' (or mesh=None)."
        )
    _check_ring_mesh(mesh, lat_axis, batch_axis)
    ring_shard_layout(plan, mesh.shape[lat_axis])  # raises where the rings cannot be split over the axis
    return RingMeshSplit(mesh, lat_axis, batch_axis)


def _sharded_rings(query, key, value, *, scale, plan: RingPlan, split: RingMeshSplit, implementation):
    """``sharded_ring_attention`` on flat fields: to the block layout and back."""
    layout = ring_shard_layout(plan, split.mesh.shape[split.axis])
    blocks = [layout.to_blocks(x, grid) for x, grid in ((query, "out"), (key, "in"), (value, "in"))]
    out = sharded_ring_attention(*blocks, plan, mesh=split.mesh, axis=split.axis, batch_axis=split.batch_axis,
                                 scale=scale, implementation=implementation)  # fmt: skip
    return layout.from_blocks(out, "out")


def neighborhood_attention_fn(plan, implementation, split: MeshSplit | RingMeshSplit | None) -> Callable:
    """``attention(q, k, v, scale=...)`` of a neighbourhood layer: serial, or sharded per ``split``."""
    if split is None:
        return functools.partial(neighborhood_attention, plan=plan, implementation=implementation)
    if isinstance(split, RingMeshSplit):
        return functools.partial(_sharded_rings, plan=plan, split=split, implementation=implementation)
    return functools.partial(
        sharded_neighborhood_attention,
        plan=plan,
        mesh=split.mesh,
        lat_axis=split.lat_axis,
        lon_axis=split.lon_axis,
        batch_axis=split.batch_axis,
        implementation=implementation,
    )


def global_attention_fn(grid_in, in_shape, implementation) -> Callable:
    """``attention(q, k, v, scale=...)`` of a global layer: the keys' weights are the ring grid ``grid_in``'s point
    weights, or those of the latitudes of a regular ``grid_in`` (a name) of ``in_shape``; constants of the
    program."""
    weights = grid_in if isinstance(grid_in, RingGrid) else quadrature_weights(in_shape, grid_in)
    return functools.partial(attention_s2, quad_weights=weights, implementation=implementation)


def layer_spec(
    in_features,
    in_shape,
    out_shape,
    *,
    num_heads=1,
    qk_features=None,
    out_features=None,
    scale=None,
    normalize_qk=False,
    use_bias=True,
    flat=False,
) -> LayerSpec:
    """Validate the structural arguments of a layer; defaults as torch-harmonics.

    ``qk_features`` and ``out_features`` default to ``in_features``; ``scale``
    defaults to ``1/sqrt(qk_features // num_heads)``. ``flat``: a layer between ring grids, whose shapes are
    ``(npoints,)`` (:func:`ring_layer_shapes`); else ``(nlat, nlon)``.
    """
    in_features = _validate.integer(in_features, "in_features", 1)
    num_heads = _validate.integer(num_heads, "num_heads", 1)
    features = {
        name: in_features if value is None else _validate.integer(value, name, 1)
        for name, value in (("qk_features", qk_features), ("out_features", out_features))
    }
    for name, given in (("qk_features", qk_features), ("out_features", out_features)):
        if features[name] % num_heads:
            # Name what the user passed: a defaulted qk_features/out_features is in_features.
            what = f"{name}={given}" if given is not None else f"in_features={in_features} (the default {name})"
            raise ValueError(
                f"num_heads={num_heads} must divide {what}; choose a multiple of num_heads"
                + ("" if given is not None else f", or pass {name} explicitly")
                + "."
            )
    qk_features, out_features = features["qk_features"], features["out_features"]
    scale = check_scale(scale, qk_features // num_heads)
    return LayerSpec(
        in_features=in_features,
        qk_features=qk_features,
        out_features=out_features,
        num_heads=num_heads,
        in_shape=in_shape if flat else validate_shape(in_shape, "in_shape"),
        out_shape=out_shape if flat else validate_shape(out_shape, "out_shape"),
        scale=scale,
        normalize_qk=_validate.boolean(normalize_qk, "normalize_qk"),
        use_bias=_validate.boolean(use_bias, "use_bias"),
    )


def layer_grid(grid, argname: str):
    """``grid`` (the argument ``argname``) as a layer takes it: a ring grid's name (:meth:`RingGrid.named`) as that
    :class:`RingGrid`; a RingGrid, a latitude grid's name (:data:`GRIDS`) or anything else (checked later) as it
    is."""
    if not isinstance(grid, str) or grid in GRIDS:
        return grid
    try:
        return RingGrid.named(grid)
    except ValueError as error:
        raise ValueError(f"{argname}={grid!r}: {error} The valid grids are {', '.join(map(repr, GRIDS))} (latitude "
                         "grids, with in_shape and out_shape) and ring grids' names.") from None  # fmt: skip


def ring_layer_shapes(grid_in, grid_out, in_shape, out_shape) -> tuple[tuple[int], tuple[int]]:
    """``(in_shape, out_shape)`` of a layer between the ring grids ``grid_in`` and ``grid_out``: ``(npoints,)`` of
    each grid; given shapes must be those (or None)."""
    for grid, name in ((grid_in, "grid_in"), (grid_out, "grid_out")):
        if not isinstance(grid, RingGrid):
            raise TypeError(f"{name} must be a RingGrid like the other grid (a layer between ring grids), got "
                            f"{grid!r}.")  # fmt: skip
    shapes = {"in_shape": (grid_in.npoints,), "out_shape": (grid_out.npoints,)}
    for name, given in (("in_shape", in_shape), ("out_shape", out_shape)):
        if given is None:
            continue
        if not isinstance(given, tuple) or len(given) != 1:
            raise TypeError(
                f"{name} must be None or ({shapes[name][0]},) between ring grids (flat fields), got {given!r}."
            )
        if _validate.integer(given[0], f"{name}[0]", 1) != shapes[name][0]:
            raise ValueError(
                f"{name}={given!r} does not match the layer's ring grid ({shapes[name][0]} points, flat fields "
                f"[batch..., npoints, features]); pass {name}=None or {shapes[name]!r}."
            )
    return shapes["in_shape"], shapes["out_shape"]


def check_dtypes(dtype, param_dtype) -> None:
    """A layer's ``dtype`` (None or a float dtype) and ``param_dtype`` (a float dtype)."""
    for name, value, optional in (("dtype", dtype, True), ("param_dtype", param_dtype, False)):
        if value is None and optional:
            continue
        try:  # jnp.dtype(None) is the default float type: None is refused by hand
            floating = value is not None and jnp.issubdtype(jnp.dtype(value), jnp.floating)
        except TypeError:
            floating = False
        if not floating:
            allowed = "None or a float dtype" if optional else "a float dtype"
            raise TypeError(f"{name} must be {allowed} (e.g. jnp.bfloat16 or jnp.float32), got {value!r}.")


def param_specs(spec: LayerSpec) -> tuple[ParamSpec, ...]:
    """Every parameter of the layer with its shape and initialiser.

    Kernels are Xavier-uniform over ``(fan_in, fan_out)`` (torch-harmonics'
    bounds ``sqrt(6/(in+qk))``, ``sqrt(6/(in+out))`` and ``sqrt(3/out)``);
    biases and norm weights start at zero.
    """
    xavier, zeros = jax.nn.initializers.xavier_uniform(), jax.nn.initializers.zeros
    cin, cqk, cout = spec.in_features, spec.qk_features, spec.out_features
    specs = [
        ParamSpec("q_kernel", (cin, cqk), xavier),
        ParamSpec("k_kernel", (cin, cqk), xavier),
        ParamSpec("v_kernel", (cin, cout), xavier),
        ParamSpec("out_kernel", (cout, cout), xavier),
    ]
    if spec.use_bias:
        specs += [
            ParamSpec("q_bias", (cqk,), zeros),
            ParamSpec("k_bias", (cqk,), zeros),
            ParamSpec("v_bias", (cout,), zeros),
            ParamSpec("out_bias", (cout,), zeros),
        ]
    if spec.normalize_qk:
        specs += [
            ParamSpec("q_norm_weight", (spec.qk_head_dim,), zeros),
            ParamSpec("k_norm_weight", (spec.qk_head_dim,), zeros),
        ]
    return tuple(specs)


def rms_norm(x, weight, eps: float | None = None):
    """RMS norm over the last axis with multiplier ``1 + weight``, returned in ``x.dtype``.

    Computed in float32 (float64 for float64 inputs) with ``eps`` defaulting to the
    machine epsilon of that computation dtype, as torch's ``rms_norm(eps=None)`` on
    float32 inputs (and under autocast, which runs the norm in float32).
    """
    compute = jnp.promote_types(x.dtype, jnp.float32)
    xc = x.astype(compute)
    eps = jnp.finfo(compute).eps if eps is None else eps
    normed = xc * jax.lax.rsqrt(jnp.mean(xc * xc, axis=-1, keepdims=True) + eps)
    return (normed * (1 + weight.astype(compute))).astype(x.dtype)


def _check_layer_inputs(query, key, value, spec: LayerSpec, padded_shapes=None) -> None:
    expected_grid = {"query": spec.out_shape, "key": spec.in_shape, "value": spec.in_shape}
    padded_out, padded_in = padded_shapes or (None, None)
    padded_grid = {"query": padded_out, "key": padded_in, "value": padded_in}
    arrays = {"query": query, "key": key, "value": value}
    axes = len(spec.out_shape)  # 2 on regular grids, 1 (the points) on ring grids
    for name, x in arrays.items():
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}.")
        shape = tuple(x.shape)
        grid = expected_grid[name]
        grids = {grid, padded_grid[name]}
        if len(shape) < axes + 1 or shape[-1] != spec.in_features or shape[-1 - axes : -1] not in grids:
            hint = (
                " For a layer from in_shape to a different out_shape pass key (and value) on the input grid."
                if name != "query" and spec.in_shape != spec.out_shape
                else ""
            )
            if padded_grid[name] not in (None, grid):
                hint += f" On this layer's mesh the grid may also come end-padded to {padded_grid[name]}."
            raise ValueError(
                f"{name} has shape {shape}; this layer expects {name} of shape "
                f"[batch..., {', '.join(map(str, grid))}, {spec.in_features}] (channels last; query on out_shape="
                f"{spec.out_shape}, key/value on in_shape={spec.in_shape}).{hint}"
            )
        if shape[: -1 - axes] != tuple(query.shape[: -1 - axes]):
            raise ValueError(
                f"{name} has batch axes {shape[:-1 - axes]} but query has {tuple(query.shape[:-1 - axes])}; they "
                "must match."
            )


def _project(x, params, prefix: str, precision):
    y = jnp.einsum("...c,cf->...f", x, params[f"{prefix}_kernel"], precision=precision)
    bias = params.get(f"{prefix}_bias")
    return y if bias is None else y + bias


def attention_layer(
    params: Mapping[str, jax.Array],
    query,
    key,
    value,
    *,
    spec: LayerSpec,
    attention: Callable,
    dtype=None,
    precision=None,
    padded_shapes=None,
):
    """Projections, heads, optional qk-norm, ``attention``, output projection.

    Args:
      params: arrays named as in :func:`param_specs`.
      query: ``[B..., nlat_out, nlon_out, in_features]``.
      key, value: ``[B..., nlat_in, nlon_in, in_features]``; ``key`` defaults to
        ``query`` and ``value`` to ``key``.
      spec: the layer structure.
      attention: ``attention(q, k, v, scale=...)`` on heads-last arrays
        ``[B..., nlat, nlon, H, D]`` (neighbourhood or global attention).
      dtype: computation dtype; ``None`` promotes the inputs' and parameters' dtypes (Flax).
      precision: ``jax.lax.Precision`` of the projections.
      padded_shapes: ``(out_shape, in_shape)`` also accepted for the grid axes of
        query and key/value (a mesh's end-padded sizes, :class:`MeshSplit`), or ``None``.

    Returns:
      ``[B..., nlat_out, nlon_out, out_features]`` in the computation dtype (grid
      axes as given for ``query``).
    """
    key = query if key is None else key
    value = key if value is None else value
    _check_layer_inputs(query, key, value, spec, padded_shapes)
    if dtype is None:
        dtype = jnp.result_type(query, key, value, *params.values())
    params = {name: jnp.asarray(p, dtype) for name, p in params.items()}
    heads = spec.num_heads

    def split_heads(x):
        return x.reshape(*x.shape[:-1], heads, x.shape[-1] // heads)

    q = split_heads(_project(jnp.asarray(query, dtype), params, "q", precision))
    k = split_heads(_project(jnp.asarray(key, dtype), params, "k", precision))
    v = split_heads(_project(jnp.asarray(value, dtype), params, "v", precision))
    if spec.normalize_qk:
        q = rms_norm(q, params["q_norm_weight"])
        k = rms_norm(k, params["k_norm_weight"])
    out = attention(q, k, v, scale=spec.scale)
    out = out.reshape(*out.shape[:-2], spec.out_features)
    return _project(out, params, "out", precision)


def _host_array(x, name: str) -> np.ndarray:
    """A host numpy copy of a state-dict entry: numpy, or a torch tensor on any device, requiring grad or
    not, in any float dtype (bfloat16, which numpy lacks, is widened exactly to float32)."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch tensor; torch itself stays unimported
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        x = x.numpy()
    try:
        array = np.asarray(x)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"state_dict[{name!r}] cannot be read as an array ({type(x).__name__}): {e}") from None
    if not np.issubdtype(array.dtype, np.floating):
        raise TypeError(f"state_dict[{name!r}] must hold floats, got dtype {array.dtype}.")
    return array


def params_from_torch_harmonics(state_dict: Mapping, spec: LayerSpec) -> dict[str, np.ndarray]:
    """Convert a torch-harmonics attention state dict to our parameters (numpy).

    Accepts the parameters of ``NeighborhoodAttentionS2`` / ``AttentionS2``
    (projection weights ``[out, in, 1, 1]``, biases, qk-norm weights) as numpy
    arrays, torch tensors (any device or float dtype, requiring grad or not) or
    anything ``np.asarray`` takes. Names and
    shapes are checked against ``spec``; any mismatch raises ``ValueError``.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of name -> array, got {type(state_dict).__name__}.")
    specs = {p.name: p for p in param_specs(spec)}
    expected = {TORCH_NAMES[name]: name for name in specs}
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    if missing or unexpected:
        raise ValueError(
            "state_dict does not match this layer "
            f"(use_bias={spec.use_bias}, normalize_qk={spec.normalize_qk}): "
            f"missing {missing}, unexpected {unexpected}; expected exactly {sorted(expected)}."
        )
    params = {}
    for torch_name, name in expected.items():
        array = _host_array(state_dict[torch_name], torch_name)
        shape = specs[name].shape
        torch_shape = (shape[1], shape[0], 1, 1) if name.endswith("_kernel") else shape
        if array.shape != torch_shape:
            raise ValueError(f"state_dict[{torch_name!r}] has shape {array.shape}, expected {torch_shape}.")
        # torch weights are [out, in, 1, 1] (1x1 convolutions); our kernels are [in, out].
        params[name] = array[:, :, 0, 0].T if name.endswith("_kernel") else array
    return params
