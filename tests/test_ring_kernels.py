"""The ring kernels (jax_s2attn_ring_* targets, CPU and CUDA) against the float64 reference on every grid kind and
direction: outputs and q/k/v gradients (float32 within 1e-5, bfloat16 and float16 within 1e-2), every result
element written, NaN where the math puts it, bitwise-repeatable gradients, vmap, which implementation runs, and
what bad operands and (on the CPU, where tables are host memory) bad tables get from the handlers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_s2attn import RingGrid, RingPlan, neighborhood_attention
from jax_s2attn.ops import _ffi

pytestmark = pytest.mark.skipif(_ffi.ring_unavailable_reason("cpu", jnp.float32) is not None,
                                reason="native CPU module with the ring targets not built")  # fmt: skip


@pytest.fixture(autouse=True)
def _ring_targets_of_the_platform(request):
    """A test on CUDA needs the CUDA module's ring targets (the GPU suite builds them)."""
    if "platform" in request.fixturenames and request.getfixturevalue("platform") == "cuda":
        reason = _ffi.ring_unavailable_reason("cuda", jnp.float32)
        if reason is not None:
            pytest.fail(f"the CUDA ring kernels cannot run: {reason}")

CPU = jax.devices("cpu")[0]

# (input grid, output grid, cutoff): self-attention, 3:2 and 2:3 longitude ratios, and between grid kinds.
PLANS = {
    "healpix_self": RingPlan(RingGrid.healpix(4), RingGrid.healpix(4), 0.35),
    "latlon_3_to_2": RingPlan(RingGrid.latlon(19, 36), RingGrid.latlon(13, 24), 0.3),
    "latlon_2_to_3": RingPlan(RingGrid.latlon(13, 24), RingGrid.latlon(19, 36), 0.3),
    "octahedral_to_healpix": RingPlan(RingGrid.octahedral(8), RingGrid.healpix(4), 0.3),
    "healpix_to_latlon": RingPlan(RingGrid.healpix(4), RingGrid.latlon(10, 20), 0.4),
    "latlon_to_octahedral": RingPlan(RingGrid.latlon(12, 24), RingGrid.octahedral(6), 0.35),
}


def _fields(plan, seed, batch=(2,), heads=2, dk=8, dv=5):
    """Random q, k, v (float64 numpy) on the plan's grids."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((*batch, plan.npoints_out, heads, dk)),
            rng.standard_normal((*batch, plan.npoints_in, heads, dk)),
            rng.standard_normal((*batch, plan.npoints_in, heads, dv)))  # fmt: skip


def _smooth_fields(plan, heads=2, dk=8, dv=8):
    """Smooth q, k, v: low-degree functions of each point's position (float64 numpy)."""

    def field(grid, d, phase):
        theta, phi = grid.point_colatitudes(), grid.point_longitudes()
        c = np.arange(heads * d).reshape(heads, d) + phase
        return np.cos(theta[:, None, None] * (1 + c % 3) + 0.3 * c) * np.sin(phi[:, None, None] + 0.1 * c)

    return field(plan.grid_out, dk, 0.0)[None], field(plan.grid_in, dk, 1.0)[None], field(plan.grid_in, dv, 2.0)[None]


def _loss(implementation, plan, weights):
    def loss(q, k, v):
        out = neighborhood_attention(q, k, v, plan, implementation=implementation)
        return jnp.vdot(out.astype(jnp.float32 if out.dtype != jnp.float64 else out.dtype), weights)

    return loss


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _reference64(plan, q, k, v, cotangent):
    """Out, lse and the q, k, v gradients of <out, cotangent> on the float64 reference."""
    with jax.enable_x64(True):
        q, k, v, cotangent = (jnp.asarray(x, jnp.float64) for x in (q, k, v, cotangent))
        out, lse = neighborhood_attention(q, k, v, plan, implementation="reference", return_residual=True)
        grads = jax.grad(_loss("reference", plan, cotangent), argnums=(0, 1, 2))(q, k, v)
        return np.asarray(out), np.asarray(lse), [np.asarray(g) for g in grads]


