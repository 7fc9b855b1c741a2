"""Builds CUDA sources for the host emulation of ``tests/cuda_emulation`` into a shared library.

Each ``.cu`` file is compiled as C++ with ``emulation.h`` force-included, then linked with the
emulation runtime (``emulation.cc``) and any plain C++ sources. Used by
``test_cuda_emulated.py`` (the kernels of ``cuda/gpu``) and
``test_cuda_emulation_primitives.py`` (the emulation's own self-test).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EMULATION = ROOT / "tests" / "cuda_emulation"


def cuda_include_dir() -> Path | None:
    """The CUDA toolkit's include directory (for cuda_runtime.h and the bf16/f16 headers), if any."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parents[1]))
    for root in filter(None, candidates):
        if (Path(root) / "include" / "cuda_runtime.h").is_file():
            return Path(root) / "include"
    return None


# The one `extern __shared__` array the emulation runtime defines (DynamicShared() of cuda/gpu).
DYNAMIC_SHARED_SYMBOL = "_ZN6s2attn3gpu21s2attn_dynamic_sharedE"


def _check_shared_declarations(kernel_object: Path) -> None:
    """``__shared__`` is ``weak`` in the emulation (see emulation.h), so an ``extern __shared__``
    array other than the runtime's would link as a null pointer: fail naming it instead."""
    nm = shutil.which("nm")
    if nm is None:
        return
    listing = subprocess.run([nm, "--undefined-only", str(kernel_object)], capture_output=True, text=True, check=True)
    weak = [fields[1] for fields in map(str.split, listing.stdout.splitlines()) if fields[:1] == ["w"]]
    # _ZTH*: the compiler's weak references to thread_local initialisers (threadIdx, ...).
    unknown = [name for name in weak if name != DYNAMIC_SHARED_SYMBOL and not name.startswith("_ZTH")]
    assert not unknown, (
        f"{kernel_object.name}: extern __shared__ {unknown} is not provided by the emulation, which "
        "defines only s2attn::gpu::s2attn_dynamic_shared: use DynamicShared()"
    )


def _host_compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


# Compile and link flags of an AddressSanitizer build (-g: reports name the kernel's lines).
ADDRESS_SANITIZER_FLAGS = ["-g", "-fsanitize=address", "-fno-omit-frame-pointer"]


def address_sanitizer_preload() -> str | None:
    """``LD_PRELOAD`` under which a Python process can load an AddressSanitizer build (the ASan
    runtime must come first; libstdc++ with it, so that ASan finds the C++ exception machinery
    jaxlib throws through), or None where the host compiler has no ASan runtime."""
    cxx = _host_compiler()
    if cxx is None:
        return None
    libraries = []
    for name in ("libasan.so", "libstdc++.so.6"):
        path = subprocess.run([cxx, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
        if not Path(path).is_absolute() or not Path(path).is_file():
            return None
        libraries.append(path)
    return " ".join(libraries)


def _compile(out: Path, kernel_sources, host_sources, defines, address_sanitizer: bool) -> tuple[list[str], list[str]]:
    """Compiles the kernel sources (emulated) and the host sources with the emulation runtime into
    objects in ``out``; returns them and the link flags. Skips the calling test where there is no
    host C++20 compiler or no CUDA headers."""
    cxx = _host_compiler()
    include = cuda_include_dir()
    if cxx is None or include is None:
        pytest.skip("needs a host C++20 compiler and the CUDA headers (nvcc's include directory)")
    sanitizer = ADDRESS_SANITIZER_FLAGS if address_sanitizer else []
    flags = ["-std=c++20", "-O1", "-fPIC", *sanitizer, f"-I{ROOT / 'cuda'}", f"-I{include}"]
    flags += [f"-D{d}" for d in defines]
    kernel_flags = [*flags, "-include", str(EMULATION / "emulation.h"), "-x", "c++"]
    jobs = [[cxx, *kernel_flags, "-c", str(src), "-o", str(out / (src.stem + ".o"))] for src in kernel_sources]
    runtime = (EMULATION / "emulation.cc", *host_sources)
    jobs += [[cxx, *flags, "-c", str(src), "-o", str(out / (src.stem + ".o"))] for src in runtime]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda cmd: subprocess.run(cmd, capture_output=True, text=True), jobs))
    for cmd, result in zip(jobs, results):
        assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr}"
    for cmd in jobs[: len(kernel_sources)]:
        _check_shared_declarations(Path(cmd[-1]))
    return [cmd[-1] for cmd in jobs], [cxx, *sanitizer]


def build_emulated_library(
    out: Path,
    kernel_sources: Sequence[Path],
    host_sources: Sequence[Path] = (),
    defines: Sequence[str] = (),
    address_sanitizer: bool = False,
) -> Path:
    """Compiles ``kernel_sources`` (CUDA, emulated) and ``host_sources`` (C++) with the emulation
    runtime into ``out/libs2attn_emulated.so`` and returns its path; skips the calling test where
    there is no host C++20 compiler or no CUDA headers. ``address_sanitizer``: an ASan build
    (load it under :func:`address_sanitizer_preload`)."""
    objects, link_command = _compile(out, kernel_sources, host_sources, defines, address_sanitizer)
    library = out / "libs2attn_emulated.so"
    link = subprocess.run(
        # -Bsymbolic: the emulated CUDA runtime must win over a real libcudart that another test's
        # import (torch's CUDA build) already loaded into the process's global symbol scope.
        [*link_command, "-shared", "-Wl,-Bsymbolic", *objects, "-o", str(library)],
        capture_output=True,
        text=True,
    )
    assert link.returncode == 0, link.stderr
    return library

