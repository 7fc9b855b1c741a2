"""Attention ops: the public functions, the pure-JAX reference and the native (FFI) path."""

from ._ffi import CUSTOM_CALL_TARGETS, export_disabled_checks
from .global_attention import attention_s2
from .neighborhood import RESIDUAL_NAME, neighborhood_attention
from .reference import reference_attention

__all__ = [
    "CUSTOM_CALL_TARGETS",
    "RESIDUAL_NAME",
    "attention_s2",
    "export_disabled_checks",
    "neighborhood_attention",
    "reference_attention",
]
