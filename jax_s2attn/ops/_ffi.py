"""Native extension modules: import, version guard, FFI target registration.

The CPU module (``_s2attn_cpu``) and the CUDA module (``_s2attn_cuda``) are both
optional at import time: without them every op runs on the pure-JAX reference
path and :func:`native_status` says why.
"""

from __future__ import annotations

import importlib
import threading

import jax
import jaxlib

__all__ = ["HAS_CPU_EXT", "HAS_CUDA_EXT", "native_backends", "native_status", "ensure_registered"]

# XLA keys handlers by (target name, platform); these are jax's platform spellings.
_PLATFORMS = {"cpu": "cpu", "cuda": "CUDA"}


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split(".")[:3] if p.isdigit())


def _load(name: str):
    """Import ``jax_s2attn.<name>``; return ``(module or None, reason)``."""
    try:
        module = importlib.import_module(f"jax_s2attn.{name}")
    except ImportError as e:
        return None, f"{name} is not built ({e})"
    built = module.build_info()["jaxlib_version"]
    if _version_tuple(built) > _version_tuple(jaxlib.__version__):
        # Newer FFI headers than the runtime would break backend initialisation.
        return None, (
            f"{name} was built against jaxlib {built} but jaxlib {jaxlib.__version__} is running; "
            "rebuild jax_s2attn with the running jax (pip install --no-build-isolation .)"
        )
    return module, "available"


_MODULES = {"cpu": _load("_s2attn_cpu"), "cuda": _load("_s2attn_cuda")}
HAS_CPU_EXT = _MODULES["cpu"][0] is not None
HAS_CUDA_EXT = _MODULES["cuda"][0] is not None
_registered = False
_lock = threading.Lock()


def native_backends() -> dict[str, bool]:
    """Which native kernel modules are importable: ``{"cpu": bool, "cuda": bool}``."""
    return {platform: module is not None for platform, (module, _) in _MODULES.items()}


def native_status() -> str:
    """One line per native module saying whether it is available, and if not why."""
    return "\n".join(f"{platform}: {reason}" for platform, (_, reason) in _MODULES.items())


def ensure_registered() -> None:
    """Register every FFI target of the available modules (idempotent, thread-safe).

    Registration does not start a backend: jaxlib queues targets per platform.
    """
    global _registered
    with _lock:
        if _registered:
            return
        for platform, (module, _) in _MODULES.items():
            if module is None:
                continue
            for name, capsule in module.registrations().items():
                jax.ffi.register_ffi_target(name, capsule, platform=_PLATFORMS[platform])
        _registered = True
