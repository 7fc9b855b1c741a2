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
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200: see tests/README.md)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
