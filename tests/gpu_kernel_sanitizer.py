"""The CUDA kernels alone on a GPU (no JAX/XLA in the process), for compute-sanitizer.

Compiles ``cuda/gpu/nbhd_attn_{fwd,bwd}.cu``, ``cuda/gpu/stencil_attn_{fwd,dq,dkv}.cu``,
``cuda/gpu/sched_attn_{fwd,dq,dkv}.cu``, ``cuda/gpu/delta_kernel.cu`` and the C entry point
``tests/cuda_emulation/run_target.cc`` with nvcc into a temporary shared library, uploads the inputs of a few
small cases with cupy (every buffer its own ``cudaMalloc``, results poisoned with NaN), runs forward, dq and dkv
of the arc-segment or the scheduled kernels (the latter as the op runs them, with the dq that forms delta, and
also beside the stencil kernels), and the ring targets, on the default stream,
synchronises after every launch and checks the results against the float64 reference of ``kernel_cases.py``
(the one the host-emulation tests use), including that every result element was written.

Exit status: 0 all cases pass, 1 a mismatch (or a CUDA error, raised as an exception),
2 no nvcc, cupy or CUDA device. ``--dry-run`` builds the inputs and references and compiles
the library, then stops before loading it (runs without a GPU).

Usage, from the repository root (cupy for the installed CUDA, e.g. cupy-cuda13x)::

    python3 tests/gpu_kernel_sanitizer.py [--dry-run]
    compute-sanitizer --tool memcheck  --error-exitcode 9 python3 tests/gpu_kernel_sanitizer.py
    compute-sanitizer --tool racecheck --error-exitcode 9 python3 tests/gpu_kernel_sanitizer.py
    compute-sanitizer --tool synccheck --error-exitcode 9 python3 tests/gpu_kernel_sanitizer.py
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# The plans import jax: keep XLA on the CPU so that only our kernels ever touch the GPU.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.append(str(Path(__file__).resolve().parents[1]))  # jax_s2attn from the checkout if not installed

import numpy as np  # noqa: E402
from kernel_cases import (  # noqa: E402
    DTYPES,
    KERNEL_SOURCES,
    LONG_ROW_PLANS,
    LONG_ROW_WINDOWS,
    PLANS,
    RING_PLANS,
    ROOT,
    RUN_TARGET_SHIM,
    SCHEDULED_TOLERANCE,
    STENCIL_PLANS,
    KernelCase,
    call_run_target,
    prepare_case,
    prepare_ring_case,
    run_case,
    run_ring_case,
    run_ring_scheduled_case,
    run_scheduled_case,
    run_scheduled_dq_forming_delta,
    run_scheduled_kind,
    run_scheduled_windows,
    scheduled_schedules,
    stencil_rows_of,
    tolerance_of,
    verify_case,
    verify_dq_forming_delta,
    verify_ring_case,
    whole_grids,
)
from jax_s2attn.ops import _ffi  # noqa: E402

NOT_AVAILABLE = 2
# (kernel, plan, Dk, Dv, dtype, windows). Arc kernels: 64/64 takes the vector fast path, 5/7
# the general path. "self" has full polar rings and wrapping arcs; "down" has shift 2, "up"
# residues 2; the long-row plans (kernel_cases.LONG_ROW_PLANS) give the scheduled kernels several
# tiles per row, tails and seams inside a tile, and several staged chunks per arc.
WINDOWED = {"q_window": (2, 3, 4, 9), "k_window": (1, 5, 5, 7), "padding": (1, 2, 2, 1)}
CASES = [
    ("arc", "self", 64, 64, "float32", {}),
    ("arc", "self", 64, 64, "bfloat16", {}),
    ("arc", "self", 5, 7, "float32", {}),
    ("arc", "self", 5, 7, "bfloat16", {}),
    ("arc", "down", 64, 64, "float32", {}),
    ("arc", "down", 5, 7, "bfloat16", {}),
    ("arc", "up", 64, 64, "bfloat16", {}),
    ("arc", "up", 5, 7, "float32", {}),
    ("arc", "self", 64, 64, "float32", WINDOWED),
    ("arc", "self", 5, 7, "bfloat16", WINDOWED),
    # The scheduled kernels (whole grids, D 32, 64 and 128): whole rings, shift 2, residues 2, rows of several tiles
    # (nlon not a multiple of the tile), whole-ring polar rows.
    ("scheduled", "self", 64, 64, "bfloat16", {}),
    ("scheduled", "down", 64, 64, "float16", {}),
    ("scheduled", "up", 64, 64, "bfloat16", {}),
    ("scheduled", "self-72", 64, 64, "float16", {}),
    ("scheduled", "up-100", 64, 64, "bfloat16", {}),
    ("scheduled", "rings-72", 64, 64, "bfloat16", {}),
    ("scheduled", "self", 128, 128, "float16", {}),
    ("scheduled", "self-72", 32, 32, "bfloat16", {}),
    ("scheduled", "up-100", 128, 128, "bfloat16", {}),
    # Windows: padding on every side; blocks from mid-ring over rows of several tiles (R = 2 from an odd longitude).
    ("scheduled", "self", 64, 64, "bfloat16", WINDOWED),
    ("scheduled", "self-72", 32, 32, "float16", LONG_ROW_WINDOWS["self-72"]),
    ("scheduled", "up-100", 128, 128, "bfloat16", LONG_ROW_WINDOWS["up-100"]),
    # The scheduled kernels beside the stencil targets (the op's _ffi.stencil_schedule: tiles of one row in the ring
    # grids' format on the first three, 4 x 16 tiles on self-9x4), writing one set of results.
    ("scheduled+stencil", "self-17x72", 64, 64, "bfloat16", {}),
    ("scheduled+stencil", "lat-10x40-9x40", 128, 128, "float16", {}),
    ("scheduled+stencil", "legendre-gauss", 32, 32, "bfloat16", {}),
    ("scheduled+stencil", "self-9x4", 64, 64, "float16", {}),
]


# Between ring grids: (kernels, plan of RING_PLANS, Dk, Dv, dtype): the ring targets (arc kernels) on the vector
# path at 64 and the general one at 5/7, and the scheduled kernels on ring block schedules at 32, 64 and 128.
RING_CASES = [
    ("ring", "healpix-self", 64, 64, "bfloat16"),
    ("ring", "latlon-3:2", 5, 7, "float32"),
    ("ring", "octahedral-healpix", 64, 64, "float16"),
    ("scheduled-rings", "healpix-self", 64, 64, "bfloat16"),
    ("scheduled-rings", "latlon-3:2", 32, 32, "float16"),
    ("scheduled-rings", "octahedral-healpix", 128, 128, "bfloat16"),
]


def build(out: Path) -> Path:
    """Compiles the kernels and the entry point for sm_90a (objects in parallel) into one library."""
    nvcc = [shutil.which("nvcc"), "-O2", "-arch=sm_90a", "-lineinfo", "-std=c++17", "-Xcompiler", "-fPIC"]
    sources = [*KERNEL_SOURCES, RUN_TARGET_SHIM]
    jobs = [[*nvcc, f"-I{ROOT / 'cuda'}", "-c", str(s), "-o", str(out / f"{s.stem}.o")] for s in sources]
    library = out / "libs2attn_kernels.so"

    def run(cmd):
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}\n{result.stderr}")

    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        list(pool.map(run, jobs))
    run([*nvcc, "-shared", *(cmd[-1] for cmd in jobs), "-o", str(library)])
    return library


class DeviceMemory:
    """Device copies of the host arrays a launch passes (uploaded as bytes: cupy has no bfloat16), each its own
    cudaMalloc; ``finish`` waits for the kernel (raising on its fault) and copies the results back."""

    def __init__(self, cupy):
        # id(host array) -> (the array, kept alive so that its id is not reused, and its device copy)
        self.cupy, self.copies = cupy, {}

    def address(self, array: np.ndarray) -> int:
        if id(array) not in self.copies:
            device = self.cupy.asarray(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
            self.copies[id(array)] = (array, device)
        return self.copies[id(array)][1].data.ptr

    def finish(self, results) -> None:
        self.cupy.cuda.Device().synchronize()
        for result in results:
            if result is not None:
                result[...] = self.copies[id(result)][1].get().view(result.dtype).reshape(result.shape)


def gpu_launch(lib, cupy):
    """A launch callable (see kernel_cases.py) that runs the kernels on the GPU."""

    def launch(target, dtype, sizes, scale, *buffers, **kwargs):
        memory = DeviceMemory(cupy)
        status = call_run_target(lib, memory.address, target, dtype, sizes, scale, *buffers, **kwargs)
        if status != 0:
            raise RuntimeError(f"launcher of target {target} returned cudaError {status}")
        memory.finish(buffers[10:])  # after the inputs (kernel_cases.call_run_target): the results

    return launch


def cupy_with_device():
    """The cupy module when it and a CUDA device are usable, else None (reason on stderr)."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy
        error = "no CUDA device"
    except Exception as exc:  # no cupy, no driver or no device
        error = exc
    print(f"gpu_kernel_sanitizer: needs cupy and a CUDA device ({error})", file=sys.stderr)
    return None


