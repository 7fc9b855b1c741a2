"""jax_s2attn: neighbourhood attention on the sphere for JAX.

Data flows one way: :mod:`~jax_s2attn.grids` (latitudes, quadrature) ->
:mod:`~jax_s2attn.plan` and :mod:`~jax_s2attn.ring_plan` (neighbourhood sparsity, arc tables) ->
:mod:`~jax_s2attn.ops` (the attention ops: pure-JAX reference and native kernels) ->
:mod:`~jax_s2attn.parallel` (sharded over a device mesh) -> :mod:`~jax_s2attn.nnx` /
:mod:`~jax_s2attn.linen` (Flax layers; optional dependency).
"""

import importlib

from .grids import GRIDS, RingGrid, latitude_spacing, precompute_latitudes, precompute_longitudes
from .ops import CUSTOM_CALL_TARGETS, RESIDUAL_NAME, attention_s2, export_disabled_checks, neighborhood_attention
from ._native import native_backends, native_status
from .parallel import sharded_neighborhood_attention
from .plan import NeighborhoodPlan
from .ring_plan import RingPlan

__version__ = "0.1.0"

__all__ = [
    "CUSTOM_CALL_TARGETS",
    "GRIDS",
    "NeighborhoodPlan",
    "RESIDUAL_NAME",
    "RingGrid",
    "RingPlan",
    "attention_s2",
    "export_disabled_checks",
    "latitude_spacing",
    "native_backends",
    "native_status",
    "neighborhood_attention",
    "precompute_latitudes",
    "precompute_longitudes",
    "sharded_neighborhood_attention",
]

_FLAX_SUBMODULES = ("nnx", "linen")


def __getattr__(name: str):
    # The Flax layers need the optional flax dependency: import them on first use.
    if name in _FLAX_SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
