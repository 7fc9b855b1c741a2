"""Attention ops: the public function, the pure-JAX reference and the native (FFI) path."""

from .neighborhood import neighborhood_attention
from .reference import reference_attention

__all__ = ["neighborhood_attention", "reference_attention"]
