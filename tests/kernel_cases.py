"""Kernel-level cases of the CUDA targets, shared by ``test_cuda_emulated.py`` (host emulation)
and ``gpu_kernel_sanitizer.py`` (the real GPU): inputs on local blocks of the grids, a dense
float64 reference built from the plan's arcs, the three launches, and the checks.

The same cases run on the arc-segment kernels (``nbhd_attn_*.cu``, walking the plan's arc tables) and on the
scheduled tensor-core kernels (``sched_attn_*.cu``, walking the plan's block schedules; 16-bit activations with
Dk == Dv in {32, 64, 128}), the latter also beside the stencil targets (``stencil_attn_*.cu``, walking the
segment tables' rows of the plan's stencil pairs).

A *launch* callable runs one arc or stencil target through ``tests/cuda_emulation/run_target.cc``::

    launch(target, dtype, sizes, scale, q, k, v, dout, lse, delta, window, row_order, table,
           weights, result0, result1[, result2], stencil_pairs=None)

with numpy inputs (``None`` for unused ones), ``table`` an ArcTable (arc targets) or a
SegmentTable (stencil targets), and NaN-filled numpy results that it overwrites in place
(``result2``: the stencil forward's out in the activations' type, in place of ``result0``).
The scheduled targets run through :func:`run_scheduled_kind` and the functions after it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np

from jax_s2attn import native_status
from jax_s2attn._native import kernel_limits
from jax_s2attn.grids import precompute_latitudes, precompute_longitudes
from jax_s2attn.parallel.layout import schedules_of_window
from jax_s2attn.grids import RingGrid
from jax_s2attn.ops import _ffi
from jax_s2attn.plan import ArcTable, NeighborhoodPlan, SegmentTable
from jax_s2attn.ring_plan import RingPlan
from jax_s2attn.ring_schedule import ring_block_schedule
from jax_s2attn.schedule import FULL, RING, RING_POINTS_SHIFT, BlockSchedule

ROOT = Path(__file__).resolve().parents[1]
KERNEL_SOURCES = [
    ROOT / "cuda" / "gpu" / name
    for name in ("nbhd_attn_fwd.cu", "nbhd_attn_bwd.cu", "stencil_attn_fwd.cu", "stencil_attn_dq.cu",
                 "stencil_attn_dkv.cu", "sched_attn_fwd.cu", "sched_attn_dq.cu", "sched_attn_dkv.cu",
                 "delta_kernel.cu")
]
RUN_TARGET_SHIM = ROOT / "tests" / "cuda_emulation" / "run_target.cc"

# dtype name -> (ActivationType of nbhd_attn_kernels.h, numpy storage type)
DTYPES = {"float32": (0, np.float32), "bfloat16": (1, ml_dtypes.bfloat16), "float16": (2, np.float16)}
# Targets of run_target.cc's RunNbhdAttnTarget: the arc kernels' forward, dq and dkv; the stencil targets' are 3
# further.
FORWARD, DQ, DKV = 0, 1, 2
STENCIL_TARGET_OFFSET = 3
# The stencil dq that forms delta itself (run_target.cc's RunStencilDqFormingDelta): a launch of it takes dlse in
# place of delta and gives (dq, delta), delta from its own probabilities.
STENCIL_DQ_FORMING_DELTA = 6
# The scheduled dq's delta (formed from the forward's float32 out) against float64, per row relative to
# sum |dout * out| + |dlse| (float32 sums of Dv terms).
FORMED_DELTA_TOLERANCE = 1e-6
# The stencil dq's delta = sum_j p_j (dout . v_j) / sum_j p_j - dlse and its dq = scale (sum_j p_j (dout . v_j) k_j -
# delta sum_j p_j k_j), float32 sums over the neighbours: against float64's delta (whose p sum to one) and the dq
# given that delta, per row relative to |dout| max_j |v_j| + |dlse| (which bounds every |p_j dout . v_j| sum), times
# scale max |k| for dq.
STENCIL_FORMED_TOLERANCE = 1e-5
# The arc kernels accumulate in float32 and the reference sees the same (rounded) inputs, so
# the bar is float32 round-off for every storage dtype.
TOLERANCE = 2e-5
# The scheduled kernels also round P and dS to the 16-bit storage type before the P.V and dS.K/Q
# products (as flash-attention kernels do): the bar is that type's round-off.
SCHEDULED_TOLERANCE = {"bfloat16": 1e-2, "float16": 2e-3}
# out (float32) is also what the op forms delta = rowsum(dout * out) from: the arc kernels keep it far inside the
# 16-bit bar, or smooth fields push dq and dk past it.
OUT_TOLERANCE = 1e-4

PLANS = {
    "self": lambda: NeighborhoodPlan((8, 16), (8, 16), theta_cutoff=0.5),  # full rings, wrapping arcs
    "wide": lambda: NeighborhoodPlan((10, 22), (10, 22), theta_cutoff=1.0),  # runs of 5..22: groups + tails
    "down": lambda: NeighborhoodPlan((8, 16), (4, 8), theta_cutoff=0.6),  # gather, shift 2
    "up": lambda: NeighborhoodPlan((4, 8), (8, 16), theta_cutoff=0.6),  # scatter, residues 2
    "up3": lambda: NeighborhoodPlan((6, 8), (12, 24), theta_cutoff=0.7),  # scatter, residues 3
    "down3": lambda: NeighborhoodPlan((8, 12), (4, 4), theta_cutoff=0.9),  # gather, shift 3; dk/dv: residues 3
    "legendre-gauss": lambda: NeighborhoodPlan((7, 12), (7, 12), "legendre-gauss", "legendre-gauss"),
    "lat-only": lambda: NeighborhoodPlan((12, 12), (6, 12), theta_cutoff=0.5),
    "lon-only": lambda: NeighborhoodPlan((6, 12), (6, 6), theta_cutoff=0.7),
}

# Rows of several scheduled tiles (16 longitudes) and arcs wider than one staged chunk (32 columns); none of the
# longitude counts is a multiple of 32.
LONG_ROW_PLANS = {
    "self-72": lambda: NeighborhoodPlan((8, 72), (8, 72), theta_cutoff=0.9),  # partial arcs of 1..31
    "up-100": lambda: NeighborhoodPlan((4, 50), (8, 100), theta_cutoff=0.6),  # residues 2
    "down-100": lambda: NeighborhoodPlan((8, 100), (4, 50), theta_cutoff=0.6),  # shift 2
    "rings-72": lambda: NeighborhoodPlan((6, 72), (6, 72), theta_cutoff=2.0),  # mostly whole rings
}

# Plans whose walks leave row pairs to the stencil kernels (jax_s2attn.plan.stencil_pairs: one residue,
# arcs within 3 longitudes): rings longer than a block's longitudes at every head dim (64, 32, 16) with a tail,
# rings shorter than the staged window (wrapped many times), more key rows than query rows, Legendre-Gauss.
def _with_stencil_rows(build):
    """``build`` checked to leave rows to the stencil kernels: the plan takes their shape from the installed
    native module, so a run that imports the checkout (no compiled module) would test no stencil rows."""

    def checked():
        plan = build()
        assert plan.forward_stencil_pairs.size and plan.backward_stencil_pairs.size, (
            "the plan leaves no rows to the stencil kernels: import jax_s2attn from its install "
            f"(jax_s2attn.native_status(): {native_status()!r})"
        )
        return plan

    return checked


STENCIL_PLANS = {
    name: _with_stencil_rows(build)
    for name, build in {
        "self": PLANS["self"],
        "legendre-gauss": PLANS["legendre-gauss"],
        "self-17x72": lambda: NeighborhoodPlan((17, 72), (17, 72)),
        "self-9x4": lambda: NeighborhoodPlan((9, 4), (9, 4)),
        "lat-10x40-9x40": lambda: NeighborhoodPlan((10, 40), (9, 40), theta_cutoff=0.2),
    }.items()
}

# Windows (prepare_case keyword arguments) of shards whose rows start mid-ring and span several tiles.
LONG_ROW_WINDOWS = {
    # queries over two blocks; keys up to the seam
    "self-72": {"q_window": (1, 3, 6, 69), "k_window": (0, 40, 8, 32), "padding": (1, 2, 1, 3)},
    # an R = 2 walk from an odd longitude
    "up-100": {"q_window": (1, 7, 6, 81), "k_window": (0, 13, 4, 37), "padding": (0, 3, 1, 0)},
}

Launch = Callable[..., None]


def neighbour_mask(plan: NeighborhoodPlan) -> np.ndarray:
    """Dense ``[query, key]`` membership (global flat points) from the plan's forward arcs."""
    table = plan.forward_arcs
    mask = np.zeros((plan.nlat_out * plan.nlon_out, plan.nlat_in * plan.nlon_in), bool)
    for h in range(plan.nlat_out):
        for w in range(plan.nlon_out):
            mask[h * plan.nlon_out + w, table.expand(h * table.residues + w % table.residues, w // table.residues)] = 1
    return mask


def psi_pairs(plan: NeighborhoodPlan) -> tuple[np.ndarray, np.ndarray]:
    """Global flat ``(query, key)`` indices of every pair, from torch-harmonics' psi CSR."""
    rows = np.repeat(np.arange(plan.csr_offsets.size - 1), np.diff(plan.csr_offsets))[:, None]
    if plan.direction == "gather":  # psi rows are query rows; columns the keys of longitude 0
        h_in, w_in = np.divmod(plan.csr_columns[:, None], plan.nlon_in)
        w_out = np.arange(plan.nlon_out)[None, :]
        query = rows * plan.nlon_out + w_out
        key = h_in * plan.nlon_in + (w_in + plan.pscale * w_out) % plan.nlon_in
    else:  # psi rows are key rows; columns the queries of key longitude 0
        h_out, w_out = np.divmod(plan.csr_columns[:, None], plan.nlon_out)
        w_in = np.arange(plan.nlon_in)[None, :]
        query = h_out * plan.nlon_out + (w_out + plan.pscale * w_in) % plan.nlon_out
        key = rows * plan.nlon_in + w_in
    return np.broadcast_to(query, key.shape).ravel(), np.broadcast_to(key, query.shape).ravel()


def check_nan_poisoning(
    plan: NeighborhoodPlan, out, lse, point: int, operand: str, channel: int = 5, value_confined: bool = True
) -> None:  # fmt: skip
    """Asserts that a NaN placed in channel ``channel`` of global query (``operand="q"``), key (``"k"``) or value
    (``"v"``) point ``point`` made exactly the query rows that see it NaN (that query; every query with that key
    as a neighbour): their ``out`` and ``lse`` (a query or key), or their ``out`` in that channel (a value, which
    no score reads), and left everything else finite. Without ``value_confined`` a value's NaN may also reach
    that channel of queries that do not see it (the tensor-core kernels' P·V multiplies a chunk's every column,
    0 · NaN for the columns outside a query's arcs); lse and the other channels stay finite."""
    queries = plan.nlat_out * plan.nlon_out
    poisoned = np.arange(queries) == point if operand == "q" else neighbour_mask(plan)[:, point]
    out, lse = np.asarray(out).reshape(queries, -1), np.asarray(lse).reshape(queries)
    assert poisoned.any()
    if operand == "v":
        others = np.arange(out.shape[1]) != channel
        assert np.isnan(out[poisoned, channel]).all() and np.isfinite(out[:, others]).all()
        assert np.isfinite(lse).all() and (not value_confined or np.isfinite(out[~poisoned]).all())
        return
    assert np.isnan(out[poisoned]).all() and np.isnan(lse[poisoned]).all()
    assert np.isfinite(out[~poisoned]).all() and np.isfinite(lse[~poisoned]).all()


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


@dataclasses.dataclass
class KernelCase:
    """Local inputs of one call of the three targets and their float64 expectations."""

    plan: NeighborhoodPlan
    dtype: str
    scale: float
    sizes: list[int]  # batch, heads, dk, dv, local q grid, local k grid, global q grid, global k grid
    inputs: tuple[np.ndarray, ...]  # q, k, v, dout, lse, delta, window (local arrays)
    fwd_order: np.ndarray
    bwd_order: np.ndarray
    q_window: tuple[int, int, int, int]
    k_window: tuple[int, int, int, int]
    expected: dict[str, np.ndarray]  # out, lse, dq, dk, dv on the real (window) blocks


def smooth_field(nlat: int, nlon: int, dim: int, grid: str) -> np.ndarray:
    """``[nlat, nlon, dim]`` values smooth in position, different per channel (the smooth-field
    cases: there dP - delta nearly cancels in the score gradients)."""
    theta = precompute_latitudes(nlat, grid)[0][:, None, None]
    phi = precompute_longitudes(nlon)[None, :, None]
    channel = np.arange(dim)[None, None, :]
    return np.sin(theta) * np.cos(phi + 0.1 * channel) + np.cos(theta) * np.sin(0.05 * channel + 0.3)


def prepare_case(
    rng,
    plan,
    batch,
    heads,
    dk,
    dv,
    dtype,
    q_window=None,
    k_window=None,
    padding=(0, 0, 0, 0),
    transform=None,
    logit_offset=0.0,
    smooth_values=False,
    logit_gain=1.0,
) -> KernelCase:
    """Random inputs on local blocks of the grids and the float64 results they must give.

    ``q_window``/``k_window`` are the real blocks ``(lat0, lon0, nlat, nlon)`` of the global
    grids; ``padding`` adds garbage rows/columns ``(q_lat, q_lon, k_lat, k_lon)`` to the local
    arrays. ``transform`` (optional) maps each local activation array before use (e.g. to a
    misaligned copy). ``smooth_values``: values smooth in position (1 % noise), where dP - delta
    nearly cancels in the score gradients (see ``run_case(as_op=True)``). ``logit_gain`` (a power of two: exact)
    multiplies q, and so the logits' spread.
    """
    (nlat_q, nlon_q), (nlat_k, nlon_k) = plan.out_shape, plan.in_shape
    q_window = q_window or (0, 0, nlat_q, nlon_q)
    k_window = k_window or (0, 0, nlat_k, nlon_k)
    storage = DTYPES[dtype][1]
    scale = 1.0 / np.sqrt(max(dk, 1))
    q, dout = (rng.standard_normal((batch, nlat_q, nlon_q, heads, d)).astype(storage) for d in (dk, dv))
    k, v = (rng.standard_normal((batch, nlat_k, nlon_k, heads, d)).astype(storage) for d in (dk, dv))
    if smooth_values:
        field = smooth_field(nlat_k, nlon_k, dv, plan.grid_in)
        v = (field[None, :, :, None, :] + 0.01 * v.astype(np.float64)).astype(storage)
    q = (q * storage(logit_gain)).astype(storage)
    if logit_offset < 0:  # every logit moves by about logit_offset: q_0 = a, k_0 = -a
        q[..., 0] = np.sqrt(-logit_offset / scale)
        k[..., 0] = -np.sqrt(-logit_offset / scale)

    # Float64 reference on the global grids, from the same rounded inputs.
    Q, G = (a.astype(np.float64).reshape(batch, nlat_q * nlon_q, heads, -1) for a in (q, dout))
    K, V = (a.astype(np.float64).reshape(batch, nlat_k * nlon_k, heads, -1) for a in (k, v))
    log_w = np.log(np.repeat(plan.quad_weights.astype(np.float64), nlon_k))
    logits = np.where(neighbour_mask(plan), scale * np.einsum("bqhd,bkhd->bhqk", Q, K) + log_w, -np.inf)
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

    q_pad, k_pad = padding[:2], padding[2:]
    q_l, dout_l = (local(a, q_window, *q_pad) for a in (q, dout))
    k_l, v_l = (local(a, k_window, *k_pad) for a in (k, v))
    lse_l = local(grid(lse_global.transpose(0, 2, 1), nlat_q, nlon_q), q_window, *q_pad, np.float32)
    delta_l = local(grid(delta, nlat_q, nlon_q), q_window, *q_pad, np.float32)
    if transform is not None:
        q_l, k_l, v_l, dout_l = map(transform, (q_l, k_l, v_l, dout_l))
    nq_lat, nq_lon, nk_lat, nk_lon = *q_l.shape[1:3], *k_l.shape[1:3]
    full_q = q_l.shape[1:3] == (nlat_q, nlon_q)
    full_k = k_l.shape[1:3] == (nlat_k, nlon_k)
    return KernelCase(
        plan=plan,
        dtype=dtype,
        scale=scale,
        sizes=[batch, heads, dk, dv, nq_lat, nq_lon, nk_lat, nk_lon, nlat_q, nlon_q, nlat_k, nlon_k],
        inputs=(q_l, k_l, v_l, dout_l, lse_l, delta_l, np.asarray([*q_window, *k_window], np.int32)),
        fwd_order=plan.forward_arcs.row_order if full_q else rng.permutation(nq_lat).astype(np.int32),
        bwd_order=plan.backward_arcs.row_order if full_k else rng.permutation(nk_lat).astype(np.int32),
        q_window=q_window,
        k_window=k_window,
        expected={
            "out": block(grid(out_ref, nlat_q, nlon_q), q_window),
            "lse": block(grid(lse_window.transpose(0, 2, 1), nlat_q, nlon_q), q_window),
            "dq": block(grid(dq_ref, nlat_q, nlon_q), q_window),
            "dk": block(grid(dk_ref, nlat_k, nlon_k), k_window),
            "dv": block(grid(dv_ref, nlat_k, nlon_k), k_window),
        },
    )


def run_case(
    case: KernelCase, launch: Launch, tables=None, as_op: bool = False, gradient_type=np.float32
) -> dict[str, np.ndarray]:  # fmt: skip
    """Runs forward, dq and dkv of the arc kernels with ``launch`` into NaN-filled results and returns them.
    ``tables``: the (forward, backward) arc tables walked, by default the plan's. ``as_op``: the backward targets
    get the lse of this forward and a delta from its float32 out, as the op feeds them, instead of the case's
    exact float64 ones; whole grids only (the forward's lse covers the window's keys, the backward needs every
    key's). ``gradient_type``: the numpy type of dq, dk and dv (float32: the arc launchers refuse others)."""
    q, k, v, dout, lse_in, delta, window = case.inputs
    if as_op and case.sizes[4:8] != case.sizes[8:12]:
        raise ValueError("as_op needs whole grids (no windows, no padding)")
    plan, weights = case.plan, case.plan.quad_weights
    forward_table, backward_table = tables or (plan.forward_arcs, plan.backward_arcs)
    out, lse = np.full((*q.shape[:4], v.shape[-1]), np.nan, np.float32), np.full(q.shape[:4], np.nan, np.float32)
    launch(FORWARD, case.dtype, case.sizes, case.scale, q, k, v, None, None, None, window, case.fwd_order,
           forward_table, weights, out, lse)  # fmt: skip
    if as_op:
        lse_in, delta = lse, (dout.astype(np.float64) * out).sum(-1).astype(np.float32)
    dq = np.full(q.shape, np.nan, gradient_type)
    launch(DQ, case.dtype, case.sizes, case.scale, q, k, v, dout, lse_in, delta, window, case.fwd_order,
           forward_table, weights, dq, None)  # fmt: skip
    dk, dv = np.full(k.shape, np.nan, gradient_type), np.full(v.shape, np.nan, gradient_type)
    launch(DKV, case.dtype, case.sizes, case.scale, q, k, v, dout, lse_in, delta, window, case.bwd_order,
           backward_table, weights, dk, dv)  # fmt: skip
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def _real_block(local: np.ndarray, window) -> np.ndarray:
    """The real points of a local result ``[batch, rows, cols, ...]`` (the first ``window[2]`` rows and
    ``window[3]`` columns)."""
    return local[:, : window[2], : window[3]]


def _padding(local: np.ndarray, window) -> np.ndarray:
    """The padding points of a local result, flattened: every row past the real ones, and the columns past the
    real ones of the real rows."""
    return np.concatenate([local[:, window[2] :].reshape(-1), local[:, : window[2], window[3] :].reshape(-1)])


def verify_case(
    case: KernelCase, results: dict[str, np.ndarray], tolerance: float = TOLERANCE, out_tolerance: float = OUT_TOLERANCE
) -> None:
    """Asserts that every element was written, real blocks match float64 and padding is empty.

    ``tolerance`` bounds out, dq, dk and dv (relative to each one's largest reference value; out
    also ``out_tolerance``).
    lse is held to float32 round-off (relative to max(1, its largest value)) in every case: no
    16-bit rounding enters it in either kernel family."""
    windows = dict.fromkeys(("out", "lse", "dq"), case.q_window) | dict.fromkeys(("dk", "dv"), case.k_window)
    real = lambda name: _real_block(results[name], windows[name])  # noqa: E731
    padding_of = lambda name: _padding(results[name], windows[name])  # noqa: E731

    for name, result in results.items():
        assert not np.isnan(result).any(), f"{name}: some elements were never written"
    lse, lse_expected = real("lse"), case.expected["lse"]
    finite = np.isfinite(lse_expected)
    assert np.array_equal(np.isfinite(lse), finite), "lse: -inf (no neighbour) pattern differs"
    lse_error = np.abs(lse[finite] - lse_expected[finite]).max(initial=0.0)
    assert lse_error <= TOLERANCE * max(1.0, np.abs(lse_expected[finite]).max(initial=0.0)), f"lse: error {lse_error}"
    for name in ("out", "dq", "dk", "dv"):
        error = _relative(real(name), case.expected[name])
        bar = min(tolerance, out_tolerance) if name == "out" else tolerance
        assert error <= bar, f"{name}: relative error {error:.2e} against float64"
    for name in ("out", "dq", "dk", "dv"):
        assert (padding_of(name) == 0).all(), f"{name}: padding points must be zero"
    assert (padding_of("lse") == -np.inf).all(), "lse: padding points must be -inf"


def tolerance_of(kernel: str, dtype: str) -> float:
    """The relative bar of verify_case for ``kernel`` ("arc" or "scheduled") on ``dtype``."""
    if kernel not in ("arc", "scheduled"):
        raise ValueError(f"kernel must be 'arc' or 'scheduled', got {kernel!r}")
    return SCHEDULED_TOLERANCE[dtype] if kernel == "scheduled" else TOLERANCE


def check_case(launch: Launch, rng, plan, batch, heads, dk, dv, dtype, *window_args, **window_kwargs) -> None:
    """prepare_case, run_case and verify_case of the arc kernels in one call (arguments as prepare_case)."""
    case = prepare_case(rng, plan, batch, heads, dk, dv, dtype, *window_args, **window_kwargs)
    verify_case(case, run_case(case, launch), tolerance_of("arc", dtype))


def table_rows(table: ArcTable | SegmentTable) -> np.ndarray:
    """The rows the kernels walk: an ArcTable's arcs or a SegmentTable's segments."""
    if isinstance(table, SegmentTable):
        return table.segments
    if isinstance(table, ArcTable):
        return table.arcs
    raise TypeError(f"table must be an ArcTable or a SegmentTable, got {type(table).__name__}")


def call_run_target(
    lib, address, target, dtype, sizes, scale, q, k, v, dout, lse, delta, window, row_order, table, weights, r0, r1,
    r2=None, stencil_pairs=None,
) -> int:  # fmt: skip
    """Calls ``RunNbhdAttnTarget`` (or for ``target`` STENCIL_DQ_FORMING_DELTA ``RunStencilDqFormingDelta``, ``delta``
    then dlse) of ``lib`` (ctypes) with the arguments of a launch callable and returns its
    cudaError_t. ``address(array)`` gives the buffer address the kernels use for a (non-None) numpy array;
    ``table`` is an ArcTable (arc targets) or a SegmentTable (stencil targets). The gradient results' type is that
    of ``r0`` (the forward's lse and ``r0`` out are float32); ``r2`` as a launch's ``result2``; ``stencil_pairs``
    (int32 ``[pairs, 2]``, stencil targets) the walking row pairs the stencil targets walk."""
    rows = table_rows(table)
    all_sizes = np.asarray([*sizes, table.residues, table.shift, rows.shape[0]], np.int64)  # host memory
    pairs = [ctypes.c_void_p(None), ctypes.c_int64(0)]
    if stencil_pairs is not None and len(stencil_pairs):
        pairs = [ctypes.c_void_p(address(stencil_pairs)), ctypes.c_int64(len(stencil_pairs))]
    tail = [ctypes.c_void_p(all_sizes.ctypes.data), ctypes.c_float(scale), *pairs]
    forming_delta = target == STENCIL_DQ_FORMING_DELTA
    if forming_delta and r2 is not None:
        raise ValueError("the dq that forms delta has two results")
    results = (r0, r1) if forming_delta else (r0, r1, r2)
    arrays = (q, k, v, dout, lse, delta, window, row_order, table.offsets, rows, weights, *results)
    result_type = np.float32 if r0 is None else r0.dtype
    gradient_dtype = next(code for code, storage in DTYPES.values() if np.dtype(storage) == result_type)
    pointers = [ctypes.c_void_p(None if a is None else address(a)) for a in arrays]
    types = [ctypes.c_int(DTYPES[dtype][0]), ctypes.c_int(gradient_dtype)]
    if forming_delta:
        return lib.RunStencilDqFormingDelta(*types, *pointers, *tail)
    return lib.RunNbhdAttnTarget(ctypes.c_int(target), *types, *pointers, *tail)


def stencil_rows_of(pairs: np.ndarray, nlat: int) -> np.ndarray:
    """The rows of stencil ``pairs`` (each pair's first row and the next) of a grid of ``nlat`` rows, as a mask."""
    rows = np.zeros(nlat, bool)
    rows[pairs[:, 0]] = rows[pairs[:, 0] + 1] = True
    return rows


def verify_dq_forming_delta(
    case: KernelCase, out: np.ndarray, dlse: np.ndarray, results: dict[str, np.ndarray], stencil_rows=None
):  # fmt: skip
    """Every element written; on the scheduled dq's rows delta = sum(dout * out, -1) - dlse to FORMED_DELTA_TOLERANCE
    and dq (``results["dq"]``, of the dq that formed ``results["delta"]``) the bits of ``results["dq_given_delta"]``,
    the dq given that delta. ``stencil_rows`` (bool ``[nlat]`` of the query grid; whole grids): the stencil dq's
    rows, whose delta comes from its own probabilities (not from ``out``): checked by
    :func:`verify_stencil_formed_delta`."""
    for name, result in results.items():
        assert not np.isnan(np.asarray(result, np.float32)).any(), f"{name}: some elements were never written"
    rows = np.zeros(case.sizes[4], bool) if stencil_rows is None else np.asarray(stencil_rows)
    terms = case.inputs[3].astype(np.float64) * out.astype(np.float64)
    expected = terms.sum(-1) - dlse
    bound = FORMED_DELTA_TOLERANCE * (np.abs(terms).sum(-1) + np.abs(dlse))
    excess = (np.abs(results["delta"] - expected) - bound)[:, ~rows]
    assert (excess <= 0).all(), f"delta: error exceeds its bound by up to {excess.max():.2e}"
    dq, given = (np.asarray(results[name]) for name in ("dq", "dq_given_delta"))
    assert dq[:, ~rows].tobytes() == given[:, ~rows].tobytes(), "dq: not the bits of the dq given its delta"
    if rows.any():
        verify_stencil_formed_delta(case, dlse, results, rows)


def verify_stencil_formed_delta(case: KernelCase, dlse: np.ndarray, results: dict[str, np.ndarray], rows) -> None:
    """:func:`check_stencil_formed_delta` on ``case``'s whole grids against its float64 delta (for dlse 0) less
    ``dlse``: ``results["delta"]``, ``results["dq"]`` and ``results["dq_given_delta"]`` on the query ``rows``."""
    assert case.plan.out_shape == tuple(case.sizes[4:6]), "whole grids only"
    q, k, v, dout = case.inputs[:4]
    expected = case.inputs[5].astype(np.float64) - dlse
    check_stencil_formed_delta(results["delta"], results["dq"], results["dq_given_delta"], expected, dout, k, v,
                               dlse, case.scale, rows)  # fmt: skip


def check_stencil_formed_delta(delta, dq, dq_given, expected_delta, dout, k, v, dlse, scale, rows) -> None:
    """On the query ``rows`` (bool ``[nlat]`` of arrays ``[batch, nlat, nlon, heads, ...]``), those of the stencil
    dq that forms delta from its own probabilities: ``delta`` within STENCIL_FORMED_TOLERANCE of
    ``expected_delta`` (float64's sum_j p_j (dout . v_j) - dlse), and ``dq`` within it of ``dq_given``, the dq
    given that delta (one rounding of the result's dtype more where it is not float32)."""
    dout, k, v, dlse, delta = (np.asarray(x, np.float64) for x in (dout, k, v, dlse, delta))
    size = np.sqrt((dout**2).sum(-1)) * np.sqrt((v**2).sum(-1)).max()  # bounds |dout . v_j|
    excess = (np.abs(delta - expected_delta) - STENCIL_FORMED_TOLERANCE * (size + np.abs(dlse)))[:, rows]
    assert (excess <= 0).all(), f"stencil delta: error exceeds its bound by up to {excess.max():.2e}"
    result_type = np.asarray(dq).dtype
    dq, dq_given = (np.asarray(x, np.float64) for x in (dq, dq_given))
    rounding = 0.0 if result_type == np.float32 else float(ml_dtypes.finfo(result_type).eps) * np.abs(dq_given)
    bound = (STENCIL_FORMED_TOLERANCE * scale * np.abs(k).max() * (size + np.abs(delta)))[..., None] + rounding
    excess = (np.abs(dq - dq_given) - bound)[:, rows]
    assert (excess <= 0).all(), f"stencil dq: error exceeds its bound by up to {excess.max():.2e}"


# Kinds of RunScheduledTarget (run_target.cc).
SCHEDULED_KINDS = {"forward": 0, "dq": 1, "dkv": 2}


class HostMemory:
    """The emulation's memory: the kernels read and write the numpy buffers themselves."""

    def address(self, array: np.ndarray) -> int:
        return array.ctypes.data

    def finish(self, results) -> None:
        pass


def call_scheduled_target(
    lib, case: KernelCase, kind: str, result_type, schedule, lse=None, delta=None, memory=None, ring_nlon=None
) -> tuple[int, tuple[np.ndarray, np.ndarray | None]]:  # fmt: skip
    """Calls ``RunScheduledTarget`` of ``lib`` for ``kind`` on ``case``'s grids and ``schedule`` into results
    poisoned with NaN (arguments as :func:`run_scheduled_kind`; ``ring_nlon`` in place of the other grid's
    longitudes, the RING chunks' modulus) and returns the launcher's cudaError_t and the results (in ``memory``,
    not yet finished)."""
    memory = memory or HostMemory()
    q, k, v, dout = case.inputs[:4]
    dv = case.sizes[3]
    if kind == "forward":
        results = (np.full(q.shape[:-1] + (dv,), np.nan, result_type), np.full(q.shape[:-1], np.nan, np.float32))
    elif kind == "dq":
        results = (np.full(q.shape, np.nan, result_type), None)
    else:
        results = (np.full(k.shape, np.nan, result_type), np.full(v.shape, np.nan, result_type))
    tables, sizes, weights = _schedule_arguments(case, schedule, walk_keys=kind == "dkv")
    if ring_nlon is not None:
        sizes[12] = ring_nlon
    arrays = (q, k, v, dout, lse, delta, *tables, weights, *results)
    pointers = [ctypes.c_void_p(None if a is None else memory.address(a)) for a in arrays]
    status = lib.RunScheduledTarget(
        ctypes.c_int(SCHEDULED_KINDS[kind]), ctypes.c_int(DTYPES[case.dtype][0]),
        ctypes.c_int(_dtype_code(result_type)), *pointers, ctypes.c_void_p(sizes.ctypes.data),
        ctypes.c_float(case.scale),
    )  # fmt: skip
    return status, results


def run_scheduled_kind(
    lib, case: KernelCase, kind: str, result_type, schedule, lse=None, delta=None, memory=None, stencil_pairs=None
) -> tuple[np.ndarray, np.ndarray | None]:  # fmt: skip
    """One scheduled kernel (``lib``: ctypes, the emulated library or a GPU build) on ``case``'s whole grids and
    ``schedule`` (:class:`~jax_s2attn.schedule.BlockSchedule` of the kernel's walk), results of numpy type
    ``result_type`` (lse float32) poisoned with NaN first: ``(out, lse)``, ``(dq, None)`` or ``(dk, dv)``. dq and
    dk/dv take ``lse`` and ``delta``. ``memory``: where the buffers live, :class:`HostMemory` by default, or an
    object with the same ``address(array)`` and ``finish(results)`` (the results copied back) for a GPU.
    ``stencil_pairs`` (whole grids; the schedule without their tiles): the stencil target then writes their rows
    into the same results."""
    memory = memory or HostMemory()
    status, results = call_scheduled_target(lib, case, kind, result_type, schedule, lse, delta, memory)
    assert status == 0, f"scheduled {kind}: launcher returned cudaError {status}"
    if stencil_pairs is not None:
        _run_stencil_kind(lib, case, kind, results, lse, delta, memory, stencil_pairs)
    memory.finish(results)
    return results


def _dtype_code(result_type) -> int:
    """The ActivationType code of numpy type ``result_type``."""
    return next(code for code, storage in DTYPES.values() if np.dtype(storage) == np.dtype(result_type))


def _schedule_arguments(case: KernelCase, schedule, walk_keys: bool) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """The schedule's tables (tiles, tile_offsets, chunks, records), RunScheduledTarget's ``sizes`` and the local
    key rows' weights of a scheduled call on ``case`` (``walk_keys``: dk/dv's backward schedule). A schedule in
    the ring grids' format (tiles of runs, :func:`~jax_s2attn.schedule.as_runs`) takes the grids as grids of one
    row and a weight per key point."""
    batch, heads, dk, _, nlat_q, nlon_q, nlat_k, nlon_k = case.sizes[:8]  # the local arrays' grids
    ring_nlon = case.plan.nlon_out if walk_keys else case.plan.nlon_in
    weights = local_key_weights(case)
    flat = schedule.tiles.ndim == 3
    if flat:
        weights = np.repeat(weights, nlon_k)
        nlat_q, nlon_q, nlat_k, nlon_k = 1, nlat_q * nlon_q, 1, nlat_k * nlon_k
    tables = [np.ascontiguousarray(getattr(schedule, name), np.int32)
              for name in ("tiles", "tile_offsets", "chunks", "records")]  # fmt: skip
    sizes = np.asarray([batch, heads, nlat_q, nlon_q, nlat_k, nlon_k, len(schedule.tiles), len(schedule.chunks),
                        len(schedule.records), schedule.classes, schedule.shift, dk, ring_nlon, int(flat)],
                       np.int64)  # fmt: skip
    return tables, sizes, weights


def run_scheduled_dq_forming_delta(
    lib, case: KernelCase, result_type, schedule, lse, out, dlse, memory=None, stencil_pairs=None
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """The scheduled dq that forms delta (``lib``, ``memory`` and ``stencil_pairs`` as for
    :func:`run_scheduled_kind`: the stencil dq that forms delta writes those rows) on ``case``'s whole grids and
    the plan's forward ``schedule``, from the forward's float32 ``out`` and ``dlse``: ``(dq, delta)``, dq of numpy
    type ``result_type``, both poisoned with NaN first."""
    memory = memory or HostMemory()
    q, k, v, dout = case.inputs[:4]
    results = (np.full(q.shape, np.nan, result_type), np.full(q.shape[:-1], np.nan, np.float32))
    tables, sizes, weights = _schedule_arguments(case, schedule, walk_keys=False)
    arrays = (q, k, v, dout, lse, out, dlse, *tables, weights, *results)
    pointers = [ctypes.c_void_p(memory.address(a)) for a in arrays]
    status = lib.RunScheduledDqFormingDelta(
        ctypes.c_int(DTYPES[case.dtype][0]), ctypes.c_int(_dtype_code(result_type)), *pointers,
        ctypes.c_void_p(sizes.ctypes.data), ctypes.c_float(case.scale),
    )  # fmt: skip
    assert status == 0, f"scheduled dq forming delta: launcher returned cudaError {status}"
    if stencil_pairs is not None:
        _run_stencil_kind(lib, case, "dq_delta", results, lse, dlse, memory, stencil_pairs)
    memory.finish(results)
    return results


def _run_stencil_kind(lib, case: KernelCase, kind: str, results, lse, delta, memory, stencil_pairs) -> None:
    """The stencil target of ``kind`` on ``case``'s whole grids, writing the rows of ``stencil_pairs`` into
    ``results`` (a scheduled kind's, in ``memory``); ``kind`` "dq_delta" is the dq that forms delta, ``delta`` then
    dlse."""
    q, k, v, dout, *_, window = case.inputs
    walk_keys = kind == "dkv"
    table = case.plan.backward_segments if walk_keys else case.plan.forward_segments
    order = case.bwd_order if walk_keys else case.fwd_order
    first, second = results
    narrow_out = kind == "forward" and first.dtype != np.float32
    r0, r1, r2 = (None, second, first) if narrow_out else (first, second, None)
    if kind == "dq_delta":
        target = STENCIL_DQ_FORMING_DELTA
    else:
        target = STENCIL_TARGET_OFFSET + {"forward": FORWARD, "dq": DQ, "dkv": DKV}[kind]
    inputs = (q, k, v, None, None, None) if kind == "forward" else (q, k, v, dout, lse, delta)
    pairs = np.ascontiguousarray(stencil_pairs, np.int32)
    status = call_run_target(lib, memory.address, target, case.dtype, case.sizes[:12], case.scale, *inputs, window,
                             order, table, case.plan.quad_weights, r0, r1, r2, stencil_pairs=pairs)  # fmt: skip
    assert status == 0, f"stencil {kind}: launcher returned cudaError {status}"


def local_key_weights(case: KernelCase) -> np.ndarray:
    """The quadrature weights of ``case``'s local key rows (rows past the grid: the last row's), float32."""
    rows = case.k_window[0] + np.arange(case.sizes[6])
    return np.ascontiguousarray(case.plan.quad_weights[np.minimum(rows, case.plan.nlat_in - 1)], np.float32)


def whole_grids(case: KernelCase) -> bool:
    """Whether ``case``'s arrays are its plan's whole grids (no window, no padding)."""
    plan = case.plan
    blocks = (tuple(case.sizes[4:6]), tuple(case.sizes[6:8]), tuple(case.q_window), tuple(case.k_window))
    return blocks == (plan.out_shape, plan.in_shape, (0, 0, *plan.out_shape), (0, 0, *plan.in_shape))


def scheduled_schedules(case: KernelCase, stencil: bool = False) -> tuple[BlockSchedule, BlockSchedule]:
    """The forward and backward schedules of ``case``: the plan's for whole grids (with ``stencil``, the op's
    beside the stencil rows: :func:`jax_s2attn.ops._ffi.stencil_schedule`), else its windows'."""
    plan = case.plan
    tile_rows, tile_cols, chunk_cols = kernel_limits().scheduled_shape
    shape = dict(tile_rows=tile_rows, tile_cols=tile_cols, chunk_cols=chunk_cols)
    if whole_grids(case) and stencil:
        return tuple(_ffi.stencil_schedule(plan, walk).schedule for walk in ("forward", "backward"))
    if whole_grids(case):
        return tuple(plan.block_schedule(walk, **shape) for walk in ("forward", "backward"))
    if stencil:
        raise ValueError("the stencil rows need whole grids (no windows, no padding)")
    window = (*case.q_window, *case.k_window)
    return schedules_of_window(plan, window, tuple(case.sizes[4:6]), tuple(case.sizes[6:8]), **shape)


def run_scheduled_windows(
    lib, case: KernelCase, result_type=np.float32, memory=None, schedules=None
) -> dict[str, np.ndarray]:  # fmt: skip
    """The scheduled forward, dq and dk/dv on ``case``'s windows and ``schedules`` (forward, backward; by default
    :func:`scheduled_schedules`), the backward with the case's global lse and delta (as the sharded op feeds
    them)."""
    forward, backward = schedules or scheduled_schedules(case)
    lse_in, delta = case.inputs[4:6]
    out, lse = run_scheduled_kind(lib, case, "forward", result_type, forward, memory=memory)
    (dq, _) = run_scheduled_kind(lib, case, "dq", result_type, forward, lse_in, delta, memory)
    dk, dv = run_scheduled_kind(lib, case, "dkv", result_type, backward, lse_in, delta, memory)
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def run_scheduled_case(
    lib, case: KernelCase, result_type=np.float32, memory=None, stencil: bool = False
) -> dict[str, np.ndarray]:  # fmt: skip
    """The scheduled forward, dq and dk/dv on ``case`` (whole grids) as the op runs them: the forward's out in
    float32 feeds delta = rowsum(dout * out), formed by the dq (:func:`run_scheduled_dq_forming_delta`, dlse 0);
    the backward takes the forward's lse; out, dq, dk and dv of numpy type ``result_type``; ``memory`` as for
    :func:`run_scheduled_kind`. ``stencil``: the stencil targets take the rows of the plan's tile stencil pairs,
    the scheduled kernels the others."""
    assert whole_grids(case), "run_scheduled_case forms delta from its own forward: whole grids only"
    forward, backward = scheduled_schedules(case, stencil)
    pairs = {walk: _ffi.stencil_schedule(case.plan, walk).pairs if stencil else None
             for walk in ("forward", "backward")}  # fmt: skip
    run = functools.partial(run_scheduled_kind, lib, case, memory=memory)
    out32, lse = run("forward", np.float32, forward, stencil_pairs=pairs["forward"])
    out = out32 if np.dtype(result_type) == np.float32 else run("forward", result_type, forward,
                                                                stencil_pairs=pairs["forward"])[0]  # fmt: skip
    dlse = np.zeros(lse.shape, np.float32)
    dq, delta = run_scheduled_dq_forming_delta(lib, case, result_type, forward, lse, out32, dlse, memory,
                                               pairs["forward"])  # fmt: skip
    dk, dv = run("dkv", result_type, backward, lse, delta, stencil_pairs=pairs["backward"])
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv, "out32": out32}


# ------------------------------------------------------------------ ring targets (arc kernels between ring grids)

RING_KINDS = {"forward": 0, "dq": 1, "dkv": 2}

# Self-attention on HEALPix, a 3:2 longitude ratio, and between grid kinds (different rings both ways).
RING_PLANS = {
    "healpix-self": lambda: RingPlan(RingGrid.healpix(4), RingGrid.healpix(4), 0.35),
    "latlon-3:2": lambda: RingPlan(RingGrid.latlon(19, 36), RingGrid.latlon(13, 24), 0.3),
    "octahedral-healpix": lambda: RingPlan(RingGrid.octahedral(8), RingGrid.healpix(4), 0.3),
}


@dataclasses.dataclass
class RingCase:
    """Flat inputs ``[batch, points, heads, dim]`` of one call of the three ring targets, the backward's lse and
    delta (float32, from the float64 forward) and the float64 results."""

    plan: RingPlan
    dtype: str
    scale: float
    inputs: tuple[np.ndarray, ...]  # q, k, v, dout in the storage type
    lse: np.ndarray
    delta: np.ndarray
    expected: dict[str, np.ndarray]  # out, lse, dq, dk, dv


def ring_pair_mask(plan: RingPlan) -> np.ndarray:
    """Dense ``[output point, input point]`` membership from the plan's query patterns."""
    grid_out, table = plan.grid_out, plan.patterns
    mask = np.zeros((grid_out.npoints, plan.grid_in.npoints), bool)
    for ring in range(grid_out.nrings):
        for i in range(int(grid_out.nlon[ring])):
            pattern = table.ring_patterns[ring] + i % table.period[ring]
            for _, first, start, length, nlon, shift in table.arcs[table.offsets[pattern] : table.offsets[pattern + 1]]:
                keys = first + (start + (i // table.period[ring]) * shift + np.arange(length)) % nlon
                mask[grid_out.ring_offsets[ring] + i, keys] = True
    return mask


def prepare_ring_case(rng, plan: RingPlan, batch: int, heads: int, dk: int, dv: int, dtype: str) -> RingCase:
    """Random inputs on the plan's grids and the float64 results of attention with cotangent ``dout`` (dense
    softmax over the plan's pairs, its gradients by hand)."""
    storage = DTYPES[dtype][1]
    scale = 1.0 / np.sqrt(max(dk, 1))
    nq, nk = plan.npoints_out, plan.npoints_in
    q, dout = (rng.standard_normal((batch, nq, heads, d)).astype(storage) for d in (dk, dv))
    k, v = (rng.standard_normal((batch, nk, heads, d)).astype(storage) for d in (dk, dv))
    q64, k64, v64, g64 = (x.astype(np.float64) for x in (q, k, v, dout))
    log_weights = np.log(plan.grid_in.point_weights())
    logits = scale * np.einsum("bqhd,bkhd->bhqk", q64, k64) + log_weights
    logits = np.where(ring_pair_mask(plan), logits, -np.inf)
    lse = _logsumexp(logits)  # [b, h, q]
    p = np.exp(logits - lse[..., None])
    out = np.einsum("bhqk,bkhd->bqhd", p, v64)
    delta = np.einsum("bqhd,bqhd->bqh", g64, out)
    ds = p * (np.einsum("bqhd,bkhd->bhqk", g64, v64) - delta.transpose(0, 2, 1)[..., None])
    expected = {
        "out": out,
        "lse": lse.transpose(0, 2, 1),
        "dq": scale * np.einsum("bhqk,bkhd->bqhd", ds, k64),
        "dk": scale * np.einsum("bhqk,bqhd->bkhd", ds, q64),
        "dv": np.einsum("bhqk,bqhd->bkhd", p, g64),
    }
    return RingCase(plan, dtype, scale, (q, k, v, dout), expected["lse"].astype(np.float32),
                    delta.astype(np.float32), expected)  # fmt: skip


def run_ring_kind(lib, case: RingCase, kind: str, tables=None, memory=None) -> tuple[np.ndarray, np.ndarray | None]:
    """One ring kernel (``lib``: the emulated library or a GPU build) into NaN-filled float32 results: ``(out,
    lse)``, ``(dq, None)`` or ``(dk, dv)``; dq and dk/dv take the case's lse and delta. ``tables``: the walk's
    ``(RingWalkTables, RingWalkSizes)`` (the plan's by default; tests pass broken ones). ``memory`` as for
    :func:`run_scheduled_kind`."""
    memory = memory or HostMemory()
    q, k, v, dout = case.inputs
    if kind == "forward":
        results = (np.full(q.shape[:-1] + (v.shape[-1],), np.nan, np.float32), np.full(q.shape[:-1], np.nan, np.float32))
    elif kind == "dq":
        results = (np.full(q.shape, np.nan, np.float32), None)
    else:
        results = (np.full(k.shape, np.nan, np.float32), np.full(v.shape, np.nan, np.float32))
    walk = "keys" if kind == "dkv" else "queries"
    arrays, counts = tables or _ffi.ring_walk_tables(case.plan, walk)
    walk_points, visited_points = (k.shape[1], q.shape[1]) if walk == "keys" else (q.shape[1], k.shape[1])
    sizes = np.asarray([q.shape[0], q.shape[2], q.shape[3], v.shape[3], walk_points, visited_points,
                        counts.walk_ring_count, counts.max_ring_points, counts.pattern_count,
                        arrays.pattern_arcs.size // 6, arrays.quad_weights.size], np.int64)  # fmt: skip
    buffers = (q, k, v, dout, case.lse, case.delta, *(np.ascontiguousarray(a) for a in arrays), *results)
    pointers = [ctypes.c_void_p(None if a is None else memory.address(a)) for a in buffers]
    status = lib.RunRingTarget(ctypes.c_int(RING_KINDS[kind]), ctypes.c_int(DTYPES[case.dtype][0]), *pointers,
                               ctypes.c_void_p(sizes.ctypes.data), ctypes.c_float(case.scale))  # fmt: skip
    assert status == 0, f"ring {kind}: launcher returned cudaError {status}"
    memory.finish(results)
    return results


def run_ring_case(lib, case: RingCase, memory_of=HostMemory) -> dict[str, np.ndarray]:
    """The three ring kernels on ``case``: ``{"out", "lse", "dq", "dk", "dv"}`` (``memory_of()`` a fresh memory
    per kernel)."""
    out, lse = run_ring_kind(lib, case, "forward", memory=memory_of())
    dq, _ = run_ring_kind(lib, case, "dq", memory=memory_of())
    dk, dv = run_ring_kind(lib, case, "dkv", memory=memory_of())
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def expand_runs_schedule(schedule: BlockSchedule) -> np.ndarray:
    """``[walking point, other point]`` counts of what the kernels compute from ``schedule`` in the ring grids'
    format (tiles of runs: ``jax_s2attn.ring_schedule``, ``jax_s2attn.schedule.as_runs``): every real point of
    every tile's runs against every kept column of its chunks (the mask of cuda/gpu/sched_attn_device.cuh)."""
    pairs = np.zeros((schedule.nlon_walk, schedule.nlon), np.int32)
    records = schedule.records.reshape(len(schedule.records), -1, 2)
    run_points = records.shape[1] // schedule.tiles.shape[1]
    for tile, runs in enumerate(schedule.tiles):
        points = [(r * run_points + j, first + j) for r, (first, count) in enumerate(runs) for j in range(count)]
        for row, first, offset, valid, flags, staging in schedule.chunks[
            schedule.tile_offsets[tile] : schedule.tile_offsets[tile + 1]
        ]:
            assert row == 0 and 1 <= valid <= schedule.chunk_cols
            columns = np.arange(valid)
            for slot, point in points:
                start, length = records[staging, slot]
                if flags & RING:  # start modulo the ring by one conditional add and one subtract, as MaskOf
                    ring_points = flags >> RING_POINTS_SHIFT
                    begin = start - offset
                    assert -ring_points <= begin < 2 * ring_points, "a ring start the kernels cannot reduce"
                    begin += ring_points if begin < 0 else 0
                    begin -= ring_points if begin >= ring_points else 0
                    keep = (columns - begin) % ring_points < length
                else:
                    keep = (columns - (start - offset) >= 0) & (columns - (start - offset) < length)
                if flags & FULL:
                    assert valid == schedule.chunk_cols and keep.all(), "a FULL chunk must need no mask"
                pairs[point, first + columns[keep]] += 1
    return pairs


def ring_schedules(plan: RingPlan) -> tuple[BlockSchedule, BlockSchedule]:
    """The forward and backward ring block schedules of ``plan`` in the scheduled kernels' shape."""
    runs, run_points = kernel_limits().scheduled_runs
    chunk_cols = kernel_limits().scheduled_shape[2]
    return tuple(ring_block_schedule(plan, walk, runs=runs, run_points=run_points, chunk_cols=chunk_cols)
                 for walk in ("forward", "backward"))  # fmt: skip


def run_ring_scheduled_kind(lib, case: RingCase, kind: str, schedule, lse=None, delta=None, forming=None, memory=None):
    """One scheduled kernel on ``case``'s flat fields (grids of one row) and ring ``schedule``: ``(out, lse)``,
    ``(dq, delta)`` with ``forming = (out, dlse)`` (the dq that forms delta), or ``(dk, dv)``; results float32,
    NaN-poisoned first."""
    memory = memory or HostMemory()
    q, k, v, dout = case.inputs
    batch, nq, heads, dk = q.shape
    if kind == "forward":
        results = (np.full(q.shape[:-1] + (v.shape[-1],), np.nan, np.float32), np.full(q.shape[:-1], np.nan, np.float32))
    elif kind == "dq":
        results = (np.full(q.shape, np.nan, np.float32), np.full(q.shape[:-1], np.nan, np.float32))
    else:
        results = (np.full(k.shape, np.nan, np.float32), np.full(v.shape, np.nan, np.float32))
    tables = [np.ascontiguousarray(getattr(schedule, name), np.int32)
              for name in ("tiles", "tile_offsets", "chunks", "records")]  # fmt: skip
    sizes = np.asarray([batch, heads, 1, nq, 1, k.shape[1], len(schedule.tiles), len(schedule.chunks),
                        len(schedule.records), schedule.classes, schedule.shift, dk, schedule.nlon, 1], np.int64)
    weights = np.ascontiguousarray(case.plan.grid_in.point_weights(), np.float32)
    code, f32 = ctypes.c_int(DTYPES[case.dtype][0]), ctypes.c_int(_dtype_code(np.float32))
    if kind == "dq":
        arrays = (q, k, v, dout, lse, *forming, *tables, weights, *results)
        pointers = [ctypes.c_void_p(memory.address(a)) for a in arrays]
        status = lib.RunScheduledDqFormingDelta(code, f32, *pointers, ctypes.c_void_p(sizes.ctypes.data),
                                                ctypes.c_float(case.scale))  # fmt: skip
    else:
        arrays = (q, k, v, dout, lse, delta, *tables, weights, *results)
        pointers = [ctypes.c_void_p(None if a is None else memory.address(a)) for a in arrays]
        status = lib.RunScheduledTarget(ctypes.c_int(SCHEDULED_KINDS[kind]), code, f32, *pointers,
                                        ctypes.c_void_p(sizes.ctypes.data), ctypes.c_float(case.scale))  # fmt: skip
    assert status == 0, f"ring scheduled {kind}: launcher returned cudaError {status}"
    memory.finish(results)
    return results


def run_ring_scheduled_case(lib, case: RingCase, memory_of=HostMemory) -> dict[str, np.ndarray]:
    """The scheduled forward, dq and dk/dv on ``case``'s ring grids as the op runs them: the forward's float32 out
    feeds the dq that forms delta (dlse 0), whose delta and the forward's lse feed dk/dv."""
    forward, backward = ring_schedules(case.plan)
    out, lse = run_ring_scheduled_kind(lib, case, "forward", forward, memory=memory_of())
    dlse = np.zeros_like(lse)
    dq, delta = run_ring_scheduled_kind(lib, case, "dq", forward, lse, forming=(out, dlse), memory=memory_of())
    dk, dv = run_ring_scheduled_kind(lib, case, "dkv", backward, lse, delta, memory=memory_of())
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def verify_ring_case(case: RingCase, results: dict[str, np.ndarray], tolerance: float = TOLERANCE) -> None:
    """Every element written, each result within ``tolerance`` of the float64 one: the float32 bar by default
    (the inputs are exact in every dtype, and the ring kernels compute in float32)."""
    for name, expected in case.expected.items():
        actual = results[name]
        assert not np.isnan(actual).any(), f"{name}: elements left unwritten"
        error = _relative(actual.astype(np.float64), expected)
        assert error <= tolerance, f"{name}: relative error {error:.2e} > {tolerance:.0e}"
