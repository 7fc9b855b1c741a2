"""The native kernels' FFI targets: which family can run a call, registration, FFI calls.

The modules themselves are loaded by :mod:`jax_s2attn._native` (optional at import time:
without them every op runs on the pure-JAX reference path and :func:`native_status` says why),
which also reports their limits.
"""

from __future__ import annotations

import functools
import threading
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._native import HAS_CPU_EXT, HAS_CUDA_EXT, MODULES, kernel_limits, native_backends, native_status
from ..ring_schedule import ring_block_schedule
from ..schedule import BlockSchedule, ScheduleSet

__all__ = [
    "BACKWARD_DKV_TARGET",
    "CUSTOM_CALL_TARGETS",
    "BACKWARD_DQ_TARGET",
    "DELTA_TARGET",
    "FORWARD_TARGET",
    "HAS_CPU_EXT",
    "HAS_CUDA_EXT",
    "KERNELS",
    "RING_BACKWARD_DKV_TARGET",
    "RING_BACKWARD_DQ_TARGET",
    "RING_FORWARD_TARGET",
    "RING_TARGETS",
    "RingWalkSizes",
    "RingWalkTables",
    "SCHEDULED_BACKWARD_DKV_TARGET",
    "SCHEDULED_BACKWARD_DQ_DELTA_TARGET",
    "SCHEDULED_BACKWARD_DQ_TARGET",
    "SCHEDULED_FORWARD_TARGET",
    "SCHEDULED_TARGETS",
    "STENCIL_BACKWARD_DKV_TARGET",
    "STENCIL_BACKWARD_DQ_DELTA_TARGET",
    "STENCIL_BACKWARD_DQ_TARGET",
    "STENCIL_FORWARD_TARGET",
    "STENCIL_TARGETS",
    "TARGETS",
    "WindowSchedules",
    "choose_kernel",
    "ensure_registered",
    "export_disabled_checks",
    "ffi_backward_dkv",
    "ffi_backward_dq",
    "ffi_delta",
    "ffi_forward",
    "ffi_ring_backward_dkv",
    "ffi_ring_backward_dq",
    "ffi_ring_forward",
    "ffi_ring_scheduled_dkv",
    "ffi_ring_scheduled_dq_delta",
    "ffi_ring_scheduled_forward",
    "ffi_scheduled_dkv",
    "ffi_scheduled_dq",
    "ffi_scheduled_dq_delta",
    "ffi_scheduled_forward",
    "full_window",
    "kernel_limits",
    "native_backends",
    "native_status",
    "ring_unavailable_reason",
    "ring_walk_tables",
    "scheduled_unavailable_reason",
    "unavailable_reason",
]

# XLA keys handlers by (target name, platform); these are jax's platform spellings.
_PLATFORMS = {"cpu": "cpu", "cuda": "CUDA"}

#: Platforms jax_s2attn has native kernels for (built or not: see :func:`native_backends`), named
#: as the FFI names them.
NATIVE_PLATFORMS = tuple(MODULES)
_registered = False
_lock = threading.Lock()


# ----------------------------------------------------------------------------- targets
# The arc-segment kernels: both modules register exactly these (the general path, exact in float32).
FORWARD_TARGET = "jax_s2attn_nbhd_fwd"
BACKWARD_DQ_TARGET = "jax_s2attn_nbhd_bwd_dq"
BACKWARD_DKV_TARGET = "jax_s2attn_nbhd_bwd_dkv"
TARGETS = (FORWARD_TARGET, BACKWARD_DQ_TARGET, BACKWARD_DKV_TARGET)

# The scheduled tensor-core kernels (CUDA, sm_90a): block schedules in place of the plan's tables, of whole grids
# (the plan's) or of a shard's windows.
SCHEDULED_FORWARD_TARGET = "jax_s2attn_sched_fwd"
SCHEDULED_BACKWARD_DQ_TARGET = "jax_s2attn_sched_bwd_dq"
SCHEDULED_BACKWARD_DKV_TARGET = "jax_s2attn_sched_bwd_dkv"
SCHEDULED_BACKWARD_DQ_DELTA_TARGET = "jax_s2attn_sched_bwd_dq_delta"
SCHEDULED_TARGETS = (
    SCHEDULED_FORWARD_TARGET, SCHEDULED_BACKWARD_DQ_TARGET, SCHEDULED_BACKWARD_DKV_TARGET,
    SCHEDULED_BACKWARD_DQ_DELTA_TARGET,
)  # fmt: skip

# The stencil kernels (CUDA): the arc targets' operands with the walk's segment table in place of its arcs and the
# stencil pairs after them; they write the rows of the stencil pairs into results aliased to a scheduled target's,
# whose schedule leaves those rows' tiles out (whole grids).
STENCIL_FORWARD_TARGET = "jax_s2attn_stencil_fwd"
STENCIL_BACKWARD_DQ_TARGET = "jax_s2attn_stencil_bwd_dq"
STENCIL_BACKWARD_DKV_TARGET = "jax_s2attn_stencil_bwd_dkv"
# The stencil dq that forms its rows' delta from its own probabilities and dlse, beside the scheduled one.
STENCIL_BACKWARD_DQ_DELTA_TARGET = "jax_s2attn_stencil_bwd_dq_delta"
STENCIL_TARGETS = (
    STENCIL_FORWARD_TARGET, STENCIL_BACKWARD_DQ_TARGET, STENCIL_BACKWARD_DKV_TARGET, STENCIL_BACKWARD_DQ_DELTA_TARGET
)

# The arc walk between ring grids (CPU and CUDA): flat fields [..., npoints, H, D] and a RingPlan's patterns (the queries'
# walk for the forward and dq, the keys' walk for dk/dv).
RING_FORWARD_TARGET = "jax_s2attn_ring_fwd"
RING_BACKWARD_DQ_TARGET = "jax_s2attn_ring_bwd_dq"
RING_BACKWARD_DKV_TARGET = "jax_s2attn_ring_bwd_dkv"
RING_TARGETS = (RING_FORWARD_TARGET, RING_BACKWARD_DQ_TARGET, RING_BACKWARD_DKV_TARGET)

# The backward's delta = sum(dout * out, -1) - dlse: both modules, the arc kernels and the sharded op. A target
# of its own because XLA fuses that reduction differently in different programs (changing its
# last bit, and so the gradients'); the kernels sum in an order fixed by Dv alone.
DELTA_TARGET = "jax_s2attn_delta"

#: Every custom-call target a jax_s2attn program may contain (``jax.export`` needs them named).
CUSTOM_CALL_TARGETS = (*TARGETS, *SCHEDULED_TARGETS, *STENCIL_TARGETS, *RING_TARGETS, DELTA_TARGET)


