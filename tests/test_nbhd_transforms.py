"""The native op under jit, vmap, grad, jax.checkpoint, shard_map and jax.export."""

from __future__ import annotations

import os
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_s2attn
from jax_s2attn import NeighborhoodPlan, neighborhood_attention
from jax_s2attn.ops import _ffi
from jax_s2attn.ops.neighborhood import RESIDUAL_NAME

native = pytest.mark.skipif(not _ffi.HAS_CPU_EXT, reason="native CPU module not built")

# Downsampling with pscale 2: both arc tables have shifts and residues.
PLAN_ARGS = ((12, 24), (6, 12), "equiangular", "equiangular", None)


@pytest.fixture
def plan():
    return NeighborhoodPlan(*PLAN_ARGS)


@pytest.fixture
def qkv(plan, exact_random):
    def make(*batch, heads=2, dk=8, dv=4, dtype=jnp.float32):
        return (
            jnp.asarray(exact_random(*batch, *plan.out_shape, heads, dk), dtype),
            jnp.asarray(exact_random(*batch, *plan.in_shape, heads, dk), dtype),
            jnp.asarray(exact_random(*batch, *plan.in_shape, heads, dv), dtype),
        )

    return make


def _loss(q, k, v, plan, implementation="ffi"):
    out, lse = neighborhood_attention(q, k, v, plan, implementation=implementation, return_residual=True)
    return jnp.sum(jnp.sin(out.astype(jnp.float32))) + jnp.sum(jnp.cos(lse))


_grad = jax.grad(_loss, argnums=(0, 1, 2))


def _largest_literal_constant(hlo_text: str) -> int:
    """Element count of the largest non-splat ``stablehlo.constant`` in a module."""
    largest = 0
    for value, tensor in re.findall(r"stablehlo\.constant dense<(.*?)> : tensor<([^>]*)>", hlo_text):
        if value.startswith(("[", '"')):  # splats print a single value
            dims = [int(d) for d in tensor.split("x")[:-1]]
            largest = max(largest, int(np.prod(dims)))
    return largest


@native
def test_plan_as_jit_argument_keeps_tables_out_of_the_program(plan, qkv):
    q, k, v = qkv(2)
    as_argument = jax.jit(_grad).lower(q, k, v, plan).as_text()
    closed_over = jax.jit(lambda q, k, v: _grad(q, k, v, plan)).lower(q, k, v).as_text()
    assert "jax_s2attn_nbhd_fwd" in as_argument and "jax_s2attn_nbhd_bwd_dkv" in as_argument
    # The window operand and the quadrature weights (one per input latitude) are constants, no table is.
    assert _largest_literal_constant(as_argument) <= max(8, plan.nlat_in)
    assert _largest_literal_constant(closed_over) > 8  # the check can fail: closures embed tables


@native
def test_vmap_equals_batch_dims(plan, qkv, platform):
    q, k, v = qkv(3, 2)
    batched = neighborhood_attention(q, k, v, plan, implementation="ffi", return_residual=True)
    mapped = jax.vmap(lambda q, k, v: neighborhood_attention(q, k, v, plan, implementation="ffi",
                                                            return_residual=True))(q, k, v)
    for a, b in zip(batched, mapped):
        np.testing.assert_array_equal(a, b)
    # Only the queries mapped: keys and values are broadcast to every query batch.
    k, v = k[0, 0], v[0, 0]
    mapped_q = jax.vmap(lambda q: neighborhood_attention(q, k, v, plan, implementation="ffi"))(q[:, 0])
    looped = jnp.stack([neighborhood_attention(x, k, v, plan, implementation="ffi") for x in q[:, 0]])
    np.testing.assert_array_equal(mapped_q, looped)


@native
def test_vmap_of_grad_equals_per_example_grads(plan, qkv, platform, rel_error):
    q, k, v = qkv(3)
    mapped = jax.jit(jax.vmap(_grad, in_axes=(0, 0, 0, None)))(q, k, v, plan)
    for i in range(q.shape[0]):
        single = jax.jit(_grad)(q[i], k[i], v[i], plan)
        for a, b in zip(mapped, single):
            assert rel_error(a[i], b) <= 1e-6


