"""Self-test of the host emulation (``tests/cuda_emulation``) on the primitives the kernels build on:
``cp.async`` of ``cuda/gpu/cp_async_sm80.cuh``, the mbarriers of ``cuda/gpu/mbarrier_sm90.cuh``, the
wgmma products of ``cuda/gpu/wgmma_sm90.cuh``, the tensor-map boxes of ``cuda/gpu/tma_sm90.cuh``,
``__syncthreads``, ``__syncwarp``, votes and shuffles, and the dynamic shared memory limits. The
kernels are in ``cuda_emulation/primitives_selftest.cu``; expected values come from numpy in float64.
Misuses the emulation must catch abort it, so those run in a subprocess.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from emulation_build import EMULATION, build_emulated_library  # noqa: E402

pytestmark = pytest.mark.slow  # a host build of the emulation and its runs

CUDA_ERROR_INVALID_VALUE = 1
DEFAULT_SHARED_LIMIT = 48 * 1024
MAX_SHARED = 232448  # the H200's opt-in maximum
STAGED_PIECES, STAGED_WORDS = 64, 32  # of StagedCopyKernel: 16-byte pieces (CopyAsync16), floats (CopyAsync4)
STAGED_BYTES = 16 + 16 * STAGED_PIECES + 4 * STAGED_WORDS  # the barrier (8 bytes, padded), the pieces, the words
# Faults of primitives_selftest.cu.
(NO_FAULT, COPY_ASYNC_TO_GLOBAL, THREAD_SKIPS_SYNCTHREADS, THREAD_WAITS_FOR_ITS_WARP, THREAD_SKIPS_ARRIVAL,
 UNINITIALISED_BARRIER, COPY_NOT_TRACKED, THREAD_ARRIVES_TWICE, COPIES_ARRIVE_TWICE, BOX_MISALIGNED,
 LANE_OTHER_DESCRIPTOR, WARP_SKIPS_WGMMA, NO_WGMMA_WAIT) = range(13)  # fmt: skip
BLOCK_THREADS = 128  # of BlockCentreKernel


@pytest.fixture(scope="module")
def library(tmp_path_factory) -> Path:
    return build_emulated_library(tmp_path_factory.mktemp("primitives"), [EMULATION / "primitives_selftest.cu"])


@pytest.fixture(scope="module")
def lib(library) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(library))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.RunStagedCopy.argtypes = [p, p, p, i64, i64, ctypes.c_int, i64]
    lib.RunBlockCentre.argtypes = [p, p, ctypes.c_int, i64, i64]
    lib.RunWarpVotes.argtypes = [p, p]
    lib.RunMbarrierRing.argtypes = [p, p, i64, i64]
    lib.RunWgmma.argtypes = [p, p, p, p, i64]
    lib.RunTensorMapBoxes.argtypes = [p, p]
    return lib


def _relative(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


def _staged_copy(lib, tile, words, *, shared_offset=0, shared_bytes=STAGED_BYTES, shared_limit=DEFAULT_SHARED_LIMIT):
    out = np.full(4 * STAGED_PIECES + STAGED_WORDS, np.nan, np.float32)
    status = lib.RunStagedCopy(tile.ctypes.data, words.ctypes.data, out.ctypes.data, shared_offset, shared_bytes,
                               shared_limit, NO_FAULT)  # fmt: skip
    return status, out


def _staged_inputs(rng):
    tile = rng.integers(0, 1 << 8, 16 * STAGED_PIECES, dtype=np.uint8)
    words = rng.standard_normal(STAGED_WORDS).astype(np.float32)
    return tile, words


@pytest.mark.parametrize(
    ("shared_offset", "shared_bytes", "shared_limit"),
    [(0, STAGED_BYTES, DEFAULT_SHARED_LIMIT), (MAX_SHARED - STAGED_BYTES, MAX_SHARED, MAX_SHARED)],
    ids=["small", "staged-at-the-end-of-227KiB"],
)
def test_copies_land_before_their_mbarrier_completes(lib, rng, shared_offset, shared_bytes, shared_limit):
    """cp.async stages 16-byte pieces and 4-byte words in shared memory, each lane's copies arriving on
    an mbarrier (.noinc) besides the lane itself; after the wait every lane reads back what another lane
    copied (NaN, were the barrier not waiting for the copies)."""
    tile, words = _staged_inputs(rng)
    status, out = _staged_copy(lib, tile, words, shared_offset=shared_offset, shared_bytes=shared_bytes,
                               shared_limit=shared_limit)  # fmt: skip
    assert status == 0
    np.testing.assert_array_equal(out[: 4 * STAGED_PIECES].view(np.uint8), tile)
    np.testing.assert_array_equal(out[4 * STAGED_PIECES :], words)


def test_dynamic_shared_memory_limits(lib, rng):
    """Past 48 KiB a launch needs cudaFuncSetAttribute, and no limit goes past the H200's 227 KiB."""
    tile, words = _staged_inputs(rng)
    assert _staged_copy(lib, tile, words, shared_bytes=DEFAULT_SHARED_LIMIT + 16)[0] == CUDA_ERROR_INVALID_VALUE
    assert _staged_copy(lib, tile, words, shared_limit=MAX_SHARED + 1)[0] == CUDA_ERROR_INVALID_VALUE
    x = rng.standard_normal(BLOCK_THREADS).astype(np.float32)
    out = np.full_like(x, np.nan)
    status = lib.RunBlockCentre(x.ctypes.data, out.ctypes.data, 1, DEFAULT_SHARED_LIMIT + 4, NO_FAULT)
    assert status == CUDA_ERROR_INVALID_VALUE  # never raised for this kernel


