"""Which kernel runs where: the scheduled tensor-core kernels vs the arc kernels vs the reference.

Runs without a GPU: the choice is static (platform, dtype, head dims), so it shows in the
arguments of the choosing functions, in the errors of forced implementations and in the
custom calls of programs exported for CUDA. The kernels' numbers are checked on the GPU
(test_scheduled_gpu.py).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_s2attn import RESIDUAL_NAME, NeighborhoodPlan, neighborhood_attention
from jax_s2attn.ops import _checks, _ffi, neighborhood
from jax_s2attn.parallel import sharded_neighborhood_attention

native = pytest.mark.skipif(not _ffi.HAS_CPU_EXT, reason="native CPU module not built")

BF16, F16, F32, F64 = (jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64))
PLAN = NeighborhoodPlan((12, 24), (6, 12))  # downsampling: forward and backward tables differ


@pytest.fixture
def scheduled_build(monkeypatch):
    """Pretend the CUDA module runs the scheduled kernels (an sm_90a build on an sm_90 device), whatever this
    machine has, so that the choice depends on platform, dtype and head dims alone."""
    monkeypatch.setattr(_ffi, "_scheduled_build_reason", lambda: None)


def _arrays(dtype, dk, dv, heads=2, batch=2, plan=PLAN):
    rng = np.random.default_rng(0)
    shapes = [
        (batch, *plan.out_shape, heads, dk),
        (batch, *plan.in_shape, heads, dk),
        (batch, *plan.in_shape, heads, dv),
    ]
    return tuple(jnp.asarray(rng.uniform(-1, 1, s), dtype) for s in shapes)


# ----------------------------------------------------------------------------- the choice

# (platform, dtype, Dk, Dv) -> kernel of implementation="ffi" where the scheduled kernels can run (whole grids and
# the blocks of a sharded grid alike).
CHOICES = [
    ("cuda", BF16, 64, 64, "scheduled"),
    ("cuda", F16, 64, 64, "scheduled"),
    ("cuda", BF16, 32, 32, "scheduled"),
    ("cuda", F16, 128, 128, "scheduled"),
    ("cuda", F32, 64, 64, "arc"),  # tensor cores would round float32 inputs
    ("cuda", F64, 64, 64, "arc"),
    ("cuda", BF16, 64, 32, "arc"),  # Dk != Dv
    ("cuda", BF16, 5, 5, "arc"),
    ("cuda", BF16, 16, 16, "arc"),  # head dims no tensor-core kernel takes
    ("cuda", F16, 256, 256, "arc"),
    ("cpu", BF16, 64, 64, "arc"),  # the tensor-core kernels are CUDA only
    ("cpu", F32, 32, 32, "arc"),
    ("rocm", BF16, 64, 64, "arc"),
]


@pytest.mark.parametrize("platform, dtype, dk, dv, kernel", CHOICES)
def test_choose_kernel_truth_table(scheduled_build, platform, dtype, dk, dv, kernel):
    assert _ffi.choose_kernel(platform, dtype, dk, dv) == kernel
    assert (_ffi.scheduled_unavailable_reason(platform, dtype, dk, dv) is None) == (kernel == "scheduled")
    if kernel == "scheduled":  # "ffi-tiled" names the tensor cores
        assert _checks.kernel_for("ffi-tiled", platform, dtype, dk, dv) == kernel


def test_scheduled_reason_names_every_unmet_condition(monkeypatch):
    monkeypatch.setattr(_ffi, "_scheduled_build_reason", lambda: None)
    reason = _ffi.scheduled_unavailable_reason("cpu", F32, 16, 16)
    assert "only on CUDA GPUs, not on cpu" in reason
    assert "bfloat16 or float16 inputs, got float32" in reason
    assert "Dk == Dv in (32, 64, 128), got Dk=16, Dv=16" in reason
    monkeypatch.setattr(_ffi, "_scheduled_build_reason", lambda: "no sm_90 device (test)")
    assert "no sm_90 device (test)" in _ffi.scheduled_unavailable_reason("cuda", BF16, 64, 64)


def test_without_the_scheduled_kernels_cuda_runs_the_arc_kernels(monkeypatch):
    monkeypatch.setattr(_ffi, "_scheduled_build_reason", lambda: "no sm_90 device (test)")
    assert _ffi.choose_kernel("cuda", BF16, 64, 64) == "arc"


@pytest.mark.parametrize(
    ("sm90a", "capabilities", "match"),
    [(False, ("9.0",), r"not built for sm_90a \(CMAKE_CUDA_ARCHITECTURES=90a\)"),
     (True, ("8.0", "9.0"), "they run on compute capability 9.0 .* this process has 8.0, 9.0"),
     (True, None, None), (True, ("9.0",), None)],  # fmt: skip
    ids=["no-sm90a-build", "other-devices", "no-device-to-ask", "sm90"],
)
def test_the_build_and_the_devices_decide_whether_the_scheduled_kernels_run(monkeypatch, sm90a, capabilities, match):
    """A CUDA module not built for sm_90a, or a process with devices other than compute capability 9.0, runs the
    arc kernels, named in the reason; a program lowered for CUDA without a device to ask takes the scheduled
    kernels."""
    module = object()
    monkeypatch.setitem(_ffi.MODULES, "cuda", (module, "available"))
    facts = (sm90a, ("90a",), capabilities)
    monkeypatch.setattr(_ffi, "_cuda_build_facts", lambda m: facts if m is module else None)
    reason = _ffi._scheduled_build_reason()
    assert (reason is None) == (match is None)
    if match is not None:
        assert re.search(match, reason), reason


# (architectures built, compute capability) -> whether the build has kernels for that device.
ARCHITECTURE_CASES = [
    (("90a",), "9.0", True),
    (("90a",), "8.0", False),  # the default build on an A100
    (("90a",), "10.0", False),  # arch-specific code runs on its own version only
    (("80", "90a"), "8.6", True),  # sm_80 machine code runs on 8.x
    (("80", "90a"), "10.0", True),  # and its PTX, compiled by the driver, on anything newer
    (("86-real",), "8.0", False),
    (("86-real",), "9.0", False),  # machine code only: no PTX to compile
    (("80-virtual",), "12.0", True),
    (("100f",), "10.3", True),
    (("100f",), "12.0", False),
    (("native",), "7.5", True),  # unreadable: not refused here
    (("90a",), "unknown", True),
]


@pytest.mark.parametrize(("architectures", "capability", "expected"), ARCHITECTURE_CASES)
def test_which_devices_a_build_has_kernels_for(architectures, capability, expected):
    assert _ffi.has_kernels_for(architectures, capability) is expected


@native
def test_a_gpu_without_kernels_in_the_build_is_named_before_lowering(monkeypatch):
    """An A100 with the default build (sm_90a): the native CUDA kernels are unavailable, with the fix named;
    implementation=None takes the reference there (with a warning), "ffi" is refused at trace time."""
    module = object()
    monkeypatch.setitem(_ffi.MODULES, "cuda", (module, "available"))
    monkeypatch.setattr(_ffi, "_cuda_build_facts", lambda m: (True, ("90a",), ("8.0",)))
    reason = _ffi.unavailable_reason("cuda", 64, 64)
    assert "has kernels for 90a (CMAKE_CUDA_ARCHITECTURES), none for this process's GPUs of compute capability 8.0" \
        in reason
    assert 'CMAKE_CUDA_ARCHITECTURES="80;90a"' in reason
    assert _checks.kernel_for(None, "cuda", BF16, 64, 64) == "reference"
    with pytest.raises(ValueError, match="implementation='ffi' cannot run on cuda: the installed _s2attn_cuda has"):
        _checks.check_runnable("ffi", "cuda", BF16, 64, 64, where="on cuda")
    monkeypatch.setattr(_ffi, "_cuda_build_facts", lambda m: (True, ("80", "90a"), ("8.0",)))
    assert _ffi.unavailable_reason("cuda", 64, 64) is None
    monkeypatch.setattr(_ffi, "_cuda_build_facts", lambda m: (True, ("90a",), None))  # no device to ask
    assert _ffi.unavailable_reason("cuda", 64, 64) is None


# (implementation, platform, dtype, Dk) -> what runs, with the native modules of both platforms
# built and the CUDA one running the scheduled kernels.
IMPLEMENTATION_CHOICES = [
    (None, "cuda", BF16, 64, "scheduled"),
    (None, "cuda", F32, 64, "arc"),
    (None, "cuda", F64, 64, "reference"),  # float64 always takes the reference
    (None, "cpu", BF16, 64, "arc"),
    (None, None, BF16, 64, "reference"),  # a platform without native kernels
    ("ffi", "cuda", BF16, 64, "scheduled"),
    ("ffi", "cuda", BF16, 8, "arc"),
    ("ffi", "cpu", F16, 64, "arc"),
    ("ffi", None, BF16, 64, "arc"),  # forced native everywhere
    ("ffi-arc", "cuda", BF16, 64, "arc"),
    ("ffi-tiled", "cuda", BF16, 64, "scheduled"),
    ("reference", "cuda", BF16, 64, "reference"),
]


@pytest.mark.parametrize("implementation, platform, dtype, dk, kernel", IMPLEMENTATION_CHOICES)
def test_what_each_implementation_runs(scheduled_build, monkeypatch, implementation, platform, dtype, dk, kernel):
    monkeypatch.setattr(_ffi, "unavailable_reason", lambda platform, dk=1, dv=1: None if platform else "none")
    assert _checks.kernel_for(implementation, platform, dtype, dk, dk) == kernel


# ----------------------------------------------------------------------------- forced kernels


def test_unknown_implementation_lists_the_choices():
    q, k, v = _arrays(F32, 4, 4)
    with pytest.raises(ValueError, match="'reference', 'ffi', 'ffi-arc' or 'ffi-tiled'"):
        neighborhood_attention(q, k, v, PLAN, implementation="tiled")


@pytest.mark.parametrize(
    "dtype, dk, match",
    [
        (BF16, 64, r"only on CUDA GPUs, not on cpu"),
        (F32, 64, r"not on cpu; they take bfloat16 or float16 inputs, got float32"),
        (BF16, 5, r"got Dk=5, Dv=5"),
    ],
)
def test_forcing_the_tensor_cores_on_cpu_names_the_reason_and_the_fix(dtype, dk, match):
    q, k, v = (jax.device_put(x, jax.devices("cpu")[0]) for x in _arrays(dtype, dk, dk))
    match = r"implementation='ffi-tiled' cannot run on cpu: the scheduled kernels"
    with pytest.raises(ValueError, match=match) as info:
        neighborhood_attention(q, k, v, PLAN, implementation="ffi-tiled")
    assert info.match(match)
    assert info.match(r"Use implementation='ffi' .* or 'ffi-arc'\.")


def test_forcing_the_tensor_cores_on_a_cpu_mesh_names_the_mesh():
    mesh = jax.make_mesh((2, 2), ("lat", "lon"), devices=jax.devices("cpu")[:4])
    q, k, v = _arrays(BF16, 64, 64)
    match = "implementation='ffi-tiled' cannot run on this cpu mesh: the scheduled kernels"
    with pytest.raises(ValueError, match=match):
        sharded_neighborhood_attention(q, k, v, PLAN, mesh=mesh, implementation="ffi-tiled")


def test_forcing_a_native_kernel_with_float64_points_to_the_reference():
    q, k, v = _arrays(F64, 4, 4)
    match = "'ffi-arc' cannot run on cpu: .*float64.* Use implementation=None or 'reference'"
    with pytest.raises(ValueError, match=match):
        neighborhood_attention(q, k, v, PLAN, implementation="ffi-arc")


@native
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_forcing_arc_on_cpu_equals_ffi(dtype):
    """On the CPU "ffi" is the arc kernels: forcing them gives the same bits, forward and backward."""
    q, k, v = _arrays(dtype, 8, 4)

    def outputs_and_grads(implementation):
        def loss(q, k, v):
            out, lse = neighborhood_attention(q, k, v, PLAN, implementation=implementation, return_residual=True)
            return jnp.sum(jnp.sin(out.astype(jnp.float32))) + jnp.sum(jnp.cos(lse)), (out, lse)

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    forced, ffi = outputs_and_grads("ffi-arc"), outputs_and_grads("ffi")
    reference = outputs_and_grads("reference")
    as_f32 = lambda tree: [np.asarray(x, np.float32) for x in jax.tree.leaves(tree)]  # noqa: E731
    for a, b in zip(as_f32(forced), as_f32(ffi)):
        np.testing.assert_array_equal(a, b)
    # The reference rounds differently somewhere: the bitwise check can fail.
    assert any(not np.array_equal(a, r) for a, r in zip(as_f32(forced), as_f32(reference)))


@native
def test_sharded_arc_equals_sharded_ffi_on_cpu():
    mesh = jax.make_mesh((2, 2), ("lat", "lon"), devices=jax.devices("cpu")[:4])
    q, k, v = _arrays(F32, 8, 4)

    def run(implementation):
        attend = functools.partial(sharded_neighborhood_attention, mesh=mesh, implementation=implementation)
        out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, PLAN), q, k, v)
        return out, vjp(out)

    for a, b in zip(jax.tree.leaves(jax.jit(lambda: run("ffi-arc"))()), jax.tree.leaves(jax.jit(lambda: run("ffi"))())):
        np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------- exported programs


def _loss(q, k, v, plan, implementation="ffi"):
    out, lse = neighborhood_attention(q, k, v, plan, implementation=implementation, return_residual=True)
    return jnp.sum(jnp.sin(out.astype(jnp.float32))) + jnp.sum(jnp.cos(lse))


def _gradient(loss):
    return jax.grad(loss, argnums=(0, 1, 2))


def _exported_module(implementation, dtype, dk, dv, platforms, program=None) -> str:
    """MLIR text of ``program(q, k, v, plan)`` (by default the gradient of a loss of the op's
    outputs), exported for ``platforms``."""
    program = program or _gradient(functools.partial(_loss, implementation=implementation))
    shapes = [(2, *PLAN.out_shape, 2, dk), (2, *PLAN.in_shape, 2, dk), (2, *PLAN.in_shape, 2, dv)]
    args = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
    plan = jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape, t.dtype), PLAN)
    exported = jax.export.export(
        jax.jit(program), platforms=platforms, disabled_checks=_ffi.export_disabled_checks()
    )(*args, plan)
    return exported.mlir_module()


# The scheduled targets of the op's forward and backward (its dq forms delta: no delta target).
OP_SCHEDULED_TARGETS = {
    _ffi.SCHEDULED_FORWARD_TARGET, _ffi.SCHEDULED_BACKWARD_DQ_DELTA_TARGET, _ffi.SCHEDULED_BACKWARD_DKV_TARGET
}  # fmt: skip


def _calls(module: str, targets) -> set[str]:
    return {t for t in targets if f"stablehlo.custom_call @{t}(" in module}


@native
@pytest.mark.parametrize("implementation", ["ffi", None])
def test_export_for_cuda_runs_scheduled_kernels_for_16_bit_heads_of_64(scheduled_build, implementation):
    """bfloat16, Dk = Dv = 64, exported for CUDA, at the default cutoff (a few neighbours per point): the forward
    and both backward targets are the scheduled ones (the custom VJP carries the choice to the backward)."""
    if implementation is None and not _ffi.HAS_CUDA_EXT:
        pytest.skip("implementation=None picks native CUDA kernels only where the CUDA module is built")
    module = _exported_module(implementation, BF16, 64, 64, ["cuda"])
    assert _calls(module, _ffi.SCHEDULED_TARGETS) == OP_SCHEDULED_TARGETS
    assert not _calls(module, _ffi.TARGETS)
    assert not _calls(module, [_ffi.DELTA_TARGET])  # the scheduled dq forms delta


@native
@pytest.mark.parametrize("dtype, dk, dv", [(F32, 64, 64), (BF16, 64, 32), (F16, 8, 8)])
def test_export_for_cuda_runs_arc_kernels_elsewhere(scheduled_build, dtype, dk, dv):
    module = _exported_module("ffi", dtype, dk, dv, ["cuda"])
    assert _calls(module, _ffi.TARGETS) == set(_ffi.TARGETS)
    assert not _calls(module, _ffi.SCHEDULED_TARGETS)
    assert _calls(module, [_ffi.DELTA_TARGET])


def _forward_result_types(module: str, target: str) -> str:
    """The result types of the (one) custom call of ``target`` in ``module``."""
    (line,) = [line for line in module.splitlines() if f"stablehlo.custom_call @{target}(" in line]
    return line.rsplit("->", 1)[1].split(" loc(")[0].strip()


def _attention(q, k, v, plan):
    return neighborhood_attention(q, k, v, plan, implementation="ffi")


_SAVING_RESIDUALS = jax.checkpoint_policies.save_only_these_names(RESIDUAL_NAME)
# Programs running the op, and whether they differentiate it: the scheduled forward writes out in the activations'
# dtype (no float32 out, no cast), and where the op is differentiated the same out in float32 beside it (the
# backward forms delta from it).
FORWARD_OUT_TYPES = {
    "alone": (_attention, False),
    "vmap": (jax.vmap(_attention, in_axes=(0, 0, 0, None)), False),
    "checkpoint": (jax.checkpoint(_attention), False),
    "grad": (_gradient(_loss), True),
    "grad-of-checkpoint-saving-residuals": (_gradient(jax.checkpoint(_loss, policy=_SAVING_RESIDUALS)), True),
    "vmap-of-grad": (jax.vmap(_gradient(_loss), in_axes=(0, 0, 0, None)), True),
}


@native
@pytest.mark.parametrize("name", FORWARD_OUT_TYPES)
def test_export_for_cuda_writes_out_in_the_input_dtype_unless_differentiated(scheduled_build, name):
    """The scheduled forward writes out in bfloat16 itself (no cast), and where the op is differentiated the same out
    in float32 as a third result. One forward either way."""
    if not _ffi.HAS_CUDA_EXT:
        pytest.skip("the CUDA module is not built")
    program, differentiated = FORWARD_OUT_TYPES[name]
    module = _exported_module("ffi", BF16, 64, 64, ["cuda"], program)
    out_shape = "2x" + "x".join(map(str, PLAN.out_shape)) + "x2x64"
    rows = out_shape.removesuffix("x64")
    results = _forward_result_types(module, _ffi.SCHEDULED_FORWARD_TARGET).strip("()").split(", ")
    expected = [f"tensor<{out_shape}xbf16>", f"tensor<{rows}xf32>"] + [f"tensor<{out_shape}xf32>"] * differentiated
    assert results == expected


STENCIL_PLAN = NeighborhoodPlan((65, 100), (65, 100))
# Downsampling: no forward pairs, backward pairs on the finer key grid.
DOWN_STENCIL_PLAN = NeighborhoodPlan((129, 100), (65, 100))


def _stencil_gate_cases():
    """``(plan, walk, heads)`` at the stencil gate of each walk that has stencil pairs: the fewest heads whose
    points of the pairs per batch entry reach STENCIL_MIN_POINTS, and one head fewer."""
    cases = []
    for name, plan in (("self", STENCIL_PLAN), ("down", DOWN_STENCIL_PLAN)):
        for walk, nlon in (("forward", plan.nlon_out), ("backward", plan.nlon_in)):
            points = 2 * len(_ffi.stencil_schedule(plan, walk).pairs) * nlon
            if points:
                heads = -(-neighborhood.STENCIL_MIN_POINTS // points)
                cases += [pytest.param(plan, walk, h, id=f"{name}-{walk}-{h}") for h in (heads - 1, heads)]
    return cases


@native
@pytest.mark.parametrize(("plan", "walk", "heads"), _stencil_gate_cases() if _ffi.HAS_CPU_EXT else [])
def test_export_for_cuda_leaves_stencil_rows_to_the_stencil_kernel_from_enough_points(
    scheduled_build, plan, walk, heads
):  # fmt: skip
    """The stencil targets of a walk (forward: the forward and the dq that forms delta; backward: dk/dv) run
    beside the scheduled ones, on the pairs of the walk's stencil schedule (an int32 operand [pairs, 2]), from
    STENCIL_MIN_POINTS points of those pairs per batch entry, and not below (batch 2 either way)."""
    pairs = _ffi.stencil_schedule(plan, walk).pairs
    points = 2 * len(pairs) * (plan.nlon_out if walk == "forward" else plan.nlon_in) * heads
    shapes = (plan.out_shape, plan.in_shape, plan.in_shape)
    args = [jax.ShapeDtypeStruct((2, *shape, heads, 32), BF16) for shape in shapes]
    tables = jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape, t.dtype), plan)
    exported = jax.export.export(jax.jit(_gradient(_loss)), platforms=["cuda"],
                                 disabled_checks=_ffi.export_disabled_checks())(*args, tables)  # fmt: skip
    module = exported.mlir_module()
    targets = (
        (_ffi.STENCIL_FORWARD_TARGET, _ffi.STENCIL_BACKWARD_DQ_DELTA_TARGET) if walk == "forward"
        else (_ffi.STENCIL_BACKWARD_DKV_TARGET,)
    )  # fmt: skip
    for target in targets:
        lines = [x for x in module.splitlines() if f"stablehlo.custom_call @{target}(" in x]
        assert len(lines) == (points >= neighborhood.STENCIL_MIN_POINTS), (target, points)
        for line in lines:
            operand_types = line.split(" : (", 1)[1].split(") ->", 1)[0].split(", ")
            assert f"tensor<{len(pairs)}x2xi32>" in operand_types, target  # before the aliased results


@native
def test_stencil_rows_need_whole_grids():
    plan = STENCIL_PLAN
    q, k, v = _arrays(BF16, 32, 32, plan=plan)
    with pytest.raises(ValueError, match=r"query grid 64x100 and key grid 65x100 must be the plan's"):
        _ffi.ffi_scheduled_forward(q[:, :-1], k, v, plan, scale=1.0, stencil=True)
    layout, schedules, query, key = _window_case(0)
    with pytest.raises(ValueError, match="stencil=True needs whole grids"):
        _ffi.ffi_scheduled_forward(query, key, key, PLAN, scale=1.0, window=layout.windows[0], schedules=schedules,
                                   stencil=True)  # fmt: skip


@native
def test_export_for_cpu_and_cuda_chooses_per_platform(scheduled_build):
    """One program for both platforms: the arc kernels in its CPU branch, the scheduled ones in its CUDA branch."""
    module = _exported_module("ffi", BF16, 64, 64, ["cpu", "cuda"])
    assert _calls(module, _ffi.SCHEDULED_TARGETS) == OP_SCHEDULED_TARGETS
    assert _calls(module, _ffi.TARGETS) == set(_ffi.TARGETS)


# ----------------------------------------------------------------------------- a window's scheduled operands


def _window_case(index: int):
    """A 2 x 3 layout of PLAN (halo rows, padding longitudes), its window schedules and window ``index``'s
    local blocks (bf16, 2 heads of 64)."""
    from jax_s2attn.parallel.layout import shard_layout, window_schedules

    layout = shard_layout(PLAN, 2, 3)
    forward, backward = window_schedules(PLAN, layout, *_ffi.kernel_limits().scheduled_shape)
    schedules = _ffi.WindowSchedules(forward, backward, jnp.int32(index))
    query = jnp.zeros((1, layout.q_lat.block, layout.q_lon.block, 2, 64), BF16)
    key = jnp.zeros((1, layout.k_ext_block, layout.k_lon.block, 2, 64), BF16)
    return layout, schedules, query, key


@native
@pytest.mark.parametrize("walk", ["forward", "backward"])
def test_a_windows_scheduled_operands_are_its_own(walk):
    """The operands of a scheduled call on a window: the window's tiles and offsets picked from the joined set by
    its index, the joined chunks and records, the quadrature weights of the key block's global rows (clamped to
    the grid), and the other grid's ring as the modulus."""
    for index in (0, 4, 11):
        layout, schedules, query, key = _window_case(index)
        window = layout.windows[index]
        (tiles, offsets, chunks, records, weights), attributes = _ffi._scheduled_operands(
            PLAN, walk, 0.125, query, key, window, schedules
        )
        joined = schedules.forward if walk == "forward" else schedules.backward
        np.testing.assert_array_equal(tiles, joined.tiles[index])
        np.testing.assert_array_equal(offsets, joined.tile_offsets[index])
        np.testing.assert_array_equal(chunks, joined.chunks)
        np.testing.assert_array_equal(records, joined.records)
        rows = np.clip(window[4] + np.arange(layout.k_ext_block), 0, PLAN.nlat_in - 1)
        np.testing.assert_array_equal(weights, np.asarray(PLAN.quad_weights)[rows])
        assert attributes["ring_nlon"] == (PLAN.nlon_in if walk == "forward" else PLAN.nlon_out)
        assert (attributes["nlat_q"], attributes["nlon_q"]) == query.shape[1:3]
        assert (attributes["nlat_k"], attributes["nlon_k"]) == key.shape[1:3]


