"""Iso-latitude ring grids (:class:`jax_s2attn.grids.RingGrid`): HEALPix against healpy, the octahedral reduced
Gaussian grids against ECMWF's published point counts, quadrature exactness, and what bad rings get."""

import pickle

import numpy as np
import pytest

from jax_s2attn import GRIDS, precompute_latitudes
from jax_s2attn.grids import RingGrid


@pytest.mark.parametrize("nside", [1, 2, 3, 4, 16, 128])
def test_healpix_pixel_centres_are_healpys_in_ring_order(nside):
    healpy = pytest.importorskip("healpy")
    grid = RingGrid.healpix(nside)
    theta, phi = healpy.pix2ang(nside, np.arange(healpy.nside2npix(nside)), nest=False)
    assert grid.npoints == theta.size and grid.nrings == 4 * nside - 1
    np.testing.assert_allclose(grid.point_colatitudes(), theta, rtol=0, atol=2e-15)
    np.testing.assert_allclose(grid.point_longitudes(), phi, rtol=0, atol=4e-15)
    if nside & (nside - 1):
        return  # healpy's ring table takes powers of two only; its pixel centres (above) any nside
    # healpy's ring table agrees with the grid's.
    first, counts, cos_theta, _, _ = healpy.ringinfo(nside, np.arange(1, 4 * nside))
    np.testing.assert_array_equal(grid.ring_offsets[:-1], first)
    np.testing.assert_array_equal(grid.nlon, counts)
    np.testing.assert_allclose(np.cos(grid.colatitudes), cos_theta, rtol=0, atol=1e-15)


@pytest.mark.parametrize("nside", [1, 8, 256])
def test_healpix_pixels_have_equal_areas(nside):
    healpy = pytest.importorskip("healpy")
    grid = RingGrid.healpix(nside)
    area = healpy.nside2pixarea(nside)
    np.testing.assert_allclose(grid.point_weights(), area, rtol=1e-14)
    assert abs(grid.point_weights().sum() - 4 * np.pi) < 1e-11
    assert grid.regular_shape is None


@pytest.mark.parametrize(("n", "points"), [(96, 40_320), (320, 421_120), (1280, 6_599_680)])
def test_octahedral_point_counts_are_ecmwfs(n, points):
    grid = RingGrid.octahedral(n)
    assert grid.npoints == points and grid.nrings == 2 * n
    assert grid.nlon[0] == 20 and grid.nlon[n - 1] == 4 * n + 16 and grid.nlon[n] == 4 * n + 16 and grid.nlon[-1] == 20
    np.testing.assert_array_equal(grid.nlon, grid.nlon[::-1])
    assert not np.any(grid.first_longitude)


@pytest.mark.parametrize("n", [1, 4, 24])
def test_octahedral_quadrature_is_exact(n):
    """The Gaussian rings integrate x^k exactly up to degree 4n - 1; each ring's equally spaced points
    integrate exp(i m phi) exactly for |m| < nlon: so the grid integrates x^k cos(m phi) exactly."""
    grid = RingGrid.octahedral(n)
    theta, phi, w = grid.point_colatitudes(), grid.point_longitudes(), grid.point_weights()
    x = np.cos(theta)
    for k in range(4 * n):
        exact = 2 * np.pi * (2.0 / (k + 1) if k % 2 == 0 else 0.0)
        assert abs(np.sum(w * x**k) - exact) < 1e-12 * max(1.0, exact), k
        for m in (1, 7, 19):
            assert abs(np.sum(w * x**k * np.cos(m * phi))) < 1e-12, (k, m)
    if n <= 4:  # one degree more in x is not integrated exactly (the rule is Gaussian, not better); at larger n
        # its error falls below round-off
        assert abs(np.sum(w * x ** (4 * n)) - 2 * np.pi * 2.0 / (4 * n + 1)) > 1e-6


@pytest.mark.parametrize("grid", GRIDS)
def test_latlon_rings_are_the_regular_grid_with_any_longitude_count(grid):
    ring = RingGrid.latlon(9, 13, grid)
    theta, w = precompute_latitudes(9, grid)
    np.testing.assert_array_equal(ring.colatitudes, theta)
    np.testing.assert_array_equal(ring.weights, w)
    assert ring.regular_shape == (9, 13) and ring.npoints == 9 * 13
    lon = ring.point_longitudes().reshape(9, 13)
    np.testing.assert_allclose(lon, np.broadcast_to(2 * np.pi * np.arange(13) / 13, (9, 13)), rtol=0, atol=1e-15)
    np.testing.assert_allclose(ring.point_weights().reshape(9, 13), np.repeat(2 * np.pi * w[:, None] / 13, 13, 1))