def test_syncthreads_orders_shared_memory_across_warps(lib, rng):
    """A tree reduction of 128 values over 4 warps through shared memory: without a working
    barrier a thread reads partial sums not written yet (NaN: shared memory starts as NaN)."""
    blocks = 3
    x = rng.standard_normal((blocks, BLOCK_THREADS)).astype(np.float32)
    out = np.full_like(x, np.nan)
    assert lib.RunBlockCentre(x.ctypes.data, out.ctypes.data, blocks, BLOCK_THREADS * 4, NO_FAULT) == 0
    x64 = x.astype(np.float64)
    assert _relative(out, x64 - x64.mean(axis=1, keepdims=True)) <= 1e-6


def test_mbarriers_hand_a_ring_of_rows_between_warps(lib, rng):
    """Seven rounds through two rows: each round's output is its own input reversed, which needs
    both barriers (written before read, read before overwritten) to wait for every thread."""
    rounds = 7
    x = rng.standard_normal((rounds, BLOCK_THREADS)).astype(np.float32)
    out = np.full_like(x, np.nan)
    assert lib.RunMbarrierRing(x.ctypes.data, out.ctypes.data, rounds, NO_FAULT) == 0
    np.testing.assert_array_equal(out, x[:, ::-1])


def test_votes_shuffles_and_syncwarp(lib, rng):
    x = (rng.standard_normal(32) * 3).astype(np.float32)
    out = np.zeros((32, 6), np.uint32)
    assert lib.RunWarpVotes(x.ctypes.data, out.ctypes.data) == 0
    lanes = np.arange(32)
    ballot = int(sum(1 << int(lane) for lane in lanes[x > 0]))
    np.testing.assert_array_equal(out[:, 0], ballot)
    np.testing.assert_array_equal(out[:, 1], int((x > 2).any()))
    np.testing.assert_array_equal(out[:, 2], int((x > -10).all()))
    np.testing.assert_array_equal(out[:, 3], (lanes ^ 3) * 7)
    half_warp = np.where(lanes < 16, x[lanes ^ 1], x[16])
    np.testing.assert_array_equal(out[:, 4].view(np.float32), half_warp)
    np.testing.assert_array_equal(out[:, 5].view(np.float32), x[::-1])


