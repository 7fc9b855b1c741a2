"""Static instruction counts of a kernel's loops, read from its SASS: no GPU needed.

Compiles a CUDA source of ``cuda/gpu`` for sm_90a (or reads a cubin), disassembles it with cuobjdump and, for every
kernel whose mangled name matches ``--kernel``, prints each loop (a branch back to an earlier address) with its
instruction count and opcode mix, innermost loops marked. The counts are static: every instruction between the
loop's start and its branch once, whichever paths a step takes. For a straight-line body, such as the stencil
kernels' neighbour loops in docs/performance.md, that is what one step issues per thread.

Run: ``python benchmarks/sass_loops.py cuda/gpu/stencil_attn_fwd.cu --kernel 'StencilFwdKernel.*bfloat16Li64'``.
cuobjdump comes from the CUDA toolkit (on PATH) or the nvidia-cuda-cuobjdump wheel, with nvidia-cuda-nvdisasm beside it
(``make test`` installs both); ``--cuobjdump PATH`` names another.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
ARCH = "sm_90a"

_SECTION_ARCH = re.compile(r"^\s*code for (sm_\w+)")
_FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)")
# "/*0040*/                   @!P0 FFMA R4, R5, R6, R4 ;" -> address 0x40, the text before ';'.
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+([^;]*);")
_BRANCH_TARGET = re.compile(r"\b0x([0-9a-f]+)\b")


@dataclasses.dataclass(frozen=True)
class Loop:
    """Instructions from ``start`` to the branch at ``end`` that jumps back to ``start`` (addresses in bytes)."""

    start: int
    end: int
    instructions: int
    opcodes: dict[str, int]
    innermost: bool


def opcode(instruction: str) -> str:
    """The base opcode of one SASS instruction: ``@!P0 FFMA.FTZ R1, ...`` -> ``FFMA``. An instruction guarded by
    ``@!PT`` or ``@!UPT`` (never true: the compiler's padding, such as the ``LDS RZ, [RZ]`` before cp.async copies)
    is its guard: it takes an issue slot and does nothing."""
    words = instruction.split()
    if words and words[0] in ("@!PT", "@!UPT"):
        return words[0]
    if words and words[0].startswith("@"):  # predicate guard
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    """Every function of cuobjdump's ``-sass`` listing: mangled name -> [(address, instruction)] in order. A name
    that comes again (a listing of several architectures) gets the architecture of its section: ``name [sm_80]``."""
    found: dict[str, list[tuple[int, str]]] = {}
    current: list[tuple[int, str]] | None = None
    arch = ""
    for line in sass.splitlines():
        if match := _SECTION_ARCH.match(line):
            arch = match.group(1)
        elif match := _FUNCTION.match(line):
            name = match.group(1)
            current = found.setdefault(name if name not in found else f"{name} [{arch}]", [])
        elif current is not None and (match := _INSTRUCTION.match(line)):
            current.append((int(match.group(1), 16), match.group(2).strip()))
    return found


def loops(instructions: list[tuple[int, str]]) -> list[Loop]:
    """The loops of one function: a backward branch (BRA to an earlier address) closes one, from its target (the
    loop's head) through the last branch back to that head (a ``continue`` adds another). A loop that holds no other
    loop is innermost. Structured code nests its loops; indirect branches (BRX, JMX) and calls are not followed."""
    index = {address: i for i, (address, _) in enumerate(instructions)}
    last_back_edge: dict[int, int] = {}  # head's index -> the last branch back to it
    for i, (address, text) in enumerate(instructions):
        if opcode(text) != "BRA" or not (target := _BRANCH_TARGET.search(text)):
            continue
        start = int(target.group(1), 16)
        # start == address: the branch to itself after a kernel's last EXIT, not a loop of the program.
        if start < address and start in index:
            last_back_edge[index[start]] = i
    spans = sorted(last_back_edge.items())
    found = []
    for first, last in spans:
        body = instructions[first : last + 1]
        nested = any(first <= a and b <= last and (a, b) != (first, last) for a, b in spans)
        counts = collections.Counter(opcode(text) for _, text in body)
        found.append(Loop(body[0][0], body[-1][0], len(body), dict(counts.most_common()), not nested))
    return found


def find_cuobjdump(explicit: str | None = None) -> str:
    """``explicit``, else cuobjdump on PATH, else the one of the nvidia-cuda-cuobjdump wheel; a ValueError naming
    the fix where there is none."""
    if explicit:
        return explicit
    if on_path := shutil.which("cuobjdump"):
        return on_path
    try:
        import nvidia  # the namespace package of NVIDIA's CUDA wheels
    except ImportError:
        nvidia = None
    for directory in getattr(nvidia, "__path__", []):
        for candidate in sorted(pathlib.Path(directory).glob("*/bin/cuobjdump")):
            return str(candidate)
    raise ValueError("no cuobjdump: install the CUDA toolkit's or `pip install nvidia-cuda-cuobjdump "
                     "nvidia-cuda-nvdisasm`, or pass --cuobjdump PATH")  # fmt: skip


def disassemble(cubin: pathlib.Path, cuobjdump: str) -> str:
    """cuobjdump's ``-sass`` listing of ``cubin``. cuobjdump runs nvdisasm, looked up on PATH: the directory of
    ``cuobjdump`` comes first (the wheels put both there)."""
    env = {**os.environ, "PATH": os.pathsep.join([str(pathlib.Path(cuobjdump).parent), os.environ.get("PATH", "")])}
    result = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"{cuobjdump} -sass failed on {cubin}:\n{result.stderr[-4000:]}")
    return result.stdout


def include_dir(source: pathlib.Path) -> pathlib.Path:
    """The ``cuda/`` folder ``source`` lies in, so that another tree's kernel compiles against that tree's headers;
    this tree's for a source elsewhere."""
    return next((parent for parent in source.resolve().parents if parent.name == "cuda"), ROOT / "cuda")


def compile_cubin(source: pathlib.Path, directory: pathlib.Path) -> pathlib.Path:
    """``source`` compiled for sm_90a as the package's build compiles it (C++17, its ``cuda/`` on the include
    path)."""
    cubin = directory / (source.stem + ".cubin")
    command = ["nvcc", "-std=c++17", f"-arch={ARCH}", "-I", str(include_dir(source)), "-cubin", "-o", str(cubin),
               str(source)]  # fmt: skip
    try:
        result = subprocess.run(command, capture_output=True, text=True)
    except FileNotFoundError:
        raise RuntimeError("nvcc is not on PATH: install the CUDA toolkit, or pass a .cubin") from None
    if result.returncode != 0:
        raise RuntimeError(f"nvcc failed on {source}:\n{result.stderr[-4000:]}")
    return cubin


def report(sass: str, kernel_pattern: str) -> str:
    """The loops of every kernel whose mangled name matches ``kernel_pattern`` (a regular expression), as text."""
    pattern = re.compile(kernel_pattern)
    lines = []
    for name, instructions in functions(sass).items():
        if not pattern.search(name):
            continue
        lines.append(f"{name}: {len(instructions)} instructions")
        for loop in loops(instructions):
            mix = ", ".join(f"{op} {n}" for op, n in loop.opcodes.items())
            mark = "innermost" if loop.innermost else "outer"
            lines.append(f"  loop {loop.start:#06x}-{loop.end:#06x}, {mark}: {loop.instructions} instructions ({mix})")
    if not lines:
        raise ValueError(f"no kernel matches --kernel {kernel_pattern!r}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=pathlib.Path, help="a .cu file to compile for sm_90a, or a .cubin")
    parser.add_argument("--kernel", default=".", help="regular expression on the kernels' mangled names")
    parser.add_argument("--cuobjdump", help="the cuobjdump to run (default: on PATH, else the wheel's)")
    args = parser.parse_args(argv)
    cuobjdump = find_cuobjdump(args.cuobjdump)
    with tempfile.TemporaryDirectory() as directory:
        cubin = args.source if args.source.suffix == ".cubin" else compile_cubin(args.source, pathlib.Path(directory))
        sass = disassemble(cubin, cuobjdump)
    print(report(sass, args.kernel))


if __name__ == "__main__":
    try:
        main()
    except (ValueError, RuntimeError) as error:
        sys.exit(f"sass_loops: {error}")