def test_own_rings_reduce_the_first_longitude_and_compare_by_value():
    rings = RingGrid([0.5, 1.5, 2.5], [3, 5, 4], [2 * np.pi / 3 + 0.1, -0.25, 0.0], [0.6, 0.8, 0.6], name="mine")
    np.testing.assert_allclose(rings.first_longitude, [0.1, 2 * np.pi / 5 - 0.25, 0.0], rtol=0, atol=1e-15)
    same = RingGrid([0.5, 1.5, 2.5], [3, 5, 4], [2 * np.pi / 3 + 0.1, -0.25, 0.0], [0.6, 0.8, 0.6], name="mine")
    assert rings == same and hash(rings) == hash(same)
    assert rings != RingGrid([0.5, 1.5, 2.5], [3, 5, 5], [2 * np.pi / 3 + 0.1, -0.25, 0.0], [0.6, 0.8, 0.6], "mine")
    assert len({rings, RingGrid.healpix(2), RingGrid.healpix(2)}) == 2
    np.testing.assert_array_equal(rings.ring_offsets, [0, 3, 8, 12])
    assert "mine" in repr(rings) and "12 points" in repr(rings)
    with pytest.raises(ValueError, match="read-only"):
        rings.nlon[0] = 4
    copy = pickle.loads(pickle.dumps(rings))
    assert copy == rings and hash(copy) == hash(rings)
    with pytest.raises(ValueError, match="read-only"):
        copy.nlon[0] = 4


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        (([0.5, 0.4], [4, 4], [0, 0], [1, 1]), ValueError, r"colatitudes must ascend strictly.*ring 1"),
        (([0.5, 3.5], [4, 4], [0, 0], [1, 1]), ValueError, r"colatitudes must ascend strictly within \[0, pi\]"),
        (([0.5, 1.0], [4, 0], [0, 0], [1, 1]), ValueError, r"nlon must be from 1 to \d+ on every ring, got 0"),
        (([0.5, 1.0], [4, 2**62], [0, 0], [1, 1]), ValueError, r"nlon must be from 1 to \d+ on every ring"),
        (([0.5, 1.0], np.array([4, 2**63], np.uint64), [0, 0], [1, 1]), ValueError, r"nlon must be from 1 to"),
        (([0.5, 1.0], [4.0, 4.0], [0, 0], [1, 1]), TypeError, r"nlon must be integers, one per ring"),
        (([0.5, 1.0], [4, 4, 4], [0, 0], [1, 1]), TypeError, r"nlon must be integers, one per ring \(2 rings\)"),
        (([0.5, 1.0], [4, 4], [0], [1, 1]), TypeError, r"first_longitude must be real numbers, one per ring"),
        (([0.5, 1.0], [4, 4], [0, 0], [1, -1]), ValueError, r"weights must be positive"),
        (([0.5, np.nan], [4, 4], [0, 0], [1, 1]), ValueError, r"colatitudes must be finite"),
        (([], [], [], []), TypeError, r"colatitudes must be real numbers"),
        ((["a", "b"], [4, 4], [0, 0], [1, 1]), TypeError, r"colatitudes must be real numbers"),
    ],
)
def test_bad_rings_are_refused_with_the_argument_named(arguments, error, match):
    with pytest.raises(error, match=match):
        RingGrid(*arguments)


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        (lambda: RingGrid.healpix(0), ValueError, r"nside must be at least 1"),
        (lambda: RingGrid.healpix(2.0), TypeError, r"nside must be an integer"),
        (lambda: RingGrid.octahedral(0), ValueError, r"n must be at least 1"),
        (lambda: RingGrid.latlon(9, 0), ValueError, r"nlon must be at least 1"),
        (lambda: RingGrid.latlon(9, 16, "gaussian"), ValueError, r"Unknown grid='gaussian'"),
        (lambda: RingGrid([0.5], [4], [0], [1], name=3), TypeError, r"name must be a str"),
        (lambda: RingGrid.named("HEALPix(4)"), ValueError, r"'HEALPix\(4\)' names no ring grid; ring grids are named"),
        (lambda: RingGrid.named("gaussian(9, 16)"), ValueError, r"names no ring grid"),
        (lambda: RingGrid.named(4), TypeError, r"name must be a str"),
    ],
)
def test_builders_refuse_bad_arguments(build, error, match):
    with pytest.raises(error, match=match):
        build()


@pytest.mark.parametrize("grid", [RingGrid.healpix(3), RingGrid.octahedral(5), RingGrid.latlon(7, 12, "lobatto")],
                         ids=lambda g: g.name)  # fmt: skip
def test_a_built_grid_is_named_as_it_prints(grid):
    assert RingGrid.named(grid.name) == grid