def export_disabled_checks() -> list:
    """The ``disabled_checks`` argument of ``jax.export.export`` for programs that call jax_s2attn's
    native kernels: jax refuses to serialize custom calls it does not know unless told which.

    The deserializing process needs ``import jax_s2attn`` (which registers the targets and the plan's
    serialization) and the same native modules.
    """
    return [jax.export.DisabledSafetyCheck.custom_call(target) for target in CUSTOM_CALL_TARGETS]


#: The native kernel families: ``"arc"`` (arc-segment walk on CUDA cores or the CPU, the
#: dtypes of :attr:`~jax_s2attn._native.KernelLimits.arc_dtypes` and any head dims) and
#: ``"scheduled"`` (tensor cores by wgmma on block schedules, of whole grids or a shard's windows, beside the
#: CUDA-core stencil kernels on rows of short arcs; see :func:`scheduled_unavailable_reason`).
KERNELS = ("arc", "scheduled")


def dtype_names(dtypes) -> str:
    """``"float32, bfloat16 or float16"``."""
    names = [np.dtype(d).name for d in dtypes]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


def ffi_platform(platform: str) -> str:
    """The FFI's name of a jax platform name (jax says "gpu" for CUDA devices)."""
    return "cuda" if platform == "gpu" else platform


def unavailable_reason(platform: str, dk: int = 1, dv: int = 1) -> str | None:
    """Why the native (arc) kernels of ``platform`` ("cpu" or "cuda") cannot run heads of
    ``dk``/``dv`` channels; None if they can."""
    if platform not in MODULES:
        return f"jax_s2attn has no native kernels for platform {platform!r} (only for cpu and cuda)"
    module, reason = MODULES[platform]
    if module is None:
        return reason
    if platform == "cuda" and (devices := _cuda_devices_reason()) is not None:
        return devices
    limit = kernel_limits().cuda_arc_max_head_dims if platform == "cuda" else None
    if limit is not None and dk + dv > limit:
        return f"the CUDA kernels support Dk + Dv <= {limit}, got Dk={dk}, Dv={dv}"
    return None


def ring_unavailable_reason(platform: str, dtype, dk: int = 1, dv: int = 1) -> str | None:
    """Why the ring-grid arc kernels cannot run inputs of ``dtype`` and head dims ``dk``/``dv`` on ``platform``;
    None if they can."""
    reason = unavailable_reason(platform, dk, dv)
    if reason is not None:
        return reason
    arc_dtypes = kernel_limits().arc_dtypes
    if jnp.dtype(dtype) not in arc_dtypes:
        names = dtype_names(arc_dtypes)
        return f"the native kernels accumulate in float32 and take {names} inputs, got {jnp.dtype(dtype).name}"
    if not set(RING_TARGETS) <= set(_registrations(MODULES[platform][0])):
        return f"the {platform} module was built without the ring targets; rebuild jax_s2attn"
    return None


@functools.cache
def _registrations(module) -> tuple[str, ...]:
    """The target names ``module`` registers (registrations() builds capsules: cached)."""
    return tuple(module.registrations())


@functools.cache
def _cuda_build_facts(module) -> tuple[bool, tuple[str, ...] | None, tuple[str, ...] | None]:
    """Whether the CUDA ``module`` was built for sm_90a, the architectures it was built for (CMake's spelling, as
    its build_info() reports them; None if it does not) and the compute capabilities of this process's CUDA devices
    (None without a CUDA backend to ask): fixed for a process, so asked once."""
    limits = module.build_info()["limits"]
    sm90a = bool(limits.get("scheduled_sm90a", False))
    built = limits.get("cuda_architectures")
    architectures = None if built is None else tuple(a for a in str(built).split(",") if a)
    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        return sm90a, architectures, None
    return sm90a, architectures, tuple(sorted({str(getattr(d, "compute_capability", "unknown")) for d in devices}))


def has_kernels_for(architectures, capability: str) -> bool:
    """Whether a CUDA build for ``architectures`` (CMake's spelling: ``"80"``, ``"90a"``, ``"100f"``,
    ``"86-real"``, ``"80-virtual"``) has kernels for a device of compute ``capability`` (``"8.6"``): machine code
    of its major version and a lower or equal minor one, or PTX of a lower or equal version (which the driver
    compiles); arch-specific code (``"90a"``) runs on its own version only, family code (``"100f"``) on its major
    version. True where either cannot be read (``"native"``, an unknown capability): not refused here."""
    try:
        major, minor = (int(x) for x in capability.split("."))
        parsed = []
        for arch in architectures:
            name, _, kind = arch.partition("-")
            suffix = name[-1] if name[-1:] in ("a", "f") else ""
            parsed.append((divmod(int(name.removesuffix(suffix)), 10), suffix, kind))
    except ValueError:
        return True
    for version, suffix, kind in parsed:
        same_major = version[0] == major and version[1] <= minor
        if suffix == "a":
            runs = version == (major, minor)
        elif suffix == "f":
            runs = same_major
        else:
            runs = (kind != "virtual" and same_major) or (kind != "real" and version <= (major, minor))
        if runs:
            return True
    return False


def _cuda_devices_reason() -> str | None:
    """Why this process's CUDA devices have no kernels in the installed CUDA module (built for other
    architectures); None if they have, or where it cannot tell (no device to ask, a module that does not say)."""
    module, _ = MODULES["cuda"]
    if module is None:
        return None
    _, architectures, capabilities = _cuda_build_facts(module)
    if architectures is None or capabilities is None:
        return None
    missing = [c for c in capabilities if not has_kernels_for(architectures, c)]
    if not missing:
        return None
    example = missing[0].replace(".", "")
    return (
        f"the installed _s2attn_cuda has kernels for {', '.join(architectures)} (CMAKE_CUDA_ARCHITECTURES), none for "
        f"this process's GPUs of compute capability {', '.join(missing)}; rebuild jax_s2attn with their architecture "
        f'added, e.g. CMAKE_CUDA_ARCHITECTURES="{example};90a"'
    )


def _scheduled_build_reason() -> str | None:
    """Why this process cannot run the scheduled kernels whatever the inputs (the CUDA module, a build for
    sm_90a, an sm_90 device: compute capability 9.0); None if it can, or if it has no CUDA device to ask (a
    program lowered for CUDA elsewhere)."""
    module, reason = MODULES["cuda"]
    if module is None:
        return reason
    sm90a, _, capabilities = _cuda_build_facts(module)
    if not sm90a:
        return "the installed _s2attn_cuda was not built for sm_90a (CMAKE_CUDA_ARCHITECTURES=90a)"
    if capabilities is None or capabilities == ("9.0",):
        return None
    return f"they run on compute capability 9.0 (H100, H200), this process has {', '.join(capabilities)}"


