"""The CUDA kernels of ``cuda/gpu`` compiled for the host and run on the CPU.

``tests/cuda_emulation`` emulates the few device facilities the kernels use (thread
indices, ``__ldg``, ``__shfl_xor_sync``, dynamic shared memory, ``cudaLaunchKernel``), so
the kernels *and their launchers* (variant dispatch, launch shapes, work decomposition) run
unchanged on a machine without a GPU. Each test compares all three targets with a dense
float64 reference built from the plan's arcs: the arc walks and window clipping, padding,
tails, the vector fast path (head dims 32/64/128) and the general path (any head dims),
16-bit widening, and that every result element is written (results start as NaN).

Timing and the GPU memory model are out of scope here: those are the H200 suite's
(``tests/gpu_sanitizer.py`` and the GPU tests).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from jax_s2attn.plan import NeighborhoodPlan

ROOT = Path(__file__).resolve().parents[1]
EMULATION = ROOT / "tests" / "cuda_emulation"
KERNEL_SOURCES = [ROOT / "cuda" / "gpu" / "nbhd_attn_fwd.cu", ROOT / "cuda" / "gpu" / "nbhd_attn_bwd.cu"]

# dtype name -> (ActivationType of nbhd_attn_kernels.h, numpy storage type)
DTYPES = {"float32": (0, np.float32), "bfloat16": (1, ml_dtypes.bfloat16), "float16": (2, np.float16)}
FORWARD, DQ, DKV = 0, 1, 2
# The kernels accumulate in float32 and the reference sees the same (rounded) inputs, so the
# bar is float32 round-off for every storage dtype.
TOLERANCE = 2e-5


def _cuda_include_dir() -> Path | None:
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parents[1]))
    for root in filter(None, candidates):
        if (Path(root) / "include" / "cuda_runtime.h").is_file():
            return Path(root) / "include"
    return None


def _build(out: Path, defines: tuple[str, ...] = ()):
    """Compiles the kernels and the emulation runtime into ``out`` and loads the library."""
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    include = _cuda_include_dir()
    if cxx is None or include is None:
        pytest.skip("needs a host C++20 compiler and the CUDA headers (nvcc's include directory)")
    flags = ["-std=c++20", "-O1", "-fPIC", f"-I{ROOT / 'cuda'}", f"-I{include}", *(f"-D{d}" for d in defines)]
    kernel_flags = [*flags, "-include", str(EMULATION / "emulation.h"), "-x", "c++"]
    jobs = [[cxx, *kernel_flags, "-c", str(src), "-o", str(out / (src.stem + ".o"))] for src in KERNEL_SOURCES]
    jobs.append([cxx, *flags, "-c", str(EMULATION / "emulation.cc"), "-o", str(out / "emulation.o")])
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda cmd: subprocess.run(cmd, capture_output=True, text=True), jobs))
    for cmd, result in zip(jobs, results):
        assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr}"
    library = out / "libs2attn_emulated.so"
    link = subprocess.run(
        [cxx, "-shared", *[str(p) for p in sorted(out.glob("*.o"))], "-o", str(library)], capture_output=True, text=True
    )
    assert link.returncode == 0, link.stderr
    lib = ctypes.CDLL(str(library))
    lib.EmuRun.restype = ctypes.c_int
    return lib


@pytest.fixture(scope="session")
def emulator(tmp_path_factory):
    """The kernels built as a host shared library (ctypes), or a skip where that cannot be done."""
    return _build(tmp_path_factory.mktemp("cuda_emulation"))


def _pointer(a):
    return None if a is None else ctypes.c_void_p(a.ctypes.data)


def _launch(lib, target, dtype, sizes, scale, q, k, v, dout, lse, delta, window, row_order, table, weights, r0, r1):
    status = lib.EmuRun(
        ctypes.c_int(target), ctypes.c_int(DTYPES[dtype][0]),
        *map(_pointer, (q, k, v, dout, lse, delta, window, row_order, table.offsets, table.arcs, weights, r0, r1)),
        _pointer(np.asarray([*sizes, table.residues, table.shift, table.arcs.shape[0]], np.int64)),
        ctypes.c_float(scale),
    )  # fmt: skip
    assert status == 0, f"launcher returned cudaError {status}"


def _misaligned(a: np.ndarray) -> np.ndarray:
    """A copy of ``a`` aligned to its element size but not to 16 bytes."""
    raw = np.empty(a.nbytes + 32, np.uint8)
    start = (16 - raw.ctypes.data % 16) % 16 + a.itemsize
    out = raw[start : start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def _neighbour_mask(plan: NeighborhoodPlan) -> np.ndarray:
    """Dense ``[query, key]`` membership (global flat points) from the plan's forward arcs."""
    table = plan.forward_arcs
    mask = np.zeros((plan.nlat_out * plan.nlon_out, plan.nlat_in * plan.nlon_in), bool)
    for h in range(plan.nlat_out):
        for w in range(plan.nlon_out):
            mask[h * plan.nlon_out + w, table.expand(h * table.residues + w % table.residues, w // table.residues)] = 1
    return mask


def _logsumexp(x):
    m = x.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))[..., 0]


