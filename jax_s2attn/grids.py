"""Latitude grids, iso-latitude ring grids and quadrature on the sphere (float64 numpy, host only).

Conventions follow torch-harmonics: the latitude axis is colatitude ``theta`` in
``[0, pi]`` stored ascending (index 0 is the north pole or the node nearest to
it); longitudes are ``2*pi*j/nlon``. Quadrature weights integrate over
``x = cos(theta)`` on ``[-1, 1]`` and therefore sum to 2.

A :class:`RingGrid` generalises the regular grids to rings of constant colatitude that each have their own
number of equally spaced points and longitude of the first point: HEALPix (RING order), ECMWF's octahedral
reduced Gaussian grids, and regular grids of any longitude count. Its points are numbered ring by ring from the
north, each ring from its first point eastwards, the order of a flat field ``[..., npoints, ...]``.
"""

from __future__ import annotations

import functools
import re

import numpy as np

from . import _validate

__all__ = [
    "GRIDS",
    "RingGrid",
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


#: How ring grids are named (:meth:`RingGrid.named`).
RING_GRID_NAMES = ('ring grids are named "healpix(<nside>)", "O<n>" (octahedral) or "<grid>(<nlat>, <nlon>)" with '
                   f"<grid> one of {', '.join(GRIDS)}")


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


#: Most points a ring of a :class:`RingGrid` may have (the neighbourhood tables index a ring's points in int32,
#: with room for an arc's start, its length and a shift).
MAX_RING_POINTS = (2**31 - 1) // 4


class RingGrid:
    """An iso-latitude ring grid: rings of constant colatitude, each of equally spaced points.

    Ring ``r`` has ``nlon[r]`` points at longitudes ``first_longitude[r] + 2*pi*j/nlon[r]``
    (``j = 0 .. nlon[r] - 1``) and colatitude ``colatitudes[r]``; every point of the ring carries the
    quadrature weight ``2*pi*weights[r]/nlon[r]`` over the sphere, where ``weights`` integrate over
    ``x = cos(theta)`` as :func:`precompute_latitudes`' do (they sum to 2, the point weights to ``4*pi``).

    Build one by name (:meth:`latlon`, :meth:`healpix`, :meth:`octahedral`) or from your own rings.

    Args:
      colatitudes: strictly ascending, in ``[0, pi]`` (float64 ``[nrings]``).
      nlon: points of each ring, integers of at least 1.
      first_longitude: longitude of each ring's first point (radians); reduced to ``[0, 2*pi/nlon)``.
      weights: positive finite quadrature weights over ``cos(theta)``, one per ring.
      name: how the grid prints (e.g. ``"healpix(64)"``).

    Ring grids are immutable and hashable by value; arrays they return are read-only.
    """

    __slots__ = ("_colatitudes", "_nlon", "_first_longitude", "_weights", "_name", "_offsets", "_key")

    def __init__(self, colatitudes, nlon, first_longitude, weights, name: str = "rings"):
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {name!r}.")
        theta = _float_rings(colatitudes, "colatitudes")
        nrings = theta.size
        counts = np.asarray(nlon)
        if counts.shape != (nrings,) or counts.dtype.kind not in "iu":
            raise TypeError(
                f"nlon must be integers, one per ring ({nrings} rings), got {_shape_and_kind(counts)}; "
                "pass the number of points of each ring."
            )
        if np.any(counts < 1) or np.any(counts > MAX_RING_POINTS):
            bad = counts[(counts < 1) | (counts > MAX_RING_POINTS)][0]
            raise ValueError(f"nlon must be from 1 to {MAX_RING_POINTS} on every ring, got {int(bad)}.")
        first = _float_rings(first_longitude, "first_longitude", nrings)
        w = _float_rings(weights, "weights", nrings)
        if np.any(np.diff(theta) <= 0) or theta[0] < 0 or theta[-1] > np.pi:
            raise ValueError(
                "colatitudes must ascend strictly within [0, pi] (ring 0 nearest the north pole), got "
                f"{_describe_range(theta)}."
            )
        if np.any(w <= 0):
            raise ValueError(f"weights must be positive on every ring, got {float(w.min())!r}.")
        step = 2.0 * np.pi / counts
        first = np.mod(first, step)
        first = np.where(first >= step, 0.0, first)  # mod can round up to the step itself
        self._colatitudes = _frozen(theta)
        self._nlon = _frozen(counts.astype(np.int64))
        self._first_longitude = _frozen(first)
        self._weights = _frozen(w)
        self._name = name
        self._offsets = _frozen(np.concatenate([[0], np.cumsum(self._nlon)]).astype(np.int64))
        self._key = (name, *(a.tobytes() for a in (self._colatitudes, self._nlon, self._first_longitude, self._weights)))

    # -- builders --------------------------------------------------------------------------------------

    @classmethod
    def latlon(cls, nlat: int, nlon: int, grid: str = "equiangular") -> "RingGrid":
        """The regular grid of ``nlat`` rings of ``nlon`` points each from longitude 0, on the latitudes and
        weights of ``grid`` (:data:`GRIDS`): the grid of ``[..., nlat, nlon, ...]`` fields, any ``nlon``."""
        theta, w = precompute_latitudes(nlat, grid)
        nlon = _validate.integer(nlon, "nlon", 1, " (the points of each ring)")
        return cls(theta, np.full(theta.size, nlon, np.int64), np.zeros(theta.size), w, f"{grid}({nlat}, {nlon})")

    @classmethod
    def healpix(cls, nside: int) -> "RingGrid":
        """HEALPix with ``nside`` (a power of two is not required) in RING order: ``4*nside - 1`` rings,
        ``12*nside**2`` pixel centres, equal-area weights (Gorski et al. 2005, the pixel centres of ``healpy``'s
        ``pix2ang(nside, ipix)`` for ``ipix`` in ring order)."""
        nside = _validate.integer(nside, "nside", 1, " (HEALPix resolution: 12 nside^2 pixels)")
        rings = np.arange(1, 4 * nside, dtype=np.int64)  # 1 .. 4 nside - 1, north to south
        cap = np.minimum(rings, 4 * nside - rings)  # ring index from the nearer pole
        polar = cap < nside
        nlon = np.where(polar, 4 * cap, 4 * nside)
        # Polar caps: 1 - |z| = i^2 / (3 nside^2), i.e. sin(theta / 2) = i / (sqrt(6) nside) from the nearer pole
        # (exact near the poles, where arccos(z) loses digits). Belt: z = 4/3 - 2 i / (3 nside).
        near_pole = 2.0 * np.arcsin(cap / (np.sqrt(6.0) * nside))
        theta_polar = np.where(rings < 2 * nside, near_pole, np.pi - near_pole)
        theta_belt = np.arccos(np.clip(4.0 / 3.0 - 2.0 * rings / (3.0 * nside), -1.0, 1.0))
        theta = np.where(polar, theta_polar, theta_belt)
        # First pixel: half a step east of 0 in the caps; in the belt too on rings with (i - nside) even,
        # on the others at 0.
        shifted = (rings - nside) % 2 == 0
        first = np.where(polar | shifted, np.pi / nlon, 0.0)
        weights = nlon * (4.0 * np.pi / (12 * nside * nside)) / (2.0 * np.pi)
        return cls(theta, nlon, first, weights, f"healpix({nside})")

    @classmethod
    def octahedral(cls, n: int) -> "RingGrid":
        """ECMWF's octahedral reduced Gaussian grid ``O<n>``: the ``2n`` Gaussian latitudes, ``4i + 16`` points
        on ring ``i`` counted from either pole (``i = 1 .. n``), each ring from longitude 0, the Gaussian
        weights; ``4n^2 + 36n`` points (O1280: 6,599,680)."""
        n = _validate.integer(n, "n", 1, " (the octahedral grid O<n> has 2n Gaussian latitudes)")
        theta, w = precompute_latitudes(2 * n, "legendre-gauss")
        i = np.arange(1, 2 * n + 1, dtype=np.int64)
        nlon = 4 * np.minimum(i, 2 * n + 1 - i) + 16
        return cls(theta, nlon, np.zeros(2 * n), w, f"O{n}")

    @classmethod
    def named(cls, name: str) -> "RingGrid":
        """The grid a name denotes, spelt as the built grids print (:attr:`name`): ``"healpix(<nside>)"``,
        ECMWF's ``"O<n>"``, or ``"<grid>(<nlat>, <nlon>)"`` for :meth:`latlon` on a grid of :data:`GRIDS`
        (``"equiangular(721, 1440)"``)."""
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}.")
        healpix = re.fullmatch(r"healpix\((\d+)\)", name)
        octahedral = re.fullmatch(r"O(\d+)", name)
        latlon = re.fullmatch(r"([a-z-]+)\((\d+), *(\d+)\)", name)
        if healpix:
            return cls.healpix(int(healpix[1]))
        if octahedral:
            return cls.octahedral(int(octahedral[1]))
        if latlon and latlon[1] in GRIDS:
            return cls.latlon(int(latlon[2]), int(latlon[3]), latlon[1])
        raise ValueError(f"{name!r} names no ring grid; {RING_GRID_NAMES}.")

    # -- description -----------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """How the grid prints, e.g. ``"healpix(64)"``."""
        return self._name

    @property
    def colatitudes(self) -> np.ndarray:
        """Colatitude of each ring (float64 ``[nrings]``, ascending)."""
        return self._colatitudes

    @property
    def nlon(self) -> np.ndarray:
        """Points of each ring (int64 ``[nrings]``)."""
        return self._nlon

    @property
    def first_longitude(self) -> np.ndarray:
        """Longitude of each ring's first point, in ``[0, 2*pi/nlon)`` (float64 ``[nrings]``)."""
        return self._first_longitude

    @property
    def weights(self) -> np.ndarray:
        """Quadrature weight of each ring over ``cos(theta)`` (float64 ``[nrings]``, summing to 2 for a
        quadrature of the whole sphere)."""
        return self._weights

    @property
    def nrings(self) -> int:
        """Number of rings."""
        return int(self._nlon.size)

    @property
    def npoints(self) -> int:
        """Number of points, all rings together (the point axis of a flat field)."""
        return int(self._offsets[-1])

    @property
    def ring_offsets(self) -> np.ndarray:
        """Index of each ring's first point in ring order, then ``npoints`` (int64 ``[nrings + 1]``)."""
        return self._offsets

    @property
    def regular_shape(self) -> tuple[int, int] | None:
        """``(nlat, nlon)`` when every ring has the same points from longitude 0 (a regular grid), else None."""
        if np.all(self._nlon == self._nlon[0]) and not np.any(self._first_longitude):
            return self.nrings, int(self._nlon[0])
        return None

    def point_colatitudes(self) -> np.ndarray:
        """Colatitude of every point in ring order (float64 ``[npoints]``)."""
        return np.repeat(self._colatitudes, self._nlon)

    def point_longitudes(self) -> np.ndarray:
        """Longitude of every point in ring order, in ``[0, 2*pi)`` (float64 ``[npoints]``)."""
        ring = np.repeat(np.arange(self.nrings), self._nlon)
        j = np.arange(self.npoints) - self._offsets[ring]
        return self._first_longitude[ring] + 2.0 * np.pi * j / self._nlon[ring]

    def point_weights(self) -> np.ndarray:
        """Quadrature weight of every point over the sphere, ``2*pi*weights/nlon`` of its ring (float64
        ``[npoints]``, summing to ``4*pi`` for a quadrature of the whole sphere)."""
        return np.repeat(2.0 * np.pi * self._weights / self._nlon, self._nlon)

    def __reduce__(self):
        return RingGrid, (self._colatitudes, self._nlon, self._first_longitude, self._weights, self._name)

    def __eq__(self, other) -> bool:
        return isinstance(other, RingGrid) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return f"RingGrid({self._name}: {self.nrings} rings, {self.npoints} points)"


