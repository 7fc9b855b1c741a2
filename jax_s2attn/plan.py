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
  row), the form the tiled kernels read: a tile of consecutive longitudes spans
  every residue.

Arcs are ``(row, lo, len)`` int32 triples: the ``len`` longitudes
``(lo + j) mod nlon`` for ``j < len`` (one wrap at most; a full ring has
``lo = 0``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import numpy as np

from ._native import kernel_limits
from .grids import latitude_spacing, precompute_latitudes, precompute_longitudes, validate_grid, validate_shape

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
        (summed over the row's residues): the kernels' schedule. The table's stencil
        rows (:func:`stencil_pairs`) come last, ascending: the tiled kernels walk the
        ranks before them.
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


def _stencil_rows_last(row_order: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """``row_order`` with the rows of ``pairs`` moved to its end (ascending), the others' order kept."""
    stencil = np.zeros(row_order.size, bool)
    stencil[pairs[:, 0]] = stencil[pairs[:, 0] + 1] = True
    return np.concatenate([row_order[~stencil[row_order]], np.flatnonzero(stencil)]).astype(np.int32)


class PlanTables(NamedTuple):
    """Device-side tables the kernels read; the pytree leaves of a plan.

    All int32 except ``quad_weights`` (float32 ``[nlat_in]``, ``2*pi*w/nlon_in``).
    The segment tables are those of :class:`SegmentTable`; where ``R == 1`` they
    are the arc tables' arrays themselves.
    """

    forward_offsets: object
    forward_arcs: object
    forward_row_order: object
    backward_offsets: object
    backward_arcs: object
    backward_row_order: object
    quad_weights: object
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
        x = np.cos(to) * cos_l * np.sin(ti) - np.cos(ti) * np.sin(to)
        y = sin_l * np.sin(ti)
        z = cos_l * np.sin(to) * np.sin(ti) + np.cos(to) * np.cos(ti)
        norm = np.sqrt(x * x + y * y + z * z)
        masks[s : s + step] = np.arccos(z / norm) <= eff
    keep = masks.any(axis=1)
    return t_idx[keep], h_idx[keep], masks[keep]


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
            theta_cutoff = float(theta_cutoff)
            if not theta_cutoff > 0 or not math.isfinite(theta_cutoff):
                raise ValueError(f"theta_cutoff must be a positive finite angle in radians, got {theta_cutoff!r}.")
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

            f, b = self.forward_arcs, self.backward_arcs
            host = (f.offsets, f.arcs, f.row_order, b.offsets, b.arcs, b.row_order, self.quad_weights)
            # First use may happen while tracing: upload eagerly, never cache a tracer.
            with jax.ensure_compile_time_eval():
                arc_tables = [jax.device_put(t) for t in host]
                segment_tables = []
                walks = [(self.forward_segments, arc_tables[0:2]), (self.backward_segments, arc_tables[3:5])]
                for table, arcs in walks:
                    # With R == 1 the segment table is the arc table (checked when the plan is built).
                    segment_tables += arcs if table.residues == 1 else map(jax.device_put, table[:2])
                stencil = map(jax.device_put, (self.forward_stencil_pairs, self.backward_stencil_pairs))
                tables = PlanTables(*arc_tables, *segment_tables, *stencil)
            object.__setattr__(self, "_tables", tables)
        return tables

    @property
    def max_neighbors(self) -> int:
        """Largest neighbourhood of any output point."""
        return int(self.forward_arcs.pattern_lengths.max())


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
        p = int(np.flatnonzero(lengths == 0)[0])
        raise ValueError(
            f"theta_cutoff={theta_cutoff!r} leaves output latitude {p // forward.residues} with no input "
            f"neighbour; use a cutoff of at least the input grid's latitude spacing "
            f"({latitude_spacing(nlat_in, key.grid_in):.6g} rad)."
        )

    forward_segments, backward_segments = SegmentTable.from_arcs(forward), SegmentTable.from_arcs(backward)
    forward_stencil_pairs, backward_stencil_pairs = stencil_pairs(forward_segments), stencil_pairs(backward_segments)
    # The tiled kernels walk the first ranks of a row order, the stencil kernels the pairs' rows.
    forward = forward._replace(row_order=_stencil_rows_last(forward.row_order, forward_stencil_pairs))
    backward = backward._replace(row_order=_stencil_rows_last(backward.row_order, backward_stencil_pairs))
    for arcs, segments in [(forward, forward_segments), (backward, backward_segments)]:
        # The device tables share the arc arrays when R == 1, which relies on this.
        if arcs.residues == 1 and not (
            np.array_equal(arcs.offsets, segments.offsets) and np.array_equal(arcs.arcs, segments.segments)
        ):
            raise RuntimeError("a one-residue segment table differs from its arc table")

    quad_weights = (np.float32(2.0 * np.pi) * w_in.astype(np.float32) / np.float32(nlon_in)).astype(np.float32)
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
    host_tables = (csr_offsets, csr_columns, quad_weights, theta_in, theta_out, *forward[:3], *backward[:3])
    stencil = (forward_stencil_pairs, backward_stencil_pairs)
    for table in (*host_tables, *forward_segments[:2], *backward_segments[:2], *stencil):
        table.setflags(write=False)
    return plan


def _flatten_plan(plan: NeighborhoodPlan):
    return tuple(plan.tables), plan._host


def _unflatten_plan(host: NeighborhoodPlan, leaves) -> NeighborhoodPlan:
    plan = object.__new__(NeighborhoodPlan)
    plan.__dict__.update(host.__dict__)
    object.__setattr__(plan, "_tables", PlanTables(*leaves))
    return plan


def _register_pytree():
    import jax

    jax.tree_util.register_pytree_node(NeighborhoodPlan, _flatten_plan, _unflatten_plan)


_register_pytree()