def _in_window(shape, window) -> np.ndarray:
    inside = np.zeros(shape, bool)
    inside[window[0] : window[0] + window[2], window[1] : window[1] + window[3]] = True
    return inside.reshape(-1)


def _relative(actual, expected) -> float:
    scale = np.abs(expected).max() if expected.size else 0.0
    return float(np.abs(actual - expected).max() / scale) if scale > 0 else float(np.abs(actual).max(initial=0.0))


def _check_case(
    lib, rng, plan, batch, heads, dk, dv, dtype, q_window=None, k_window=None, padding=(0, 0, 0, 0), misaligned=False
):
    """Runs forward, dq and dkv on local blocks of the grids and checks them against float64.

    ``q_window``/``k_window`` are the real blocks ``(lat0, lon0, nlat, nlon)`` of the global
    grids; ``padding`` adds garbage rows/columns ``(q_lat, q_lon, k_lat, k_lon)`` to the local
    arrays. Results of padding points must be zeros (lse -inf); everything must be written.
    """
    (nlat_q, nlon_q), (nlat_k, nlon_k) = plan.out_shape, plan.in_shape
    q_window = q_window or (0, 0, nlat_q, nlon_q)
    k_window = k_window or (0, 0, nlat_k, nlon_k)
    storage = DTYPES[dtype][1]
    scale = 1.0 / np.sqrt(max(dk, 1))
    q, dout = (rng.standard_normal((batch, nlat_q, nlon_q, heads, d)).astype(storage) for d in (dk, dv))
    k, v = (rng.standard_normal((batch, nlat_k, nlon_k, heads, d)).astype(storage) for d in (dk, dv))

    # Float64 reference on the global grids, from the same rounded inputs.
    Q, G = (a.astype(np.float64).reshape(batch, nlat_q * nlon_q, heads, -1) for a in (q, dout))
    K, V = (a.astype(np.float64).reshape(batch, nlat_k * nlon_k, heads, -1) for a in (k, v))
    log_w = np.log(np.repeat(plan.quad_weights.astype(np.float64), nlon_k))
    logits = np.where(_neighbour_mask(plan), scale * np.einsum("bqhd,bkhd->bhqk", Q, K) + log_w, -np.inf)
    keys_in = _in_window((nlat_k, nlon_k), k_window)
    queries_in = _in_window((nlat_q, nlon_q), q_window)
    windowed = np.where(keys_in, logits, -np.inf)  # forward: keys of the window only
    lse_window = _logsumexp(windowed)
    with np.errstate(invalid="ignore"):
        out_ref = np.einsum("bhqk,bkhd->bqhd", np.nan_to_num(np.exp(windowed - lse_window[..., None])), V)
    lse_global = _logsumexp(logits)  # backward: probabilities from the global lse
    p = np.exp(logits - lse_global[..., None])
    delta = (G * np.einsum("bhqk,bkhd->bqhd", p, V)).sum(-1)
    ds = p * (np.einsum("bqhd,bkhd->bhqk", G, V) - delta.transpose(0, 2, 1)[..., None])
    dq_ref = scale * np.einsum("bhqk,bkhd->bqhd", np.where(keys_in, ds, 0.0), K)
    dk_ref = scale * np.einsum("bhqk,bqhd->bkhd", np.where(queries_in[:, None], ds, 0.0), Q)
    dv_ref = np.einsum("bhqk,bqhd->bkhd", np.where(queries_in[:, None], p, 0.0), G)

    def grid(a, nlat, nlon):  # [batch, points, heads, ...] -> [batch, nlat, nlon, heads, ...]
        return a.reshape(batch, nlat, nlon, *a.shape[2:])

    def block(a, window):  # the window's block of a global grid array
        return a[:, window[0] : window[0] + window[2], window[1] : window[1] + window[3]]

    def local(a, window, pad_lat, pad_lon, dtype_=None):  # window block + garbage padding
        real_block = block(a, window)
        shape = (batch, window[2] + pad_lat, window[3] + pad_lon, *real_block.shape[3:])
        out = (3 * rng.standard_normal(shape)).astype(dtype_ or a.dtype)
        out[:, : window[2], : window[3]] = real_block
        return out

    def real(a, window):  # the real block of a local array
        return a[:, : window[2], : window[3]]

    def padding_of(a, window):
        return np.concatenate([a[:, window[2] :].reshape(-1), a[:, : window[2], window[3] :].reshape(-1)])

    q_pad, k_pad = padding[:2], padding[2:]
    q_l, dout_l = (local(a, q_window, *q_pad) for a in (q, dout))
    k_l, v_l = (local(a, k_window, *k_pad) for a in (k, v))
    lse_l = local(grid(lse_global.transpose(0, 2, 1), nlat_q, nlon_q), q_window, *q_pad, np.float32)
    delta_l = local(grid(delta, nlat_q, nlon_q), q_window, *q_pad, np.float32)
    if misaligned:  # the vector path needs 16-byte aligned activations: these take the general path
        q_l, k_l, v_l, dout_l = map(_misaligned, (q_l, k_l, v_l, dout_l))
    nq_lat, nq_lon, nk_lat, nk_lon = *q_l.shape[1:3], *k_l.shape[1:3]
    window = np.asarray([*q_window, *k_window], np.int32)
    full_q = q_l.shape[1:3] == (nlat_q, nlon_q)
    full_k = k_l.shape[1:3] == (nlat_k, nlon_k)
    fwd_order = plan.forward_arcs.row_order if full_q else rng.permutation(nq_lat).astype(np.int32)
    bwd_order = plan.backward_arcs.row_order if full_k else rng.permutation(nk_lat).astype(np.int32)
    sizes = [batch, heads, dk, dv, nq_lat, nq_lon, nk_lat, nk_lon, nlat_q, nlon_q, nlat_k, nlon_k]
    weights = plan.quad_weights
    args = (q_l, k_l, v_l, dout_l, lse_l, delta_l, window)

    out = np.full((batch, nq_lat, nq_lon, heads, dv), np.nan, np.float32)
    lse = np.full((batch, nq_lat, nq_lon, heads), np.nan, np.float32)
    _launch(lib, FORWARD, dtype, sizes, scale, *args[:3], None, None, None, window, fwd_order, plan.forward_arcs,
            weights, out, lse)  # fmt: skip
    dq = np.full(q_l.shape, np.nan, np.float32)
    _launch(lib, DQ, dtype, sizes, scale, *args, fwd_order, plan.forward_arcs, weights, dq, None)
    dk_, dv_ = np.full(k_l.shape, np.nan, np.float32), np.full(v_l.shape, np.nan, np.float32)
    _launch(lib, DKV, dtype, sizes, scale, *args, bwd_order, plan.backward_arcs, weights, dk_, dv_)

    for name, result in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk_), ("dv", dv_)):
        assert not np.isnan(result).any(), f"{name}: some elements were never written"
    lse_expected = block(grid(lse_window.transpose(0, 2, 1), nlat_q, nlon_q), q_window)
    finite = np.isfinite(lse_expected)
    assert np.array_equal(np.isfinite(real(lse, q_window)), finite), "lse: -inf (no neighbour) pattern differs"
    assert np.abs(real(lse, q_window)[finite] - lse_expected[finite]).max(initial=0.0) <= TOLERANCE * max(
        1.0, np.abs(lse_expected[finite]).max(initial=0.0)
    )
    checks = [
        ("out", real(out, q_window), out_ref, nlat_q, nlon_q, q_window),
        ("dq", real(dq, q_window), dq_ref, nlat_q, nlon_q, q_window),
        ("dk", real(dk_, k_window), dk_ref, nlat_k, nlon_k, k_window),
        ("dv", real(dv_, k_window), dv_ref, nlat_k, nlon_k, k_window),
    ]
    for name, actual, expected, nlat, nlon, win in checks:
        expected = block(grid(expected, nlat, nlon), win)
        error = _relative(actual, expected)
        assert error <= TOLERANCE, f"{name}: relative error {error:.2e} against float64"
    results = (("out", out, q_window), ("dq", dq, q_window), ("dk", dk_, k_window), ("dv", dv_, k_window))
    for name, result, win in results:
        assert (padding_of(result, win) == 0).all(), f"{name}: padding points must be zero"
    assert (padding_of(lse, q_window) == -np.inf).all(), "lse: padding points must be -inf"