def _float_rings(values, name: str, nrings: int | None = None) -> np.ndarray:
    """``values`` as finite float64 ``[nrings]`` (any length >= 1 when ``nrings`` is None), else an error naming
    ``name``."""
    array = np.asarray(values)
    if array.dtype.kind not in "iuf" or array.ndim != 1 or array.size == 0 or (nrings is not None and array.size != nrings):
        want = "one per ring" if nrings is None else f"one per ring ({nrings} rings)"
        raise TypeError(f"{name} must be real numbers, {want}, got {_shape_and_kind(array)}.")
    array = array.astype(np.float64)
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name} must be finite, got {array[~np.isfinite(array)][0]!r}.")
    return array


def _shape_and_kind(array: np.ndarray) -> str:
    return f"an array of shape {array.shape} and dtype {array.dtype}"


def _describe_range(theta: np.ndarray) -> str:
    bad = np.flatnonzero(np.diff(theta) <= 0)
    if bad.size:
        return f"ring {int(bad[0]) + 1} at {theta[bad[0] + 1]!r} after {theta[bad[0]]!r}"
    return f"values from {theta[0]!r} to {theta[-1]!r}"


def _frozen(array: np.ndarray) -> np.ndarray:
    array = np.ascontiguousarray(array)
    array.setflags(write=False)
    return array
