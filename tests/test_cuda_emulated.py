"""The CUDA kernels of ``cuda/gpu`` compiled for the host and run on the CPU.

``tests/cuda_emulation`` emulates the few device facilities the kernels use (thread
indices, ``__ldg``, warp shuffles, ``__syncthreads``, ``wgmma``, ``cp.async``, TMA, mbarriers,
dynamic shared memory, ``cudaLaunchKernel``), so the kernels *and their launchers* (variant
dispatch, launch shapes, work decomposition) run unchanged on a machine without a GPU. Each
test compares the targets with a dense float64 reference built from the plan's arcs,
and checks that every result element is written (results start as NaN).

Arc-segment kernels (``nbhd_attn_*.cu``): the arc walks and window clipping, padding, tails,
the vector fast path (head dims 32/64/128) and the general path (any head dims), 16-bit
widening. Scheduled tensor-core kernels (``sched_attn_*.cu``): the block schedules of whole grids,
of a shard's windows and of ring grids (R = 1, 2, 3, shifts, whole rings, tiles and chunks with their
masks), the dq that forms delta, results in the activations' type. Stencil kernels (``stencil_attn_*.cu``):
the rows of the plan's stencil pairs beside the scheduled kernels, and the launchers' refusals (dtype, head
dims, alignment, gradient types, no pairs). Ring targets (the arc kernels between ring grids) and delta.

Timing and the GPU memory model are out of scope here: those are the H200 suite's
(``tests/gpu_kernel_sanitizer.py``, ``tests/gpu_sanitizer.py`` and the GPU tests). The
cases, reference and checks live in ``kernel_cases.py``, shared with the GPU harness.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from jax_s2attn._native import kernel_limits
from jax_s2attn.ops import _ffi
from jax_s2attn.parallel import shard_layout
from jax_s2attn.parallel.layout import window_schedules
from jax_s2attn.plan import NeighborhoodPlan
from jax_s2attn.schedule import BlockSchedule

sys.path.insert(0, str(Path(__file__).parent))  # emulation_build.py, kernel_cases.py (shared with the GPU harness)
from emulation_build import address_sanitizer_preload, build_emulated_library  # noqa: E402
from kernel_cases import (  # noqa: E402
    DKV,
    DQ,
    DTYPES,
    FORWARD,
    KERNEL_SOURCES,
    LONG_ROW_PLANS,
    LONG_ROW_WINDOWS,
    PLANS,
    RING_PLANS,
    RUN_TARGET_SHIM,
    SCHEDULED_TOLERANCE,
    STENCIL_DQ_FORMING_DELTA,
    STENCIL_PLANS,
    STENCIL_TARGET_OFFSET,
    call_run_target,
    call_scheduled_target,
    check_case,
    check_nan_poisoning,
    prepare_case,
    prepare_ring_case,
    run_case,
    run_ring_case,
    run_ring_kind,
    ring_schedules,
    run_ring_scheduled_case,
    run_ring_scheduled_kind,
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
)

# Host builds of the kernels, their emulated runs and the AddressSanitizer run: the slow tier.
pytestmark = pytest.mark.slow

CUDA_ERROR_INVALID_VALUE = 1


# A prebuilt emulated library for the whole test run instead of a fresh build (the sanitized run of
# test_kernels_under_address_sanitizer).
PREBUILT_LIBRARY = "S2ATTN_EMULATED_LIBRARY"


def _build(out: Path, defines: tuple[str, ...] = ()):
    """Compiles the kernels and the emulation runtime into ``out``; returns the library (ctypes)."""
    return ctypes.CDLL(str(build_emulated_library(out, KERNEL_SOURCES, [RUN_TARGET_SHIM], defines)))


def _status_callable(lib):
    """A status callable of the library ``lib``: runs one target on host arrays (arguments of a
    launch callable, see kernel_cases.py) and returns the launcher's cudaError_t."""
    return lambda *args, **kwargs: call_run_target(lib, lambda a: a.ctypes.data, *args, **kwargs)


def _asserting_success(status_of):
    """The launch callable of a status callable: a launcher's error fails the test."""

    def launch(*args, **kwargs):
        status = status_of(*args, **kwargs)
        assert status == 0, f"launcher returned cudaError {status}"

    return launch


@pytest.fixture(scope="module")
def emulated_library(tmp_path_factory):
    """The kernels built as a host shared library (or the prebuilt one of a sanitized run), or a
    skip where that cannot be done."""
    prebuilt = os.environ.get(PREBUILT_LIBRARY)
    return ctypes.CDLL(prebuilt) if prebuilt else _build(tmp_path_factory.mktemp("cuda_emulation"))


@pytest.fixture(scope="module")
def launch_status(emulated_library):
    """Status callable of the emulated kernels."""
    return _status_callable(emulated_library)


@pytest.fixture(scope="module")
def emulator(launch_status):
    """Launch callable of the emulated kernels (a launcher's error fails the test)."""
    return _asserting_success(launch_status)


