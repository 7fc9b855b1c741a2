"""The CUDA kernels of ``cuda/gpu`` compiled for the host and run on the CPU.

``tests/cuda_emulation`` emulates the few device facilities the kernels use (thread
indices, ``__ldg``, ``__shfl_xor_sync``, dynamic shared memory, ``cudaLaunchKernel``), so
the kernels *and their launchers* (variant dispatch, launch shapes, work decomposition) run
unchanged on a machine without a GPU. Each test compares all three targets with a dense
float64 reference built from the plan's arcs: the arc walks and window clipping, padding,
tails, the vector fast path (head dims 32/64/128) and the general path (any head dims),
16-bit widening, and that every result element is written (results start as NaN).

Timing and the GPU memory model are out of scope here: those are the H200 suite's
(``tests/gpu_kernel_sanitizer.py``, ``tests/gpu_sanitizer.py`` and the GPU tests). The
cases, reference and checks live in ``kernel_cases.py``, shared with the GPU harness.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # emulation_build.py, kernel_cases.py (shared with the GPU harness)
from emulation_build import build_emulated_library  # noqa: E402
from kernel_cases import (  # noqa: E402
    DTYPES,
    FORWARD,
    KERNEL_SOURCES,
    PLANS,
    RUN_TARGET_SHIM,
    call_run_target,
    check_case,
)


def _build(out: Path, defines: tuple[str, ...] = ()):
    """Compiles the kernels and the emulation runtime into ``out``; returns the library (ctypes)."""
    return ctypes.CDLL(str(build_emulated_library(out, KERNEL_SOURCES, [RUN_TARGET_SHIM], defines)))


def _launcher(lib):
    """A launch callable (see kernel_cases.py) that runs the attention kernels of ``lib`` on host arrays."""

    def launch(*args):
        status = call_run_target(lib, lambda a: a.ctypes.data, *args)
        assert status == 0, f"launcher returned cudaError {status}"

    return launch


@pytest.fixture(scope="session")
def emulated_library(tmp_path_factory):
    """The kernels built as a host shared library, or a skip where that cannot be done."""
    return _build(tmp_path_factory.mktemp("cuda_emulation"))


@pytest.fixture(scope="session")
def emulator(emulated_library):
    return _launcher(emulated_library)


def _misaligned(a: np.ndarray) -> np.ndarray:
    """A copy of ``a`` aligned to its element size but not to 16 bytes."""
    raw = np.empty(a.nbytes + 32, np.uint8)
    start = (16 - raw.ctypes.data % 16) % 16 + a.itemsize
    out = raw[start : start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


# (Dk, Dv): the vector fast path takes 32, 64 and 128; the rest runs the general path.
HEAD_DIMS = [(32, 32), (64, 64), (128, 128), (5, 7), (130, 3)]


# Every dtype and head dim on the two self-attention plans; the widening does not depend on
# the plan, so the others run float32 (and bfloat16 on the fast path).
SERIAL_CASES = [
    (plan_name, dims, dtype)
    for plan_name in PLANS
    for dims in HEAD_DIMS
    for dtype in DTYPES
    if plan_name in ("self", "wide") or dtype == "float32" or (dtype == "bfloat16" and dims == (64, 64))
]


@pytest.mark.parametrize(
    ("plan_name", "dims", "dtype"), SERIAL_CASES, ids=[f"{p}-dk{d[0]}-dv{d[1]}-{t}" for p, d, t in SERIAL_CASES]
)
def test_serial_matches_float64(emulator, rng, plan_name, dims, dtype):
    heads = 3 if dims[0] == 32 else 1  # several heads per row on the smallest dims
    check_case(emulator, rng, PLANS[plan_name](), 2, heads, *dims, dtype)


WINDOWS = [  # (q_window, k_window, padding (q_lat, q_lon, k_lat, k_lon)) on the 8x16 self plan
    ((2, 3, 4, 9), None, (1, 2, 0, 0)),
    (None, (1, 5, 5, 7), (0, 0, 2, 1)),
    ((0, 8, 8, 8), (3, 0, 5, 16), (1, 0, 0, 3)),
    ((5, 0, 3, 16), (0, 4, 2, 4), (2, 1, 1, 1)),  # no query of the block sees a key of the window
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("dims", [(64, 64), (5, 7)], ids=lambda d: f"dk{d[0]}-dv{d[1]}")
@pytest.mark.parametrize("windows", WINDOWS, ids=lambda w: f"q{w[0]}-k{w[1]}")
def test_windows_with_padding(emulator, rng, windows, dims, dtype):
    q_window, k_window, padding = windows
    check_case(emulator, rng, PLANS["self"](), 2, 2, *dims, dtype, q_window, k_window, padding)


@pytest.mark.parametrize("plan_name", ["down", "up"])
def test_resampling_windows(emulator, rng, plan_name):
    plan = PLANS[plan_name]()
    (nlat_q, nlon_q), (nlat_k, nlon_k) = plan.out_shape, plan.in_shape
    q_window = (1, 2, nlat_q - 2, nlon_q - 4)
    k_window = (0, nlon_k // 2, nlat_k - 1, nlon_k // 2)
    check_case(emulator, rng, plan, 1, 2, 64, 64, "float32", q_window, k_window, (1, 1, 1, 1))


@pytest.mark.parametrize("dims", [(4, 0), (0, 4), (1, 1), (33, 31), (64, 32), (256, 256)])
def test_unusual_head_dims(emulator, rng, dims):
    check_case(emulator, rng, PLANS["self"](), 1, 2, *dims, "float32")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_unaligned_buffers_take_the_general_path(emulator, rng, dtype):
    check_case(emulator, rng, PLANS["self"](), 2, 2, 64, 64, dtype, transform=_misaligned)


def test_empty_batch_launches_nothing(emulator):
    plan = PLANS["self"]()
    q = np.zeros((0, 8, 16, 1, 64), np.float32)
    out = np.zeros((0, 8, 16, 1, 64), np.float32)
    lse = np.zeros((0, 8, 16, 1), np.float32)
    window = np.asarray([0, 0, 8, 16, 0, 0, 8, 16], np.int32)
    sizes = [0, 1, 64, 64, 8, 16, 8, 16, 8, 16, 8, 16]
    table = plan.forward_arcs
    emulator(FORWARD, "float32", sizes, 0.125, q, q, q, None, None, None, window, table.row_order, table,
            plan.quad_weights, out, lse)  # fmt: skip


def test_corrupted_tables_stay_in_bounds(emulator, rng):
    """Device tables the host cannot validate: garbage must never index outside the arrays."""
    plan = PLANS["self"]()
    table = plan.forward_arcs
    big = np.iinfo(np.int32).max
    garbage_arcs = rng.integers(-big, big, size=table.arcs.shape, dtype=np.int64).astype(np.int32)
    garbage_offsets = rng.integers(-50, 10 * table.arcs.shape[0], size=table.offsets.shape).astype(np.int32)
    q = rng.standard_normal((1, 8, 16, 1, 64)).astype(np.float32)
    sizes = [1, 1, 64, 64, 8, 16, 8, 16, 8, 16, 8, 16]
    for window, arcs, offsets in [
        ([0, 0, 8, 16, 0, 0, 8, 16], garbage_arcs, table.offsets),
        ([0, 0, 8, 16, 0, 0, 8, 16], table.arcs, garbage_offsets),
        ([7, 9, 5, 16, -3, 2, 8, 99], table.arcs, table.offsets),  # windows that do not fit: empty
    ]:
        broken = table._replace(arcs=np.ascontiguousarray(arcs), offsets=np.ascontiguousarray(offsets))
        out = np.full((1, 8, 16, 1, 64), np.nan, np.float32)
        lse = np.full((1, 8, 16, 1), np.nan, np.float32)
        emulator(FORWARD, "float32", sizes, 0.125, q, q, q, None, None, None,
                np.asarray(window, np.int32), table.row_order, broken, plan.quad_weights, out, lse)  # fmt: skip
        assert not np.isnan(out).any() and not np.isnan(lse).any()


@pytest.fixture(scope="module")
def small_launch_limits(tmp_path_factory):
    """The kernels built with launch limits small enough to pass in a test: 2 blocks in y and z
    for the attention kernels, 2 blocks in all for delta."""
    return _build(tmp_path_factory.mktemp("small_limits"), ("S2ATTN_MAX_GRID_YZ=2", "S2ATTN_MAX_DELTA_BLOCKS=2"))


def test_grids_past_the_block_limit_are_split(small_launch_limits, rng):
    """More than 65535 (batch x head) indices or rows: the launchers split the grid into several
    launches (checked here with a limit of 2 blocks in y and z)."""
    launch = _launcher(small_launch_limits)
    check_case(launch, rng, PLANS["down"](), 3, 3, 32, 32, "float32")
    check_case(launch, rng, PLANS["down"](), 2, 1, 5, 7, "bfloat16")


# ----------------------------------------------------------------------------- delta


def _check_delta(lib, rng, rows, dv, dtype):
    """The delta kernel against float64 on ``rows`` random rows; the result starts as NaN."""
    code, storage = DTYPES[dtype]
    dout = rng.standard_normal((rows, dv)).astype(storage)
    out = rng.standard_normal((rows, dv)).astype(np.float32)
    dlse = rng.standard_normal(rows).astype(np.float32)
    delta = np.full(rows, np.nan, np.float32)
    status = lib.RunDelta(
        ctypes.c_int(code), *(ctypes.c_void_p(a.ctypes.data) for a in (dout, out, dlse, delta)),
        ctypes.c_int64(rows), ctypes.c_int64(dv),
    )  # fmt: skip
    assert status == 0, f"launcher returned cudaError {status}"
    want = np.sum(dout.astype(np.float64) * out, axis=-1) - dlse
    assert not np.isnan(delta).any()
    assert np.abs(delta - want).max() <= 1e-6 * np.abs(want).max()


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("dv", [0, 1, 5, 31, 32, 33, 64, 130])
def test_delta_matches_float64(emulated_library, rng, dv, dtype):
    _check_delta(emulated_library, rng, 37, dv, dtype)  # 37 rows: a partly idle last block


def test_delta_rows_past_the_block_limit_loop(small_launch_limits, rng):
    """More rows than the launch has warps: the grid-stride loop covers them (2 blocks here)."""
    _check_delta(small_launch_limits, rng, 61, 40, "bfloat16")