def scheduled_unavailable_reason(platform: str, dtype, dk: int, dv: int) -> str | None:
    """Why the scheduled tensor-core kernels cannot run inputs of ``dtype`` with heads of ``dk``/``dv``
    channels on ``platform``; None if they can.

    They need a CUDA module built for sm_90a, an sm_90 device, and the dtypes and head dims of
    :func:`kernel_limits` (``scheduled_*``); they take whole grids and the blocks of a sharded grid alike.
    """
    reasons = []
    if platform != "cuda":
        reasons.append(f"they run only on CUDA GPUs, not on {platform}")
    else:
        build = _scheduled_build_reason()
        if build is not None:
            reasons.append(build)
    limits = kernel_limits()
    if limits is not None:
        if jnp.dtype(dtype) not in limits.scheduled_dtypes:
            reasons.append(f"they take {dtype_names(limits.scheduled_dtypes)} inputs, got {jnp.dtype(dtype).name}")
        if dk != dv or dk not in limits.scheduled_head_dims:
            dims = ", ".join(map(str, limits.scheduled_head_dims))
            reasons.append(f"they need Dk == Dv in ({dims}), got Dk={dk}, Dv={dv}")
    return f"the scheduled kernels cannot run: {'; '.join(reasons)}" if reasons else None


def choose_kernel(platform: str, dtype, dk: int, dv: int) -> str:
    """The native kernel for these inputs on ``platform``: ``"scheduled"`` (tensor cores) where it can run,
    ``"arc"`` (the general path) everywhere else."""
    return "scheduled" if scheduled_unavailable_reason(platform, dtype, dk, dv) is None else "arc"


def ensure_registered() -> None:
    """Register every FFI target of the built modules (idempotent, thread-safe); done on import, so that
    a deserialized ``jax.export`` program finds them.

    Registration does not start a backend: jaxlib queues targets per platform.
    """
    global _registered
    with _lock:
        if _registered:
            return
        for platform, (module, _) in MODULES.items():
            if module is None:
                continue
            for name, capsule in module.registrations().items():
                jax.ffi.register_ffi_target(name, capsule, platform=_PLATFORMS[platform])
        _registered = True


# ----------------------------------------------------------------------------- FFI calls
# Per step of the arc kernels: the target and the table it walks, as (offsets, entries) names of PlanTables fields;
# the entries name is also the plan's host table (residues, shift). Forward and dQ walk the forward (query-owned)
# table, dK/dV the backward (key-owned) one.
_STEPS = {
    "forward": (FORWARD_TARGET, "forward_offsets", "forward_arcs"),
    "dq": (BACKWARD_DQ_TARGET, "forward_offsets", "forward_arcs"),
    "dkv": (BACKWARD_DKV_TARGET, "backward_offsets", "backward_arcs"),
}


def _step(plan, step: str, scale) -> tuple[str, tuple, dict]:
    """``(target, (offsets, entries) operands, attributes)`` of the arc kernels' ``step`` ("forward", "dq" or
    "dkv")."""
    target, offsets, entries = _STEPS[step]
    tables = plan.tables
    operands = (getattr(tables, offsets), getattr(tables, entries))
    return target, operands, _attributes(plan, getattr(plan, entries), scale)


def _attributes(plan, table, scale) -> dict:
    """FFI attributes of a call walking ``table``, with the exact types the handlers bind."""
    return {
        "scale": np.float32(scale),
        "residues": np.int64(table.residues),
        "shift": np.int64(table.shift),
        "nlat_q": np.int64(plan.nlat_out),
        "nlon_q": np.int64(plan.nlon_out),
        "nlat_k": np.int64(plan.nlat_in),
        "nlon_k": np.int64(plan.nlon_in),
    }


def _varying_axes(x) -> frozenset:
    """Manual mesh axes ``x`` varies over inside ``shard_map`` (empty outside)."""
    return jax.typeof(x).manual_axis_type.varying


def _vary_together(operands):
    """Cast every operand to the union of the operands' varying manual axes.

    Inside ``shard_map`` an FFI call needs operands of one varying type; doing the
    cast here (instead of leaving it to ``ffi_call``) lets the results be typed
    like any one operand.
    """
    varying = [_varying_axes(x) for x in operands]
    union = frozenset().union(*varying)
    return [
        x if axes == union else jax.lax.pcast(x, tuple(union - axes), to="varying")
        for x, axes in zip(operands, varying)
    ]


def _result_type(like, shape, dtype) -> jax.ShapeDtypeStruct:
    """Result type; inside ``shard_map`` it varies over ``like``'s manual axes."""
    aval = jax.typeof(like)
    if not aval.manual_axis_type.varying:
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(
        shape,
        dtype,
        sharding=jax.NamedSharding(aval.sharding.mesh, jax.sharding.PartitionSpec()),
        manual_axis_type=aval.manual_axis_type,
    )


def _call(target, operands, result_shapes, attributes, poison_results, result_dtype=jnp.float32, initial=None):
    """One ``ffi_call`` with results of ``result_shapes``, all of ``result_dtype`` (or, a tuple,
    one dtype per result).

    With ``poison_results`` (a test aid) every result buffer starts as NaN: NaN-filled
    operands are appended and aliased to the results, so an element a kernel forgets
    to write stays NaN. ``initial`` (arrays of the results' shapes and dtypes) is appended and aliased the
    same way: the call updates them in place (the stencil targets write their rows into a scheduled target's
    results). The handlers ignore the extra operands.
    """
    dtypes = result_dtype if isinstance(result_dtype, tuple) else (result_dtype,) * len(result_shapes)
    operands = [jnp.asarray(x) for x in operands]
    if poison_results and initial is None:
        initial = [jnp.full(shape, jnp.nan, dtype) for shape, dtype in zip(result_shapes, dtypes, strict=True)]
    if initial is not None:
        operands += [jnp.asarray(x) for x in initial]
    operands = _vary_together(operands)
    results = [_result_type(operands[0], shape, dtype) for shape, dtype in zip(result_shapes, dtypes, strict=True)]
    first_alias = len(operands) - len(result_shapes)
    aliases = {first_alias + i: i for i in range(len(result_shapes))} if initial is not None else None
    call = jax.ffi.ffi_call(target, results, vmap_method="broadcast_all", input_output_aliases=aliases)
    return call(*operands, **attributes)


def _index(x):
    return jnp.asarray(x, jnp.int32)


def _grid_dims(name, x) -> tuple:
    """``(leading dims, nlat, nlon, heads)`` of an activation ``[..., nlat, nlon, H, D]``."""
    if len(x.shape) < 4:
        raise ValueError(f"{name} must have shape [..., nlat, nlon, heads, head_dim], got shape {tuple(x.shape)}.")
    *lead, nlat, nlon, heads, _ = x.shape
    return tuple(lead), nlat, nlon, heads