@pytest.mark.parametrize("name", sorted(PLANS))
@pytest.mark.parametrize("smooth", [False, True], ids=["random", "smooth"])
def test_float32_outputs_and_gradients_match_float64(platform, name, smooth):
    plan = PLANS[name]
    q, k, v = _smooth_fields(plan) if smooth else _fields(plan, seed=len(name))
    cotangent = np.random.default_rng(7).standard_normal((*q.shape[:-1], v.shape[-1]))
    out64, lse64, grads64 = _reference64(plan, q, k, v, cotangent)
    q32, k32, v32 = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    out, lse = neighborhood_attention(q32, k32, v32, plan, implementation="ffi", return_residual=True)
    assert out.dtype == jnp.float32 and lse.dtype == jnp.float32
    assert _rel(out, out64) <= 1e-5 and _rel(lse, lse64) <= 1e-5
    grads = jax.grad(_loss("ffi", plan, jnp.asarray(cotangent, jnp.float32)), argnums=(0, 1, 2))(q32, k32, v32)
    for label, g, expected in zip("qkv", grads, grads64):
        assert _rel(g, expected) <= 1e-5, label


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("name", ["healpix_self", "latlon_3_to_2"])
def test_16_bit_outputs_and_gradients_within_1e_2(platform, name, dtype):
    plan = PLANS[name]
    q, k, v = (np.asarray(jnp.asarray(x, dtype), np.float64) for x in _fields(plan, seed=3))  # representable
    cotangent = np.random.default_rng(8).standard_normal((*q.shape[:-1], v.shape[-1]))
    out64, _, grads64 = _reference64(plan, q, k, v, cotangent)
    q16, k16, v16 = (jnp.asarray(x, dtype) for x in (q, k, v))
    out = neighborhood_attention(q16, k16, v16, plan, implementation="ffi")
    assert out.dtype == dtype and _rel(out, out64) <= 1e-2
    grads = jax.grad(_loss("ffi", plan, jnp.asarray(cotangent, jnp.float32)), argnums=(0, 1, 2))(q16, k16, v16)
    for label, g, expected in zip("qkv", grads, grads64):
        assert g.dtype == dtype and _rel(g, expected) <= 1e-2, label


@pytest.mark.parametrize("name", ["healpix_self", "latlon_2_to_3", "octahedral_to_healpix"])
def test_every_result_element_is_written(platform, name):
    plan = PLANS[name]
    q, k, v = (jnp.asarray(x, jnp.float32) for x in _fields(plan, seed=4, batch=(3,)))
    queries, keys = (_ffi.ring_walk_tables(plan, walk) for walk in ("queries", "keys"))
    out, lse = _ffi.ffi_ring_forward(q, k, v, *queries, scale=0.4, poison_results=True)
    dout = jnp.ones_like(out)
    delta = _ffi.ffi_delta(dout, out)
    dq = _ffi.ffi_ring_backward_dq(q, k, v, dout, lse, delta, *queries, scale=0.4, poison_results=True)
    dk, dv = _ffi.ffi_ring_backward_dkv(q, k, v, dout, lse, delta, *keys, scale=0.4, poison_results=True)
    for label, x in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv)):
        assert np.isfinite(np.asarray(x)).all(), label


def test_nan_stays_where_the_reference_puts_it(platform):
    plan = PLANS["healpix_to_latlon"]
    q, k, v = _fields(plan, seed=5, batch=(1,))
    k[0, 17, 1, 3] = np.nan  # one key of head 1: NaN in the outputs of exactly the queries that see it
    v[0, 40, 0, 2] = np.nan  # one value of head 0
    with jax.enable_x64(True):
        expected = np.asarray(neighborhood_attention(*(jnp.asarray(x) for x in (q, k, v)), plan,
                                                     implementation="reference"))  # fmt: skip
    out = np.asarray(neighborhood_attention(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), plan,
                                            implementation="ffi"))  # fmt: skip
    assert np.isnan(expected).any() and not np.isnan(expected).all()
    np.testing.assert_array_equal(np.isnan(out), np.isnan(expected))
    finite = ~np.isnan(expected)
    assert _rel(out[finite], expected[finite]) <= 1e-5


