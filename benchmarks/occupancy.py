"""Registers, shared memory and resident warps per SM of the tiled CUDA kernels, without a GPU.

The tiled kernels are bound by latency at the warps an SM keeps resident (``docs/performance.md``), so a
tiling variant is worth timing only if it changes them. This script answers that on any machine
with ``nvcc``:

* registers and spills of every tiled kernel instantiation, from ``nvcc -Xptxas -v`` on
  ``cuda/gpu/tiled_attn_{fwd,dq,dkv}.cu`` (with ``-D`` overrides of the ``S2ATTN_TILED_*`` macros);
* dynamic shared memory per block and threads per block, printed by a small host program built
  from the same headers as each kernel file includes them (the kernels' own ``BlockSharedBytes`` in
  the kernel's own pipeline shape, not a copy of its arithmetic);
* resident warps per SM from Hopper's limits (compute capability 9.0, the CUDA occupancy
  calculator's rules): 16 K registers per SM sub-partition (four per SM) allocated in units of
  256 per warp, 228 KiB of shared memory per SM with 1 KiB reserved per block, 32 blocks and
  64 warps per SM.

Run: ``python benchmarks/occupancy.py [-D S2ATTN_TILED_WARPS=2 -D S2ATTN_TILED_CHUNK=32 ...]``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import pathlib
import re
import shutil
import subprocess
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = ("gpu/tiled_attn_fwd.cu", "gpu/tiled_attn_dq.cu", "gpu/tiled_attn_dkv.cu")

# Hopper (sm_90) SM limits.
SUB_PARTITIONS = 4
REGISTERS_PER_SUB_PARTITION = 16384
REGISTER_UNIT_PER_WARP = 256
SHARED_PER_SM = 228 * 1024
SHARED_RESERVED_PER_BLOCK = 1024
SHARED_UNIT = 128
MAX_BLOCKS = 32
MAX_WARPS = 64

_ENTRY = re.compile(r"Compiling entry function '(\S+)'")
_SPILLS = re.compile(r"(\d+) bytes spill stores")
_REGISTERS = re.compile(r"Used (\d+) registers")
# The forward's third template argument is how many parts it multiplies P in (tiled_attn_fwd.cu's KernelFor).
_KERNEL = re.compile(r"(Tiled\w+?)KernelI(6__half|13__nv_bfloat16)Li(\d+)E(?:Li(\d)E)?")


@dataclasses.dataclass(frozen=True)
class KernelResources:
    kernel: str  # "TiledFwd" (P in two parts), "TiledFwd1" (P once: the op undifferentiated), "TiledDq", "TiledDkv"
    dtype: str  # "bfloat16" or "float16"
    head_dim: int
    registers: int
    spill_bytes: int


def parse_ptxas(log: str) -> list[KernelResources]:
    """The tiled kernels' registers and spill stores in a ``ptxas -v`` log (other entries skipped)."""
    found, entry, spills = [], None, 0
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            entry, spills = _KERNEL.search(m.group(1)), 0
        elif (m := _SPILLS.search(line)) and entry:
            spills = int(m.group(1))
        elif (m := _REGISTERS.search(line)) and entry:
            name, dtype, dim, parts = entry.groups()
            kernel = name + ("1" if parts == "1" else "")
            dtype = "float16" if dtype == "6__half" else "bfloat16"
            found.append(KernelResources(kernel, dtype, int(dim), int(m.group(1)), spills))
            entry = None
    return found


