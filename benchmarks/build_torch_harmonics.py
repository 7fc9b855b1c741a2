"""Builds torch-harmonics' CUDA attention layer against the local torch, for the benchmark's
torch-harmonics column (``benchmarks/attention.py`` times it when ``torch_harmonics`` imports).

Its wheels are built for one torch release each (0.9.3: torch 2.14); this compiles the attention
extension from an unpacked torch-harmonics source tree instead. Only what a single device needs: the
interface, the CPU kernels and the CUDA kernels without the ring (distributed) files, which take
longest; on 16 cores about 3.5 minutes, the three modules in parallel. The
convolution module imports names that exist only when its own extension is built, which the
attention layer never uses: the copy in DEST binds them to None so that the package imports.

Usage: python benchmarks/build_torch_harmonics.py SRC DEST, where SRC holds ``torch_harmonics/``
(e.g. an unpacked sdist or wheel of 0.9.3); then put DEST on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

MODULES = ("_C", "attention_helpers", "disco_helpers")
CUDA_ON = ["-DBUILD_CUDA=1", "-DBUILD_CPP=1"]


def _build(name: str, src: Path) -> tuple[str, str]:
    """Compiles one module with torch's extension builder; returns (name, path of the library)."""
    from torch.utils.cpp_extension import load

    attention = src / "torch_harmonics" / "attention" / "optimized"
    disco = src / "torch_harmonics" / "disco" / "optimized"
    if name == "attention_helpers":
        sources, flags, include = [attention / "attention_helpers.cpp"], CUDA_ON, attention
    elif name == "disco_helpers":  # built without kernels: reports them unavailable
        sources, flags, include = [disco / "disco_helpers.cpp"], [], disco
    else:
        cuda = [f for f in sorted(glob.glob(str(attention / "kernels_cuda" / "*.cu"))) if "_ring" not in f]
        cpu = sorted(glob.glob(str(attention / "kernels_cpu" / "*.cpp")))
        sources, flags, include = [attention / "attention_interface.cpp", *cpu, *cuda], CUDA_ON, attention
    build_dir = Path("/tmp/torch_harmonics_build") / name
    build_dir.mkdir(parents=True, exist_ok=True)
    load(name, [str(s) for s in sources], extra_cflags=["-O3", *flags], extra_cuda_cflags=["-O3", *flags],
         extra_include_paths=[str(include)], build_directory=str(build_dir), is_python_module=name != "_C")
    return name, str(build_dir / f"{name}.so")


def _copy_sources(src: Path, dest: Path) -> Path:
    """Copies SRC's torch_harmonics/ into DEST (replacing an earlier copy) without the prebuilt extensions
    of an unpacked wheel: built for another torch, they would load before ours (Python tries
    `_C.cpython-312-...so` before `_C.so`) and fail, leaving the package unimportable. Returns the copy."""
    package = dest / "torch_harmonics"
    shutil.rmtree(package, ignore_errors=True)
    shutil.copytree(src / "torch_harmonics", package, ignore=shutil.ignore_patterns("*.so"))
    return package


def _import_without_disco_kernels(package: Path) -> None:
    """Binds the names disco/convolution.py imports from its optimized module to None where absent."""
    path = package / "disco" / "convolution.py"
    text = path.read_text()
    start = text.index("from .optimized.disco_optimized import (")
    end = text.index(")", start) + 1
    names = [n.strip() for n in text[text.index("(", start) + 1 : end - 1].split(",") if n.strip()]
    bindings = "\n".join(f"{n} = getattr(_disco_optimized, {n!r}, None)" for n in names)
    path.write_text(f"{text[:start]}from .optimized import disco_optimized as _disco_optimized\n{bindings}{text[end:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path, help="folder holding torch_harmonics/ (sources)")
    parser.add_argument("dest", type=Path, help="where the built package goes (put it on PYTHONPATH)")
    args = parser.parse_args()
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    os.environ.setdefault("MAX_JOBS", "12")
    start = time.time()
    package = _copy_sources(args.src, args.dest)
    _import_without_disco_kernels(package)
    with ProcessPoolExecutor(len(MODULES)) as pool:
        for name, library in pool.map(_build, MODULES, [args.src] * len(MODULES)):
            shutil.copy(library, package / "attention" / "_C.so" if name == "_C" else args.dest)
            print(f"built {name} ({time.time() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