@native
def test_a_windows_scheduled_operands_are_refused_without_their_pair_or_on_other_blocks():
    layout, schedules, query, key = _window_case(0)
    window = layout.windows[0]
    with pytest.raises(ValueError, match="window and schedules go together"):
        _ffi._scheduled_operands(PLAN, "forward", 0.125, query, key, window, None)
    with pytest.raises(ValueError, match="window and schedules go together"):
        _ffi._scheduled_operands(PLAN, "forward", 0.125, query, key, None, schedules)
    with pytest.raises(ValueError, match="the query blocks are .* window schedules' walking blocks"):
        _ffi._scheduled_operands(PLAN, "forward", 0.125, query[:, :-1], key, window, schedules)
    with pytest.raises(ValueError, match="the key blocks are .* window schedules' walking blocks"):
        _ffi._scheduled_operands(PLAN, "backward", 0.125, query, key[:, :, :-1], window, schedules)


@native
def test_export_for_cuda_runs_the_stencil_targets_beside_the_scheduled_ones(scheduled_build):
    """The op on the scheduled kernels at 360x720 and the default cutoff (one head: the rows of whole tiles of
    stencil pairs pass the stencil gate), exported for CUDA: forward, dq and dk/dv each a scheduled target whose
    schedule leaves out the stencil rows' tiles (its stencil_tiles attribute counts them; tiles of one row, in the
    ring grids' format on the flat grids) and a stencil target that updates the scheduled target's results in
    place (aliased operands); delta formed by the two dq targets (the scheduled and the stencil dq_delta), no
    delta target."""
    plan = NeighborhoodPlan((360, 720), (360, 720))
    chosen = [_ffi.stencil_schedule(plan, walk) for walk in ("forward", "backward")]
    assert all(c.flat for c in chosen) and np.array_equal(chosen[0].pairs, chosen[1].pairs)
    pairs = chosen[0].pairs
    assert np.array_equal(pairs, plan.tile_stencil_pairs("forward", tile_rows=1)) and len(pairs) > 0
    left_out = 2 * len(pairs) * -(-720 // 64)  # tiles of one row

    def loss(q, k, v, plan):
        return neighborhood._native_attention(q, k, v, plan, 0.125, "scheduled")[0].astype(jnp.float32).sum()

    args = [jax.ShapeDtypeStruct((1, 360, 720, 1, 64), BF16)] * 3
    shapes = jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape, t.dtype), plan)
    exported = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=["cuda"],
                                 disabled_checks=_ffi.export_disabled_checks())(*args, shapes)  # fmt: skip
    calls = [line for line in exported.mlir_module().splitlines() if "stablehlo.custom_call @jax_s2attn" in line]
    once = (_ffi.SCHEDULED_FORWARD_TARGET, _ffi.SCHEDULED_BACKWARD_DQ_DELTA_TARGET, _ffi.SCHEDULED_BACKWARD_DKV_TARGET,
            _ffi.STENCIL_FORWARD_TARGET, _ffi.STENCIL_BACKWARD_DQ_DELTA_TARGET, _ffi.STENCIL_BACKWARD_DKV_TARGET)
    for target in once:
        assert sum(f"@{target}(" in line for line in calls) == 1, target
    for target in (_ffi.SCHEDULED_BACKWARD_DQ_TARGET, _ffi.STENCIL_BACKWARD_DQ_TARGET, _ffi.DELTA_TARGET):
        assert not any(f"@{target}(" in line for line in calls), target
    for line in calls:
        if "@jax_s2attn_sched_" in line:
            assert f"stencil_tiles = {left_out} : i64" in line and "ring_grids = true" in line
            assert "tensor<1x1x259200x1x64xbf16>" in line
        if "@jax_s2attn_stencil_" in line:
            assert "output_operand_aliases" in line


