"""The GPU ceilings the benchmarks' floors use, measured on the H200, and the floor itself."""

from __future__ import annotations

import jax.numpy as jnp

COPY_BANDWIDTH = 4.3e12  # bytes/s, device-to-device copy measured on the H200 (read + write)
PEAK_FLOPS = {"bfloat16": 790e12, "float16": 790e12, "float32": 67e12}  # matrix bf16 measured; fp32 datasheet


def floor_ms(q_points: int, k_points: int, channels: int, useful_flops: float, dtype: str, backward: bool) -> float:
    """max(bytes / copy bandwidth, useful FLOPs / peak) in ms, each tensor read or written once: the forward reads
    q, k, v and writes out; the backward adds out, dout, dq; k, v, dk, dv (points over the batch)."""
    size = jnp.dtype(dtype).itemsize
    q_elements, k_elements = q_points * channels, k_points * channels
    tensors = (2 * q_elements + 2 * k_elements) * size  # q, out; k, v
    if backward:
        tensors += (3 * q_elements + 4 * k_elements) * size  # out, dout, dq; k, v, dk, dv
    return 1e3 * max(tensors / COPY_BANDWIDTH, useful_flops / PEAK_FLOPS[dtype])