def test_gradients_are_bitwise_repeatable_across_programs(platform):
    plan = PLANS["octahedral_to_healpix"]
    q, k, v = (jnp.asarray(x, jnp.float32) for x in _fields(plan, seed=6))
    cotangent = jnp.asarray(np.random.default_rng(9).standard_normal((*q.shape[:-1], v.shape[-1])), jnp.float32)
    grad = jax.grad(_loss("ffi", plan, cotangent), argnums=(0, 1, 2))
    first = grad(q, k, v)
    # A different program around the same op: jitted, with other work fused next to it.
    second = jax.jit(lambda q, k, v: [g * 1.0 for g in grad(q, k, v)] + [jnp.sum(q * 2.0)])(q, k, v)[:3]
    for a, b in zip(first, second):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_vmap_and_batch_axes_give_the_unbatched_results(platform):
    plan = PLANS["latlon_3_to_2"]
    q, k, v = (jnp.asarray(x, jnp.float32) for x in _fields(plan, seed=10, batch=(3, 2)))
    batched = neighborhood_attention(q, k, v, plan, implementation="ffi")
    mapped = jax.vmap(lambda q, k, v: neighborhood_attention(q, k, v, plan, implementation="ffi"))(q, k, v)
    single = neighborhood_attention(q[1, 0], k[1, 0], v[1, 0], plan, implementation="ffi")
    np.testing.assert_array_equal(np.asarray(batched), np.asarray(mapped))
    np.testing.assert_array_equal(np.asarray(batched[1, 0]), np.asarray(single))
    # vmap over the query alone: the key and value (and the tables) are broadcast to the mapped axis.
    shared = jax.vmap(lambda q: neighborhood_attention(q, k[0, 0], v[0, 0], plan, implementation="ffi"))(q[0])
    np.testing.assert_array_equal(np.asarray(shared[1]), np.asarray(
        neighborhood_attention(q[0, 1], k[0, 0], v[0, 0], plan, implementation="ffi")))  # fmt: skip


def _custom_call_targets(fn, *args) -> str:
    return jax.jit(fn).lower(*args).as_text()


def test_the_default_runs_the_ring_kernels_and_float64_on_the_reference(platform):
    plan = PLANS["healpix_self"]
    q, k, v = (jnp.asarray(x, jnp.float32) for x in _fields(plan, seed=11))
    text = _custom_call_targets(lambda q, k, v: neighborhood_attention(q, k, v, plan), q, k, v)
    assert _ffi.RING_FORWARD_TARGET in text
    with jax.enable_x64(True):
        q64, k64, v64 = (jnp.asarray(x, jnp.float64) for x in (q, k, v))
        text = _custom_call_targets(lambda q, k, v: neighborhood_attention(q, k, v, plan), q64, k64, v64)
        assert _ffi.RING_FORWARD_TARGET not in text
        with pytest.raises(ValueError, match=rf"implementation='ffi' cannot run a RingPlan on {platform}: .*float64"):
            neighborhood_attention(q64, k64, v64, plan, implementation="ffi")
    text = _custom_call_targets(lambda q, k, v: neighborhood_attention(q, k, v, plan, implementation="reference"),
                                q, k, v)  # fmt: skip
    assert _ffi.RING_FORWARD_TARGET not in text


def test_forcing_the_kernels_without_the_cpu_module_names_the_reason(monkeypatch):
    monkeypatch.setitem(_ffi.MODULES, "cpu", (None, "_s2attn_cpu is not built (test)"))
    plan = PLANS["healpix_self"]
    q, k, v = (jax.device_put(x.astype(np.float32), CPU) for x in _fields(plan, seed=12))
    with pytest.raises(ValueError, match=r"cannot run a RingPlan on cpu: _s2attn_cpu is not built \(test\)"):
        neighborhood_attention(q, k, v, plan, implementation="ffi-arc")


# ----------------------------------------------------------------------------- handlers


def _tables_with(plan, walk, **changes):
    """``(tables, sizes)`` of ``walk`` with some entries replaced (numpy copies; ``sizes`` by name too)."""
    tables, sizes = _ffi.ring_walk_tables(plan, walk)
    tables = {name: np.array(x, copy=True) for name, x in tables._asdict().items()}
    sizes = sizes._asdict()
    for name, change in changes.items():
        if name in sizes:
            sizes[name] = change(sizes[name])
        else:
            tables[name] = change(tables[name])
    return _ffi.RingWalkTables(**tables), _ffi.RingWalkSizes(**sizes)


def _set(index, value):
    def change(table):
        table[index] = value
        return table

    return change


