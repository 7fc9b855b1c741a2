"""Shared fixtures: seeded random inputs, float64 enabled, platform gating."""

from __future__ import annotations

import os
import zlib

# Eight virtual CPU devices for the sharded tests; must precede the first backend use.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
import pytest

jax.config.update("jax_enable_x64", True)


@pytest.fixture(autouse=True)
def full_float32_matmuls():
    """GPUs run float32 dots in TF32 by default (~1e-3 relative error); the float32 bars assume full float32."""
    with jax.default_matmul_precision("highest"):
        yield


def pytest_addoption(parser):
    parser.addoption("--seed", type=int, default=20261129, help="seed of the random test inputs")


@pytest.fixture
def rng(request):
    """A numpy Generator seeded per test (so tests are independent and reproducible)."""
    seed = request.config.getoption("--seed")
    return np.random.default_rng([seed, zlib.crc32(request.node.nodeid.encode())])


def has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (on the H200: bash benchmarks/run_h200.sh tests)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _dense_membership(plan) -> np.ndarray:
    """Boolean ``[out points, in points]``: geodesic distance <= (1 + 1e-3) * cutoff.

    Independent of the library: spherical law of cosines on the actual longitudes.
    """
    th_o = np.repeat(plan.theta_out, plan.nlon_out)
    ph_o = np.tile(2 * np.pi * np.arange(plan.nlon_out) / plan.nlon_out, plan.nlat_out)
    th_i = np.repeat(plan.theta_in, plan.nlon_in)
    ph_i = np.tile(2 * np.pi * np.arange(plan.nlon_in) / plan.nlon_in, plan.nlat_in)
    cos_d = np.cos(th_o)[:, None] * np.cos(th_i)[None, :] + np.sin(th_o)[:, None] * np.sin(th_i)[None, :] * np.cos(
        ph_o[:, None] - ph_i[None, :]
    )
    return np.arccos(np.clip(cos_d, -1.0, 1.0)) <= (1 + 1e-3) * plan.theta_cutoff


def _dense_attention(query, key, value, plan, scale):
    """Float64 masked softmax over all (output, input) pairs: ``(out, lse)``.

    Arrays are ``[B, nlat, nlon, H, D]``; written with ``jax.numpy`` so tests can
    differentiate it. Weights are recomputed from the grid's quadrature, not read
    from the plan.
    """
    import jax.numpy as jnp

    from jax_s2attn import precompute_latitudes

    q, k, v = (jnp.asarray(x, jnp.float64) for x in (query, key, value))
    b, h = q.shape[0], q.shape[-2]
    qf = q.reshape(b, -1, h, q.shape[-1])
    kf = k.reshape(b, -1, h, k.shape[-1])
    vf = v.reshape(b, -1, h, v.shape[-1])
    _, w = precompute_latitudes(plan.nlat_in, plan.grid_in)
    # The exact weights 2*pi*w/nlon_in: the float64 path computes with them (the native kernels and lower
    # precisions with their float32 rounding, within every tolerance below).
    logw = np.repeat(np.log(2 * np.pi * w / plan.nlon_in), plan.nlon_in)
    logits = jnp.einsum("bohd,bihd->bhoi", qf, kf) * scale + logw
    logits = jnp.where(_dense_membership(plan), logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    out = jnp.einsum("bhoi,bihd->bohd", jnp.exp(logits - lse), vf)
    return out.reshape(*q.shape[:-1], -1), jnp.moveaxis(lse[..., 0], 1, -1).reshape(q.shape[:-1])


@pytest.fixture
def dense_membership():
    return _dense_membership


@pytest.fixture
def dense_attention():
    """Independent float64 oracle: ``dense_attention(q, k, v, plan, scale) -> (out, lse)``."""
    return _dense_attention


def relative_error(actual, expected) -> float:
    """max |actual - expected| / max |expected|; NaN anywhere fails (returns inf)."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    if not np.all(np.isfinite(actual)):
        return float("inf")
    return float(np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-300))


@pytest.fixture
def rel_error():
    return relative_error


@pytest.fixture
def exact_random(rng):
    """``exact_random(*shape)``: float64 values in (-2, 2) exactly representable in float16,
    bfloat16 and float32, so one float64 oracle serves every input dtype."""
    return lambda *shape: np.clip(np.round(rng.uniform(-2, 2, shape) * 128), -255, 255) / 128


#: Bounds on relative_error against float64 per input dtype, the project's standard: fp32 <= 1e-5,
#: bf16 and fp16 <= 1e-2.
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 1e-2}


@pytest.fixture
def tolerance():
    """``tolerance(dtype) -> float``: the standard relative-error bound for that input dtype."""
    return lambda dtype: TOLERANCE[np.dtype(dtype).name]


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def platform(request):
    """Runs the test once per platform, with that platform's first device as the default."""
    device = jax.devices("gpu" if request.param == "cuda" else request.param)[0]
    with jax.default_device(device):
        yield request.param