def _misaligned(a: np.ndarray) -> np.ndarray:
    """A copy of ``a`` aligned to its element size but not to 16 bytes."""
    raw = np.empty(a.nbytes + 32, np.uint8)
    start = (16 - raw.ctypes.data % 16) % 16 + a.itemsize
    out = raw[start : start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


# (Dk, Dv): the vector fast path takes 32, 64 and 128; the rest runs the general path.
HEAD_DIMS = [(32, 32), (64, 64), (128, 128), (5, 7), (130, 3)]
# The activations' types of the scheduled and the stencil kernels.
SIXTEEN_BIT_DTYPES = ["bfloat16", "float16"]


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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("plan_name", ["down", "up"])
def test_resampling_windows(emulator, rng, plan_name, dtype):
    plan = PLANS[plan_name]()
    (nlat_q, nlon_q), (nlat_k, nlon_k) = plan.out_shape, plan.in_shape
    q_window = (1, 2, nlat_q - 2, nlon_q - 4)
    k_window = (0, nlon_k // 2, nlat_k - 1, nlon_k // 2)
    check_case(emulator, rng, plan, 1, 2, 64, 64, dtype, q_window, k_window, (1, 1, 1, 1))


@pytest.mark.parametrize("dims", [(4, 0), (0, 4), (1, 1), (33, 31), (64, 32), (256, 256)])
def test_unusual_head_dims(emulator, rng, dims):
    check_case(emulator, rng, PLANS["self"](), 1, 2, *dims, "float32")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_unaligned_buffers_take_the_general_path(emulator, rng, dtype):
    check_case(emulator, rng, PLANS["self"](), 2, 2, 64, 64, dtype, transform=_misaligned)


def test_empty_batch_launches_nothing(emulator):
    """Succeeds without a launch (the emulated cudaLaunchKernel refuses an empty grid)."""
    plan = PLANS["self"]()
    q = np.zeros((0, 8, 16, 1, 64), np.float32)
    out = np.zeros((0, 8, 16, 1, 64), np.float32)
    lse = np.zeros((0, 8, 16, 1), np.float32)
    window = np.asarray([0, 0, 8, 16, 0, 0, 8, 16], np.int32)
    sizes = [0, 1, 64, 64, 8, 16, 8, 16, 8, 16, 8, 16]
    emulator(FORWARD, "float32", sizes, 0.125, q, q, q, None, None, None, window, plan.forward_arcs.row_order,
             plan.forward_arcs, plan.quad_weights, out, lse)  # fmt: skip


@pytest.mark.parametrize("stencil", [False, True], ids=["scheduled", "scheduled+stencil"])
def test_scheduled_and_stencil_empty_batch_launches_nothing(emulated_library, rng, stencil):
    """The scheduled targets (and the stencil targets beside them) on an empty batch: every launcher, the dq that
    forms delta included, succeeds without a launch (the emulated cudaLaunchKernel refuses an empty grid)."""
    plan = STENCIL_PLANS["self-9x4"]() if stencil else PLANS["self"]()
    case = prepare_case(rng, plan, 1, 1, 64, 64, "bfloat16")
    empty = dataclasses.replace(case, sizes=[0, *case.sizes[1:]], inputs=(*(a[:0] for a in case.inputs[:6]),
                                                                          case.inputs[6]))  # fmt: skip
    results = run_scheduled_case(emulated_library, empty, stencil=stencil)
    assert all(result.shape[0] == 0 for result in results.values())


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
    launch = _asserting_success(_status_callable(small_launch_limits))
    check_case(launch, rng, PLANS["down"](), 3, 3, 32, 32, "float32")
    check_case(launch, rng, PLANS["down"](), 2, 1, 5, 7, "bfloat16")


def test_scheduled_and_stencil_grids_past_the_block_limit_are_split(small_launch_limits, rng):
    """More than 65535 (batch x head) slabs or stencil row pairs: the scheduled and the stencil launchers split
    the grid into several launches (checked here with a limit of 2 blocks in y and z): 3 slabs, more than 2 row
    pairs in both walks, every element written and within the bar of float64."""
    plan = STENCIL_PLANS["self-17x72"]()
    assert all(len(_ffi.stencil_schedule(plan, walk).pairs) > 2 for walk in ("forward", "backward"))
    case = prepare_case(rng, plan, 3, 1, 32, 32, "float16")
    bar = tolerance_of("scheduled", "float16")
    verify_case(case, run_scheduled_case(small_launch_limits, case, stencil=True), bar, out_tolerance=bar)


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
    """More rows than one sweep of the launch covers (2 blocks of 8 warps, 4 rows each, here): the
    grid-stride loop takes the rest, three sweeps, the last one partial."""
    _check_delta(small_launch_limits, rng, 150, 40, "bfloat16")


@pytest.mark.parametrize("shapes", [((33, 72), (33, 72)), ((33, 72), (65, 144))], ids=["self", "up"])
@pytest.mark.parametrize("dtype", SIXTEEN_BIT_DTYPES)
def test_smooth_values_keep_gradients_accurate(emulator, rng, dtype, shapes):
    """Values smooth in position: dP - delta nearly cancels in the score gradients, so dq and dk
    keep the bar only if out, from which the op takes delta, is accurate well beyond it (the
    backward targets get the kernels' own lse and delta here, as in the op)."""
    plan = NeighborhoodPlan(*shapes, theta_cutoff=0.15)
    case = prepare_case(rng, plan, 2, 1, 64, 64, dtype, smooth_values=True)
    verify_case(case, run_case(case, emulator, as_op=True), tolerance_of("arc", dtype))


def test_backward_launchers_refuse_other_gradient_types(launch_status, rng):
    """Arc kernels: float32 gradients only (the stencil targets': test_stencil_launchers_refuse_other_gradient_types)."""
    case = prepare_case(rng, PLANS["self"](), 1, 1, 64, 64, "bfloat16")
    statuses = []
    results = run_case(case, lambda *args, **kwargs: statuses.append(launch_status(*args, **kwargs)),
                       gradient_type=ml_dtypes.bfloat16)  # fmt: skip
    assert statuses == [0, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_INVALID_VALUE]
    assert all(np.isnan(results[name]).all() for name in ("dq", "dk", "dv"))


# ------------------------------------------------------------------ stencil targets alone


def _stencil_results(case, kind: str, gradient_type=np.float32) -> tuple:
    """NaN-filled results of stencil ``kind`` ("forward": float32 out and lse; "dq", "dq_delta": dq of
    ``gradient_type`` (and float32 delta); "dkv": dk and dv of ``gradient_type``) on ``case``'s arrays."""
    q, k, v = case.inputs[:3]
    if kind == "forward":
        return np.full((*q.shape[:4], v.shape[-1]), np.nan, np.float32), np.full(q.shape[:4], np.nan, np.float32)
    if kind == "dq":
        return np.full(q.shape, np.nan, gradient_type), None
    if kind == "dq_delta":
        return np.full(q.shape, np.nan, gradient_type), np.full(q.shape[:4], np.nan, np.float32)
    return np.full(k.shape, np.nan, gradient_type), np.full(v.shape, np.nan, gradient_type)


def _stencil_status(launch_status, case, kind: str, results, table=None, pairs=None, inputs=None) -> int:
    """The status of stencil ``kind`` (as for :func:`_stencil_results`) alone on ``case``'s arrays (whole grids),
    writing ``results``: walking ``table`` (the plan's segment table of the walk by default) and the rows of
    ``pairs`` (the plan's stencil pairs of the walk by default; the dq that forms delta takes dlse 0).
    ``inputs``: the case's inputs, or others."""
    q, k, v, dout, lse, delta, window = inputs or case.inputs
    walk = "backward" if kind == "dkv" else "forward"
    table = getattr(case.plan, f"{walk}_segments") if table is None else table
    pairs = getattr(case.plan, f"{walk}_stencil_pairs") if pairs is None else pairs
    order = case.bwd_order if kind == "dkv" else case.fwd_order
    target = {"forward": STENCIL_TARGET_OFFSET + FORWARD, "dq": STENCIL_TARGET_OFFSET + DQ,
              "dq_delta": STENCIL_DQ_FORMING_DELTA, "dkv": STENCIL_TARGET_OFFSET + DKV}[kind]  # fmt: skip
    if kind == "forward":
        dout = lse = delta = None
    elif kind == "dq_delta":
        delta = np.zeros(q.shape[:4], np.float32)  # dlse
    return launch_status(target, case.dtype, case.sizes, case.scale, q, k, v, dout, lse, delta, window, order, table,
                         case.plan.quad_weights, *results, stencil_pairs=np.ascontiguousarray(pairs, np.int32))


@pytest.mark.parametrize("walk", ["forward", "backward"])
def test_stencil_rows_with_corrupted_tables_stay_in_bounds(launch_status, rng, walk):
    """The stencil targets on device tables the host cannot validate: garbage segments (random; every
    segment of the pairs' rows at the largest start and length, whose sum overflows int32), garbage
    offsets, garbage pairs (first rows and first rows of the other grid anywhere) and a window that is not
    whole must never index outside the arrays (the sanitized run checks), and but for garbage pairs every
    result row of the pairs is still written: the forward's, and dk/dv's (whose stencil kernel also stages the
    queries' lse and delta)."""
    plan = STENCIL_PLANS["self-17x72"]()
    case = prepare_case(rng, plan, 1, 2, 32, 32, "bfloat16")
    kind = "forward" if walk == "forward" else "dkv"
    table, pairs = getattr(plan, f"{walk}_segments"), getattr(plan, f"{walk}_stencil_pairs")
    assert pairs.size, "the plan must leave rows to the stencil kernels"
    rows = stencil_rows_of(pairs, plan.nlat_out if walk == "forward" else plan.nlat_in)
    extreme = table.segments.copy()
    for h in np.flatnonzero(rows):
        extreme[table.offsets[h] : table.offsets[h + 1], 1:] = np.iinfo(np.int32).max
    other_grid = plan.in_shape if walk == "forward" else plan.out_shape
    tables = [*_corrupted_segments(table, rng, *other_grid), table._replace(segments=extreme)]
    big = np.iinfo(np.int32).max
    bad_pairs = rng.integers(-big, big, size=pairs.shape, dtype=np.int64).astype(np.int32)
    near_pairs = rng.integers(-3, max(plan.nlat_in, plan.nlat_out) + 3, size=pairs.shape).astype(np.int32)
    bad_window = np.asarray([0, 0, plan.nlat_out, plan.nlon_out - 1, 0, 0, *plan.in_shape], np.int32)
    runs = [(case.inputs, t) for t in tables] + [((*case.inputs[:6], bad_window), table)]
    for inputs, broken_table in runs:
        results = _stencil_results(case, kind)
        assert _stencil_status(launch_status, case, kind, results, broken_table, pairs, inputs) == 0
        assert not any(np.isnan(r[:, rows]).any() for r in results)
    for garbage in (bad_pairs, near_pairs):  # anywhere (clamped to the edges), and rows near and inside the grids
        assert _stencil_status(launch_status, case, kind, _stencil_results(case, kind), table, garbage) == 0


def _corrupted_segments(table, rng, nlat_other: int, nlon_other: int):
    """Copies of a segment table with garbage segments (anything; rows in range with arcs out of
    range) or garbage offsets."""
    segments, offsets = table.segments, table.offsets
    big = np.iinfo(np.int32).max
    anything = rng.integers(-big, big, size=segments.shape, dtype=np.int64)
    plausible = rng.integers(-2 * nlon_other, 3 * nlon_other, size=segments.shape)
    plausible[:, 0] = rng.integers(-1, nlat_other + 1, size=segments.shape[0])
    bad_offsets = rng.integers(-50, 10 * segments.shape[0], size=offsets.shape)
    return [
        table._replace(segments=np.ascontiguousarray(anything, np.int32)),
        table._replace(segments=np.ascontiguousarray(plausible, np.int32)),
        table._replace(offsets=np.ascontiguousarray(bad_offsets, np.int32)),
    ]


STENCIL_KINDS = ("forward", "dq", "dq_delta", "dkv")


def _refused_by_stencil_launchers(launch_status, case, pairs=None, kinds=STENCIL_KINDS, gradient_type=np.float32):
    """Asserts that the stencil launchers of ``kinds`` return cudaErrorInvalidValue without writing a result."""
    for kind in kinds:
        results = _stencil_results(case, kind, gradient_type)
        assert _stencil_status(launch_status, case, kind, results, pairs=pairs) == CUDA_ERROR_INVALID_VALUE, kind
        assert all(np.isnan(np.asarray(r, np.float32)).all() for r in results if r is not None), kind


def test_stencil_launchers_refuse_misaligned_buffers(launch_status, rng):
    case = prepare_case(rng, STENCIL_PLANS["self"](), 1, 2, 64, 64, "bfloat16", transform=_misaligned)
    _refused_by_stencil_launchers(launch_status, case)


def test_stencil_launchers_refuse_a_call_without_pairs(launch_status, rng):
    case = prepare_case(rng, STENCIL_PLANS["self"](), 1, 2, 64, 64, "bfloat16")
    _refused_by_stencil_launchers(launch_status, case, pairs=np.zeros((0, 2), np.int32))


def test_stencil_launchers_refuse_more_pairs_than_rows(launch_status, rng):
    case = prepare_case(rng, STENCIL_PLANS["self"](), 1, 2, 64, 64, "bfloat16")
    rows = case.plan.nlat_out  # = nlat_in: either walk
    _refused_by_stencil_launchers(launch_status, case, pairs=np.zeros((rows // 2 + 1, 2), np.int32))


def test_stencil_forward_launcher_takes_exactly_one_out(launch_status, rng):
    """Both outs (float32 and in the activations' type), or neither: cudaErrorInvalidValue, nothing written."""
    case = prepare_case(rng, STENCIL_PLANS["self"](), 1, 1, 64, 64, "bfloat16")
    q, k, v, *_, window = case.inputs
    pairs = np.ascontiguousarray(case.plan.forward_stencil_pairs, np.int32)
    both = (np.full((*q.shape[:4], 64), np.nan, np.float32), np.full(q.shape, np.nan, q.dtype))
    for out, narrow in [(None, None), both]:
        lse = np.full(q.shape[:4], np.nan, np.float32)
        status = launch_status(STENCIL_TARGET_OFFSET + FORWARD, "bfloat16", case.sizes, case.scale, q, k, v, None,
                               None, None, window, case.fwd_order, case.plan.forward_segments, case.plan.quad_weights,
                               out, lse, narrow, stencil_pairs=pairs)  # fmt: skip
        assert status == CUDA_ERROR_INVALID_VALUE and np.isnan(lse).all()
        assert all(np.isnan(np.asarray(x, np.float32)).all() for x in (out, narrow) if x is not None)


@pytest.mark.parametrize(
    ("dims", "dtype"),
    [((48, 48), "bfloat16"), ((64, 32), "float16"), ((32, 64), "bfloat16"), ((256, 256), "float16"),
     ((16, 16), "bfloat16"), ((64, 64), "float32")],  # fmt: skip
    ids=lambda x: f"dk{x[0]}-dv{x[1]}" if isinstance(x, tuple) else x,
)
def test_stencil_launchers_refuse_unsupported_cases(launch_status, rng, dims, dtype):
    _refused_by_stencil_launchers(launch_status, prepare_case(rng, STENCIL_PLANS["self"](), 1, 1, *dims, dtype))


def test_stencil_launchers_refuse_other_gradient_types(launch_status, rng):
    """Stencil targets: gradients of float32 or the activations' type (bfloat16 here), not float16; the forward,
    whose out is float32 here, runs."""
    case = prepare_case(rng, STENCIL_PLANS["self"](), 1, 1, 64, 64, "bfloat16")
    results = _stencil_results(case, "forward")
    assert _stencil_status(launch_status, case, "forward", results) == 0
    _refused_by_stencil_launchers(launch_status, case, kinds=STENCIL_KINDS[1:], gradient_type=np.float16)


# Tests run again under AddressSanitizer, in a subprocess with an ASan build of the kernels: a
# read or write outside an array that would pass unnoticed here (garbage tables, an index past a
# short table) aborts the run with a report naming the kernel's line.
SANITIZED_TESTS = (
    "corrupted or scheduled_windows or resampling or (scheduled_matches and self) or rounded_float32 or delta "
    "or stencil or ring or empty or nan or residues"
)


def test_kernels_under_address_sanitizer(tmp_path):
    if os.environ.get(PREBUILT_LIBRARY):
        pytest.skip("this is the sanitized run")
    preload = address_sanitizer_preload()
    if preload is None:
        pytest.skip("needs the host compiler's AddressSanitizer runtime")
    library = build_emulated_library(tmp_path, KERNEL_SOURCES, [RUN_TARGET_SHIM], address_sanitizer=True)
    environment = os.environ | {PREBUILT_LIBRARY: str(library), "LD_PRELOAD": preload, "ASAN_OPTIONS": "detect_leaks=0"}
    # -s: an ASan report is written as the process aborts, past any capture of pytest.
    # -P: the installed package (with its native modules), not the checkout that is the working directory.
    command = [sys.executable, "-P", "-m", "pytest", __file__, "-q", "-s", "-p", "no:cacheprovider", "-k", SANITIZED_TESTS]
    result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{result.stdout[-4000:]}\n{result.stderr[-8000:]}"


@pytest.mark.parametrize(("kernel", "dtype"), [("arc", "float32"),
                                               ("scheduled", "bfloat16"),
                                               ("scheduled+stencil", "float16")])  # fmt: skip
@pytest.mark.parametrize("operand", ["q", "k", "v"])
def test_forward_propagates_nan(emulator, emulated_library, rng, kernel, dtype, operand):
    """A NaN in one query (one key) makes that query's (every query that has that key as a
    neighbour's) output row and lse NaN, and leaves the others finite: NaN never turns into a
    plausible zero. A NaN in one value makes that channel of the outputs that see it NaN; on the scheduled
    kernels it may also reach that channel of queries whose chunks hold the value without seeing it (0 · NaN in
    P·V), never lse or another channel. On the scheduled kernels beside the stencil rows, the NaN point lies on a
    stencil row (its key's queries in stencil rows and in the scheduled kernels' rows)."""
    stencil = kernel == "scheduled+stencil"
    plan = STENCIL_PLANS["self-17x72"]() if stencil else PLANS["self"]()
    case = prepare_case(rng, plan, 1, 1, 64, 64, dtype)
    q, k, v = case.inputs[:3]
    nlon = q.shape[2]
    pairs = _ffi.stencil_schedule(plan, "forward").pairs if stencil else None
    row = int(pairs[len(pairs) // 2, 0]) if stencil else plan.out_shape[0] // 2  # a middle (stencil) row
    point = row * nlon + 3  # a query (key) point of that row
    array = {"q": q, "k": k, "v": v}[operand]
    array[0, point // nlon, point % nlon, 0, 5] = np.nan
    if kernel == "arc":
        results = run_case(case, emulator)
        out, lse = results["out"], results["lse"]
    else:
        forward, _ = scheduled_schedules(case, stencil)
        out, lse = run_scheduled_kind(emulated_library, case, "forward", np.float32, forward, stencil_pairs=pairs)
    check_nan_poisoning(plan, out, lse, point, operand, value_confined=kernel != "scheduled")


# ------------------------------------------------------------------ scheduled tensor-core kernels

# Every plan of PLANS (whole rings, shifts and residues 2 and 3, Gauss rows, lat- and lon-only) and rows of several
# tiles (nlon 72, 100: not multiples of the tile) on the scheduled kernels, batch 2 and 2 heads.
SCHEDULED_CASES = [(name, dtype) for name in [*PLANS, *LONG_ROW_PLANS] for dtype in SIXTEEN_BIT_DTYPES]
SCHEDULED_PLANS = PLANS | LONG_ROW_PLANS


@pytest.mark.parametrize(("plan_name", "dtype"), SCHEDULED_CASES, ids=[f"{p}-{t}" for p, t in SCHEDULED_CASES])
def test_scheduled_matches_float64(emulated_library, rng, plan_name, dtype):
    """The scheduled forward, dq and dk/dv as the op runs them (delta from the float32 out, the forward's lse)
    against float64: out within the 16-bit bar (P is rounded once), lse to float32 round-off, every element of
    every result written (NaN-poisoned first)."""
    case = prepare_case(rng, SCHEDULED_PLANS[plan_name](), 2, 2, 64, 64, dtype)
    bar = tolerance_of("scheduled", dtype)
    verify_case(case, run_scheduled_case(emulated_library, case), bar, out_tolerance=bar)


# The directions, several classes, rows of several tiles and whole rings; head dims 32 and 128 on one plan.
SCHEDULED_FORMING_DELTA_CASES = [
    *((name, dtype, 64) for name in ("self", "down3", "up3", "self-72", "rings-72") for dtype in SIXTEEN_BIT_DTYPES),
    ("self-72", "bfloat16", 32), ("up3", "float16", 128),
]  # fmt: skip


@pytest.mark.parametrize(("plan_name", "dtype", "d"), SCHEDULED_FORMING_DELTA_CASES,
                         ids=[f"{p}-{t}-D{d}" for p, t, d in SCHEDULED_FORMING_DELTA_CASES])  # fmt: skip
def test_scheduled_dq_forms_delta(emulated_library, rng, plan_name, dtype, d):
    """The scheduled dq that forms delta from the forward's float32 out and dlse (not zero): delta of every point
    within FORMED_DELTA_TOLERANCE of float64, dq the bits of the scheduled dq given that delta, every element of
    both written (NaN-poisoned first)."""
    case = prepare_case(rng, SCHEDULED_PLANS[plan_name](), 2, 2, d, d, dtype)
    forward, _ = scheduled_schedules(case)
    out, lse = run_scheduled_kind(emulated_library, case, "forward", np.float32, forward)
    dlse = rng.standard_normal(lse.shape).astype(np.float32)
    dq, delta = run_scheduled_dq_forming_delta(emulated_library, case, np.float32, forward, lse, out, dlse)
    (dq_given, _) = run_scheduled_kind(emulated_library, case, "dq", np.float32, forward, lse, delta)
    verify_dq_forming_delta(case, out, dlse, {"dq": dq, "delta": delta, "dq_given_delta": dq_given})


def _without_chunks(schedule: BlockSchedule, emptied) -> BlockSchedule:
    """``schedule`` with the chunk lists of the tiles ``emptied`` (indices) taken out."""
    offsets = schedule.tile_offsets
    keep = np.ones(len(schedule.chunks), bool)
    for tile in emptied:
        keep[offsets[tile]:offsets[tile + 1]] = False
    counts = np.diff(offsets) * np.isin(np.arange(len(offsets) - 1), emptied, invert=True)
    new_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return schedule._replace(tile_offsets=new_offsets, chunks=schedule.chunks[keep])


def test_scheduled_dq_forms_delta_on_tiles_without_chunks(emulated_library, rng):
    """A tile whose chunk list is empty writes its results without walking (zeros); the dq that forms delta still
    forms and writes its points' delta, which dk/dv reads: here two tiles' chunks taken out of the forward
    schedule (a whole tile and one past the ring's end), every point's delta within FORMED_DELTA_TOLERANCE, dq zero
    on those tiles and the bits of the dq given that delta."""
    case = prepare_case(rng, SCHEDULED_PLANS["self-72"](), 2, 2, 64, 64, "bfloat16")
    forward, _ = scheduled_schedules(case)
    out, lse = run_scheduled_kind(emulated_library, case, "forward", np.float32, forward)
    partial = np.flatnonzero(forward.tiles[:, 1] + forward.tile_cols > case.plan.nlon_out)
    whole = np.flatnonzero(forward.tiles[:, 1] + forward.tile_cols <= case.plan.nlon_out)
    emptied = [int(whole[0]), int(partial[0])]
    schedule = _without_chunks(forward, emptied)
    dlse = rng.standard_normal(lse.shape).astype(np.float32)
    dq, delta = run_scheduled_dq_forming_delta(emulated_library, case, np.float32, schedule, lse, out, dlse)
    (dq_given, _) = run_scheduled_kind(emulated_library, case, "dq", np.float32, schedule, lse, delta)
    verify_dq_forming_delta(case, out, dlse, {"dq": dq, "delta": delta, "dq_given_delta": dq_given})
    for row, lon in forward.tiles[emptied]:
        block = dq[:, row : row + forward.tile_rows, lon : lon + forward.tile_cols]
        assert block.size and not block.any(), (row, lon)


@pytest.mark.parametrize("d", [32, 64, 128])
def test_scheduled_dkv_tiles_of_one_block_walk_apart(emulated_library, rng, d):
    """dk/dv runs several tiles a block (three consumer warpgroups at head dims 32 and 64, one at 128), each walking
    its own chunk list: on the backward schedule of 10 tiles (blocks of 3, 3, 3 and 1 tiles) with the middle tile
    of the second block emptied, that tile's dk and dv are zero and every other element the bits of the whole
    schedule's results, all written (NaN-poisoned first)."""
    case = prepare_case(rng, SCHEDULED_PLANS["self-72"](), 2, 2, d, d, "bfloat16")
    _, backward = scheduled_schedules(case)
    assert len(backward.tiles) == 10, len(backward.tiles)
    lse, delta = case.inputs[4:6]
    whole = run_scheduled_kind(emulated_library, case, "dkv", np.float32, backward, lse, delta)
    emptied = 4
    part = run_scheduled_kind(emulated_library, case, "dkv", np.float32, _without_chunks(backward, [emptied]), lse,
                              delta)  # fmt: skip
    row, lon = backward.tiles[emptied]
    rows, lons = slice(row, row + backward.tile_rows), slice(lon, lon + backward.tile_cols)
    for name, got, expected in zip(("dk", "dv"), part, whole):
        assert not np.isnan(got).any(), name
        assert got[:, rows, lons].size and not got[:, rows, lons].any(), name
        expected = expected.copy()
        expected[:, rows, lons] = 0
        np.testing.assert_array_equal(got, expected, err_msg=name)


# Head dims 32 (64-byte rows, the 64-byte swizzle) and 128 (two 64-element blocks a row): the directions, several
# classes, rows of several tiles and whole rings.
SCHEDULED_HEAD_DIM_PLANS = ("self", "down3", "up3", "self-72", "rings-72")
SCHEDULED_HEAD_DIM_CASES = [(name, dtype, d) for d in (32, 128) for name in SCHEDULED_HEAD_DIM_PLANS
                            for dtype in SIXTEEN_BIT_DTYPES]  # fmt: skip


@pytest.mark.parametrize(("plan_name", "dtype", "d"), SCHEDULED_HEAD_DIM_CASES,
                         ids=[f"{p}-{t}-D{d}" for p, t, d in SCHEDULED_HEAD_DIM_CASES])
def test_scheduled_head_dims_32_and_128_match_float64(emulated_library, rng, plan_name, dtype, d):
    """Head dims 32 and 128 on the scheduled kernels (every block of every row staged and multiplied, O and the
    row sums as separate products) against float64, every element of every result written."""
    case = prepare_case(rng, SCHEDULED_PLANS[plan_name](), 2, 2, d, d, dtype)
    bar = tolerance_of("scheduled", dtype)
    verify_case(case, run_scheduled_case(emulated_library, case), bar, out_tolerance=bar)


# Windows of a sharded grid on the scheduled kernels: the 8x16 self plan's WINDOWS (a block seeing no key, a key
# block of whole rings, padding on every side), blocks from mid-ring over rows of several tiles (an R = 2 walk from
# an odd longitude), resampling windows and whole rings.
SCHEDULED_WINDOW_CASES = (
    [("self", *w) for w in WINDOWS]
    + [(name, w["q_window"], w["k_window"], w["padding"]) for name, w in LONG_ROW_WINDOWS.items()]
    + [("down", (1, 2, 2, 4), (0, 8, 7, 8), (1, 1, 1, 1)), ("up3", (1, 3, 10, 17), (2, 0, 4, 8), (1, 3, 0, 1)),
       ("rings-72", (1, 0, 4, 72), (0, 30, 6, 42), (0, 5, 2, 0))]
)  # fmt: skip


@pytest.mark.parametrize("dtype", SIXTEEN_BIT_DTYPES)
@pytest.mark.parametrize(("plan_name", "q_window", "k_window", "padding"), SCHEDULED_WINDOW_CASES,
                         ids=[f"{c[0]}-q{c[1]}-k{c[2]}" for c in SCHEDULED_WINDOW_CASES])  # fmt: skip
def test_scheduled_windows_with_padding(emulated_library, rng, plan_name, q_window, k_window, padding, dtype):
    """A shard's blocks on the scheduled kernels (the window's schedule in local coordinates, the local key rows'
    weights, the other grid's ring as the modulus): out and lse over the key block, dq over its keys and dk/dv
    over the query block against float64, every element written, padding zero (lse -inf)."""
    plan = SCHEDULED_PLANS[plan_name]()
    case = prepare_case(rng, plan, 2, 2, 64, 64, dtype, q_window, k_window, padding)
    bar = tolerance_of("scheduled", dtype)
    verify_case(case, run_scheduled_windows(emulated_library, case), bar, out_tolerance=bar)


@pytest.mark.parametrize(("shapes", "lat_parts", "lon_parts"), [(((17, 36), (17, 36)), 2, 5),
                                                                (((24, 48), (12, 24)), 3, 2)], ids=str)  # fmt: skip
def test_scheduled_windows_of_a_layout(emulated_library, rng, shapes, lat_parts, lon_parts):
    """The windows of a sharded layout on the schedules the sharded op runs (jax_s2attn.parallel.layout's
    window_schedules: every window's schedule joined into one set, a window's tiles and offsets picked by its
    index): the first shard's own window, the last shard's (padding), the last longitude shard's first ring step
    (padding queries over the first key chunk) and a middle latitude shard's last one (halo rows), each against
    float64, padding zero."""
    plan = NeighborhoodPlan(*shapes, theta_cutoff=0.4)
    layout = shard_layout(plan, lat_parts, lon_parts)
    sets = window_schedules(plan, layout, *kernel_limits().scheduled_shape)
    q_block, k_block = (layout.q_lat.block, layout.q_lon.block), (layout.k_ext_block, layout.k_lon.block)
    steps = {(0, 0, 0), (lat_parts - 1, lon_parts - 1, lon_parts - 1), (0, lon_parts - 1, 0),
             (lat_parts // 2, 0, lon_parts - 1)}  # (latitude shard, longitude shard, key chunk)
    for index in sorted(layout.window_index(*step) for step in steps):
        window = layout.windows[index].tolist()
        padding = (q_block[0] - window[2], q_block[1] - window[3], k_block[0] - window[6], k_block[1] - window[7])
        case = prepare_case(rng, plan, 1, 2, 64, 64, "bfloat16", tuple(window[:4]), tuple(window[4:]), padding)
        picked = [BlockSchedule(s.tiles[index], s.tile_offsets[index], s.chunks, s.records, *s[4:]) for s in sets]
        bar = tolerance_of("scheduled", "bfloat16")
        verify_case(case, run_scheduled_windows(emulated_library, case, schedules=picked), bar, out_tolerance=bar)


@pytest.mark.parametrize("windows", WINDOWS[1:3], ids=lambda w: f"q{w[0]}-k{w[1]}")
def test_scheduled_windows_padding_stays_zero_with_extreme_logits(emulated_library, rng, windows):
    """Logits near -120: a padding key row shares its chunks with real rows, and its unnormalised probability
    w * exp(s - lse) from the garbage it holds overflows; its dk/dv must still be zeros (and every other result
    within the bar of float64)."""
    q_window, k_window, padding = windows
    case = prepare_case(rng, PLANS["self"](), 1, 2, 64, 64, "bfloat16", q_window, k_window, padding,
                        logit_offset=-120.0)  # fmt: skip
    bar = tolerance_of("scheduled", "bfloat16")
    verify_case(case, run_scheduled_windows(emulated_library, case), bar, out_tolerance=bar)


def test_scheduled_many_residues(emulated_library, rng):
    """Upsampling 4 -> 400 longitudes: 100 classes of walking points (one staging a class per key row); nothing
    in the walk is sized by the classes."""
    case = prepare_case(rng, NeighborhoodPlan((5, 4), (9, 400), theta_cutoff=1.0), 1, 1, 32, 32, "bfloat16")
    bar = tolerance_of("scheduled", "bfloat16")
    verify_case(case, run_scheduled_case(emulated_library, case), bar, out_tolerance=bar)


@pytest.mark.parametrize("kind", ["forward", "dq", "dkv"])
def test_scheduled_launchers_refuse_unsupported_head_dims_and_ring_moduli(emulated_library, rng, kind):
    """Head dims other than 32, 64 and 128, and a RING chunks' modulus below 1: cudaErrorInvalidValue, nothing
    written."""
    for d, ring_nlon in [(48, None), (16, None), (256, None), (64, 0), (64, -16)]:
        case = prepare_case(rng, PLANS["self"](), 1, 1, d, d, "bfloat16")
        schedule = scheduled_schedules(case)[kind == "dkv"]
        status, results = call_scheduled_target(emulated_library, case, kind, np.float32, schedule,
                                                 *case.inputs[4:6], ring_nlon=ring_nlon)  # fmt: skip
        assert status == CUDA_ERROR_INVALID_VALUE, (d, ring_nlon)
        assert all(np.isnan(r).all() for r in results if r is not None), (d, ring_nlon)


@pytest.mark.parametrize("plan_name", ["self", "up3"])
def test_scheduled_kernels_with_corrupted_schedules_stay_in_bounds(emulated_library, rng, plan_name):
    """A block schedule in device memory is not checked by the host: garbage tiles, tile offsets, chunks (flags
    and offsets included) or records must never index outside the arrays (the sanitized run), in the forward, dq,
    the dq that forms delta and dk/dv; with only the records garbage, every result element is still written."""
    case = prepare_case(rng, PLANS[plan_name](), 1, 1, 32, 32, "bfloat16")
    big = np.iinfo(np.int32).max
    schedules = dict(zip(("forward", "backward"), scheduled_schedules(case)))
    lse, delta = case.inputs[4:6]
    out = np.ascontiguousarray(case.expected["out"], np.float32)
    for kind, walk in (("forward", "forward"), ("dq", "forward"), ("dq_delta", "forward"), ("dkv", "backward")):
        for name in ("tiles", "tile_offsets", "chunks", "records"):
            table = getattr(schedules[walk], name)
            garbage = rng.integers(-big, big, size=table.shape, dtype=np.int64).astype(np.int32)
            garbage.reshape(-1)[: garbage.size // 2] %= 64  # plausible small values too
            schedule = schedules[walk]._replace(**{name: garbage})
            if kind == "dq_delta":
                results = run_scheduled_dq_forming_delta(emulated_library, case, np.float32, schedule, lse, out,
                                                         np.zeros_like(lse))  # fmt: skip
            else:
                results = run_scheduled_kind(emulated_library, case, kind, np.float32, schedule, lse, delta)
            if name == "records":
                assert not any(np.isnan(r).any() for r in results if r is not None), (kind, name)


SMOOTH_SHAPES = [((33, 72), (33, 72)), ((66, 144), (33, 72)), ((33, 72), (65, 144))]
SMOOTH_CASES = [(shapes, 64) for shapes in SMOOTH_SHAPES] + [(SMOOTH_SHAPES[0], 32), (SMOOTH_SHAPES[0], 128)]


@pytest.mark.parametrize("dtype", SIXTEEN_BIT_DTYPES)
@pytest.mark.parametrize(("shapes", "head_dim"), SMOOTH_CASES, ids=str)
def test_scheduled_smooth_values_keep_gradients_accurate(emulated_library, rng, dtype, shapes, head_dim):
    """Values smooth in position, where dP - delta nearly cancels: out divided by the row sums of the rounded P
    keeps dq and dk within the bar with P multiplied once (with float32 sums the gradients miss it)."""
    plan = NeighborhoodPlan(*shapes, theta_cutoff=0.15)
    case = prepare_case(rng, plan, 1, 1, head_dim, head_dim, dtype, smooth_values=True)
    bar = tolerance_of("scheduled", dtype)
    verify_case(case, run_scheduled_case(emulated_library, case), bar, out_tolerance=bar)


@pytest.mark.parametrize("dtype", SIXTEEN_BIT_DTYPES)
def test_scheduled_forward_keeps_maxima_that_rise_past_the_rescale_slack(emulated_library, rng, dtype):
    """Logits spread over tens of log2 units (q times 8): along a walk the row maxima rise both by less than the
    forward's rescale slack (kept: P above 1) and by more (moved, O rescaled); out, lse and the gradients stay
    within the bar of float64."""
    plan = NeighborhoodPlan((33, 72), (33, 72), theta_cutoff=0.25)
    case = prepare_case(rng, plan, 1, 2, 64, 64, dtype, logit_gain=8.0)
    bar = tolerance_of("scheduled", dtype)
    verify_case(case, run_scheduled_case(emulated_library, case), bar, out_tolerance=bar)


# Plans whose walks leave rows to the stencil kernels beside the scheduled ones (_ffi.stencil_schedule: tiles of
# one row in the ring grids' format, on self-9x4 the kernels' 4 x 16): Legendre-Gauss rows from the pole, a band in
# mid-grid, every row but one, more key rows than query rows (the two walks' pairs differ).
SCHEDULED_STENCIL_CASES = [
    ("legendre-gauss", 32, "float16"), ("self-17x72", 64, "bfloat16"), ("self-17x72", 128, "float16"),
    ("self-9x4", 64, "bfloat16"), ("lat-10x40-9x40", 64, "float16"),
]  # fmt: skip


@pytest.mark.parametrize(("plan_name", "d", "dtype"), SCHEDULED_STENCIL_CASES,
                         ids=[f"{p}-d{d}-{t}" for p, d, t in SCHEDULED_STENCIL_CASES])  # fmt: skip
def test_scheduled_beside_the_stencil_rows_matches_float64(emulated_library, rng, plan_name, d, dtype):
    """The scheduled kernels on the schedule without the stencil rows' tiles, then the stencil targets on those
    rows into the same NaN-poisoned results (as the op runs them): every element written, out, lse and the
    gradients against float64 to the 16-bit bar. Given float64's lse and delta, the stencil rows (float32
    throughout: P and dS never rounded) hold out, dq, dk and dv within float32 round-off, which the scheduled
    kernels' rows do not; results in the activations' type are the float32 ones rounded, bit for bit."""
    plan = STENCIL_PLANS[plan_name]()
    pairs = {walk: _ffi.stencil_schedule(plan, walk).pairs for walk in ("forward", "backward")}
    assert all(len(p) for p in pairs.values()), "the plan must leave rows to the stencil kernels"
    case = prepare_case(rng, plan, 2, 2, d, d, dtype)
    bar = tolerance_of("scheduled", dtype)
    wide = run_scheduled_case(emulated_library, case, stencil=True)
    verify_case(case, wide, bar, out_tolerance=bar)
    forward, backward = scheduled_schedules(case, stencil=True)
    exact = case.inputs[4:6]  # float64's lse and delta
    run = functools.partial(run_scheduled_kind, emulated_library, case, result_type=np.float32)
    given = {"out": wide["out"], "dq": run("dq", schedule=forward, lse=exact[0], delta=exact[1],
                                           stencil_pairs=pairs["forward"])[0]}  # fmt: skip
    given["dk"], given["dv"] = run("dkv", schedule=backward, lse=exact[0], delta=exact[1],
                                   stencil_pairs=pairs["backward"])  # fmt: skip
    for name, walk in [("out", "forward"), ("dq", "forward"), ("dk", "backward"), ("dv", "backward")]:
        walked = np.zeros(case.expected[name].shape[1], bool)
        walked[pairs[walk][:, 0]] = walked[pairs[walk][:, 0] + 1] = True
        error = np.abs(given[name] - case.expected[name]).max(axis=(0, 2, 3, 4)) / np.abs(case.expected[name]).max()
        assert (error[walked] <= 2e-5).all(), f"{name}: stencil rows {error[walked]}"
        assert error[~walked].max() > 2e-5, f"{name}: the scheduled kernels' rows are within float32 round-off"
    narrow = run_scheduled_case(emulated_library, case, DTYPES[dtype][1], stencil=True)
    for name in ("out", "dq", "dk", "dv"):
        assert narrow[name].tobytes() == wide[name].astype(narrow[name].dtype).tobytes(), name


@pytest.mark.parametrize("logit_gain", [1.0 / 64, 16.0, 64.0])
def test_the_stencil_forward_is_float32_accurate_at_any_logit_spread(emulated_library, rng, logit_gain):
    """The stencil forward moves a point's running maximum only where a logit passes it by more than the rescale
    slack: with logits nearly equal (q / 64: no move after a point's first neighbour), spread over tens of log2
    units (q times 16: moves at irregular neighbours, different for the points of a warp) and over hundreds (q times
    64: rises past float32's range above a maximum that did not move), out and lse of the stencil rows stay within
    float32 round-off of float64."""
    plan = STENCIL_PLANS["self-17x72"]()
    pairs = _ffi.stencil_schedule(plan, "forward").pairs
    case = prepare_case(rng, plan, 1, 2, 64, 64, "bfloat16", logit_gain=logit_gain)
    forward, _ = scheduled_schedules(case, stencil=True)
    out, lse = run_scheduled_kind(emulated_library, case, "forward", np.float32, forward, stencil_pairs=pairs)
    rows = stencil_rows_of(pairs, plan.nlat_out)
    expected_out, expected_lse = case.expected["out"][:, rows], case.expected["lse"][:, rows]
    out_error = np.abs(out[:, rows] - expected_out).max() / np.abs(expected_out).max()
    lse_error = np.abs(lse[:, rows] - expected_lse).max() / np.abs(expected_lse).max()
    assert out_error <= 2e-5 and lse_error <= 2e-6, (out_error, lse_error)


@pytest.mark.parametrize(("plan_name", "d", "dtype"), SCHEDULED_STENCIL_CASES,
                         ids=[f"{p}-d{d}-{t}" for p, d, t in SCHEDULED_STENCIL_CASES])  # fmt: skip
def test_scheduled_dq_forms_delta_beside_the_stencil_rows(emulated_library, rng, plan_name, d, dtype):
    """The scheduled dq that forms delta on the schedule without the stencil rows' tiles, from the forward's float32
    out and dlse (not zero), then the stencil dq forming those rows' delta into the same results from its own
    probabilities: every element of both written (NaN-poisoned first); on the scheduled rows delta within
    FORMED_DELTA_TOLERANCE of float64 and dq the bits of the scheduled dq given that delta, on the stencil rows both
    within STENCIL_FORMED_TOLERANCE of float64's delta and of the stencil dq given that delta."""
    plan = STENCIL_PLANS[plan_name]()
    pairs = _ffi.stencil_schedule(plan, "forward").pairs
    case = prepare_case(rng, plan, 2, 2, d, d, dtype)
    forward, _ = scheduled_schedules(case, stencil=True)
    run = functools.partial(run_scheduled_kind, emulated_library, case, result_type=np.float32, schedule=forward,
                            stencil_pairs=pairs)  # fmt: skip
    out, lse = run("forward")
    dlse = rng.standard_normal(lse.shape).astype(np.float32)
    dq, delta = run_scheduled_dq_forming_delta(emulated_library, case, np.float32, forward, lse, out, dlse,
                                               stencil_pairs=pairs)  # fmt: skip
    (dq_given, _) = run("dq", lse=lse, delta=delta)
    verify_dq_forming_delta(case, out, dlse, {"dq": dq, "delta": delta, "dq_given_delta": dq_given},
                            stencil_rows_of(pairs, plan.nlat_out))  # fmt: skip


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("dtype", SIXTEEN_BIT_DTYPES)
def test_scheduled_results_in_the_activations_type_are_the_rounded_float32_ones(emulated_library, rng, dtype,
                                                                                 head_dim):
    """out, dq, dk and dv of the activations' type hold the bits of the float32 results rounded to nearest, and
    a second run gives the same bits (no atomics: every result row is written once by its block)."""
    case = prepare_case(rng, PLANS["up"](), 2, 2, head_dim, head_dim, dtype)
    wide = run_scheduled_case(emulated_library, case)
    narrow = run_scheduled_case(emulated_library, case, DTYPES[dtype][1])
    for name in ("out", "dq", "dk", "dv"):
        assert narrow[name].tobytes() == wide[name].astype(narrow[name].dtype).tobytes(), name
    again = run_scheduled_case(emulated_library, case)
    for name, result in wide.items():
        assert result.tobytes() == again[name].tobytes(), name


# ------------------------------------------------------------------ ring targets (arc kernels between ring grids)


RING_CASES = [  # plan, (Dk, Dv), dtype: the vector path at 32 and 64, the general one at (5, 7)
    ("healpix-self", (32, 32), "float32"),
    ("healpix-self", (64, 64), "bfloat16"),
    ("latlon-3:2", (64, 64), "float32"),
    ("latlon-3:2", (5, 7), "float16"),
    ("octahedral-healpix", (32, 32), "bfloat16"),
    ("octahedral-healpix", (5, 7), "float32"),
]


@pytest.mark.parametrize(("plan_name", "dims", "dtype"), RING_CASES,
                         ids=[f"{p}-dk{d[0]}-dv{d[1]}-{t}" for p, d, t in RING_CASES])  # fmt: skip
def test_ring_kernels_match_float64(emulated_library, rng, plan_name, dims, dtype):
    case = prepare_ring_case(rng, RING_PLANS[plan_name](), 2, 2, *dims, dtype)
    verify_ring_case(case, run_ring_case(emulated_library, case))


# The scheduled kernels on ring block schedules: HEALPix self-attention (8-ring tiles), 3:2 and octahedral -> HEALPix
# (window and ring stagings, RING chunks of their own modulus), at every scheduled head dim.
RING_SCHEDULED_CASES = [
    ("healpix-self", 64, "bfloat16"),
    ("latlon-3:2", 32, "float16"),
    ("octahedral-healpix", 128, "bfloat16"),
]


@pytest.mark.parametrize(("plan_name", "dim", "dtype"), RING_SCHEDULED_CASES,
                         ids=[f"{p}-d{d}-{t}" for p, d, t in RING_SCHEDULED_CASES])  # fmt: skip
def test_ring_scheduled_kernels_match_float64(emulated_library, rng, plan_name, dim, dtype):
    """The scheduled forward, the dq that forms delta and dk/dv on ring block schedules, against float64:
    every element written, out and the gradients within the 16-bit bar (P and dS rounded), lse at float32."""
    case = prepare_ring_case(rng, RING_PLANS[plan_name](), 2, 2, dim, dim, dtype)
    results = run_ring_scheduled_case(emulated_library, case)
    verify_ring_case(case, results, SCHEDULED_TOLERANCE[dtype])
    error = np.max(np.abs(results["lse"] - case.expected["lse"]))
    assert error <= 1e-4, f"lse: absolute error {error:.1e}"


def test_ring_scheduled_kernels_with_corrupted_schedules_stay_in_bounds(emulated_library, rng):
    """A ring schedule in device memory is not checked by the host: garbage runs, tile offsets, chunks (flags and
    their ring modulus included) or records must never index outside the arrays (the sanitized run); with only the
    records garbage, every result element is still written."""
    case = prepare_ring_case(rng, RING_PLANS["latlon-3:2"](), 1, 1, 32, 32, "bfloat16")
    big = np.iinfo(np.int32).max
    schedules = dict(zip(("forward", "backward"), ring_schedules(case.plan)))
    lse, delta = case.lse, case.delta
    out = np.asarray(case.expected["out"], np.float32)
    for kind, walk in (("forward", "forward"), ("dq", "forward"), ("dkv", "backward")):
        for name in ("tiles", "tile_offsets", "chunks", "records"):
            table = getattr(schedules[walk], name)
            garbage = rng.integers(-big, big, size=table.shape, dtype=np.int64).astype(np.int32)
            garbage.reshape(-1)[: garbage.size // 2] %= 64  # plausible small values too
            schedule = schedules[walk]._replace(**{name: garbage})
            forming = (out, np.zeros_like(lse)) if kind == "dq" else None
            results = run_ring_scheduled_kind(emulated_library, case, kind, schedule, lse, delta, forming)
            if name == "records":
                assert not any(np.isnan(r).any() for r in results), (kind, name)


def test_ring_kernels_with_corrupted_tables_stay_in_bounds(emulated_library, rng):
    """Ring tables in device memory are not checked by the host: garbage must never index outside the arrays (the
    sanitized run). With the rings intact and garbage patterns or arcs, every result element is still written."""
    case = prepare_ring_case(rng, RING_PLANS["octahedral-healpix"](), 1, 1, 32, 32, "float32")
    big = np.iinfo(np.int32).max
    for kind in ("forward", "dq", "dkv"):
        walk = "keys" if kind == "dkv" else "queries"
        for corrupt in range(4):  # walk_rings, ring_order, pattern_offsets, pattern_arcs
            plan_tables, sizes = _ffi.ring_walk_tables(case.plan, walk)
            tables = [np.array(t, copy=True) for t in plan_tables]
            tables[corrupt] = rng.integers(-big, big, size=tables[corrupt].shape, dtype=np.int64).astype(np.int32)
            flat = tables[corrupt].reshape(-1)
            flat[: flat.size // 2] %= 64  # small values too: plausible indices (the rest huge or negative)
            results = run_ring_kind(emulated_library, case, kind, tables=(_ffi.RingWalkTables(*tables), sizes))
            if corrupt >= 2:  # garbage rings or ring order may leave points unvisited: only bounds hold there
                assert not any(np.isnan(result).any() for result in results if result is not None), corrupt


@pytest.mark.parametrize("dtype", SIXTEEN_BIT_DTYPES)
def test_the_stencil_dq_forming_delta_stays_float32_accurate_beside_a_key_offset(emulated_library, rng, dtype):
    """Values smooth in position (dP - delta nearly cancels) and a key channel common to every key far above the
    others (k_0 = -31, the rest about 1; every logit about -120, so that lse carries float32 round-off): the
    stencil dq that forms delta from its own probabilities holds its rows' dq within 1e-4 of float64, given
    float32 lse as the op gives it (a delta not divided by the probabilities' own sum: 7e-4 to 1e-3)."""
    plan = STENCIL_PLANS["self-17x72"]()
    pairs = _ffi.stencil_schedule(plan, "forward").pairs
    case = prepare_case(rng, plan, 2, 2, 64, 64, dtype, smooth_values=True, logit_offset=-120.0)
    assert np.abs(case.inputs[1][..., 0].astype(np.float32)).min() > 30, "the keys must share a large channel"
    forward, _ = scheduled_schedules(case, stencil=True)
    out, lse = run_scheduled_kind(emulated_library, case, "forward", np.float32, forward, stencil_pairs=pairs)
    dq, _ = run_scheduled_dq_forming_delta(emulated_library, case, np.float32, forward, lse, out,
                                           np.zeros_like(lse), stencil_pairs=pairs)  # fmt: skip
    rows = stencil_rows_of(pairs, plan.nlat_out)
    expected = case.expected["dq"]
    error = np.abs(dq - expected).max(axis=(0, 2, 3, 4)) / np.abs(expected).max()
    assert (error[rows] <= 1e-4).all(), f"stencil rows: {error[rows].max():.2e}"