@native
@pytest.mark.parametrize("implementation", ["ffi", None])
def test_checkpoint_saves_named_residuals(plan, qkv, implementation, rel_error):
    """With the residual names saved, the native forward runs once in a grad; without, twice."""
    q, k, v = qkv(2)

    def loss(q, k, v):
        return _loss(q, k, v, plan, implementation)

    saving = jax.checkpoint(loss, policy=jax.checkpoint_policies.save_only_these_names(RESIDUAL_NAME))

    def forward_calls(fn):
        return str(jax.make_jaxpr(jax.grad(fn, argnums=(0, 1, 2)))(q, k, v)).count("jax_s2attn_nbhd_fwd")

    assert forward_calls(saving) == 1
    assert forward_calls(jax.checkpoint(loss)) == 2
    for a, b in zip(jax.grad(saving, argnums=(0, 1, 2))(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)):
        assert rel_error(a, b) <= 1e-6


@native
def test_shard_map_over_batch_with_grad(plan, qkv, rel_error):
    """Under shard_map (check_vma on) forward and gradients equal the unsharded ones."""
    mesh = jax.make_mesh((2,), ("b",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices("cpu")[:2])
    q, k, v = (jax.device_put(x, jax.NamedSharding(mesh, P("b"))) for x in qkv(4))

    def sharded_loss(q, k, v):
        local = jax.shard_map(lambda q, k, v: _loss(q, k, v, plan)[None], mesh=mesh, in_specs=P("b"),
                              out_specs=P("b"))
        return jnp.sum(local(q, k, v))

    got = jax.jit(jax.value_and_grad(sharded_loss, argnums=(0, 1, 2)))(q, k, v)
    want = jax.value_and_grad(_loss, argnums=(0, 1, 2))(*(np.asarray(x) for x in (q, k, v)), plan)
    assert rel_error(got[0], want[0]) <= 1e-6
    for a, b in zip(got[1], want[1]):
        assert rel_error(a, b) <= 1e-6


@pytest.mark.parametrize("implementation", ["ffi", None])
def test_export_for_cuda_lowers_custom_calls(plan, implementation):
    """Exported for CUDA from this machine: the native targets appear exactly when a CUDA
    module is built (or "ffi" is forced); a CPU-only build lowers the reference instead."""
    if implementation == "ffi" and not _ffi.HAS_CPU_EXT:
        pytest.skip("forcing 'ffi' needs the native module of the tracing platform")
    sds = [jax.ShapeDtypeStruct(x.shape, jnp.bfloat16) for x in (jnp.zeros((2, *plan.out_shape, 2, 8)),
                                                                jnp.zeros((2, *plan.in_shape, 2, 8)),
                                                                jnp.zeros((2, *plan.in_shape, 2, 4)))]
    plan_sds = jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape, t.dtype), plan)
    exported = jax.export.export(
        jax.jit(lambda q, k, v, plan: _grad(q, k, v, plan, implementation)),
        platforms=["cuda"],
        disabled_checks=jax_s2attn.export_disabled_checks(),
    )(*sds, plan_sds)
    module = exported.mlir_module()
    expect_native = implementation == "ffi" or _ffi.HAS_CUDA_EXT
    for target in (*_ffi.TARGETS, _ffi.DELTA_TARGET):
        assert (f"stablehlo.custom_call @{target}(" in module) == expect_native, target


@native
def test_export_round_trips_with_the_plan_as_an_argument(plan, qkv):
    """Serialized and deserialized, for both platforms: the same results and gradients as the op, the plan
    rebuilt from its serialized arguments (not a closure constant)."""
    q, k, v = qkv(2)
    exported = jax.export.export(
        jax.jit(lambda q, k, v, plan: (_loss(q, k, v, plan, None), _grad(q, k, v, plan, None))),
        platforms=["cpu", "cuda"],
        disabled_checks=jax_s2attn.export_disabled_checks(),
    )(q, k, v, plan)
    restored = jax.export.deserialize(exported.serialize())
    assert restored.in_tree == jax.tree.structure(((q, k, v, plan), {}))
    loss, grads = restored.call(q, k, v, plan)
    want_loss, want_grads = _loss(q, k, v, plan, None), _grad(q, k, v, plan, None)
    np.testing.assert_array_equal(loss, want_loss)
    for a, b in zip(grads, want_grads):
        np.testing.assert_array_equal(a, b)
    assert set(jax_s2attn.CUSTOM_CALL_TARGETS) >= {*_ffi.TARGETS, *_ffi.SCHEDULED_TARGETS, *_ffi.STENCIL_TARGETS, _ffi.DELTA_TARGET}