@native
def test_export_for_cuda_passes_flat_grids_under_vmap_and_batch_dims(scheduled_build):
    """The scheduled targets on tiles of one row (360x720, default cutoff) under vmap, with two batch dims: each
    takes and returns its grids as grids of one row after all the leading dims, the tables with vmap's copies in
    front; the stencil targets take the grids as they are."""
    plan = NeighborhoodPlan((360, 720), (360, 720))

    def loss(q, k, v):
        attend = lambda q, k, v: neighborhood._native_attention(q, k, v, plan, 0.125, "scheduled")[0]
        return jax.vmap(attend)(q, k, v).astype(jnp.float32).sum()

    args = [jax.ShapeDtypeStruct((2, 3, 360, 720, 1, 64), BF16)] * 3
    exported = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=["cuda"],
                                 disabled_checks=_ffi.export_disabled_checks())(*args)  # fmt: skip
    calls = [line for line in exported.mlir_module().splitlines() if "stablehlo.custom_call @jax_s2attn" in line]
    assert len(calls) == 6
    for line in calls:
        signature = line[line.rindex(" : (") :]
        if "@jax_s2attn_sched_" in line:
            assert "tensor<2x3x1x259200x1x64xbf16>" in signature and "x360x720x" not in signature
            assert "tensor<2x259200xf32>" in signature  # a weight per key point, vmap's copy in front
        else:
            assert "tensor<2x3x360x720x1x64xbf16>" in signature and "x259200x" not in signature