PLANS = {
    "self": lambda: NeighborhoodPlan((8, 16), (8, 16), theta_cutoff=0.5),  # full rings, wrapping arcs
    "wide": lambda: NeighborhoodPlan((10, 22), (10, 22), theta_cutoff=1.0),  # runs of 5..22: groups + tails
    "down": lambda: NeighborhoodPlan((8, 16), (4, 8), theta_cutoff=0.6),  # gather, shift 2
    "up": lambda: NeighborhoodPlan((4, 8), (8, 16), theta_cutoff=0.6),  # scatter, residues 2
    "legendre-gauss": lambda: NeighborhoodPlan((7, 12), (7, 12), "legendre-gauss", "legendre-gauss"),
    "lat-only": lambda: NeighborhoodPlan((12, 12), (6, 12), theta_cutoff=0.5),
    "lon-only": lambda: NeighborhoodPlan((6, 12), (6, 6), theta_cutoff=0.7),
}
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
    _check_case(emulator, rng, PLANS[plan_name](), 2, heads, *dims, dtype)


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
    _check_case(emulator, rng, PLANS["self"](), 2, 2, *dims, dtype, q_window, k_window, padding)


@pytest.mark.parametrize("plan_name", ["down", "up"])
def test_resampling_windows(emulator, rng, plan_name):
    plan = PLANS[plan_name]()
    (nlat_q, nlon_q), (nlat_k, nlon_k) = plan.out_shape, plan.in_shape
    q_window = (1, 2, nlat_q - 2, nlon_q - 4)
    k_window = (0, nlon_k // 2, nlat_k - 1, nlon_k // 2)
    _check_case(emulator, rng, plan, 1, 2, 64, 64, "float32", q_window, k_window, (1, 1, 1, 1))


@pytest.mark.parametrize("dims", [(4, 0), (0, 4), (1, 1), (33, 31), (64, 32), (256, 256)])
def test_unusual_head_dims(emulator, rng, dims):
    _check_case(emulator, rng, PLANS["self"](), 1, 2, *dims, "float32")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_unaligned_buffers_take_the_general_path(emulator, rng, dtype):
    _check_case(emulator, rng, PLANS["self"](), 2, 2, 64, 64, dtype, misaligned=True)


def test_empty_batch_launches_nothing(emulator):
    plan = PLANS["self"]()
    q = np.zeros((0, 8, 16, 1, 64), np.float32)
    out = np.zeros((0, 8, 16, 1, 64), np.float32)
    lse = np.zeros((0, 8, 16, 1), np.float32)
    window = np.asarray([0, 0, 8, 16, 0, 0, 8, 16], np.int32)
    sizes = [0, 1, 64, 64, 8, 16, 8, 16, 8, 16, 8, 16]
    table = plan.forward_arcs
    _launch(emulator, FORWARD, "float32", sizes, 0.125, q, q, q, None, None, None, window, table.row_order, table,
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
        _launch(emulator, FORWARD, "float32", sizes, 0.125, q, q, q, None, None, None,
                np.asarray(window, np.int32), table.row_order, broken, plan.quad_weights, out, lse)  # fmt: skip
        assert not np.isnan(out).any() and not np.isnan(lse).any()


def test_grids_past_the_block_limit_are_split(tmp_path, rng):
    """More than 65535 (batch x head) indices or rows: the launchers split the grid into several
    launches (checked here with a limit of 2 blocks in y and z)."""
    lib = _build(tmp_path, defines=("S2ATTN_MAX_GRID_YZ=2",))
    _check_case(lib, rng, PLANS["down"](), 3, 3, 32, 32, "float32")
    _check_case(lib, rng, PLANS["down"](), 2, 1, 5, 7, "bfloat16")
