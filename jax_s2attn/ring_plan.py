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

import math
from typing import NamedTuple

import numpy as np

from . import _validate
from .grids import RingGrid
from .plan import THETA_CUTOFF_EPS, within_cutoff

__all__ = ["RingArcs", "ring_arcs"]


class RingArcs(NamedTuple):
    """The neighbourhoods of every point of an output ring grid among an input ring grid's points.

    ``pairs[p] = (a, b, period, shift)``: output ring ``a`` sees input ring ``b``; output point ``i`` of ring ``a``
    (counted from the ring's first point) sees the ``arcs[pair_offsets[p] + i % period] = (start, length)`` arc
    of ring ``b`` moved on by ``(i // period) * shift``: key indices ``(start + (i // period) * shift + t) mod
    nlon_b`` for ``t < length``. Pairs are sorted by ``a``, then ``b``; ``ring_pairs[a] .. ring_pairs[a + 1]``
    are ring ``a``'s. Every arc has ``length >= 1``; a residue that sees none of ring ``b`` has ``length`` 0.
    """

    pairs: np.ndarray  # int64 [npairs, 4]
    pair_offsets: np.ndarray  # int64 [npairs + 1]
    arcs: np.ndarray  # int64 [narcs, 2]
    ring_pairs: np.ndarray  # int64 [nrings_out + 1]
    theta_cutoff: float

    def keys_of(self, grid_out: RingGrid, grid_in: RingGrid, point: int) -> np.ndarray:
        """Indices (ring order of ``grid_in``) of the keys output point ``point`` (ring order) attends to,
        ascending."""
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
        """(Output point, input point) pairs of the neighbourhoods of ``grid_out`` (the grid they were built
        for), summed over every output point."""
        if not len(self.pairs):
            return 0
        lengths = np.add.reduceat(self.arcs[:, 1], self.pair_offsets[:-1])
        per_period = grid_out.nlon[self.pairs[:, 0]] // self.pairs[:, 2]
        return int(np.sum(lengths * per_period))


def ring_arcs(grid_out: RingGrid, grid_in: RingGrid, theta_cutoff: float) -> RingArcs:
    """The neighbourhoods of ``grid_out``'s points among ``grid_in``'s within ``theta_cutoff`` radians (the
    module's rule), as :class:`RingArcs`."""
    for grid, name in ((grid_out, "grid_out"), (grid_in, "grid_in")):
        if not isinstance(grid, RingGrid):
            raise TypeError(f"{name} must be a RingGrid, got {type(grid).__name__}; build one with RingGrid.latlon, "
                            "RingGrid.healpix or RingGrid.octahedral.")  # fmt: skip
    theta_cutoff = _validate.positive_finite(theta_cutoff, "theta_cutoff", " in radians", "; pass e.g. 0.05")
    eff = (1.0 + THETA_CUTOFF_EPS) * theta_cutoff
    theta_out, theta_in = grid_out.colatitudes, grid_in.colatitudes
    lo = np.searchsorted(theta_in, theta_out - eff, side="left")
    hi = np.searchsorted(theta_in, theta_out + eff, side="right")
    pairs, offsets, arcs, ring_pairs = [], [0], [], [0]
    for a in range(grid_out.nrings):
        for b in range(int(lo[a]), int(hi[a])):
            found = _pair_arcs(grid_out, grid_in, a, b, eff)
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


def _pair_arcs(grid_out: RingGrid, grid_in: RingGrid, a: int, b: int, eff: float):
    """``(period, shift, arcs [period, 2])`` of output ring ``a`` against input ring ``b``, or None where no
    residue sees any of ring ``b``."""
    n_a, n_b = int(grid_out.nlon[a]), int(grid_in.nlon[b])
    g = math.gcd(n_a, n_b)
    period, shift = n_a // g, n_b // g
    theta_a, theta_b = float(grid_out.colatitudes[a]), float(grid_in.colatitudes[b])
    offset = float(grid_in.first_longitude[b]) - float(grid_out.first_longitude[a])
    residues = np.arange(period, dtype=np.int64)
    # Where each residue's query falls on ring b's lattice (in key steps), and the arc's half-width there.
    centre = (residues * n_b / n_a - offset * n_b / (2.0 * np.pi))
    sin_product = np.sin(theta_a) * np.sin(theta_b)
    cos_half = (np.cos(eff) - np.cos(theta_a) * np.cos(theta_b)) / sin_product if sin_product > 0 else -np.inf
    if cos_half <= -1.0:
        half_steps = n_b  # the whole ring, if anything
    elif cos_half > 1.0:
        half_steps = 0.0  # at most the nearest key (rounding), checked below
    else:
        half_steps = np.arccos(cos_half) * n_b / (2.0 * np.pi)
    margin = 2
    first = np.floor(centre - half_steps).astype(np.int64) - margin
    width = int(min(n_b, math.floor(2 * half_steps) + 2 * margin + 2))
    j = first[:, None] + np.arange(width)[None, :]
    inside = _member(n_a, n_b, offset, theta_a, theta_b, residues[:, None], j, eff)
    arcs = np.zeros((period, 2), np.int64)
    if width == n_b:  # the window is the whole ring: its members must be one cyclic run
        count = inside.sum(axis=1)
        starts = inside & ~np.roll(inside, 1, axis=1)
        full = count == n_b
        if np.any(~full & (count > 0) & (starts.sum(axis=1) != 1)):
            raise RuntimeError(f"rings {a} and {b}: a neighbourhood is not one arc")
        at = np.where(full, 0, np.argmax(starts, axis=1))
        arcs[:, 0] = np.mod(j[np.arange(period), at], n_b)
        arcs[:, 1] = count
    else:  # a window wider than the arc by `margin` on each side: the members must not touch its ends
        if np.any(inside[:, 0] | inside[:, -1]):
            raise RuntimeError(f"rings {a} and {b}: the arc reaches past its window")
        count = inside.sum(axis=1)
        starts = inside & ~np.concatenate([np.zeros((period, 1), bool), inside[:, :-1]], axis=1)
        if np.any((count > 0) & (starts.sum(axis=1) != 1)):
            raise RuntimeError(f"rings {a} and {b}: a neighbourhood is not one arc")
        at = np.argmax(inside, axis=1)
        arcs[:, 0] = np.mod(j[np.arange(period), at], n_b)
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
