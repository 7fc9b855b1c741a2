"""The native extension modules: import, version guard, and what they report about their kernels.

The CPU module (``_s2attn_cpu``) and the CUDA module (``_s2attn_cuda``) are both optional at
import time: without them every op runs on the pure-JAX reference path and
:func:`native_status` says why. Their limits (dtypes, head dims, the stencil kernels' shape)
come from the modules' ``build_info()`` (``cuda/common/kernel_limits.h``), never from copies
here. This module sits below the plan: it imports no other part of the package.
"""

from __future__ import annotations

import dataclasses
import importlib

import jaxlib
import ml_dtypes  # jax's dependency: numpy itself has no bfloat16
import numpy as np

__all__ = [
    "HAS_CPU_EXT",
    "HAS_CUDA_EXT",
    "MODULES",
    "KernelLimits",
    "kernel_limits",
    "native_backends",
    "native_status",
]


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split(".")[:3] if p.isdigit())


def _load(name: str):
    """Import ``jax_s2attn.<name>``; return ``(module or None, reason)``."""
    try:
        module = importlib.import_module(f"jax_s2attn.{name}")
    except ImportError as e:
        return None, f"{name} is not built ({e})"
    info = module.build_info()
    if "limits" not in info:
        return None, f"{name} was built from other sources than this package's (rebuild jax_s2attn)"
    built = info["jaxlib_version"]
    if _version_tuple(built) > _version_tuple(jaxlib.__version__):
        # Newer FFI headers than the runtime would break backend initialisation.
        return None, (
            f"{name} was built against jaxlib {built} but jaxlib {jaxlib.__version__} is running; "
            "rebuild jax_s2attn with the running jax (pip install --no-build-isolation .)"
        )
    return module, "built"


#: Platform (as the FFI names it) -> ``(module or None, reason)``.
MODULES = {"cpu": _load("_s2attn_cpu"), "cuda": _load("_s2attn_cuda")}
HAS_CPU_EXT = MODULES["cpu"][0] is not None
HAS_CUDA_EXT = MODULES["cuda"][0] is not None


def native_backends() -> dict[str, bool]:
    """Which native kernel modules are built and importable: ``{"cpu": bool, "cuda": bool}`` (whether this
    process also has a device to run them on is :func:`native_status`'s second half)."""
    return {platform: module is not None for platform, (module, _) in MODULES.items()}


def _devices_here(platform: str) -> str | None:
    """Why this process has no ``platform`` device for the kernels; None if it has one (starts jax's backends)."""
    import jax  # deferred: importing the package must not start a backend

    try:
        devices = jax.devices(platform)
    except RuntimeError:
        devices = []
    if devices:
        return None
    backends = ", ".join(sorted({d.platform for d in jax.devices()}))
    return f"no {platform} device in this process (jax's devices: {backends})"


def native_status() -> str:
    """One line per native module: whether it is built, and whether it is usable here (a device of its
    platform is visible to jax), and if not why. Asking starts jax's backends."""
    lines = []
    for platform, (module, reason) in MODULES.items():
        if module is None:
            lines.append(f"{platform}: {reason}")
            continue
        missing = _devices_here(platform)
        lines.append(f"{platform}: built; " + ("usable here" if missing is None else f"not usable here: {missing}"))
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class KernelLimits:
    """What the native kernels of this build accept (``cuda/common/kernel_limits.h``).

    Attributes:
      arc_dtypes: activation dtypes of the arc-segment kernels (CPU and CUDA).
      stencil_max_other_rows: rows of the other grid a stencil row pair may see.
      stencil_max_half: longitudes each side of a point that a stencil row's arcs stay within.
      scheduled_shape: ``(tile_rows, tile_cols, chunk_cols)`` of the block schedule the scheduled
        kernels walk (:meth:`~jax_s2attn.plan.NeighborhoodPlan.block_schedule`).
      scheduled_runs: ``(runs, points)``: on ring grids a tile is ``runs`` runs of up to ``points``
        consecutive points of one ring (:func:`~jax_s2attn.ring_schedule.ring_block_schedule`).
      scheduled_head_dims: head dims (``Dk == Dv``) of the scheduled kernels.
      scheduled_dtypes: activation dtypes of the scheduled kernels.
      cuda_arc_max_head_dims: the largest ``Dk + Dv`` of the CUDA arc kernels; None without the
        CUDA module.
    """

    arc_dtypes: tuple[np.dtype, ...]
    stencil_max_other_rows: int
    stencil_max_half: int
    scheduled_shape: tuple[int, int, int]
    scheduled_runs: tuple[int, int]
    scheduled_head_dims: tuple[int, ...]
    scheduled_dtypes: tuple[np.dtype, ...]
    cuda_arc_max_head_dims: int | None


def _dtypes(names) -> tuple[np.dtype, ...]:
    return tuple(np.dtype(ml_dtypes.bfloat16 if name == "bfloat16" else name) for name in names)


def _kernel_limits() -> KernelLimits | None:
    modules = [MODULES[p][0] for p in ("cuda", "cpu") if MODULES[p][0] is not None]
    if not modules:
        return None
    # Both modules compile the same header; the CUDA one adds the limits of its own kernels.
    limits = modules[0].build_info()["limits"]
    return KernelLimits(
        arc_dtypes=_dtypes(limits["arc_dtypes"]),
        stencil_max_other_rows=int(limits["stencil_max_other_rows"]),
        stencil_max_half=int(limits["stencil_max_half"]),
        scheduled_shape=tuple(int(x) for x in limits["scheduled_shape"]),
        scheduled_runs=tuple(int(x) for x in limits["scheduled_runs"]),
        scheduled_head_dims=tuple(int(d) for d in limits["scheduled_head_dims"]),
        scheduled_dtypes=_dtypes(limits["scheduled_dtypes"]),
        cuda_arc_max_head_dims=int(limits["cuda_arc_max_head_dims"]) if "cuda_arc_max_head_dims" in limits else None,
    )


_LIMITS = _kernel_limits()


def kernel_limits() -> KernelLimits | None:
    """The native kernels' limits as their modules report them; None where no native module is built."""
    return _LIMITS
