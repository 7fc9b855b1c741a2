"""Latitude grids: node placement and quadrature exactness."""

import numpy as np
import pytest

from jax_s2attn import GRIDS, latitude_spacing, precompute_latitudes, precompute_longitudes


def _moment_error(grid, n, degree):
    """Max error integrating x^k, k <= degree, over [-1, 1] with the grid's rule."""
    theta, w = precompute_latitudes(n, grid)
    x = np.cos(theta)
    k = np.arange(degree + 1)
    exact = np.where(k % 2 == 0, 2.0 / (k + 1), 0.0)
    return np.max(np.abs((x[None, :] ** k[:, None]) @ w - exact))


@pytest.mark.parametrize("n", [2, 3, 7, 16, 33])
@pytest.mark.parametrize(
    "grid, exact_degree",
    [
        ("legendre-gauss", lambda n: 2 * n - 1),
        ("lobatto", lambda n: 2 * n - 3),
        ("equiangular", lambda n: n - 1),
        ("equiangular-trapezoidal", lambda n: 1),
    ],
)
def test_quadrature_exactness(grid, exact_degree, n):
    assert _moment_error(grid, n, exact_degree(n)) < 1e-13


@pytest.mark.parametrize("grid", ["legendre-gauss", "lobatto"])
def test_quadrature_is_not_exact_one_degree_higher(grid):
    # Guards the exactness test itself: the next degree must fail.
    n = 8
    degree = {"legendre-gauss": 2 * n, "lobatto": 2 * n - 2}[grid]
    assert _moment_error(grid, n, degree) > 1e-6


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("n", [2, 5, 64, 181])
def test_nodes_and_weights(grid, n):
    theta, w = precompute_latitudes(n, grid)
    assert theta.dtype == np.float64 and w.dtype == np.float64
    assert theta.shape == w.shape == (n,)
    assert np.all(np.diff(theta) > 0) and theta[0] >= 0 and theta[-1] <= np.pi
    assert np.all(w > 0)
    assert abs(w.sum() - 2.0) < 1e-13
    np.testing.assert_allclose(w, w[::-1], rtol=1e-12)  # symmetric about the equator
    if grid != "legendre-gauss":
        assert theta[0] == 0.0 and abs(theta[-1] - np.pi) < 1e-15


def test_known_values_n7():
    # torch-harmonics' values.
    theta, w = precompute_latitudes(7, "legendre-gauss")
    np.testing.assert_allclose(theta[:4], [0.3204, 0.7355, 1.1529, np.pi / 2], atol=1e-4)
    np.testing.assert_allclose(w[:4], [0.1295, 0.2797, 0.3818, 0.4180], atol=1e-4)
    theta, w = precompute_latitudes(7, "lobatto")
    np.testing.assert_allclose(theta[:4], [0.0, 0.5913, 1.0828, np.pi / 2], atol=1e-4)
    np.testing.assert_allclose(w[:4], [0.0476, 0.2768, 0.4318, 0.4876], atol=1e-4)


def test_equiangular_is_equispaced_and_trapezoidal_is_not():
    theta, _ = precompute_latitudes(9, "equiangular")
    np.testing.assert_allclose(theta, np.pi * np.arange(9) / 8, atol=3e-15)
    theta, w = precompute_latitudes(9, "equiangular-trapezoidal")
    np.testing.assert_allclose(np.cos(theta), np.linspace(1, -1, 9), atol=1e-15)
    np.testing.assert_allclose(w, [0.125] + [0.25] * 7 + [0.125])


def test_latitude_spacing():
    assert abs(latitude_spacing(180, "equiangular") - np.pi / 179) < 1e-14
    # torch-harmonics' values at nlat = 180.
    assert abs(latitude_spacing(180, "legendre-gauss") - 0.017405) < 1e-6
    assert abs(latitude_spacing(180, "lobatto") - 0.021347) < 1e-6
    assert abs(latitude_spacing(180, "equiangular-trapezoidal") - 0.14963) < 1e-5


def test_longitudes():
    np.testing.assert_allclose(precompute_longitudes(4), [0, np.pi / 2, np.pi, 3 * np.pi / 2])


def test_unknown_grid_lists_valid_names():
    with pytest.raises(ValueError, match="legendre-gauss") as info:
        precompute_latitudes(8, "clenshaw-curtis")
    assert all(g in str(info.value) for g in GRIDS)


@pytest.mark.parametrize("grid", ["equiangular", "lobatto"])
def test_too_few_latitudes(grid):
    with pytest.raises(ValueError, match=f"nlat must be at least 2, got 1 .*grid '{grid}'"):
        precompute_latitudes(1, grid)
