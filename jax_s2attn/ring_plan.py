"""Neighbourhoods between two iso-latitude ring grids (host only, float64 numpy).

Output point ``o`` attends to input point ``i`` iff their geodesic distance is ``<= (1 + 1e-3) * theta_cutoff``,
evaluated as :class:`~jax_s2attn.plan.NeighborhoodPlan` evaluates it (the key rotated into the frame of the query
at longitude 0, normalised, arccos), with the key's longitude relative to the query's taken exactly from the
rings' integer lattices: between a query ``i`` of ring ``a`` (``n_a`` points) and a key ``j`` of ring ``b``,

    lambda = (first_b - first_a) + 2 pi k / (n_a n_b),   k = j n_a - i n_b  (reduced to |k| <= n_a n_b / 2).

So a ring pair's neighbourhoods repeat: with ``g = gcd(n_a, n_b)``, query ``i + n_a / g`` sees the keys of query
``i`` moved on by ``n_b / g``, bit for bit. :class:`RingArcs` stores one arc of key indices per ring pair and
residue ``i mod (n_a / g)``; a geodesic ball meets a ring in one arc.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

from . import _validate
from .grids import RingGrid
from .plan import THETA_CUTOFF_EPS, within_cutoff

__all__ = ["RingArcs", "RingPatterns", "RingPlan", "ring_arcs", "ring_patterns"]


class RingArcs(NamedTuple):
    """The neighbourhoods of every point of a *walking* ring grid among a *visited* ring grid's points: the input
    points each output point attends to (the queries' walk, the forward's), or the output points attending to each
    input point (the keys' walk, the backward's dk and dv).

    ``pairs[p] = (a, b, period, shift)``: walking ring ``a`` meets visited ring ``b``; walking point ``i`` of ring
    ``a`` (counted from the ring's first point) meets the ``arcs[pair_offsets[p] + i % period] = (start, length)``
    arc of ring ``b`` moved on by ``(i // period) * shift``: visited indices ``(start + (i // period) * shift + t)
    mod nlon_b`` for ``t < length``. Pairs are sorted by ``a``, then ``b``; ``ring_pairs[a] .. ring_pairs[a + 1]``
    are ring ``a``'s. A pair is listed where some residue meets ring ``b``; a residue that meets none of it has an
    arc of ``length`` 0.
    """

    pairs: np.ndarray  # int64 [npairs, 4]
    pair_offsets: np.ndarray  # int64 [npairs + 1]
    arcs: np.ndarray  # int64 [narcs, 2]
    ring_pairs: np.ndarray  # int64 [walking rings + 1]
    theta_cutoff: float

    def keys_of(self, grid_in: RingGrid, grid_out: RingGrid, point: int) -> np.ndarray:
        """Indices (ring order of the visited grid ``grid_in``) of the points walking point ``point`` (ring order of
        ``grid_out``, the walking grid) meets, ascending."""
        a = int(np.searchsorted(grid_out.ring_offsets, point, side="right") - 1)
        i = point - int(grid_out.ring_offsets[a])
        keys = []
        for p in range(int(self.ring_pairs[a]), int(self.ring_pairs[a + 1])):
            _, b, period, shift = (int(v) for v in self.pairs[p])
            start, length = (int(v) for v in self.arcs[self.pair_offsets[p] + i % period])
            nlon_b = int(grid_in.nlon[b])
            keys.append(grid_in.ring_offsets[b] + (start + (i // period) * shift + np.arange(length)) % nlon_b)
        return np.sort(np.concatenate(keys)) if keys else np.zeros(0, np.int64)

    def num_pairs(self, grid_out: RingGrid) -> int:
        """Pairs of the neighbourhoods of the walking grid ``grid_out`` (the grid they were built for), summed over
        every walking point."""
        if not len(self.pairs):
            return 0
        lengths = np.add.reduceat(self.arcs[:, 1], self.pair_offsets[:-1])
        per_period = grid_out.nlon[self.pairs[:, 0]] // self.pairs[:, 2]
        return int(np.sum(lengths * per_period))


def ring_arcs(grid_in: RingGrid, grid_out: RingGrid, theta_cutoff: float, walk: str = "queries") -> RingArcs:
    """The neighbourhoods of attention from ``grid_in`` to ``grid_out`` within ``theta_cutoff`` radians (the
    module's rule), as :class:`RingArcs`: ``walk="queries"`` walks ``grid_out`` (each output point's input
    neighbours), ``walk="keys"`` walks ``grid_in`` (each input point's output neighbours). Both evaluate the rule
    on the same ``(query, key)`` integers, so one is exactly the other transposed."""
    for grid, name in ((grid_in, "grid_in"), (grid_out, "grid_out")):
        if not isinstance(grid, RingGrid):
            raise TypeError(f"{name} must be a RingGrid, got {type(grid).__name__}; build one with RingGrid.latlon, "
                            "RingGrid.healpix or RingGrid.octahedral.")  # fmt: skip
    if walk not in ("queries", "keys"):
        raise ValueError(f"walk must be 'queries' or 'keys', got {walk!r}.")
    theta_cutoff = _validate.positive_finite(theta_cutoff, "theta_cutoff", " in radians", "; pass e.g. 0.05")
    eff = (1.0 + THETA_CUTOFF_EPS) * theta_cutoff
    walking, visited = (grid_out, grid_in) if walk == "queries" else (grid_in, grid_out)
    lo = np.searchsorted(visited.colatitudes, walking.colatitudes - eff, side="left")
    hi = np.searchsorted(visited.colatitudes, walking.colatitudes + eff, side="right")
    pairs, offsets, arcs, ring_pairs = [], [0], [], [0]
    for a in range(walking.nrings):
        for b in range(int(lo[a]), int(hi[a])):
            found = _pair_arcs(grid_out, grid_in, *((a, b) if walk == "queries" else (b, a)), eff, walk)
            if found is None:
                continue
            period, shift, pair_arcs = found
            pairs.append((a, b, period, shift))
            arcs.append(pair_arcs)
            offsets.append(offsets[-1] + period)
        ring_pairs.append(len(pairs))
    return RingArcs(
        pairs=np.asarray(pairs, np.int64).reshape(-1, 4),
        pair_offsets=np.asarray(offsets, np.int64),
        arcs=np.concatenate(arcs).astype(np.int64) if arcs else np.zeros((0, 2), np.int64),
        ring_pairs=np.asarray(ring_pairs, np.int64),
        theta_cutoff=float(theta_cutoff),
    )


class RingPatterns(NamedTuple):
    """Per walking pattern its arcs: ``arcs[offsets[p]:offsets[p + 1]]`` rows of ``(visited ring, first point of
    the ring, start, length, nlon, shift)``; walking point ``i`` of ring ``a`` has pattern ``ring_patterns[a] + i %
    period[a]`` and meets the points ``first + (start + (i // period[a]) * shift + t) % nlon``, ``t < length``, of
    the visited grid (ring order)."""

    offsets: np.ndarray  # int64 [npatterns + 1]
    arcs: np.ndarray  # int32 [narcs, 6]
    ring_patterns: np.ndarray  # int64 [nrings_out + 1]
    period: np.ndarray  # int64 [nrings_out]

    @property
    def lengths(self) -> np.ndarray:
        """Neighbours of each pattern (int64 ``[npatterns]``)."""
        total = np.concatenate([[0], np.cumsum(self.arcs[:, 3])])
        return total[self.offsets[1:]] - total[self.offsets[:-1]]


def ring_patterns(visited: RingGrid, walking: RingGrid, table: RingArcs) -> RingPatterns:
    """The walking patterns of the neighbourhoods ``table`` (:func:`ring_arcs` walking ``walking`` and visiting
    ``visited``)."""
    counts, arcs, periods = [], [], []
    for a in range(walking.nrings):
        n_a = int(walking.nlon[a])
        first, last = int(table.ring_pairs[a]), int(table.ring_pairs[a + 1])
        pairs = table.pairs[first:last]
        n_b = visited.nlon[pairs[:, 1]]
        common = math.gcd(n_a, *(int(n) for n in n_b))
        period = n_a // common
        # [pair, residue] arcs of each of the ring's pairs for the ring's residues r: the pair's residue r mod its
        # period, moved on by its shift once per whole period in r.
        r = np.arange(period)[None, :]
        pair_period, pair_shift = pairs[:, 2:3], pairs[:, 3:4]
        start, length = np.moveaxis(table.arcs[table.pair_offsets[first:last, None] + r % pair_period], -1, 0)
        start = (start + (r // pair_period) * pair_shift) % n_b[:, None]
        p, residue = np.nonzero((length > 0).T)[::-1]  # ordered by residue, then pair
        b = pairs[p, 1]
        arcs.append(np.stack([b, visited.ring_offsets[b], start[p, residue], length[p, residue], n_b[p],
                              n_b[p] // common], axis=1))  # fmt: skip
        counts.append(np.bincount(residue, minlength=period))
        periods.append(period)
    counts = np.concatenate(counts)
    return RingPatterns(
        offsets=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        arcs=np.concatenate(arcs).astype(np.int32).reshape(-1, 6),  # point indices of grids below 2^31 points
        ring_patterns=np.concatenate([[0], np.cumsum(periods)]).astype(np.int64),
        period=np.asarray(periods, np.int64),
    )


def _pair_arcs(grid_out: RingGrid, grid_in: RingGrid, a: int, b: int, eff: float, walk: str = "queries"):
    """``(period, shift, arcs [period, 2])`` of output ring ``a`` and input ring ``b`` walking ring ``a``'s
    queries (``walk="queries"``) or ring ``b``'s keys (``"keys"``), or None where no residue meets the other
    ring. Either way membership is the rule on query ``i`` of ring ``a`` and key ``j`` of ring ``b``."""
    n_a, n_b = int(grid_out.nlon[a]), int(grid_in.nlon[b])
    g = math.gcd(n_a, n_b)
    theta_a, theta_b = float(grid_out.colatitudes[a]), float(grid_in.colatitudes[b])
    offset = float(grid_in.first_longitude[b]) - float(grid_out.first_longitude[a])
    # n_walk points walk, n_other are visited; the other ring's longitudes relative to the walking ring's are
    # `sign * offset` on.
    n_walk, n_other, sign = (n_a, n_b, 1.0) if walk == "queries" else (n_b, n_a, -1.0)
    period, shift = n_walk // g, n_other // g
    residues = np.arange(period, dtype=np.int64)
    # Where each residue's walking point falls on the other ring's lattice (in its steps), and the arc's
    # half-width there.
    centre = residues * n_other / n_walk - sign * offset * n_other / (2.0 * np.pi)
    sin_product = np.sin(theta_a) * np.sin(theta_b)
    cos_half = (np.cos(eff) - np.cos(theta_a) * np.cos(theta_b)) / sin_product if sin_product > 0 else -np.inf
    if cos_half <= -1.0:
        half_steps = n_other  # the whole ring, if anything
    elif cos_half > 1.0:
        half_steps = 0.0  # at most the nearest key (rounding), checked below
    else:
        half_steps = np.arccos(cos_half) * n_other / (2.0 * np.pi)
    # A window a few keys wider than the analytic arc on each side; where rounding puts a member at its edge,
    # wider, up to the whole ring.
    for margin in (2, 64, n_other):
        width = int(min(n_other, math.floor(2 * half_steps) + 2 * margin + 2))
        first = np.floor(centre - half_steps).astype(np.int64) - margin
        j = first[:, None] + np.arange(width)[None, :]
        walking = residues[:, None]
        query, key = (walking, j) if walk == "queries" else (j, walking)
        inside = _member(n_a, n_b, offset, theta_a, theta_b, query, key, eff)
        if width == n_other or not np.any(inside[:, 0] | inside[:, -1]):
            break
    arcs = np.zeros((period, 2), np.int64)
    count = inside.sum(axis=1)
    if width == n_other:  # the window is the whole ring: its members must be one cyclic run
        starts = inside & ~np.roll(inside, 1, axis=1)
        full = count == n_other
        if np.any(~full & (count > 0) & (starts.sum(axis=1) != 1)):
            raise RuntimeError(f"rings {a} and {b}: a neighbourhood is not one arc")
        at = np.where(full, 0, np.argmax(starts, axis=1))
    else:  # members inside the window, off its ends: one run
        starts = inside & ~np.concatenate([np.zeros((period, 1), bool), inside[:, :-1]], axis=1)
        if np.any((count > 0) & (starts.sum(axis=1) != 1)):
            raise RuntimeError(f"rings {a} and {b}: a neighbourhood is not one arc")
        at = np.argmax(inside, axis=1)
    arcs[:, 0] = np.mod(j[np.arange(period), at], n_other)
    arcs[:, 1] = count
    if not arcs[:, 1].any():
        return None
    return period, shift, arcs


def _member(n_a, n_b, offset, theta_a, theta_b, i, j, eff) -> np.ndarray:
    """The rule for query ``i`` of ring ``a`` and keys ``j`` of ring ``b`` (the module's lambda, then the plan's
    rotation, normalisation and arccos)."""
    k = j * n_a - i * n_b
    modulus = n_a * n_b
    k = np.mod(k + modulus // 2, modulus) - modulus // 2
    lam = offset + 2.0 * np.pi * k / modulus
    return within_cutoff(theta_a, theta_b, np.cos(lam), np.sin(lam), eff)


class RingPlan:
    """Neighbourhood sparsity of attention from ring grid ``grid_in`` to ring grid ``grid_out``.

    Output point ``o`` attends to every input point ``i`` within ``(1 + 1e-3) * theta_cutoff`` (the module's
    rule: :class:`~jax_s2attn.NeighborhoodPlan`'s, on any two ring grids). Fields on ring grids are flat, ``[B...,
    npoints, H, D]`` in ring order (:class:`~jax_s2attn.grids.RingGrid`); the quadrature weights inside the
    softmax are ``grid_in``'s point weights.

    Args:
      grid_in: the keys' and values' grid.
      grid_out: the queries' and outputs' grid.
      theta_cutoff: neighbourhood radius in radians. Default (only between regular grids whose longitude counts
        divide one another, as :class:`~jax_s2attn.NeighborhoodPlan`'s): the largest latitude spacing of the
        output grid (of the input grid when upsampling); elsewhere pass one.

    Plans are immutable, hashable and cached on their arguments; pass them to ``jax.jit`` as ordinary or static
    arguments alike (their tables are host constants).

    Attributes: ``grid_in``, ``grid_out``, ``theta_cutoff`` (radians), ``arcs`` (:class:`RingArcs`), ``patterns``
    (:class:`RingPatterns`, what the reference and the native forward and dq walk), ``key_patterns`` (the keys'
    walk of the native dk and dv, built on first use), ``num_pairs`` (neighbour pairs over all output points),
    ``max_neighbors`` (largest neighbourhood), ``block_schedules`` (the ring block schedules built for it by
    :func:`~jax_s2attn.ring_schedule.ring_block_schedule`, by their arguments).
    """

    __slots__ = ("_key", "grid_in", "grid_out", "theta_cutoff", "arcs", "patterns", "num_pairs", "max_neighbors",
                 "_key_patterns", "block_schedules")  # fmt: skip

    def __new__(cls, grid_in: RingGrid, grid_out: RingGrid, theta_cutoff: float | None = None):
        for grid, name in ((grid_in, "grid_in"), (grid_out, "grid_out")):
            if not isinstance(grid, RingGrid):
                raise TypeError(f"{name} must be a RingGrid (RingGrid.healpix, RingGrid.octahedral, RingGrid.latlon "
                                f"or your own rings), got {type(grid).__name__}.")  # fmt: skip
            if grid.npoints >= 2**31:
                raise ValueError(f"{name} has {grid.npoints} points; a RingPlan indexes points with int32 (< 2^31).")
        if theta_cutoff is None:
            theta_cutoff = _default_cutoff(grid_in, grid_out)
        else:
            theta_cutoff = _validate.positive_finite(theta_cutoff, "theta_cutoff", " in radians", "; pass e.g. 0.05")
        return _build_ring_plan(grid_in, grid_out, theta_cutoff)

    def __setattr__(self, name, value):
        raise AttributeError("RingPlan is immutable")

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other) -> bool:
        return isinstance(other, RingPlan) and self._key == other._key

    def __reduce__(self):
        return RingPlan, (self.grid_in, self.grid_out, self.theta_cutoff)

    def __repr__(self) -> str:
        return (f"RingPlan(grid_in={self.grid_in.name!r}, grid_out={self.grid_out.name!r}, "
                f"theta_cutoff={self.theta_cutoff!r}, num_pairs={self.num_pairs})")  # fmt: skip

    @property
    def key_patterns(self) -> RingPatterns:
        """The neighbourhoods walked from the keys (each input point's output points), exactly the transpose of
        :attr:`patterns`: the walk of the native dk and dv. Built on first use (about as long as the plan)."""
        if self._key_patterns is None:
            table = ring_arcs(self.grid_in, self.grid_out, self.theta_cutoff, walk="keys")
            patterns = ring_patterns(self.grid_out, self.grid_in, table)
            for array in patterns:
                array.setflags(write=False)
            object.__setattr__(self, "_key_patterns", patterns)
        return self._key_patterns

    @property
    def npoints_in(self) -> int:
        """Points of the input grid (the point axis of key and value)."""
        return self.grid_in.npoints

    @property
    def npoints_out(self) -> int:
        """Points of the output grid (the point axis of query and out)."""
        return self.grid_out.npoints


def _default_cutoff(grid_in: RingGrid, grid_out: RingGrid) -> float:
    """One latitude spacing, as :class:`~jax_s2attn.NeighborhoodPlan` takes it, where its rule is defined."""
    shape_in, shape_out = grid_in.regular_shape, grid_out.regular_shape
    if shape_in is not None and shape_out is not None and min(shape_in[0], shape_out[0]) >= 2:
        if shape_in[1] % shape_out[1] == 0:
            return _largest_spacing(grid_out)
        if shape_out[1] % shape_in[1] == 0:
            return _largest_spacing(grid_in)
    raise ValueError(
        f"theta_cutoff is needed between {grid_in.name} and {grid_out.name}: the default (one latitude spacing, "
        "torch-harmonics' rule) is defined only between regular grids of two or more rings whose longitude counts "
        "divide one another; "
        f"pass one in radians, e.g. theta_cutoff={2 * max(_largest_spacing(grid_in), _largest_spacing(grid_out)):.3g}."
    )


def _largest_spacing(grid: RingGrid) -> float:
    """Largest gap between neighbouring rings (pi for a grid of one ring)."""
    return float(np.max(np.diff(grid.colatitudes))) if grid.nrings > 1 else float(np.pi)


@functools.lru_cache(maxsize=16)
def _build_ring_plan(grid_in: RingGrid, grid_out: RingGrid, theta_cutoff: float) -> RingPlan:
    arcs = ring_arcs(grid_in, grid_out, theta_cutoff)
    patterns = ring_patterns(grid_in, grid_out, arcs)
    lengths = patterns.lengths
    if (lengths == 0).any():
        raise _empty_neighbourhood_error(grid_out, grid_in, patterns, theta_cutoff)
    plan = object.__new__(RingPlan)
    for name, value in dict(_key=(grid_in, grid_out, theta_cutoff), grid_in=grid_in, grid_out=grid_out,
                            theta_cutoff=float(theta_cutoff), arcs=arcs, patterns=patterns,
                            num_pairs=arcs.num_pairs(grid_out), max_neighbors=int(lengths.max()),
                            _key_patterns=None, block_schedules={}).items():  # fmt: skip
        object.__setattr__(plan, name, value)
    for table in (*arcs[:4], *patterns):
        table.setflags(write=False)
    return plan


def _empty_neighbourhood_error(grid_out: RingGrid, grid_in: RingGrid, patterns: RingPatterns, theta_cutoff) -> ValueError:
    """The error for output points without any input point within the cutoff, with the smallest cutoff that
    gives every one a neighbour."""
    empty = np.flatnonzero(patterns.lengths == 0)
    ring = np.searchsorted(patterns.ring_patterns, empty, side="right") - 1
    residue = empty - patterns.ring_patterns[ring]
    theta = grid_out.colatitudes[ring]
    lon = grid_out.first_longitude[ring] + 2.0 * np.pi * residue / grid_out.nlon[ring]
    # On each input ring the nearest point is the lattice point nearest the query's longitude.
    step = 2.0 * np.pi / grid_in.nlon
    nearest = np.round((lon[:, None] - grid_in.first_longitude) / step) * step + grid_in.first_longitude - lon[:, None]
    cos_d = np.cos(theta)[:, None] * np.cos(grid_in.colatitudes) + np.sin(theta)[:, None] * np.sin(
        grid_in.colatitudes) * np.cos(nearest)  # fmt: skip
    needed = float(np.arccos(np.clip(cos_d, -1.0, 1.0)).min(axis=1).max())
    digits = 5 - int(np.floor(np.log10(needed)))
    suggestion = np.ceil(needed / (1.0 + THETA_CUTOFF_EPS) * 10.0**digits) / 10.0**digits
    return ValueError(
        f"theta_cutoff={theta_cutoff!r} leaves output points of {grid_out.name} with no input neighbour on "
        f"{grid_in.name} (the first on output ring {int(ring[0])}, colatitude {theta[0]:.6g} rad); pass "
        f"theta_cutoff >= {suggestion:.{max(digits, 0)}f}."
    )


def _register_pytree():
    import jax

    # No leaves: the plan is its own static description (its tables are host constants of the traced program).
    jax.tree_util.register_pytree_node(RingPlan, lambda plan: ((), plan), lambda plan, _: plan)


_register_pytree()