@native
def test_export_for_cuda_forms_delta_in_the_scheduled_dq_without_stencil_rows(scheduled_build):
    """The op on the scheduled kernels where no stencil rows run beside them (tc 0.1 on 33x72), exported for
    CUDA: its backward forms delta in the scheduled dq (the dq_delta target, float32 out and dlse in, dq and
    delta out) and the dk/dv target reads that delta; no delta target, no stencil target."""
    plan = NeighborhoodPlan((33, 72), (33, 72), theta_cutoff=0.1)
    args = [jax.ShapeDtypeStruct((1, 33, 72, 2, 64), BF16)] * 3
    assert not neighborhood.uses_stencil_rows(plan, args[0], "scheduled")

    def loss(q, k, v, plan):
        return neighborhood._native_attention(q, k, v, plan, 0.125, "scheduled")[0].astype(jnp.float32).sum()

    shapes = jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape, t.dtype), plan)
    exported = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=["cuda"],
                                 disabled_checks=_ffi.export_disabled_checks())(*args, shapes)  # fmt: skip
    text = exported.mlir_module()
    counts = {t: text.count(f"@{t}(") for t in (*_ffi.SCHEDULED_TARGETS, *_ffi.STENCIL_TARGETS, _ffi.DELTA_TARGET)}
    assert counts == {**dict.fromkeys(counts, 0), _ffi.SCHEDULED_FORWARD_TARGET: 1,
                      _ffi.SCHEDULED_BACKWARD_DQ_DELTA_TARGET: 1, _ffi.SCHEDULED_BACKWARD_DKV_TARGET: 1}  # fmt: skip
