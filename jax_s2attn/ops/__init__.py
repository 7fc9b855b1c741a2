"""Attention ops: the public functions, the pure-JAX reference and the native (FFI) path."""

from .global_attention import attention_s2
from .neighborhood import RESIDUAL_NAME, neighborhood_attention
from .reference import reference_attention

__all__ = ["RESIDUAL_NAME", "attention_s2", "neighborhood_attention", "reference_attention"]
