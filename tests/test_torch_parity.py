"""Numerical parity with the real torch-harmonics 0.9.3 layers (CPU kernels).

A torch layer with random parameters (biases and qk-norm weights included) is
copied into ours with ``load_torch_harmonics_state_dict``; outputs and input
gradients of both float32 layers must agree to rel <= 1e-5 (max abs error over
max abs value). Both run in float32 on purpose: the qk-norm epsilon is the
machine epsilon of the dtype, so a float64 layer is a (slightly) different
function. Our float32-vs-float64 accuracy is tested in test_nnx.py.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

try:
    import torch
    import torch_harmonics  # noqa: F401
    from torch_harmonics.attention import AttentionS2 as TorchAttentionS2
    from torch_harmonics.attention import NeighborhoodAttentionS2 as TorchNeighborhoodAttentionS2
    from torch_harmonics.attention.attention import optimized_kernels_is_available
except ImportError as error:
    pytest.skip(
        f"torch-harmonics cannot be imported ({error}); install torch and torch-harmonics==0.9.3 "
        "to run the parity tests.",
        allow_module_level=True,
    )

pytest.importorskip("flax")
from flax import nnx  # noqa: E402

from jax_s2attn import _layers  # noqa: E402
from jax_s2attn.nnx import AttentionS2, NeighborhoodAttentionS2  # noqa: E402

RTOL = 1e-5

# (in_shape, out_shape, grid_in, grid_out, num_heads, normalize_qk, qk_features, out_features):
# self-attention, downsampling and upsampling on three grids, heads 1/2 and
# qk-norm on/off spread over the cases, unequal q/k and v widths in some.
CASES = {
    "self-equiangular-h1": ((8, 16), (8, 16), "equiangular", "equiangular", 1, False, None, None),
    "self-gauss-h2-norm": ((7, 14), (7, 14), "legendre-gauss", "legendre-gauss", 2, True, 6, 4),
    "self-lobatto-h2": ((9, 12), (9, 12), "lobatto", "lobatto", 2, False, None, None),
    "down-equiangular-h2-norm": ((12, 24), (6, 12), "equiangular", "equiangular", 2, True, None, 6),
    "down-gauss-h1": ((12, 24), (6, 8), "legendre-gauss", "legendre-gauss", 1, False, 6, None),
    "down-equiangular-to-gauss-h2": ((13, 24), (6, 12), "equiangular", "legendre-gauss", 2, False, None, None),
    "down-lobatto-h1-norm": ((12, 12), (6, 12), "lobatto", "lobatto", 1, True, None, None),
    "up-equiangular-h1-norm": ((6, 12), (12, 24), "equiangular", "equiangular", 1, True, None, None),
    "up-gauss-h2": ((6, 12), (12, 24), "legendre-gauss", "legendre-gauss", 2, False, 6, 2),
    "up-lobatto-h2-norm": ((5, 6), (9, 18), "lobatto", "lobatto", 2, True, None, None),
}
# The fast tier: one case per direction; between them qk-norm on and off, unequal q/k and v widths, and
# Legendre-Gauss and mixed grids.
FAST_CASES = ("self-gauss-h2-norm", "down-equiangular-to-gauss-h2", "up-gauss-h2")
IN_FEATURES = 4
BATCH = 2


def _randomize(torch_layer, rng):
    """Random values for every parameter, so biases and norm weights are exercised too."""
    with torch.no_grad():
        for p in torch_layer.parameters():
            p.copy_(torch.from_numpy(0.5 * rng.standard_normal(p.shape).astype(np.float32)))
    return {name: p.detach().numpy() for name, p in torch_layer.state_dict().items()}


def _torch_run(torch_layer, query, key, value, cotangent):
    tensors = [
        torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2))).requires_grad_() for x in (query, key, value)
    ]
    q, k, v = tensors
    out = torch_layer(q) if key is query else torch_layer(q, k, v)
    out.backward(torch.from_numpy(np.ascontiguousarray(cotangent.transpose(0, 3, 1, 2))))

    def nhwc(t):
        return t.detach().numpy().transpose(0, 2, 3, 1)

    grads = [nhwc(q.grad)] if key is query else [nhwc(t.grad) for t in tensors]
    return nhwc(out), grads


def _jax_run(layer, query, key, value, cotangent):
    self_attention = key is query
    args = [jnp.asarray(x) for x in ((query,) if self_attention else (query, key, value))]

    @jax.jit
    def run(args, cotangent):
        out, vjp = jax.vjp(lambda *a: layer(*a), *args)
        return out, vjp(cotangent)

    out, grads = run(args, jnp.asarray(cotangent))
    return np.asarray(out, np.float64), [np.asarray(g, np.float64) for g in grads]


def _assert_close(name, actual, exact):
    assert np.all(np.isfinite(actual)), f"{name}: non-finite values"
    rel = np.max(np.abs(actual - exact)) / np.max(np.abs(exact))
    assert rel <= RTOL, f"{name}: rel {rel:.2e} > {RTOL:g} against the float64 evaluation"


def _cotangent(rng, torch_layer, out_shape):
    return rng.standard_normal((BATCH, *out_shape, torch_layer.out_channels)).astype(np.float32)


def _run_case(make_torch, make_ours, in_shape, out_shape, rng, monkeypatch):
    torch_layer = make_torch()
    state = _randomize(torch_layer, rng)
    self_attention = in_shape == out_shape
    query = rng.standard_normal((BATCH, *out_shape, IN_FEATURES)).astype(np.float32)
    if self_attention:
        key = value = query
    else:
        key = rng.standard_normal((BATCH, *in_shape, IN_FEATURES)).astype(np.float32)
        value = rng.standard_normal((BATCH, *in_shape, IN_FEATURES)).astype(np.float32)
    cotangent = _cotangent(rng, torch_layer, out_shape)
    their_out, their_grads = _torch_run(torch_layer, query, key, value, cotangent)

    layer = make_ours()
    layer.load_torch_harmonics_state_dict(state)
    out, grads = _jax_run(layer, query, key, value, cotangent)
    # Both float32 layers are held to the float64 evaluation of the same function, not to each
    # other: float64 with the float32 qk-norm eps (torch's eps=None in float32).
    monkeypatch.setattr(_layers, "rms_norm", functools.partial(_layers.rms_norm, eps=float(np.finfo(np.float32).eps)))
    exact_layer = make_ours(dtype=jnp.float64, param_dtype=jnp.float64)
    exact_layer.load_torch_harmonics_state_dict(state)
    f64 = [None if x is None else x.astype(np.float64) for x in (query, key, value, cotangent)]
    exact_out, exact_grads = _jax_run(exact_layer, f64[0], f64[0] if key is query else f64[1],
                                      f64[0] if value is query else f64[2], f64[3])
    for label, (o, g) in {"ours": (out, grads), "torch-harmonics": (their_out, their_grads)}.items():
        _assert_close(f"{label} output", o, exact_out)
        assert len(g) == len(exact_grads)
        for name, actual, exact in zip(("d query", "d key", "d value"), g, exact_grads):
            _assert_close(f"{label} {name}", actual, exact)


def test_torch_harmonics_cpu_kernels_load():
    assert optimized_kernels_is_available(), (
        "torch-harmonics' optimized CPU kernels did not load, so the parity tests would only compare "
        "against its slow torch reference; reinstall torch-harmonics==0.9.3 against this torch."
    )


@pytest.mark.parametrize("case", [c if c in FAST_CASES else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_neighborhood_attention_matches_torch_harmonics(case, rng, monkeypatch):
    in_shape, out_shape, grid_in, grid_out, heads, qknorm, qk_features, out_features = CASES[case]

    def make_torch():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # default-cutoff notice on non-equiangular grids
            return TorchNeighborhoodAttentionS2(
                IN_FEATURES,
                in_shape,
                out_shape,
                grid_in=grid_in,
                grid_out=grid_out,
                num_heads=heads,
                use_qknorm=qknorm,
                k_channels=qk_features,
                out_channels=out_features,
            )

    def make_ours(**dtypes):
        return NeighborhoodAttentionS2(
            IN_FEATURES,
            in_shape,
            out_shape,
            num_heads=heads,
            qk_features=qk_features,
            out_features=out_features,
            grid_in=grid_in,
            grid_out=grid_out,
            normalize_qk=qknorm,
            rngs=nnx.Rngs(0),
            **dtypes,
        )

    _run_case(make_torch, make_ours, in_shape, out_shape, rng, monkeypatch)


@pytest.mark.parametrize(
    "in_shape, out_shape, grid, heads, qknorm",
    [((6, 12), (6, 12), "equiangular", 2, True), ((8, 16), (5, 8), "legendre-gauss", 1, False)],
    ids=["self", "down"],
)
def test_global_attention_matches_torch_harmonics(in_shape, out_shape, grid, heads, qknorm, rng, monkeypatch):
    def make_torch():
        return TorchAttentionS2(IN_FEATURES, heads, in_shape, out_shape, grid_in=grid, grid_out=grid, use_qknorm=qknorm)

    def make_ours(**dtypes):
        return AttentionS2(
            IN_FEATURES,
            in_shape,
            out_shape,
            num_heads=heads,
            grid_in=grid,
            grid_out=grid,
            normalize_qk=qknorm,
            rngs=nnx.Rngs(0),
            **dtypes,
        )

    _run_case(make_torch, make_ours, in_shape, out_shape, rng, monkeypatch)