def ffi_forward(query, key, value, plan, window, row_order, *, scale, poison_results=False):
    """The arc kernels' forward target: ``(out, lse)`` over the keys inside ``window``, both float32.

    Activations ``query [..., nq_lat, nq_lon, H, Dk]``, ``key [..., nk_lat, nk_lon, H, Dk]``,
    ``value [..., nk_lat, nk_lon, H, Dv]`` (local blocks, equal leading dims, one dtype);
    ``window`` int32[8] (cuda/README.md); ``row_order`` int32 local query rows, longest
    first. Returns ``out [..., nq_lat, nq_lon, H, Dv]`` and ``lse [..., nq_lat, nq_lon, H]``;
    a query without neighbours in the window gets ``out = 0``, ``lse = -inf``.

    Beyond the query's rank, shapes and dtypes are checked by the handler (``INVALID_ARGUMENT``).
    ``poison_results`` (all three targets) is a test aid: results start as NaN, so any
    element a kernel leaves unwritten shows.
    """
    target, walk, attributes = _step(plan, "forward", scale)
    lead, nq_lat, nq_lon, heads = _grid_dims("query", query)
    operands = (query, key, value, _index(window), _index(row_order), *walk, plan.quad_weights)
    shapes = [(*lead, nq_lat, nq_lon, heads, value.shape[-1]), (*lead, nq_lat, nq_lon, heads)]
    out, lse = _call(target, operands, shapes, attributes, poison_results)
    return out, lse


def ffi_backward_dq(query, key, value, dout, lse, delta, plan, window, row_order, *, scale, poison_results=False):
    """The arc kernels' dQ target (shaped like ``query``, float32) over the keys inside ``window``.

    ``lse`` and ``delta = sum(dout * out, -1)`` are float32 ``[..., nq_lat, nq_lon, H]``
    and global (merged over every key block); ``row_order`` holds local query rows.
    """
    target, walk, attributes = _step(plan, "dq", scale)
    operands = (query, key, value, dout, lse, delta, _index(window), _index(row_order), *walk, plan.quad_weights)
    (dq,) = _call(target, operands, [query.shape], attributes, poison_results)
    return dq


def ffi_backward_dkv(query, key, value, dout, lse, delta, plan, window, row_order, *, scale, poison_results=False):
    """The arc kernels' dK/dV target: ``(dk, dv)``, shaped like ``key`` and ``value``, float32.

    Sums over the queries inside ``window`` (walking the transposed table); ``row_order``
    holds local key rows. ``lse``/``delta`` as in :func:`ffi_backward_dq`.
    """
    target, walk, attributes = _step(plan, "dkv", scale)
    operands = (query, key, value, dout, lse, delta, _index(window), _index(row_order), *walk, plan.quad_weights)
    dk, dv = _call(target, operands, [key.shape, value.shape], attributes, poison_results)
    return dk, dv


class WindowSchedules(NamedTuple):
    """The scheduled kernels' walks for the calls of one sharded layout: the forward (query tiles over key chunks)
    and backward (key tiles over query chunks) :class:`~jax_s2attn.schedule.ScheduleSet` of every window the
    layout has, and ``index`` (int32, may be traced) of this call's window in both."""

    forward: ScheduleSet
    backward: ScheduleSet
    index: jax.Array


def full_window(plan) -> np.ndarray:
    """The window of a serial call: every query and every key, int32 ``[8]``."""
    return np.array([0, 0, *plan.out_shape, 0, 0, *plan.in_shape], dtype=np.int32)


class StencilSchedule(NamedTuple):
    """A walk's schedule beside the stencil rows, as the kernels take it.

    Attributes:
      schedule: the plan's block schedule without the stencil rows' tiles, in the regular format or (``flat``) in
        the ring grids' (:func:`~jax_s2attn.schedule.as_runs`: the arrays go to the kernels as grids of one row).
      pairs: the stencil pairs whose rows it leaves out (:meth:`~jax_s2attn.NeighborhoodPlan.tile_stencil_pairs`
        of its tiles' rows), what the stencil targets take.
      flat: whether ``schedule`` is in the ring grids' format.
      stencil_tiles: the walking grid's tiles of its shape it leaves out (the scheduled targets' attribute).
    """

    schedule: BlockSchedule
    pairs: np.ndarray
    flat: bool
    stencil_tiles: int