def case_name(kernel, plan, dk, dv, dtype, windows) -> str:
    return f"{kernel} {plan} Dk={dk} Dv={dv} {dtype}{' windowed+padding' if windows else ''}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="build inputs, references and the library; no GPU")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rng = np.random.default_rng(20261129)
    plans = PLANS | LONG_ROW_PLANS | STENCIL_PLANS
    cases: list[tuple[str, str, KernelCase]] = [
        (case_name(*spec), spec[0], prepare_case(rng, plans[spec[1]](), 2, 2, *spec[2:5], **spec[5]))
        for spec in CASES
    ]
    if shutil.which("nvcc") is None:
        print("gpu_kernel_sanitizer: needs nvcc on PATH", file=sys.stderr)
        return NOT_AVAILABLE
    cupy = None if args.dry_run else cupy_with_device()
    if cupy is None and not args.dry_run:
        return NOT_AVAILABLE
    with tempfile.TemporaryDirectory(prefix="s2attn_kernels_") as tmp:
        library = build(Path(tmp))
        print(f"gpu_kernel_sanitizer: built {library.name} in {time.perf_counter() - start:.1f} s")
        if args.dry_run:
            for name, _, case in cases:
                assert all(np.isfinite(e).all() for n, e in case.expected.items() if n != "lse"), name
                print(f"dry  {name}: sizes {case.sizes}")
            return 0
        cupy.cuda.set_allocator(None)  # one cudaMalloc per buffer, so memcheck sees each buffer's bounds
        lib = ctypes.CDLL(str(library))
        launch = gpu_launch(lib, cupy)
        failures = 0
        for name, kind, case in cases:
            kernel, stencil = kind.removesuffix("+stencil"), kind.endswith("+stencil")
            try:
                if kernel == "scheduled":  # float32 results, then the activations' type (the op's)
                    bar = tolerance_of("scheduled", case.dtype)
                    if whole_grids(case):
                        run_scheduled = functools.partial(run_scheduled_case, stencil=stencil)
                    else:
                        run_scheduled = run_scheduled_windows
                    verify_case(case, run_scheduled(lib, case, memory=DeviceMemory(cupy)), bar, out_tolerance=bar)
                    narrow = run_scheduled(lib, case, DTYPES[case.dtype][1], DeviceMemory(cupy))
                    narrow = {name: result.astype(np.float32) for name, result in narrow.items()}
                    verify_case(case, narrow, bar, out_tolerance=bar)
                    if whole_grids(case):  # the dq that forms delta (and the stencil one) from random out and dlse
                        forward = scheduled_schedules(case, stencil)[0]
                        pairs = _ffi.stencil_schedule(case.plan, "forward").pairs if stencil else None
                        lse = case.inputs[4]
                        out = rng.standard_normal(case.inputs[3].shape).astype(np.float32)
                        dlse = rng.standard_normal(lse.shape).astype(np.float32)
                        dq, delta = run_scheduled_dq_forming_delta(lib, case, np.float32, forward, lse, out, dlse,
                                                                   DeviceMemory(cupy), pairs)  # fmt: skip
                        given, _ = run_scheduled_kind(lib, case, "dq", np.float32, forward, lse, delta,
                                                      DeviceMemory(cupy), pairs)  # fmt: skip
                        rows = stencil_rows_of(pairs, case.plan.nlat_out) if stencil else None
                        verify_dq_forming_delta(case, out, dlse, {"dq": dq, "delta": delta, "dq_given_delta": given},
                                                rows)  # fmt: skip
                    print(f"ok   {name}")
                    continue
                verify_case(case, run_case(case, launch), tolerance_of(kernel, case.dtype))
                print(f"ok   {name}")
            except AssertionError as error:
                failures += 1
                print(f"FAIL {name}: {error}")
        for kernel, plan_name, dk, dv, dtype in RING_CASES:
            name = f"{kernel} {plan_name} Dk={dk} Dv={dv} {dtype}"
            try:
                case = prepare_ring_case(rng, RING_PLANS[plan_name](), 2, 2, dk, dv, dtype)
                memory_of = functools.partial(DeviceMemory, cupy)
                if kernel == "ring":
                    verify_ring_case(case, run_ring_case(lib, case, memory_of=memory_of))
                else:  # the scheduled kernels on ring block schedules: P and dS rounded, the 16-bit bar
                    verify_ring_case(case, run_ring_scheduled_case(lib, case, memory_of=memory_of),
                                     SCHEDULED_TOLERANCE[dtype])  # fmt: skip
                print(f"ok   {name}")
            except AssertionError as error:
                failures += 1
                print(f"FAIL {name}: {error}")
    print(f"gpu_kernel_sanitizer: {failures} failing case(s) in {time.perf_counter() - start:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