def resident_warps(registers: int, warps_per_block: int, shared_bytes: int) -> tuple[int, int, int]:
    """Warps per SM allowed by registers, by shared memory, and resident (the smaller, in whole blocks)."""
    per_warp = -(-registers * 32 // REGISTER_UNIT_PER_WARP) * REGISTER_UNIT_PER_WARP
    warps_by_registers = SUB_PARTITIONS * (REGISTERS_PER_SUB_PARTITION // per_warp)
    blocks_by_registers = warps_by_registers // warps_per_block
    per_block = -(-(shared_bytes + SHARED_RESERVED_PER_BLOCK) // SHARED_UNIT) * SHARED_UNIT
    blocks_by_shared = SHARED_PER_SM // per_block
    blocks = min(blocks_by_registers, blocks_by_shared, MAX_BLOCKS, MAX_WARPS // warps_per_block)
    return blocks_by_registers * warps_per_block, blocks_by_shared * warps_per_block, blocks * warps_per_block


def _nvcc(nvcc: str, arch: str, defines: list[str]) -> list[str]:
    return [nvcc, "-std=c++17", "-O3", f"-arch=sm_{arch}", f"-I{ROOT / 'cuda'}", *(f"-D{d}" for d in defines)]


def _run(command: list[str]) -> subprocess.CompletedProcess:
    """Runs ``command``; on failure raises with its output (e.g. a shape the kernels' static_asserts reject)."""
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    return result


def _ptxas_log(command: list[str], source: str) -> str:
    return _run([*command, "-Xptxas", "-v", "-c", str(ROOT / "cuda" / source), "-o", "/dev/null"]).stderr


_LAYOUT_PROGRAM = """
#include <cstdio>
{includes}
int main() {{
  using namespace s2attn::gpu::tiled;
  std::printf("%d %d %d %zu %zu %zu\\n", kWarps, kChunk, kStages, BlockSharedBytes<32>(), BlockSharedBytes<64>(),
              BlockSharedBytes<128>());
}}
"""
_DEVICE_HEADER = re.compile(r'^\s*#\s*include\s+"gpu/tiled_attn_device\.cuh"')


@dataclasses.dataclass(frozen=True)
class Shape:
    """A kernel file's pipeline shape and dynamic shared memory per block by head dim."""

    warps: int
    chunk: int
    stages: int
    shared: dict[int, int]


def shape_includes(text: str, source: str) -> list[str]:
    """The preprocessor lines of a kernel file up to its include of the device header: what fixes
    its pipeline shape (a file may pick its own before that include)."""
    lines = text.splitlines()
    header = next((i for i, line in enumerate(lines) if _DEVICE_HEADER.match(line)), None)
    if header is None:
        raise SystemExit(f"{source}: no #include of gpu/tiled_attn_device.cuh to take the pipeline shape from")
    return [line for line in lines[: header + 1] if line.lstrip().startswith("#")]


def _layout(command: list[str], source: str) -> Shape:
    """The pipeline shape of the kernel in ``source``, from the kernels' headers as it includes them."""
    includes = shape_includes((ROOT / "cuda" / source).read_text(), source)
    with tempfile.TemporaryDirectory() as tmp:
        program, binary = pathlib.Path(tmp) / "layout.cu", pathlib.Path(tmp) / "layout"
        program.write_text(_LAYOUT_PROGRAM.format(includes="\n".join(includes)))
        _run([*command, str(program), "-o", str(binary)])
        warps, chunk, stages, *shared = map(int, _run([str(binary)]).stdout.split())
    return Shape(warps, chunk, stages, dict(zip((32, 64, 128), shared)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-D", dest="defines", action="append", default=[], help="macro, e.g. S2ATTN_TILED_WARPS=2")
    parser.add_argument("--arch", default="90", choices=["90", "90a"], help="the limits above are Hopper's")
    parser.add_argument("--nvcc", default=shutil.which("nvcc") or "nvcc")
    args = parser.parse_args()
    command = _nvcc(args.nvcc, args.arch, args.defines)
    with concurrent.futures.ThreadPoolExecutor() as pool:
        logs = pool.map(lambda source: _ptxas_log(command, source), SOURCES)
        layouts = pool.map(lambda source: _layout(command, source), SOURCES)
        rows = [(k, shape) for log, shape in zip(logs, layouts) for k in parse_ptxas(log)]
    print(f"defines: {' '.join(args.defines) or '(defaults)'}")
    print(f"{'kernel':<10}{'dtype':<10}{'D':>4}{'warps':>6}{'chunk':>6}{'stages':>7}{'regs':>6}{'spills B':>10}"
          f"{'shared KiB':>12}{'warps/SM: by regs':>19}{'by shared':>11}{'resident':>10}")
    for k, shape in sorted(rows, key=lambda row: (row[0].kernel, row[0].dtype, row[0].head_dim)):
        shared = shape.shared[k.head_dim]
        by_registers, by_shared, resident = resident_warps(k.registers, shape.warps, shared)
        print(f"{k.kernel:<10}{k.dtype:<10}{k.head_dim:>4}{shape.warps:>6}{shape.chunk:>6}{shape.stages:>7}"
              f"{k.registers:>6}{k.spill_bytes:>10}{shared / 1024:>12.1f}{by_registers:>19}{by_shared:>11}"
              f"{resident:>10}")


if __name__ == "__main__":
    main()