# Each fault in a fresh process (the emulation aborts): the call (I: int64_t) and what stderr must say.
FAULTS = {
    "copy-async-to-global": (
        f"RunStagedCopy(c, a, out, I(0), I({STAGED_BYTES}), {DEFAULT_SHARED_LIMIT}, I({COPY_ASYNC_TO_GLOBAL}))",
        "CopyAsync16 destination: address",
    ),
    "copy-past-the-launch-shared-memory": (
        f"RunStagedCopy(c, a, out, I(0), I({STAGED_BYTES - 16}), {DEFAULT_SHARED_LIMIT}, I({NO_FAULT}))",
        f"is not inside the launch's {STAGED_BYTES - 16} bytes of dynamic shared memory",
    ),
    "thread-skips-syncthreads": (
        f"RunBlockCentre(c, out, 1, I(512), I({THREAD_SKIPS_SYNCTHREADS}))",
        "returned from the kernel while other threads wait at __syncthreads (block 0,0,0, thread 70)",
    ),
    "deadlock": (
        f"RunBlockCentre(c, out, 1, I(512), I({THREAD_WAITS_FOR_ITS_WARP}))",
        "threads 0..69: __syncthreads\n  threads 70..70: __syncwarp\n  threads 71..127: __syncthreads",
    ),
    "mbarrier-missing-arrival": (
        f"RunMbarrierRing(c, out, I(3), I({THREAD_SKIPS_ARRIVAL}))",
        "threads 0..127: MbarrierWait",
    ),
    "copy-not-tracked": (
        f"RunStagedCopy(c, a, out, I(0), I({STAGED_BYTES}), {DEFAULT_SHARED_LIMIT}, I({COPY_NOT_TRACKED}))",
        "MbarrierArrive with cp.async copies that no barrier tracks (CopyAsyncArriveOn first)",
    ),
    "mbarrier-double-arrival": (
        f"RunMbarrierRing(c, out, I(3), I({THREAD_ARRIVES_TWICE}))",
        "MbarrierArrive: thread arrives twice in one phase of barrier",
    ),
    "mbarrier-double-copy-arrival": (
        f"RunStagedCopy(c, a, out, I(0), I({STAGED_BYTES}), {DEFAULT_SHARED_LIMIT}, I({COPIES_ARRIVE_TWICE}))",
        "CopyAsyncArriveOn: thread arrives twice in one phase of barrier",
    ),
    "mbarrier-not-initialised": (
        f"RunMbarrierRing(c, out, I(3), I({UNINITIALISED_BARRIER}))",
        "MbarrierArrive: barrier",
    ),
    "tensor-map-box-misaligned": (
        f"RunWgmma(wide, wide, wide, wide, I({BOX_MISALIGNED}))",
        "is not 1024-byte aligned",
    ),
    "wgmma-lanes-disagree": (
        f"RunWgmma(wide, wide, wide, wide, I({LANE_OTHER_DESCRIPTOR}))",
        "wgmma: lane 3 gives other descriptors, shape or accumulate than lane 0",
    ),
    "wgmma-warp-skips": (
        f"RunWgmma(wide, wide, wide, wide, I({WARP_SKIPS_WGMMA}))",
        "wgmma: warp 2 issued 9 wgmmas, warp 0 of its warpgroup 10",
    ),
    "wgmma-never-waited-for": (
        f"RunWgmma(wide, wide, wide, wide, I({NO_WGMMA_WAIT}))",
        "returned from the kernel with wgmma results never waited for",
    ),
}