# name -> (walk, table changes, expected message)
TABLE_ERRORS = {
    "rings_not_tiling": ("queries", dict(walk_rings=_set((1, 0), 5)), r"walk_rings row 1 = \(5, .* must start at point"),
    "ring_past_grid": ("queries", dict(walk_rings=_set((-1, 1), 999)), r"walk_rings row \d+ = .* hold 1 to"),
    "ring_order": ("keys", dict(ring_order=_set(0, 1)), "ring_order must be a permutation"),
    "max_ring_points": ("queries", dict(max_ring_points=lambda _: 8), r"walk_rings row \d+ = .* max_ring_points = 8"),
    "patterns_past_table": ("queries", dict(walk_rings=_set((0, 2), 10_000)), "patterns inside the"),
    "offsets_decreasing": ("queries", dict(pattern_offsets=_set(1, -1)), "pattern_offsets must be non-decreasing"),
    "offsets_start": ("queries", dict(pattern_offsets=_set(0, 1)), "pattern_offsets must start at 0"),
    "arc_past_grid": ("queries", dict(pattern_arcs=_set((0, 1), 10_000)), r"pattern arc 0 = .* is outside the visited grid"),
    "arc_start": ("keys", dict(pattern_arcs=_set((0, 2), -1)), r"pattern arc 0 = .* is outside the visited grid"),
    "arc_length": ("queries", dict(pattern_arcs=_set((0, 3), 0)), r"pattern arc 0 = .* is outside the visited grid"),
    "arcs_missing": ("queries", dict(pattern_arcs=lambda a: a[:0]), "pattern_arcs has 0 elements"),
    # Ring 0 (4 points) has period 1: its arcs move on at every point.
    "shift_past_ring": ("queries", dict(pattern_arcs=_set((0, 5), 10_000)), "moves on by shift 10000"),
    "weights": ("queries", dict(quad_weights=lambda w: w[:-1]), "quad_weights has"),
    "pattern_count": ("queries", dict(pattern_count=lambda count: count + 1), "pattern_offsets has"),
}


@pytest.mark.parametrize("name", sorted(TABLE_ERRORS))
def test_handlers_reject_bad_tables(name):
    plan = PLANS["healpix_self"]
    walk, changes, message = TABLE_ERRORS[name]
    bad = _tables_with(plan, walk, **changes)
    q, k, v = (jax.device_put(x.astype(np.float32), CPU) for x in _fields(plan, seed=13))  # host tables: checked
    dout = jax.device_put(np.zeros((*q.shape[:-1], v.shape[-1]), np.float32), CPU)
    lse = jax.device_put(np.zeros(q.shape[:-1], np.float32), CPU)
    if walk == "queries":
        call = lambda: _ffi.ffi_ring_forward(q, k, v, *bad, scale=0.5)  # noqa: E731
    else:
        call = lambda: _ffi.ffi_ring_backward_dkv(q, k, v, dout, lse, lse, *bad, scale=0.5)  # noqa: E731
    with pytest.raises(jax.errors.JaxRuntimeError, match=f"(?s)INVALID_ARGUMENT: .*{message}"):
        jax.block_until_ready(call())


def test_forward_mode_needs_the_reference_and_says_so(platform):
    plan = PLANS["healpix_self"]
    q, k, v = (jnp.asarray(x, jnp.float32) for x in _fields(plan, seed=15))
    with pytest.raises(TypeError, match="implementation='reference'"):
        jax.jvp(lambda q: neighborhood_attention(q, k, v, plan), (q,), (q,))
    out, tangent = jax.jvp(lambda q: neighborhood_attention(q, k, v, plan, implementation="reference"), (q,), (q,))
    assert np.isfinite(np.asarray(tangent)).all() and tangent.shape == out.shape


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda q, k, v: (q, k[..., :1, :], v), "same number of heads"),
        (lambda q, k, v: (q, k, v[:, :-1]), "k and v must have the same points"),
        (lambda q, k, v: (q, k, v[:1]), r"same leading \(batch\) dims"),
        (lambda q, k, v: (q, k[0, 0], v), "k must have rank >= 3"),
        (lambda q, k, v: (q, k.astype(jnp.bfloat16), v), "share one dtype"),
    ],
)
def test_forward_handler_rejects_bad_activations(platform, change, message):
    plan = PLANS["healpix_self"]
    q, k, v = change(*(jnp.asarray(x, jnp.float32) for x in _fields(plan, seed=14)))
    with pytest.raises(jax.errors.JaxRuntimeError, match=f"(?s)INVALID_ARGUMENT: .*{message}"):
        jax.block_until_ready(_ffi.ffi_ring_forward(q, k, v, *_ffi.ring_walk_tables(plan, "queries"), scale=0.5))
