"""Latitude grids and quadrature on the sphere (float64 numpy, host only).

Conventions follow torch-harmonics: the latitude axis is colatitude ``theta`` in
``[0, pi]`` stored ascending (index 0 is the north pole or the node nearest to
it); longitudes are ``2*pi*j/nlon``. Quadrature weights integrate over
``x = cos(theta)`` on ``[-1, 1]`` and therefore sum to 2.
"""

from __future__ import annotations

import functools

import numpy as np

from . import _validate

__all__ = [
    "GRIDS",
    "precompute_latitudes",
    "precompute_longitudes",
    "quadrature_weights",
    "latitude_spacing",
    "validate_grid",
    "validate_shape",
]

#: Canonical grid names (torch-harmonics spelling). ``"equiangular"`` is
#: Clenshaw-Curtis with both poles; ``"equiangular-trapezoidal"`` is equispaced
#: in ``cos(theta)``, not in ``theta``, despite its name.
GRIDS = ("equiangular", "legendre-gauss", "lobatto", "equiangular-trapezoidal")


def validate_grid(grid: str, argname: str = "grid") -> str:
    """``grid`` if it is one of :data:`GRIDS`, else a ``TypeError``/``ValueError`` naming ``argname``."""
    if not isinstance(grid, str):
        raise TypeError(f"{argname} must be a grid name (a str), got {grid!r}; valid grids are: {_grid_names()}.")
    if grid not in GRIDS:
        raise ValueError(f"Unknown {argname}={grid!r}; valid grids are: {_grid_names()}.")
    return grid


def _grid_names() -> str:
    return ", ".join(repr(g) for g in GRIDS)


def validate_shape(shape, argname: str = "shape") -> tuple[int, int]:
    """``(nlat, nlon)`` of a grid shape: two integers (``numbers.Integral``), each at least 2; else a
    ``TypeError``/``ValueError`` naming ``argname``."""
    try:
        items = None if isinstance(shape, (str, bytes)) else tuple(shape)
    except TypeError:
        items = None
    if items is None or len(items) != 2:
        raise TypeError(f"{argname} must be a pair (nlat, nlon) of integers, e.g. (181, 360), got {shape!r}.")
    hint = f" in {argname}={items!r}; pass whole numbers of latitudes and longitudes, each at least 2"
    nlat, nlon = (_validate.integer(n, axis, 2, hint) for n, axis in zip(items, ("nlat", "nlon")))
    return nlat, nlon


def _legendre(n: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(P_n(x), P_{n-1}(x))`` by the three-term recurrence."""
    p_prev, p = np.ones_like(x), x.copy()
    if n == 0:
        return p_prev, np.zeros_like(x)
    for k in range(1, n):
        p_prev, p = p, ((2 * k + 1) * x * p - k * p_prev) / (k + 1)
    return p, p_prev


def _clenshaw_curtis(n: int) -> tuple[np.ndarray, np.ndarray]:
    big_n = n - 1
    k = np.arange(n)
    theta = np.arccos(np.cos(np.pi * k / big_n))
    c = np.full(n, 2.0)
    c[0] = c[-1] = 1.0
    j = np.arange(1, big_n // 2 + 1)
    b = np.where(2 * j == big_n, 1.0, 2.0)
    series = (b[None, :] * np.cos(2.0 * np.pi * np.outer(k, j) / big_n) / (4.0 * j**2 - 1.0)).sum(axis=1)
    weights = c / big_n * (1.0 - series)
    return theta, weights


def _legendre_gauss(n: int) -> tuple[np.ndarray, np.ndarray]:
    x, w = np.polynomial.legendre.leggauss(n)
    return np.arccos(x)[::-1].copy(), w[::-1].copy()


def _lobatto(n: int) -> tuple[np.ndarray, np.ndarray]:
    x = -np.cos(np.pi * np.arange(n) / (n - 1))
    for _ in range(100):
        p, p_prev = _legendre(n - 1, x)
        step = (x * p - p_prev) / (n * p)
        x = x - step
        if np.max(np.abs(step)) <= 1e-16:
            break
    p, _ = _legendre(n - 1, x)
    w = 2.0 / (n * (n - 1) * p**2)
    return np.arccos(x)[::-1].copy(), w[::-1].copy()


def _trapezoidal(n: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.linspace(-1.0, 1.0, n)
    w = np.full(n, 2.0 / (n - 1))
    w[0] = w[-1] = 1.0 / (n - 1)
    return np.arccos(x)[::-1].copy(), w[::-1].copy()


_BUILDERS = {
    "equiangular": _clenshaw_curtis,
    "legendre-gauss": _legendre_gauss,
    "lobatto": _lobatto,
    "equiangular-trapezoidal": _trapezoidal,
}


def precompute_latitudes(nlat: int, grid: str = "equiangular") -> tuple[np.ndarray, np.ndarray]:
    """Colatitude nodes and quadrature weights of a latitude grid.

    Args:
      nlat: number of latitude rings, at least 2 (``"legendre-gauss"`` accepts 1).
      grid: one of :data:`GRIDS`.

    Returns:
      ``(colatitudes, weights)``: float64 arrays of shape ``[nlat]``; colatitudes
      ascend from the north pole, weights are positive and sum to 2.
    """
    validate_grid(grid)
    min_nlat = 1 if grid == "legendre-gauss" else 2
    nlat = _validate.integer(nlat, "nlat", min_nlat, f" (the number of latitude rings of grid {grid!r})")
    theta, weights = _BUILDERS[grid](nlat)
    return np.ascontiguousarray(theta, dtype=np.float64), np.ascontiguousarray(weights, dtype=np.float64)


def precompute_longitudes(nlon: int) -> np.ndarray:
    """Longitudes ``2*pi*j/nlon`` for ``j = 0..nlon-1`` (float64); ``nlon`` an integer of at least 1."""
    nlon = _validate.integer(nlon, "nlon", 1, " (the number of longitudes)")
    return np.linspace(0.0, 2.0 * np.pi, nlon + 1, dtype=np.float64)[:-1]


def quadrature_weights(shape: tuple[int, int], grid: str = "equiangular") -> np.ndarray:
    """Per-latitude quadrature weights ``2*pi*w/nlon`` (float32 ``[nlat]``) of a grid.

    The weights inside the softmax: torch-harmonics' ``quad_weights`` buffer, bit for bit, and
    :attr:`NeighborhoodPlan.quad_weights` of a plan whose input grid is ``(shape, grid)``.
    """
    nlat, nlon = validate_shape(shape, "shape")
    validate_grid(grid, "grid")
    return _quadrature_weights(nlat, nlon, grid).copy()


@functools.lru_cache(maxsize=64)
def _quadrature_weights(nlat: int, nlon: int, grid: str) -> np.ndarray:
    # float32 arithmetic, as torch-harmonics computes them. Cached: layers ask for them at every call.
    _, w = precompute_latitudes(nlat, grid)
    weights = np.float32(2.0 * np.pi) * w.astype(np.float32) / np.float32(nlon)
    weights.setflags(write=False)
    return weights


def latitude_spacing(nlat: int, grid: str = "equiangular") -> float:
    """Largest gap between neighbouring colatitude nodes (radians).

    This is the default neighbourhood radius of torch-harmonics 0.9.3; for the
    equiangular grid it equals ``pi / (nlat - 1)``.
    """
    theta, _ = precompute_latitudes(nlat, grid)
    if theta.size < 2:
        return float(np.pi)
    return float(np.max(np.diff(theta)))
