"""jax_s2attn: neighbourhood attention on the sphere for JAX.

Data flows one way: :mod:`~jax_s2attn.grids` (latitudes, quadrature) ->
:mod:`~jax_s2attn.plan` (neighbourhood sparsity, arc tables) ->
:mod:`~jax_s2attn.ops` (the attention op: pure-JAX reference and native kernels) ->
:mod:`~jax_s2attn.parallel` (the op sharded over a device mesh).
"""

from .grids import GRIDS, latitude_spacing, precompute_latitudes, precompute_longitudes
from .ops import neighborhood_attention
from .ops._ffi import native_backends, native_status
from .parallel import sharded_neighborhood_attention
from .plan import NeighborhoodPlan

__version__ = "0.1.0"

__all__ = [
    "GRIDS",
    "NeighborhoodPlan",
    "latitude_spacing",
    "native_backends",
    "native_status",
    "neighborhood_attention",
    "precompute_latitudes",
    "precompute_longitudes",
    "sharded_neighborhood_attention",
]