def test_wgmma_products_match_numpy(lib, rng):
    """wgmma_sm90.cuh's three products on tiles staged by tensor-map boxes: A B^T with A from shared memory
    and from register fragments (documented layout), A[:, :32] V with B MN-major."""
    bf16 = ml_dtypes.bfloat16
    a = rng.standard_normal((64, 64)).astype(bf16)
    b = rng.standard_normal((32, 64)).astype(bf16)
    v = rng.standard_normal((32, 64)).astype(bf16)
    out = np.full(64 * 32 * 2 + 64 * 64, np.nan, np.float32)
    assert lib.RunWgmma(a.ctypes.data, b.ctypes.data, v.ctypes.data, out.ctypes.data, NO_FAULT) == 0
    a64, b64, v64 = (x.astype(np.float64) for x in (a, b, v))
    scores = a64 @ b64.T
    assert _relative(out[: 64 * 32].reshape(64, 32), scores) <= 1e-6
    assert _relative(out[64 * 32 : 2 * 64 * 32].reshape(64, 32), scores) <= 1e-6
    assert _relative(out[2 * 64 * 32 :].reshape(64, 64), a64[:, :32] @ v64) <= 1e-6


def _swizzled(box: np.ndarray) -> np.ndarray:
    """The bytes of 128-byte rows laid out with the 128-byte swizzle: byte a at a ^ (((a >> 7) & 7) << 4)."""
    raw = box.view(np.uint8).reshape(-1)
    address = np.arange(raw.size)
    laid_out = np.empty_like(raw)
    laid_out[address ^ (((address >> 7) & 7) << 4)] = raw
    return laid_out


def test_tensor_map_boxes_fill_zeros_and_swizzle(lib, rng):
    """Boxes of 16 rows of a [20, 64] bf16 tensor at rows -3 and 10: rows outside are zeros; swizzled
    boxes follow the 128-byte swizzle of CUTLASS's Swizzle<3, 4, 3>, the plain one is row-major."""
    x = rng.standard_normal((20, 64)).astype(ml_dtypes.bfloat16)
    out = np.zeros(3 * 2048, np.uint8)
    assert lib.RunTensorMapBoxes(x.ctypes.data, out.ctypes.data) == 0
    padded = np.concatenate([np.zeros((3, 64), x.dtype), x, np.zeros((6, 64), x.dtype)])  # rows -3 .. 25
    first, second = padded[0:16], padded[13:29]
    np.testing.assert_array_equal(out[:2048], _swizzled(first))
    np.testing.assert_array_equal(out[2048:4096], _swizzled(second))
    np.testing.assert_array_equal(out[4096:], first.view(np.uint8).reshape(-1))


@pytest.mark.parametrize("fault", FAULTS)
def test_misuse_aborts_with_a_message(library, fault):
    call, message = FAULTS[fault]
    script = f"""
import ctypes
import numpy as np
lib = ctypes.CDLL({str(library)!r})
I = ctypes.c_int64
arrays = (np.ones(16 * 16, np.uint16), np.ones(16 * 16, np.float32), np.zeros(2 * 16 * 16, np.float32),
          np.zeros(2 * 64 * 64, np.float32))
a, c, out, wide = (ctypes.c_void_p(x.ctypes.data) for x in arrays)
lib.{call}
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


# Shared memory the emulation cannot provide must not compile or link: it would silently be one
# array per thread (static) or a null pointer (another extern name). Each declares `tile`.
UNSUPPORTED_SHARED = {
    "static-array": ("__shared__ float tile[64];", "weak declaration of .tile. must be public"),
    "other-extern-name": ("extern __shared__ float tile[];", "is not provided by the emulation"),
}


@pytest.mark.parametrize("case", UNSUPPORTED_SHARED)
def test_unsupported_shared_memory_is_refused(tmp_path, case):
    declaration, message = UNSUPPORTED_SHARED[case]
    source = tmp_path / "kernel.cu"
    source.write_text(
        '#include "gpu/nbhd_attn_kernels.h"\n'
        f"__global__ void Kernel(s2attn::NbhdAttnGpuParams p) {{ {declaration} p.out[0] = tile[threadIdx.x]; }}\n"
    )
    with pytest.raises(AssertionError, match=message):
        build_emulated_library(tmp_path, [source])