def stencil_schedule(plan, walk: str) -> StencilSchedule:
    """The schedule of ``walk`` ("forward" or "backward") the scheduled targets take beside the stencil targets on
    ``plan``'s whole grids: of the kernels' tiles (``scheduled_shape``: 4 × 16 walking points) and tiles of one
    row (1 × 64, in the ring grids' format, ``scheduled_runs``), the one that multiplies fewer chunks. Rows of
    short arcs go to the stencil kernels, so the rows left are the polar ones, whose arcs at the default cutoff
    span tens of longitudes: there 64 consecutive points of one row share more of their chunks than 16 of four
    rows (``docs/performance.md``, "What each tile shape multiplies")."""
    limits = kernel_limits()
    tile_rows, tile_cols, chunk_cols = limits.scheduled_shape
    nlat, nlon = plan.out_shape if walk == "forward" else plan.in_shape

    def chosen(schedule, rows, cols, flat):
        tiles = -(-nlat // rows) * -(-nlon // cols)
        pairs = plan.tile_stencil_pairs(walk, tile_rows=rows)
        return StencilSchedule(schedule, pairs, flat, tiles - schedule.tiles.shape[0])

    shape = dict(tile_rows=tile_rows, tile_cols=tile_cols, chunk_cols=chunk_cols)
    if not len(plan.tile_stencil_pairs(walk, tile_rows=1)):  # the walk has no stencil pairs: all of it
        return chosen(plan.block_schedule(walk, **shape), tile_rows, tile_cols, False)
    rows = plan.block_schedule(walk, **shape, stencil=True)
    points = tile_rows * tile_cols
    one_row = plan.block_schedule(walk, tile_rows=1, tile_cols=points, chunk_cols=chunk_cols, stencil=True,
                                  runs=limits.scheduled_runs)  # fmt: skip
    if one_row.chunks.shape[0] < rows.chunks.shape[0]:  # a tie keeps the kernels' own tiles
        return chosen(one_row, 1, points, True)
    return chosen(rows, tile_rows, tile_cols, False)


def _scheduled_operands(
    plan, walk: str, scale, query, key, window=None, schedules=None, stencil=False
) -> tuple[tuple, dict]:  # fmt: skip
    """The schedule operands (tiles, tile_offsets, chunks, records, quad_weights) of ``walk`` in the kernels'
    shape and the attributes of a scheduled call on ``query``'s and ``key``'s grids: the plan's schedule for whole
    grids (with ``stencil``, :func:`stencil_schedule`; in the ring grids' format, the attribute ``ring_grids``,
    the arrays go as grids of one row: :func:`_scheduled_call`), or with ``window`` (int32 ``[8]``) and ``schedules``
    (:class:`WindowSchedules`) the window's, with the quadrature weights of the key arrays' rows."""
    tile_rows, tile_cols, chunk_cols = kernel_limits().scheduled_shape
    if (window is None) != (schedules is None):
        raise ValueError("window and schedules go together: pass both (a shard's blocks) or neither (whole grids).")
    if stencil and schedules is not None:
        raise ValueError("stencil=True needs whole grids; the blocks of a sharded grid take no stencil rows.")
    stencil_tiles, flat = 0, False
    if schedules is None:
        if stencil:
            s, _, flat, stencil_tiles = stencil_schedule(plan, walk)
        else:
            s = plan.block_schedule(walk, tile_rows=tile_rows, tile_cols=tile_cols, chunk_cols=chunk_cols)
        tiles, tile_offsets = s.tiles, s.tile_offsets
        weights = np.repeat(plan.quad_weights, plan.nlon_in) if flat else plan.quad_weights  # per key point
    else:
        s = schedules.forward if walk == "forward" else schedules.backward
        if (s.tile_rows, s.tile_cols, s.chunk_cols) != (tile_rows, tile_cols, chunk_cols):
            kernels = (tile_rows, tile_cols, chunk_cols)
            raise ValueError(f"the window schedules' shape {tuple(s[4:7])} is not the kernels' {kernels}.")
        index = _index(schedules.index)
        tiles, tile_offsets = jnp.asarray(s.tiles)[index], jnp.asarray(s.tile_offsets)[index]
        rows = _index(window)[4] + jnp.arange(key.shape[-4], dtype=jnp.int32)
        weights = jnp.asarray(plan.quad_weights)[jnp.clip(rows, 0, plan.nlat_in - 1)]
    _, nq_lat, nq_lon, _ = _grid_dims("query", query)
    _, nk_lat, nk_lon, _ = _grid_dims("key", key)
    if schedules is None and ((nq_lat, nq_lon), (nk_lat, nk_lon)) != (plan.out_shape, plan.in_shape):
        raise ValueError(
            f"query grid {nq_lat}x{nq_lon} and key grid {nk_lat}x{nk_lon} must be the plan's {plan.out_shape} and "
            f"{plan.in_shape} (or pass window and schedules for a shard's blocks)."
        )
    walking, (nlat_walk, nlon_walk) = ("query", (nq_lat, nq_lon)) if walk == "forward" else ("key", (nk_lat, nk_lon))
    if schedules is not None and (nlat_walk, nlon_walk) != (s.nlat_walk, s.nlon_walk):
        raise ValueError(
            f"the {walking} blocks are {nlat_walk}x{nlon_walk}, the window schedules' walking blocks "
            f"{s.nlat_walk}x{s.nlon_walk}: build the schedules for these blocks (parallel.layout.window_schedules)."
        )
    operands = (_index(tiles), _index(tile_offsets), _index(s.chunks), _index(s.records), weights)
    grids = ((1, nq_lat * nq_lon), (1, nk_lat * nk_lon)) if flat else ((nq_lat, nq_lon), (nk_lat, nk_lon))
    return operands, _scheduled_attributes(s, scale, *grids, stencil_tiles, ring_grids=flat)


def _scheduled_call(target, arrays, schedule, shapes, attributes, poison_results, dtypes) -> list:
    """The scheduled ``target`` on ``arrays`` (q first, then activations and per-point operands ``[..., nlat,
    nlon, ...]`` of whole grids) and ``schedule``'s operands, results of ``shapes``. Where the schedule is in the ring
    grids' format (attribute ``ring_grids``, :func:`stencil_schedule`) the grids go as grids of one row, which
    for contiguous arrays is only another shape."""
    if not attributes["ring_grids"]:
        return _call(target, (*arrays, *schedule), shapes, attributes, poison_results, dtypes)
    lead = arrays[0].ndim - 4  # q [..., nlat, nlon, H, D]

    def one_row(shape):
        return (*shape[:lead], 1, shape[lead] * shape[lead + 1], *shape[lead + 2 :])

    flat = [x.reshape(one_row(x.shape)) for x in arrays]
    results = _call(target, (*flat, *schedule), [one_row(s) for s in shapes], attributes, poison_results, dtypes)
    return [r.reshape(s) for r, s in zip(results, shapes)]


def _scheduled_attributes(schedule, scale, query_grid, key_grid, stencil_tiles=0, ring_grids=False) -> dict:
    """The attributes of a scheduled call on ``schedule`` (a :class:`~jax_s2attn.schedule.BlockSchedule` or a ring
    grids' schedule in the kernels' shape) between the arrays' ``query_grid`` and ``key_grid`` ``(rows,
    longitudes)`` (cuda/README.md, "Scheduled targets")."""
    (nq_lat, nq_lon), (nk_lat, nk_lon) = query_grid, key_grid
    sizes = dict(classes=schedule.classes, shift=schedule.shift, nlat_q=nq_lat, nlon_q=nq_lon, nlat_k=nk_lat,
                 nlon_k=nk_lon, ring_nlon=schedule.nlon, tile_rows=schedule.tile_rows, tile_cols=schedule.tile_cols,
                 chunk_cols=schedule.chunk_cols, stencil_tiles=stencil_tiles)  # fmt: skip
    return {"scale": np.float32(scale), **{k: np.int64(v) for k, v in sizes.items()}, "ring_grids": bool(ring_grids)}


def _stencil_rows(target, walk: str, operands, plan, scale, results, dtypes) -> tuple:
    """``results`` of a scheduled call on whole grids whose schedule left out the stencil rows' tiles, with those
    rows (the pairs of :func:`stencil_schedule` of ``walk``) written in place by the stencil target ``target`` on
    the operands before its tables: the scheduled call's activations (and, for the dq that forms delta, dlse)."""
    tables = (getattr(plan.tables, f"{walk}_{name}") for name in ("row_order", "segment_offsets", "segments"))
    pairs = stencil_schedule(plan, walk).pairs
    operands = (*operands, full_window(plan), *tables, plan.quad_weights, pairs)
    attributes = _attributes(plan, getattr(plan, f"{walk}_segments"), scale)
    return tuple(_call(target, operands, [x.shape for x in results], attributes, False, dtypes, initial=results))


def _scheduled_result_dtype(dtype, query, name: str) -> jnp.dtype:
    """``dtype`` (the argument ``name``) checked: float32 or the activations' dtype."""
    dtype = jnp.dtype(dtype)
    if dtype in (jnp.dtype(jnp.float32), jnp.dtype(query.dtype)):
        return dtype
    raise ValueError(f"{name} must be float32 or {jnp.dtype(query.dtype).name} (the dtype of query), got {dtype.name}.")


def ffi_scheduled_forward(
    query, key, value, plan, *, scale, out_dtype=jnp.float32, float32_out=False, poison_results=False, window=None,
    schedules=None, stencil=False,
):  # fmt: skip
    """The scheduled forward target: ``(out, lse)`` of whole grids (``query [..., nlat_out, nlon_out, H, D]``,
    ``key``/``value [..., nlat_in, nlon_in, H, D]``) on ``plan``'s forward block schedule, or of a shard's local
    blocks over the keys inside ``window`` (int32 ``[8]``, cuda/README.md "Windows") on its schedule in
    ``schedules`` (:class:`WindowSchedules`): results as the other targets' over a window (padding: out 0, lse
    -inf).

    P is rounded once to the activations' dtype for P·V and out divided by the row sums of that rounded P
    (a delta formed from a float32 out then agrees with the backward's probabilities on smooth fields);
    ``lse`` comes from float32 sums. ``out_dtype``: float32 (what the backward forms delta from) or the
    activations' dtype (the float32 result rounded to nearest). The caller checks that the kernels can
    run (:func:`scheduled_unavailable_reason`); the handler checks shapes and dtypes.

    ``float32_out`` (with ``out_dtype`` the activations' dtype): ``(out, lse, out_f32)``, the same out also in
    float32, what the differentiated op keeps for delta, written by the same kernel.

    ``stencil`` (all three scheduled targets; whole grids): the stencil kernels take the rows of the plan's
    :meth:`~jax_s2attn.NeighborhoodPlan.tile_stencil_pairs` (the stencil target, writing into the scheduled
    call's results), the scheduled kernels every other row. ``out_f32`` then holds the scheduled rows only (the
    stencil rows are left unwritten: the stencil dq forms their delta from its own probabilities,
    :func:`ffi_scheduled_dq_delta`).
    """
    dtype = _scheduled_result_dtype(out_dtype, query, "out_dtype")
    if float32_out and dtype != jnp.dtype(query.dtype):
        raise ValueError(f"float32_out=True needs out_dtype={jnp.dtype(query.dtype).name} (the dtype of query): the "
                         f"float32 out is the third result, got out_dtype={dtype.name}.")  # fmt: skip
    schedule, attributes = _scheduled_operands(plan, "forward", scale, query, key, window, schedules, stencil)
    lead, nq_lat, nq_lon, heads = _grid_dims("query", query)
    out_shape = (*lead, nq_lat, nq_lon, heads, value.shape[-1])
    shapes = [out_shape, (*lead, nq_lat, nq_lon, heads)] + [out_shape] * float32_out
    dtypes = (dtype, jnp.dtype(jnp.float32)) + (jnp.dtype(jnp.float32),) * float32_out
    results = _scheduled_call(SCHEDULED_FORWARD_TARGET, (query, key, value), schedule, shapes, attributes,
                              poison_results, dtypes)  # fmt: skip
    if stencil:
        written = _stencil_rows(STENCIL_FORWARD_TARGET, "forward", (query, key, value), plan, scale, results[:2],
                                dtypes[:2])  # fmt: skip
        results = [*written, *results[2:]]
    return tuple(results)


def ffi_scheduled_dq(
    query, key, value, dout, lse, delta, plan, *, scale, gradient_dtype=jnp.float32, poison_results=False,
    window=None, schedules=None, stencil=False,
):  # fmt: skip
    """The scheduled dq target (shaped like ``query``): ``lse`` and ``delta = sum(dout * out, -1) - dlse``
    float32 ``[..., nlat_out, nlon_out, H]`` (global: the whole grid's); ``gradient_dtype`` float32 or the
    activations' dtype; ``window``, ``schedules`` and ``stencil`` as for :func:`ffi_scheduled_forward` (dq over
    the window's keys)."""
    dtype = _scheduled_result_dtype(gradient_dtype, query, "gradient_dtype")
    schedule, attributes = _scheduled_operands(plan, "forward", scale, query, key, window, schedules, stencil)
    operands = (query, key, value, dout, lse, delta)
    results = _scheduled_call(SCHEDULED_BACKWARD_DQ_TARGET, operands, schedule, [query.shape], attributes,
                              poison_results, dtype)  # fmt: skip
    if stencil:
        results = _stencil_rows(STENCIL_BACKWARD_DQ_TARGET, "forward", operands, plan, scale, results, dtype)
    return results[0]


def ffi_scheduled_dq_delta(
    query, key, value, dout, lse, out, dlse, plan, *, scale, gradient_dtype=jnp.float32, poison_results=False,
    stencil=False,
):  # fmt: skip
    """The scheduled dq that forms delta itself: ``(dq, delta)``, whole grids.

    As :func:`ffi_scheduled_dq`, but given the forward's float32 ``out`` and ``dlse`` (as :func:`ffi_delta` takes
    them) in place of delta: each block forms ``delta = sum(dout * out, -1) - dlse`` of its query tile at its
    entry, in a fixed order (not the delta target's: the last bits may differ), uses it, and returns it for
    :func:`ffi_scheduled_dkv`, so that the op needs no delta target between the passes. With ``stencil`` the
    stencil target forms the delta of the stencil rows as ``sum_j p_j (dout . v_j) / sum_j p_j - dlse`` from its own
    (float32, never rounded) probabilities, without reading ``out`` there, and its dq as ``scale (sum_j p_j (dout .
    v_j) k_j - delta sum_j p_j k_j)`` (equal to the dq given that delta up to float32 round-off, not in every bit).
    Where dq is summed over key windows (the sharded op), :func:`ffi_delta` forms delta instead."""
    dtype = _scheduled_result_dtype(gradient_dtype, query, "gradient_dtype")
    schedule, attributes = _scheduled_operands(plan, "forward", scale, query, key, stencil=stencil)
    dout, out, dlse = _delta_operands(dout, out, dlse)
    dtypes = (dtype, jnp.dtype(jnp.float32))
    results = _scheduled_call(SCHEDULED_BACKWARD_DQ_DELTA_TARGET, (query, key, value, dout, lse, out, dlse),
                              schedule, [query.shape, dlse.shape], attributes, poison_results, dtypes)  # fmt: skip
    if stencil:
        operands = (query, key, value, dout, lse, dlse)
        results = _stencil_rows(STENCIL_BACKWARD_DQ_DELTA_TARGET, "forward", operands, plan, scale, results, dtypes)
    return tuple(results)


def ffi_scheduled_dkv(
    query, key, value, dout, lse, delta, plan, *, scale, gradient_dtype=jnp.float32, poison_results=False,
    window=None, schedules=None, stencil=False,
):  # fmt: skip
    """The scheduled dk/dv target on ``plan``'s backward block schedule (or the window's: over the window's
    queries): ``(dk, dv)`` shaped like ``key`` and ``value``; operands as :func:`ffi_scheduled_dq` (``stencil``:
    the key rows of the backward walk's stencil pairs on the stencil target)."""
    dtype = _scheduled_result_dtype(gradient_dtype, query, "gradient_dtype")
    schedule, attributes = _scheduled_operands(plan, "backward", scale, query, key, window, schedules, stencil)
    operands = (query, key, value, dout, lse, delta)
    results = _scheduled_call(SCHEDULED_BACKWARD_DKV_TARGET, operands, schedule, [key.shape, value.shape],
                              attributes, poison_results, dtype)  # fmt: skip
    if stencil:
        results = _stencil_rows(STENCIL_BACKWARD_DKV_TARGET, "backward", operands, plan, scale, results, dtype)
    return tuple(results)


# ----------------------------------------------------------------------------- ring grids


class RingWalkTables(NamedTuple):
    """The table operands of a ring target (common/ring_walk.h): int32 ``walk_rings [rings, 4]``, ``ring_order
    [rings]``, ``pattern_offsets [patterns + 1]``, ``pattern_arcs [arcs, 6]`` and float32 ``quad_weights`` (per
    input ring: the visited rings of the queries' walk, the walking rings of the keys')."""

    walk_rings: np.ndarray
    ring_order: np.ndarray
    pattern_offsets: np.ndarray
    pattern_arcs: np.ndarray
    quad_weights: np.ndarray


class RingWalkSizes(NamedTuple):
    """The ring targets' attributes: the sizes of one copy of a walk's tables."""

    walk_ring_count: int
    visited_ring_count: int
    pattern_count: int
    max_ring_points: int


@functools.lru_cache(maxsize=32)
def ring_walk_tables(plan, walk: str) -> tuple[RingWalkTables, RingWalkSizes]:
    """The tables (host numpy) and sizes of ``plan``'s walk, "queries" (the forward and dq) or "keys" (dk/dv), as
    the ring targets take them."""
    patterns = plan.patterns if walk == "queries" else plan.key_patterns
    walking, visited = (plan.grid_out, plan.grid_in) if walk == "queries" else (plan.grid_in, plan.grid_out)
    walk_rings = np.stack([walking.ring_offsets[:-1], walking.nlon, patterns.ring_patterns[:-1], patterns.period],
                          axis=1).astype(np.int32)  # fmt: skip
    tables = RingWalkTables(
        walk_rings=walk_rings,
        ring_order=np.argsort(-walking.nlon, kind="stable").astype(np.int32),  # most points first
        pattern_offsets=patterns.offsets.astype(np.int32),
        pattern_arcs=patterns.arcs,
        quad_weights=(2.0 * np.pi * plan.grid_in.weights / plan.grid_in.nlon).astype(np.float32),
    )
    for table in tables:
        table.setflags(write=False)
    sizes = RingWalkSizes(walking.nrings, visited.nrings, len(patterns.offsets) - 1, int(walking.nlon.max()))
    return tables, sizes


def _ring_call(target, operands, tables: RingWalkTables, sizes: RingWalkSizes, scale, result_shapes,
               poison_results):  # fmt: skip
    attributes = {"scale": np.float32(scale), **{name: np.int64(value) for name, value in sizes._asdict().items()}}
    return _call(target, (*operands, *tables), result_shapes, attributes, poison_results)


def _flat_dims(name, x) -> tuple:
    """``(leading dims, npoints, heads)`` of a flat activation ``[..., npoints, H, D]``."""
    if len(x.shape) < 3:
        raise ValueError(f"{name} must have shape [..., npoints, heads, head_dim], got shape {tuple(x.shape)}.")
    return tuple(x.shape[:-3]), x.shape[-3], x.shape[-2]


def ffi_ring_forward(query, key, value, tables: RingWalkTables, sizes: RingWalkSizes, *, scale,
                     poison_results=False):  # fmt: skip
    """Ring forward target: ``(out, lse)``, both float32, of attention walking the queries' ``tables`` and
    ``sizes`` (:func:`ring_walk_tables` of a :class:`~jax_s2attn.RingPlan`, or a shard's).

    ``query [..., npoints_out, H, Dk]``, ``key [..., npoints_in, H, Dk]``, ``value [..., npoints_in, H, Dv]`` in
    ring order (equal leading dims, one dtype: float32, bfloat16 or float16). Returns ``out [..., npoints_out, H,
    Dv]`` and ``lse [..., npoints_out, H]``. Beyond the query's rank, the handler checks shapes and dtypes
    (``INVALID_ARGUMENT``). ``poison_results`` (all three ring targets) is a test aid: results start as NaN.
    """
    lead, points, heads = _flat_dims("query", query)
    shapes = [(*lead, points, heads, value.shape[-1]), (*lead, points, heads)]
    out, lse = _ring_call(RING_FORWARD_TARGET, (query, key, value), tables, sizes, scale, shapes, poison_results)
    return out, lse


def ffi_ring_backward_dq(query, key, value, dout, lse, delta, tables: RingWalkTables, sizes: RingWalkSizes, *,
                         scale, poison_results=False):  # fmt: skip
    """Ring dq target: ``dq`` (float32, the shape of ``query``) from the forward's ``lse`` and ``delta``
    (:func:`ffi_delta`), both float32 ``[..., npoints_out, H]``; the queries' walk."""
    operands = (query, key, value, dout, lse, delta)
    (dq,) = _ring_call(RING_BACKWARD_DQ_TARGET, operands, tables, sizes, scale, [query.shape], poison_results)
    return dq


def ffi_ring_backward_dkv(query, key, value, dout, lse, delta, tables: RingWalkTables, sizes: RingWalkSizes, *,
                          scale, poison_results=False):  # fmt: skip
    """Ring dk/dv target: ``(dk, dv)`` (float32, the shapes of ``key`` and ``value``); the keys' walk
    (:attr:`~jax_s2attn.RingPlan.key_patterns`)."""
    operands = (query, key, value, dout, lse, delta)
    dk, dv = _ring_call(RING_BACKWARD_DKV_TARGET, operands, tables, sizes, scale, [key.shape, value.shape],
                        poison_results)  # fmt: skip
    return dk, dv


def _ring_scheduled_operands(plan, walk: str, scale) -> tuple[tuple, dict]:
    """The operands (tiles, tile_offsets, chunks, records, quad_weights per input point) and attributes of a
    scheduled call on ``plan``'s ring block schedule of ``walk`` (:func:`~jax_s2attn.ring_schedule.ring_block_schedule`
    in the kernels' shape): the flat fields as grids of one row."""
    limits = kernel_limits()
    runs, run_points = limits.scheduled_runs
    s = ring_block_schedule(plan, walk, runs=runs, run_points=run_points, chunk_cols=limits.scheduled_shape[2])
    weights = plan.grid_in.point_weights().astype(np.float32)
    operands = (s.tiles, s.tile_offsets, s.chunks, s.records, weights)
    return operands, _scheduled_attributes(s, scale, (1, plan.npoints_out), (1, plan.npoints_in), ring_grids=True)


def ffi_ring_scheduled_forward(query, key, value, plan, *, scale, out_dtype=jnp.float32, poison_results=False):
    """The scheduled forward target between ring grids: ``(out, lse)`` of flat fields (``query [..., npoints_out,
    H, D]``, ``key``/``value [..., npoints_in, H, D]``, bfloat16 or float16, ``D`` one of the scheduled head dims)
    on ``plan``'s ring block schedule; ``out_dtype`` float32 or the activations' dtype, ``lse`` float32. As
    :func:`ffi_scheduled_forward`: P rounded once, out divided by the rounded P's row sums."""
    dtype = _scheduled_result_dtype(out_dtype, query, "out_dtype")
    schedule, attributes = _ring_scheduled_operands(plan, "forward", scale)
    lead, points, heads = _flat_dims("query", query)
    shapes = [(*lead, 1, points, heads, value.shape[-1]), (*lead, 1, points, heads)]
    operands = (*(x.reshape(*lead, 1, *x.shape[-3:]) for x in (query, key, value)), *schedule)
    out, lse = _call(SCHEDULED_FORWARD_TARGET, operands, shapes, attributes, poison_results,
                     (dtype, jnp.dtype(jnp.float32)))  # fmt: skip
    return out.reshape(*lead, points, heads, value.shape[-1]), lse.reshape(*lead, points, heads)


def ffi_ring_scheduled_dq_delta(
    query, key, value, dout, lse, out, dlse, plan, *, scale, gradient_dtype=jnp.float32, poison_results=False
):  # fmt: skip
    """The scheduled dq between ring grids that forms delta itself: ``(dq, delta)`` from the forward's float32
    ``out`` and ``dlse`` (float32 ``[..., npoints_out, H]``), as :func:`ffi_scheduled_dq_delta` on flat fields."""
    dtype = _scheduled_result_dtype(gradient_dtype, query, "gradient_dtype")
    schedule, attributes = _ring_scheduled_operands(plan, "forward", scale)
    lead, points, heads = _flat_dims("query", query)
    grid = [x.reshape(*lead, 1, *x.shape[-3:]) for x in (query, key, value, dout, out)]
    rows = [x.reshape(*lead, 1, points, heads) for x in (lse, dlse)]
    dout_, out_, dlse_ = _delta_operands(grid[3], grid[4], rows[1])
    operands = (*grid[:3], dout_, rows[0], out_, dlse_, *schedule)
    dq, delta = _call(SCHEDULED_BACKWARD_DQ_DELTA_TARGET, operands, [grid[0].shape, rows[1].shape], attributes,
                      poison_results, (dtype, jnp.dtype(jnp.float32)))  # fmt: skip
    return dq.reshape(query.shape), delta.reshape(*lead, points, heads)


def ffi_ring_scheduled_dkv(
    query, key, value, dout, lse, delta, plan, *, scale, gradient_dtype=jnp.float32, poison_results=False
):  # fmt: skip
    """The scheduled dk/dv target between ring grids on ``plan``'s backward ring block schedule: ``(dk, dv)``
    shaped like ``key`` and ``value``, from float32 ``lse`` and ``delta`` ``[..., npoints_out, H]``."""
    dtype = _scheduled_result_dtype(gradient_dtype, query, "gradient_dtype")
    schedule, attributes = _ring_scheduled_operands(plan, "backward", scale)
    lead, points, heads = _flat_dims("query", query)
    grid = [x.reshape(*lead, 1, *x.shape[-3:]) for x in (query, key, value, dout)]
    rows = [x.reshape(*lead, 1, points, heads) for x in (lse, delta)]
    dk, dv = _call(SCHEDULED_BACKWARD_DKV_TARGET, (*grid, *rows, *schedule), [grid[1].shape, grid[2].shape],
                   attributes, poison_results, dtype)  # fmt: skip
    return dk.reshape(key.shape), dv.reshape(value.shape)


def _delta_operands(dout, out, dlse) -> tuple:
    """``(dout, out, dlse)`` as arrays after checking their dtypes and shapes (``out`` float32); ``dlse`` None
    becomes zeros."""
    dout, out = jnp.asarray(dout), jnp.asarray(out)
    lead, nlat, nlon, heads = _grid_dims("dout", dout)
    rows_shape = (*lead, nlat, nlon, heads)
    arc_dtypes = kernel_limits().arc_dtypes  # the delta target takes what the arc kernels take
    if dout.dtype not in arc_dtypes:
        raise TypeError(f"dout must be {dtype_names(arc_dtypes)}, got {dout.dtype.name}.")
    if out.shape != dout.shape or out.dtype != jnp.float32:
        raise ValueError(
            f"out must be float32 with the shape of dout {tuple(dout.shape)}, "
            f"got {out.dtype.name} {tuple(out.shape)}."
        )
    dlse = jnp.zeros(rows_shape, jnp.float32) if dlse is None else jnp.asarray(dlse)
    if tuple(dlse.shape) != rows_shape or dlse.dtype != jnp.float32:
        raise ValueError(
            f"dlse must be float32 of shape {rows_shape} (dout without its last axis), "
            f"got {dlse.dtype.name} {tuple(dlse.shape)}."
        )
    return dout, out, dlse


def ffi_delta(dout, out, dlse=None, *, poison_results=False):
    """The backward's ``delta = sum(dout * out, -1) - dlse`` in float32, summed in a fixed order.

    ``dout [..., nlat, nlon, H, Dv]`` (float32, bfloat16 or float16), ``out`` float32 of the same
    shape (the unrounded forward output), ``dlse`` float32 ``[..., nlat, nlon, H]`` (the cotangent
    of ``lse``; None means zero). Returns float32 ``[..., nlat, nlon, H]``, bitwise identical in
    every compiled program (a jnp reduction is not: XLA fuses it per program).
    """
    dout, out, dlse = _delta_operands(dout, out, dlse)
    (delta,) = _call(DELTA_TARGET, (dout, out, dlse), [dlse.shape], {}, poison_results)
    return delta


ensure_registered()
