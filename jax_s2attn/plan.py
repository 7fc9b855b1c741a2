"""The neighbourhood plan: which input points each output point attends to.

Built once on the host in float64 numpy and cached. The plan holds three views
of the same sparsity:

* ``csr_offsets`` / ``csr_columns``: torch-harmonics' ``psi`` in its own layout
  (gather: one row per output latitude, columns ``hi*nlon_in + wi`` for the output
  at longitude 0; scatter: one row per input latitude, columns ``ho*nlon_out + wo``).
* ``forward_arcs``: for every query *pattern* the contiguous longitude arcs it
  reads on each key row. Output ``(ho, wo)`` uses pattern ``ho*R + wo % R``
  with every arc start shifted by ``S*(wo // R)`` key longitudes (``R``/``S`` are
  the table's ``residues``/``shift``). This is the gather walk of the forward
  pass and of dQ, for every direction.
* ``backward_arcs``: the transpose, keyed by input point, walked by dK/dV.
* ``forward_segments`` / ``backward_segments``: the same arcs merged per walking
  *row* (all ``R`` residues of one row side by side, one entry per other-grid
  row), the form the stencil kernels read (rows of short arcs beside the scheduled
  tensor-core kernels).

Arcs are ``(row, lo, len)`` int32 triples: the ``len`` longitudes
``(lo + j) mod nlon`` for ``j < len`` (one wrap at most; a full ring has
``lo = 0``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import NamedTuple

import numpy as np

from . import _validate
from ._native import kernel_limits
from .grids import (
    latitude_spacing,
    precompute_latitudes,
    precompute_longitudes,
    quadrature_weights,
    validate_grid,
    validate_shape,
)
from .schedule import BlockSchedule, as_runs, build_schedule, check_shape, tile_stencil_pairs, without_row_tiles

__all__ = ["ArcTable", "NeighborhoodPlan", "PlanTables", "SegmentTable", "THETA_CUTOFF_EPS", "stencil_pairs"]

#: Relative widening of the cutoff used by the membership test (torch-harmonics).
THETA_CUTOFF_EPS = 1e-3

# Bounds the float64 temporaries of the membership test to ~16 MB each.
_MEMBERSHIP_CHUNK = 1 << 21


class ArcTable(NamedTuple):
    """Arc-segment form of one walk direction (host numpy, int32).

    Attributes:
      offsets: ``[num_patterns + 1]`` CSR offsets into ``arcs``.
      arcs: ``[num_arcs, 3]`` rows of ``(row, lo, len)``, rows ascending per pattern.
      row_order: ``[rows]`` rows of the walking grid, most neighbours first
        (summed over the row's residues): the arc kernels' schedule.
      residues: ``R``; pattern of point ``(h, w)`` is ``h*R + w % R``.
      shift: ``S``; arcs of point ``(h, w)`` start ``S*(w // R)`` longitudes later.
      nlon: longitudes of the grid the arcs run on.
    """

    offsets: np.ndarray
    arcs: np.ndarray
    row_order: np.ndarray
    residues: int
    shift: int
    nlon: int

    @property
    def pattern_lengths(self) -> np.ndarray:
        """Neighbour count of every pattern (int64)."""
        return np.add.reduceat(
            np.append(self.arcs[:, 2].astype(np.int64), 0), self.offsets[:-1]
        ) * (np.diff(self.offsets) > 0)

    def expand(self, pattern: int, position: int = 0) -> np.ndarray:
        """Flat neighbour indices ``row*nlon + lon`` of one point (for tests/debugging).

        ``pattern`` is ``h*R + w % R`` and ``position`` is ``w // R``.
        """
        arcs = self.arcs[self.offsets[pattern] : self.offsets[pattern + 1]].astype(np.int64)
        start = arcs[:, 1] + self.shift * position
        lon = (start[:, None] + np.arange(self.nlon)[None, :]) % self.nlon
        mask = np.arange(self.nlon)[None, :] < arcs[:, 2:3]
        return (arcs[:, 0:1] * self.nlon + lon)[mask]


class SegmentTable(NamedTuple):
    """The arcs of an :class:`ArcTable` merged per walking row (host numpy, int32).

    Walking row ``h`` owns the patterns ``h*R + r`` for ``r < R``. Its segments are
    the other-grid rows any of them reads, ascending; segment ``(row, lo_0 ..
    lo_{R-1}, len_0 .. len_{R-1})`` holds the arc ``(lo_r mod nlon, len_r)`` of
    pattern ``h*R + r`` on ``row``, or ``(0, 0)`` where that pattern reads nothing
    there. Point ``(h, w)`` reads ``len_r`` longitudes from ``lo_r + S*(w // R)``
    with ``r = w % R``.

    The ``lo_r`` of one segment are unwrapped consistently, so that the arcs of
    neighbouring points of different residues are neighbours on the integer line
    too (a tile's union of arcs is then a short window, not a whole ring): each
    arc's centre is taken nearest to its point's own longitude ``r*S/R`` on the
    other grid, then the segment moves by whole rings so that its smallest ``lo``
    lies in ``[0, nlon)``. So every ``lo_r >= 0``, but ``lo_r`` may reach past
    ``nlon`` when ``R > 1``. With ``R == 1`` the table equals the arc table.

    Attributes:
      offsets: ``[nlat_walk + 1]`` CSR offsets into ``segments``.
      segments: ``[num_segments, 1 + 2R]``.
      residues, shift, nlon: as in the :class:`ArcTable` it was built from.
    """

    offsets: np.ndarray
    segments: np.ndarray
    residues: int
    shift: int
    nlon: int

    @classmethod
    def from_arcs(cls, table: ArcTable) -> SegmentTable:
        """Merge ``table``'s patterns per walking row."""
        residues = table.residues
        nlat_walk = (table.offsets.size - 1) // residues
        pattern = np.repeat(np.arange(table.offsets.size - 1), np.diff(table.offsets))
        walk_row, residue = np.divmod(pattern, residues)
        row, lo, length = table.arcs.T.astype(np.int64)
        nrows = int(row.max()) + 1 if row.size else 1
        keys, segment = np.unique(walk_row * nrows + row, return_inverse=True)
        if np.unique(segment * residues + residue).size != segment.size:
            # Impossible for geodesic balls (one arc per pattern and row); guards the construction.
            raise RuntimeError("a pattern has two arcs on the same row")
        # Unwrap each lo so that its arc's centre lies within half a ring of the point's own
        # longitude r*S/R (all scaled by 2R to stay integer), then move each segment by whole
        # rings so that its smallest lo is in [0, nlon).
        nlon = table.nlon
        centre = 2 * residues * lo + residues * (length - 1) - 2 * table.shift * residue
        lo = lo - nlon * np.floor_divide(centre + residues * nlon, 2 * residues * nlon)
        smallest = np.full(keys.size, np.iinfo(np.int64).max)
        np.minimum.at(smallest, segment, lo)
        lo = lo - nlon * np.floor_divide(smallest, nlon)[segment]
        if (lo >= 2 * nlon).any():  # the kernels wrap a start at most twice (cuda/README.md)
            raise RuntimeError("an unwrapped segment start reached 2 * nlon")
        segments = np.zeros((keys.size, 1 + 2 * residues), dtype=np.int32)
        segments[:, 0] = keys % nrows
        segments[segment, 1 + residue] = lo
        segments[segment, 1 + residues + residue] = length
        offsets = np.zeros(nlat_walk + 1, dtype=np.int32)
        np.cumsum(np.bincount(keys // nrows, minlength=nlat_walk), out=offsets[1:])
        return cls(offsets, segments, residues, table.shift, table.nlon)


def stencil_pairs(table: SegmentTable) -> np.ndarray:
    """The walking row pairs ``(2i, 2i + 1)`` of ``table`` the stencil kernels take, int32 ``[pairs, 2]``
    rows of (first walking row, first other-grid row they see); none where no native module is built
    (no kernel would take them).

    With ``H = stencil_max_half`` and ``O = stencil_max_other_rows`` of :func:`~jax_s2attn._native.kernel_limits`
    (the stencil kernels' shape), a pair qualifies when the walk has one residue and shift 1 (arcs
    relative to their point), each arc ``(lo, len)`` of both rows starts at ``lo`` (or ``lo - nlon`` when
    ``lo > H``) longitudes from its point, at least ``-H``, and ends at most ``H`` past it, and the rows
    both rows see span at most ``O``. The kernel applies the same rule to every arc it reads. Rows of short arcs cost the tensor-core kernels whole 16-column blocks
    for a few neighbours (docs/performance.md).
    """
    none = np.zeros((0, 2), np.int32)
    limits = kernel_limits()
    if limits is None or table.residues != 1 or table.shift != 1:
        return none
    max_half, max_other_rows = limits.stencil_max_half, limits.stencil_max_other_rows
    rows = table.offsets.size - 1
    segments = table.segments.astype(np.int64)
    row_of = np.repeat(np.arange(rows), np.diff(table.offsets))
    other, lo, length = segments[:, 0], segments[:, 1], segments[:, 2]
    start = np.where(lo > max_half, lo - table.nlon, lo)
    short = (start >= -max_half) & (start + length - 1 <= max_half)
    row_short = np.ones(rows, bool)
    np.logical_and.at(row_short, row_of, short)
    first, last = np.full(rows, np.iinfo(np.int64).max), np.full(rows, -1)
    np.minimum.at(first, row_of, other)
    np.maximum.at(last, row_of, other)
    pairs = np.arange(rows // 2)
    even, odd = 2 * pairs, 2 * pairs + 1
    pair_first = np.minimum(first[even], first[odd])
    keep = row_short[even] & row_short[odd] & (np.maximum(last[even], last[odd]) - pair_first < max_other_rows)
    # A pair of rows without arcs (never in a plan: every query has a neighbour) stages from row 0.
    pair_first = np.where(pair_first > last.max(initial=0), 0, pair_first)
    return np.stack([even[keep], pair_first[keep]], axis=1).astype(np.int32).reshape(-1, 2)


class PlanTables(NamedTuple):
    """Device-side tables the kernels read; the pytree leaves of a plan.

    All int32 index tables: a dtype cast of every floating leaf of a model's state (mixed
    precision) leaves them alone. The quadrature weights are not among them: each call
    takes them from the host (:meth:`NeighborhoodPlan.quadrature_weights`) in the precision
    it computes in. The segment tables are those of :class:`SegmentTable`; where ``R == 1``
    they are the arc tables' arrays themselves.
    """

    forward_offsets: object
    forward_arcs: object
    forward_row_order: object
    backward_offsets: object
    backward_arcs: object
    backward_row_order: object
    forward_segment_offsets: object
    forward_segments: object
    backward_segment_offsets: object
    backward_segments: object
    forward_stencil_pairs: object
    backward_stencil_pairs: object


def _membership(theta_out, theta_in, lon_in, eff):
    """Band pairs ``(t, h)`` and boolean masks ``[pairs, nlon_in]`` of the rule.

    Input point ``(theta_in[h], lon_in[j])`` belongs to output ``(theta_out[t], 0)``
    iff its geodesic distance is ``<= eff``, evaluated literally as
    torch-harmonics does (rotation into the output's frame, normalisation,
    arccos), so the sparsity matches it bit for bit.
    """
    lo = np.searchsorted(theta_in, theta_out - eff, side="left")
    hi = np.searchsorted(theta_in, theta_out + eff, side="right")
    counts = hi - lo
    t_idx = np.repeat(np.arange(theta_out.size), counts)
    h_idx = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts) + np.repeat(lo, counts)
    masks = np.empty((t_idx.size, lon_in.size), dtype=bool)
    cos_l, sin_l = np.cos(lon_in)[None, :], np.sin(lon_in)[None, :]
    step = max(1, _MEMBERSHIP_CHUNK // max(1, lon_in.size))
    for s in range(0, t_idx.size, step):
        to = theta_out[t_idx[s : s + step]][:, None]
        ti = theta_in[h_idx[s : s + step]][:, None]
        masks[s : s + step] = within_cutoff(to, ti, cos_l, sin_l, eff)
    keep = masks.any(axis=1)
    return t_idx[keep], h_idx[keep], masks[keep]


def within_cutoff(theta_out, theta_in, cos_l, sin_l, eff):
    """The rule, as torch-harmonics evaluates it: whether the input point at colatitude ``theta_in`` and longitude
    ``l`` (by ``cos_l``, ``sin_l``) relative to the output point at ``theta_out`` lies within ``eff`` radians,
    by the rotation into the output's frame, normalisation and arccos (arrays broadcast)."""
    x = np.cos(theta_out) * cos_l * np.sin(theta_in) - np.cos(theta_in) * np.sin(theta_out)
    y = sin_l * np.sin(theta_in)
    z = cos_l * np.sin(theta_out) * np.sin(theta_in) + np.cos(theta_out) * np.cos(theta_in)
    norm = np.sqrt(x * x + y * y + z * z)
    return np.arccos(z / norm) <= eff


def _arcs_of(masks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(lo, len)`` of cyclic masks ``[n, nlon]`` that are each a single arc."""
    count = masks.sum(axis=1)
    starts = masks & ~np.roll(masks, 1, axis=1)
    full = count == masks.shape[1]
    bad = ~full & (starts.sum(axis=1) != 1)
    if bad.any():  # Impossible for geodesic balls; guards the construction itself.
        raise RuntimeError("neighbourhood is not one contiguous longitude arc per row")
    lo = np.where(full, 0, np.argmax(starts, axis=1))
    return lo, count


def _arc_table(pattern, row, masks, num_patterns, residues, shift) -> ArcTable:
    """Pack per-(pattern, row) masks into an :class:`ArcTable`."""
    nonempty = masks.any(axis=1)
    pattern, row, masks = pattern[nonempty], row[nonempty], masks[nonempty]
    lo, length = _arcs_of(masks)
    perm = np.lexsort((row, pattern))
    arcs = np.stack([row[perm], lo[perm], length[perm]], axis=1).astype(np.int32)
    offsets = np.zeros(num_patterns + 1, dtype=np.int64)
    np.cumsum(np.bincount(pattern, minlength=num_patterns), out=offsets[1:])
    row_lengths = np.bincount(pattern // residues, weights=length, minlength=num_patterns // residues)
    return ArcTable(
        offsets=offsets.astype(np.int32),
        arcs=np.ascontiguousarray(arcs),
        row_order=np.argsort(-row_lengths, kind="stable").astype(np.int32),
        residues=int(residues),
        shift=int(shift),
        nlon=int(masks.shape[1]),
    )


def _residue_masks(masks: np.ndarray, factor: int) -> np.ndarray:
    """Re-index masks over a fine axis to ``[n, factor, nlon_fine // factor]``.

    Entry ``[:, r, w]`` is ``masks[:, (r - factor*w) mod nlon_fine]``: membership of
    coarse longitude ``w`` seen from fine residue ``r``.
    """
    nlon = masks.shape[1]
    r = np.arange(factor)[:, None]
    w = np.arange(nlon // factor)[None, :]
    return masks[:, (r - factor * w) % nlon]


def _split_residues(pattern_rows, other_rows, res_masks, factor):
    n = pattern_rows.size
    pattern = (pattern_rows[:, None] * factor + np.arange(factor)[None, :]).reshape(-1)
    rows = np.repeat(other_rows, factor)
    return pattern, rows, res_masks.reshape(n * factor, res_masks.shape[-1])


@dataclasses.dataclass(frozen=True)
class _PlanKey:
    in_shape: tuple[int, int]
    out_shape: tuple[int, int]
    grid_in: str
    grid_out: str
    theta_cutoff: float | None


class NeighborhoodPlan:
    """Neighbourhood sparsity of attention from ``in_shape`` to ``out_shape`` on the sphere.

    Output point ``o`` attends to every input point ``i`` with geodesic distance
    ``d(o, i) <= (1 + 1e-3) * theta_cutoff`` (inclusive, float64), exactly as
    torch-harmonics builds its ``psi``.

    Args:
      in_shape: ``(nlat_in, nlon_in)`` of keys/values.
      out_shape: ``(nlat_out, nlon_out)`` of queries/outputs.
      grid_in, grid_out: latitude grids (see :data:`jax_s2attn.grids.GRIDS`).
      theta_cutoff: neighbourhood radius in radians. Default: the largest
        latitude spacing of the output grid (of the input grid when upsampling).

    Plans are immutable, hashable and cached on their arguments, so they can be
    static arguments of ``jax.jit``. Direction: ``"gather"`` when ``nlon_in`` is a
    multiple of ``nlon_out`` (self-attention, downsampling), ``"scatter"`` when
    ``nlon_out`` is a proper multiple of ``nlon_in`` (upsampling).
    """

    def __new__(cls, in_shape, out_shape, grid_in="equiangular", grid_out="equiangular", theta_cutoff=None):
        in_shape = validate_shape(in_shape, "in_shape")
        out_shape = validate_shape(out_shape, "out_shape")
        validate_grid(grid_in, "grid_in")
        validate_grid(grid_out, "grid_out")
        if theta_cutoff is not None:
            theta_cutoff = _validate.positive_finite(
                theta_cutoff, "theta_cutoff", " in radians", "; pass e.g. 0.05, or None for one latitude spacing"
            )
        return _build_plan(_PlanKey(in_shape, out_shape, grid_in, grid_out, theta_cutoff))

    def __init__(self, *args, **kwargs):  # All work happens in the cached builder.
        pass

    def __setattr__(self, name, value):
        raise AttributeError("NeighborhoodPlan is immutable")

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other) -> bool:
        return isinstance(other, NeighborhoodPlan) and self._key == other._key

    def __repr__(self) -> str:
        return (
            f"NeighborhoodPlan(in_shape={self.in_shape}, out_shape={self.out_shape}, "
            f"grid_in={self.grid_in!r}, grid_out={self.grid_out!r}, theta_cutoff={self.theta_cutoff!r}, "
            f"direction={self.direction!r}, nnz={self.nnz}, num_pairs={self.num_pairs})"
        )

    def __reduce__(self):
        k = self._key
        return (NeighborhoodPlan, (k.in_shape, k.out_shape, k.grid_in, k.grid_out, k.theta_cutoff))

    # Shapes -------------------------------------------------------------------
    @property
    def nlat_in(self) -> int:
        return self.in_shape[0]

    @property
    def nlon_in(self) -> int:
        return self.in_shape[1]

    @property
    def nlat_out(self) -> int:
        return self.out_shape[0]

    @property
    def nlon_out(self) -> int:
        return self.out_shape[1]

    @property
    def tables(self) -> PlanTables:
        """The kernel tables as ``jax.Array`` s, uploaded once per plan.

        A plan is a pytree whose leaves are these tables: pass it as an ordinary
        (non-static) argument of ``jax.jit`` and the tables enter the computation as
        operands instead of constants baked into the program.
        """
        tables = self.__dict__.get("_tables")
        if tables is None:
            import jax  # Deferred: building a plan must not start a backend.

            # First use may happen while tracing: upload eagerly, never cache a tracer.
            with jax.ensure_compile_time_eval():
                uploaded = {}  # one device array per host array (R == 1 segment tables are the arc tables)
                tables = PlanTables(
                    *(uploaded.setdefault(id(t), jax.device_put(t)) for t in _host_tables(self._host))
                )
            object.__setattr__(self, "_tables", tables)
        return tables

    def quadrature_weights(self, dtype) -> np.ndarray:
        """Per input latitude, the weight ``2*pi*w/nlon_in`` inside the softmax, ``[nlat_in]`` host numpy.

        float64 (exact) for a float64 computation; for any other ``dtype`` the float32 table the
        native kernels read, :attr:`quad_weights` (torch-harmonics' bits).
        """
        return self._quad_weights_float64 if np.dtype(dtype) == np.float64 else self.quad_weights

    def check_tables(self) -> None:
        """Raise ``TypeError`` unless the device tables are what this plan built (int32, its shapes), e.g.
        after a dtype cast of every leaf of a pytree holding the plan."""
        for name, leaf, host in zip(PlanTables._fields, self.tables, _host_tables(self._host)):
            if getattr(leaf, "dtype", None) != np.int32 or tuple(getattr(leaf, "shape", ())) != host.shape:
                raise TypeError(
                    f"the plan's table {name} is {getattr(leaf, 'dtype', type(leaf).__name__)} of shape "
                    f"{tuple(getattr(leaf, 'shape', ()))}, but the plan built it int32 of shape {host.shape}: a "
                    "transformation of the whole pytree holding the plan changed it. Its tables are all int32 index "
                    "tables; cast only floating leaves (e.g. jax.tree.map(lambda x: x.astype(jnp.bfloat16) if "
                    "jnp.issubdtype(x.dtype, jnp.floating) else x, state)) or leave the plan out of the cast."
                )

    def block_schedule(
        self, walk: str, *, tile_rows: int = 4, tile_cols: int = 16, chunk_cols: int = 32, stencil: bool = False,
        runs: tuple[int, int] | None = None,
    ) -> BlockSchedule:  # fmt: skip
        """The block-sparse schedule of one walk (:mod:`jax_s2attn.schedule`), built once per plan and shape.

        Args:
          walk: ``"forward"`` (query tiles over key chunks: the forward pass and dQ) or ``"backward"``
            (key tiles over query chunks: dK/dV).
          tile_rows, tile_cols, chunk_cols: the shape of a tile and of a chunk.
          stencil: leave out the tiles of the rows :meth:`tile_stencil_pairs` gives the stencil kernels.
          runs: ``(runs, run_points)``: the schedule in the ring grids' format (:func:`~jax_s2attn.schedule.as_runs`:
            flat fields, a tile as ``runs`` runs of up to ``run_points`` points along its rows); None: the
            regular format.
        """
        walk = _check_walk(walk)
        stencil = _validate.boolean(stencil, "stencil")
        # Checked before the cache, whose keys would take True for 1 and 16.0 for 16.
        shape = check_shape("tile_rows", tile_rows, 1), check_shape("tile_cols", tile_cols, 1)
        if runs is not None:
            if not isinstance(runs, tuple) or len(runs) != 2:
                raise TypeError(f"runs must be a tuple (runs, run_points) or None, got {runs!r}.")
            runs = _validate.integer(runs[0], "runs[0]", 1), _validate.integer(runs[1], "runs[1]", 1)
        return _block_schedule(self._key, walk, *shape, check_shape("chunk_cols", chunk_cols, 16), stencil, runs)

    def tile_stencil_pairs(self, walk: str, *, tile_rows: int = 4) -> np.ndarray:
        """The stencil pairs of one walk (:attr:`forward_stencil_pairs` or :attr:`backward_stencil_pairs`) whose
        tiles of ``tile_rows`` rows hold no other rows: what the stencil kernels take beside the scheduled ones,
        whose schedule (:meth:`block_schedule` with ``stencil=True``) lists the other tiles. Int32 ``[pairs, 2]``."""
        walk = _check_walk(walk)
        return _tile_stencil_pairs(self._key, walk, check_shape("tile_rows", tile_rows, 1))

    @property
    def max_neighbors(self) -> int:
        """Largest neighbourhood of any output point."""
        return int(self.forward_arcs.pattern_lengths.max())


def _nearest_input_distance(theta: float, lon: float, theta_in: np.ndarray, nlon_in: int) -> float:
    """Geodesic distance from the point ``(theta, lon)`` to the nearest point of the input grid: on each
    input ring the nearest longitude is the one nearest ``lon``."""
    step = 2.0 * np.pi / nlon_in
    nearest = np.round(lon / step) * step - lon
    cos_d = np.cos(theta) * np.cos(theta_in) + np.sin(theta) * np.sin(theta_in) * np.cos(nearest)
    return float(np.arccos(np.clip(cos_d, -1.0, 1.0)).min())


def _empty_neighbourhood_error(lengths, residues: int, theta_cutoff: float, theta_out, theta_in, key) -> ValueError:
    """The error for output points without any input point within the cutoff: which points, whether the
    gap is between latitudes or between the longitudes of a ring, and the smallest cutoff that closes it."""
    empty = np.flatnonzero(lengths == 0)
    rows, residue = np.divmod(empty, residues)
    nlon_in, nlon_out = key.in_shape[1], key.out_shape[1]
    needed = max(
        _nearest_input_distance(theta_out[r], 2.0 * np.pi * m / nlon_out, theta_in, nlon_in)
        for r, m in zip(rows, residue)
    )
    # The rule admits distances up to (1 + THETA_CUTOFF_EPS) * theta_cutoff; rounded up to the digits shown.
    digits = 5 - int(np.floor(np.log10(needed)))
    suggestion = np.ceil(needed / (1.0 + THETA_CUTOFF_EPS) * 10.0**digits) / 10.0**digits
    row_has_neighbours = lengths.reshape(-1, residues).sum(axis=1) > 0
    if row_has_neighbours[rows].all():
        where = (
            f"{len(rows)} output point classes (the first at latitude {int(rows[0])}, longitude {int(residue[0])}) "
            f"fall between the input grid's longitudes, {2.0 * np.pi / nlon_in:.6g} rad apart on the equator"
        )
    else:
        row = int(rows[~row_has_neighbours[rows]][0])
        where = (
            f"output latitude {row} (colatitude {theta_out[row]:.6g} rad) is farther than theta_cutoff from every "
            "input ring"
        )
    return ValueError(
        f"theta_cutoff={theta_cutoff!r} leaves output points with no input neighbour: {where}. "
        f"Use theta_cutoff >= {suggestion:.6g} rad (the smallest cutoff that gives every output point a neighbour)."
    )


def _host_tables(plan: NeighborhoodPlan) -> tuple[np.ndarray, ...]:
    """The host arrays of :class:`PlanTables`, in its order (the same array twice where a segment table is
    its arc table)."""
    f, b = plan.forward_arcs, plan.backward_arcs
    fs, bs = plan.forward_segments, plan.backward_segments
    forward_segments = (f.offsets, f.arcs) if fs.residues == 1 else (fs.offsets, fs.segments)
    backward_segments = (b.offsets, b.arcs) if bs.residues == 1 else (bs.offsets, bs.segments)
    return (
        f.offsets, f.arcs, f.row_order, b.offsets, b.arcs, b.row_order,
        *forward_segments, *backward_segments, plan.forward_stencil_pairs, plan.backward_stencil_pairs,
    )  # fmt: skip


def _set(obj, **values):
    for name, value in values.items():
        object.__setattr__(obj, name, value)


@functools.lru_cache(maxsize=64)
def _build_plan(key: _PlanKey) -> NeighborhoodPlan:
    (nlat_in, nlon_in), (nlat_out, nlon_out) = key.in_shape, key.out_shape
    if nlon_in % nlon_out == 0:
        direction = "gather"
    elif nlon_out % nlon_in == 0:
        direction = "scatter"
    else:
        raise ValueError(
            f"nlon_in={nlon_in} and nlon_out={nlon_out}: one longitude count must be an integer multiple "
            "of the other (e.g. nlon_in = 2*nlon_out for downsampling)."
        )
    theta_in, w_in = precompute_latitudes(nlat_in, key.grid_in)
    theta_out, _ = precompute_latitudes(nlat_out, key.grid_out)
    theta_cutoff = key.theta_cutoff
    if theta_cutoff is None:
        theta_cutoff = (
            latitude_spacing(nlat_out, key.grid_out)
            if direction == "gather"
            else latitude_spacing(nlat_in, key.grid_in)
        )
    eff = (1.0 + THETA_CUTOFF_EPS) * theta_cutoff

    if direction == "gather":
        pscale = nlon_in // nlon_out
        rows, cols, masks = _membership(theta_out, theta_in, precompute_longitudes(nlon_in), eff)
        psi_rows, psi_nlon, nrows = rows, nlon_in, nlat_out
        forward = _arc_table(rows, cols, masks, nlat_out, residues=1, shift=pscale)
        pattern, other, res = _split_residues(cols, rows, _residue_masks(masks, pscale), pscale)
        backward = _arc_table(pattern, other, res, nlat_in * pscale, residues=pscale, shift=1)
    else:
        pscale = nlon_out // nlon_in
        # torch-harmonics builds the upsampling psi with the grids swapped.
        rows, cols, masks = _membership(theta_in, theta_out, precompute_longitudes(nlon_out), eff)
        psi_rows, psi_nlon, nrows = rows, nlon_out, nlat_in
        backward = _arc_table(rows, cols, masks, nlat_in, residues=1, shift=pscale)
        pattern, other, res = _split_residues(cols, rows, _residue_masks(masks, pscale), pscale)
        forward = _arc_table(pattern, other, res, nlat_out * pscale, residues=pscale, shift=1)

    counts = masks.sum(axis=1)
    csr_offsets = np.zeros(nrows + 1, dtype=np.int64)
    np.cumsum(np.bincount(psi_rows, weights=counts, minlength=nrows).astype(np.int64), out=csr_offsets[1:])
    pair_r, pair_lon = np.nonzero(masks)
    csr_columns = cols[pair_r].astype(np.int64) * psi_nlon + pair_lon

    lengths = forward.pattern_lengths
    if (lengths == 0).any():
        raise _empty_neighbourhood_error(lengths, forward.residues, theta_cutoff, theta_out, theta_in, key)

    forward_segments, backward_segments = SegmentTable.from_arcs(forward), SegmentTable.from_arcs(backward)
    forward_stencil_pairs, backward_stencil_pairs = stencil_pairs(forward_segments), stencil_pairs(backward_segments)
    for arcs, segments in [(forward, forward_segments), (backward, backward_segments)]:
        # The device tables share the arc arrays when R == 1, which relies on this.
        if arcs.residues == 1 and not (
            np.array_equal(arcs.offsets, segments.offsets) and np.array_equal(arcs.arcs, segments.segments)
        ):
            raise RuntimeError("a one-residue segment table differs from its arc table")

    # torch-harmonics' float32 weights (what the native kernels read) and the exact ones (float64 computations).
    quad_weights = quadrature_weights(key.in_shape, key.grid_in)
    quad_weights_float64 = 2.0 * np.pi * w_in / nlon_in
    plan = object.__new__(NeighborhoodPlan)
    _set(
        plan,
        _key=key,
        _tables=None,
        in_shape=key.in_shape,
        out_shape=key.out_shape,
        grid_in=key.grid_in,
        grid_out=key.grid_out,
        theta_cutoff=float(theta_cutoff),
        direction=direction,
        pscale=pscale,
        theta_in=theta_in,
        theta_out=theta_out,
        quad_weights=quad_weights,
        _quad_weights_float64=quad_weights_float64,
        csr_offsets=csr_offsets,
        csr_columns=csr_columns,
        nnz=int(csr_columns.size),
        num_pairs=int(lengths.sum() * (nlon_out // forward.residues)),
        forward_arcs=forward,
        backward_arcs=backward,
        forward_segments=forward_segments,
        backward_segments=backward_segments,
        forward_stencil_pairs=forward_stencil_pairs,
        backward_stencil_pairs=backward_stencil_pairs,
    )
    _set(plan, _host=plan)
    host_tables = (
        csr_offsets, csr_columns, quad_weights, quad_weights_float64, theta_in, theta_out, *forward[:3], *backward[:3]
    )  # fmt: skip
    stencil = (forward_stencil_pairs, backward_stencil_pairs)
    for table in (*host_tables, *forward_segments[:2], *backward_segments[:2], *stencil):
        table.setflags(write=False)
    return plan


def _check_walk(walk) -> str:
    if walk not in ("forward", "backward"):
        raise ValueError(f"walk={walk!r} must be 'forward' (queries over keys) or 'backward' (keys over queries).")
    return walk


# A schedule is ~40 bytes a chunk (23 MB per walk at 721x1440, tc 0.03): a few plans' worth are kept (a plan with
# stencil rows keeps up to five a walk: whole and without those rows' tiles, on 4 x 16 and 1 x 64 tiles, and the
# latter as runs). Every call passes all seven arguments, so that one schedule has one key.
@functools.lru_cache(maxsize=32)
def _block_schedule(key: _PlanKey, walk: str, tile_rows: int, tile_cols: int, chunk_cols: int, stencil: bool,
                    runs: tuple[int, int] | None = None) -> BlockSchedule:  # fmt: skip
    plan = _build_plan(key)
    if runs is not None:
        nlat_other = plan.nlat_in if walk == "forward" else plan.nlat_out
        regular = _block_schedule(key, walk, tile_rows, tile_cols, chunk_cols, stencil, None)
        schedule = as_runs(regular, *runs, nlat_other)
    elif stencil:
        schedule = without_row_tiles(_block_schedule(key, walk, tile_rows, tile_cols, chunk_cols, False, None),
                                     _tile_stencil_pairs(key, walk, tile_rows))  # fmt: skip
    else:
        segments, shape = (
            (plan.forward_segments, plan.out_shape) if walk == "forward" else (plan.backward_segments, plan.in_shape)
        )
        schedule = build_schedule(segments, *shape, tile_rows=tile_rows, tile_cols=tile_cols, chunk_cols=chunk_cols)
    for table in schedule[:4]:
        table.setflags(write=False)
    return schedule


@functools.lru_cache(maxsize=16)
def _tile_stencil_pairs(key: _PlanKey, walk: str, tile_rows: int) -> np.ndarray:
    plan = _build_plan(key)
    if walk == "forward":
        pairs = tile_stencil_pairs(plan.forward_stencil_pairs, plan.nlat_out, tile_rows)
    else:
        pairs = tile_stencil_pairs(plan.backward_stencil_pairs, plan.nlat_in, tile_rows)
    pairs.setflags(write=False)
    return pairs


def _flatten_plan(plan: NeighborhoodPlan):
    return tuple(plan.tables), plan._host


def _unflatten_plan(host: NeighborhoodPlan, leaves) -> NeighborhoodPlan:
    plan = object.__new__(NeighborhoodPlan)
    plan.__dict__.update(host.__dict__)
    object.__setattr__(plan, "_tables", PlanTables(*leaves))
    return plan


#: Name of the plan's pytree node in programs serialized by ``jax.export``.
SERIALIZED_NAME = "jax_s2attn.NeighborhoodPlan"


def _serialize_plan(host: NeighborhoodPlan) -> bytes:
    """The plan's constructor arguments (its tables are rebuilt from them): what ``jax.export`` stores."""
    k = host._key
    arguments = dict(in_shape=k.in_shape, out_shape=k.out_shape, grid_in=k.grid_in, grid_out=k.grid_out,
                     theta_cutoff=k.theta_cutoff)  # fmt: skip
    return json.dumps(arguments).encode()


def _deserialize_plan(data: bytes) -> NeighborhoodPlan:
    arguments = json.loads(data.decode())
    return NeighborhoodPlan(
        tuple(arguments["in_shape"]), tuple(arguments["out_shape"]), arguments["grid_in"], arguments["grid_out"],
        arguments["theta_cutoff"],
    )._host  # fmt: skip


def _register_pytree():
    import jax

    jax.tree_util.register_pytree_node(NeighborhoodPlan, _flatten_plan, _unflatten_plan)
    # Exported programs that take a plan as an argument serialize it by its constructor arguments.
    jax.export.register_pytree_node_serialization(
        NeighborhoodPlan,
        serialized_name=SERIALIZED_NAME,
        serialize_auxdata=_serialize_plan,
        deserialize_auxdata=_deserialize_plan,
    )


_register_pytree()