def test_eager_float64_check_grads_compiles_once(rng):
    """Un-jitted, as a notebook calls it: order-2 checks in both modes compile the op once per shape and
    transformation (a few programs in all), instead of dispatching, and compiling, each operation of the
    reference path on every evaluation (about 200 programs for this check, several times the time)."""
    import logging
    import time

    from jax.test_util import check_grads

    plan = NeighborhoodPlan((8, 16), (8, 16), theta_cutoff=0.5)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 8, 16, 1, 2))) for _ in range(3))
    compiled = []

    class Compilations(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("Compiling"):
                compiled.append(record.getMessage())

    handler, logger = Compilations(), logging.getLogger("jax")
    logger.addHandler(handler)
    start = time.perf_counter()
    try:
        with jax.log_compiles(True):
            check_grads(lambda q, k, v: neighborhood_attention(q, k, v, plan), (q, k, v), order=2, modes=("fwd", "rev"))
    finally:
        logger.removeHandler(handler)
    assert len(compiled) < 50, compiled
    assert time.perf_counter() - start < 120


@native
def test_forward_mode_of_the_native_kernels_names_the_reference(plan, qkv):
    q, k, v = qkv(1)
    with pytest.raises(TypeError, match="reverse mode only.*implementation='reference'"):
        jax.jvp(lambda q: neighborhood_attention(q, k, v, plan, implementation="ffi"), (q,), (q,))
    out, tangent = jax.jvp(lambda q: neighborhood_attention(q, k, v, plan, implementation="reference"), (q,), (q,))
    assert tangent.shape == out.shape and bool(jnp.isfinite(tangent).all())


def test_fallback_to_the_reference_warns_once(plan, qkv, monkeypatch):
    from jax_s2attn.ops import _checks

    monkeypatch.setitem(_ffi.MODULES, "cpu", (None, "_s2attn_cpu is not built (test)"))
    monkeypatch.setattr(_checks, "_warned_fallbacks", set())
    q, k, v = (jax.device_put(x, jax.devices("cpu")[0]) for x in qkv(1))
    message = r"pure-JAX reference on cpu.*_s2attn_cpu is not built \(test\)"
    with pytest.warns(_checks.NativeFallbackWarning, match=message):
        neighborhood_attention(q, k, v, plan)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        neighborhood_attention(q, k, v, plan)  # once per platform and process
        neighborhood_attention(q, k, v, plan, implementation="reference")  # chosen: no warning
        neighborhood_attention(q.astype(jnp.float64), k.astype(jnp.float64), v.astype(jnp.float64), plan)


def test_registrations_match_target_names():
    """Both modules register the arc targets, the ring targets and delta, the CUDA module also the
    scheduled and stencil ones."""
    common = (*_ffi.TARGETS, *_ffi.RING_TARGETS, _ffi.DELTA_TARGET)
    expected = {"cpu": common, "cuda": common + _ffi.SCHEDULED_TARGETS + _ffi.STENCIL_TARGETS}
    for platform, available in _ffi.native_backends().items():
        if not available:
            continue
        registered = sorted(_ffi.MODULES[platform][0].registrations())
        assert registered == sorted(expected[platform]), platform


def test_native_status_tells_built_from_usable_here():
    backends = jax_s2attn.native_backends()
    lines = jax_s2attn.native_status().splitlines()
    assert [line.split(": ", 1)[0] for line in lines] == list(backends) == ["cpu", "cuda"]
    platforms = {d.platform for d in jax.devices()}
    for (platform, built), line in zip(backends.items(), lines):
        status = line.split(": ", 1)[1]
        if not built:
            assert "not built" in status or "rebuild" in status, line
            continue
        device_here = (platform == "cpu") or ("gpu" in platforms or "cuda" in platforms)
        expected = "built; usable here" if device_here else "built; not usable here: no cuda device in this process"
        assert status.startswith(expected), line
    assert backends["cpu"] == _ffi.HAS_CPU_EXT and backends["cuda"] == _ffi.HAS_CUDA_EXT


@pytest.mark.skipif(not os.environ.get("CI"), reason="only CI guarantees a native build")
def test_ci_runs_the_native_module():
    assert _ffi.HAS_CPU_EXT, _ffi.native_status()
