"""How the warp-specialised prototype's chunks meet its warps' arcs, and what other tile shapes would
multiply.

Replays the walk of ``experimental/cuda/ws_attention.cu`` on the host: blocks of 4 query rows x 16 longitudes,
per key row a window of the rows' arcs staged in 32-column chunks, one warp per query row. Each
(warp, chunk) is *full* (every column valid and inside all 16 queries' arcs: no per-element test),
*none* (no column in any arc: no softmax) or *partial*. Then, for m64 tiles of other shapes (rows x
longitudes) and chunk widths, the chunks staged and the useful fraction of the pairs multiplied. The
half-widths follow the prototype's own rule (``HalfWidths``), not the plan's.
Usage: ``python experimental/ws_chunk_covers.py``.
"""

from __future__ import annotations

import math

import numpy as np

RING = 1 << 20  # the prototype's kRing: a key row every query of the row sees whole
ROWS, LONS, CHUNK = 4, 16, 32  # kTileRows, kGroupLons (one consumer warpgroup per block), kChunk


def half_widths(nlat: int, nlon: int, cutoff: float) -> np.ndarray:
    """[query row, key row] longitudes each side a query sees (-1: none, RING: the whole ring)."""
    theta = np.pi * np.arange(nlat) / (nlat - 1)
    sines = np.sin(theta)[:, None] * np.sin(theta)[None, :]
    cosines = np.cos(theta)[:, None] * np.cos(theta)[None, :]
    pole = sines < 1e-12
    c = (math.cos(cutoff) - cosines) / np.where(pole, 1.0, sines)
    half = np.full((nlat, nlat), -1, np.int64)
    half[pole & (np.abs(theta[:, None] - theta[None, :]) <= cutoff)] = RING
    seen = ~pole & (c <= 1)
    arc = np.floor(np.arccos(np.clip(c, -1, 1)) / (2 * np.pi / nlon) + 1e-9).astype(np.int64)
    half[seen] = np.where(c[seen] <= -1, RING, arc[seen])
    half[(half >= 0) & (2 * half + 1 >= nlon)] = RING
    return half


def _key_rows(half: np.ndarray, rows: int):
    """Per block of ``rows`` query rows and key row it sees: the rows' half-widths there and their reach."""
    for first_row in range(0, half.shape[0], rows):
        block = half[first_row:first_row + rows]
        reach = block.max(axis=0)
        for key_row in np.nonzero(reach >= 0)[0]:
            yield block[:, key_row], int(reach[key_row])


def covers(nlat: int, nlon: int, cutoff: float) -> dict[str, int]:
    """Counts of full, none and partial (warp, chunk) pairs over the whole walk."""
    counts = {"full": 0, "none": 0, "partial": 0}
    for widths, reach in _key_rows(half_widths(nlat, nlon, cutoff), ROWS):
        for first_lon in range(0, nlon, LONS):
            lo, hi = first_lon - reach, first_lon + LONS + reach
            begin, end = (0, nlon) if hi - lo >= nlon else (lo, hi)  # wrapping leaves the classes alone
            for lon in range(begin, end, CHUNK):
                valid = min(CHUNK, end - lon)
                for width in widths:
                    counts[_cover(width, lon, valid, first_lon)] += 1
    return counts


def _cover(width: int, lon: int, valid: int, first_lon: int) -> str:
    if width < 0:
        return "none"
    if width >= RING:
        return "full" if valid == CHUNK else "partial"
    last_lon = first_lon + LONS - 1
    if valid == CHUNK and lon >= last_lon - width and lon + CHUNK - 1 <= first_lon + width:
        return "full"
    if lon + valid - 1 < first_lon - width or lon > last_lon + width:
        return "none"
    return "partial"


def tiling(nlat: int, nlon: int, cutoff: float, rows: int, chunk: int) -> tuple[int, float]:
    """Chunks staged and the useful fraction of the pairs multiplied by m64 tiles of ``rows`` query rows x
    ``64 // rows`` longitudes, each multiplying every ``chunk``-column chunk of its key rows' windows."""
    lons = 64 // rows
    tiles = math.ceil(nlon / lons)
    chunks = useful = 0
    for widths, reach in _key_rows(half_widths(nlat, nlon, cutoff), rows):
        window = nlon if lons + 2 * reach >= nlon else lons + 2 * reach
        chunks += tiles * math.ceil(window / chunk)
        useful += nlon * int(np.where(widths >= RING, nlon, np.where(widths >= 0, 2 * widths + 1, 0)).sum())
    return chunks, useful / (chunks * 64 * chunk)


def main() -> None:
    configs = [("721x1440 tc 0.03", 721, 1440, 0.03), ("721x1440 default", 721, 1440, 2 * math.pi / 1440),
               ("360x720 tc 0.03", 360, 720, 0.03)]
    for name, nlat, nlon, cutoff in configs:
        counts = covers(nlat, nlon, cutoff)
        total = sum(counts.values())
        shares = "  ".join(f"{key} {value / total:.1%}" for key, value in counts.items())
        print(f"{name:18s} warp-chunks {total:.3e}  {shares}", flush=True)
    for name, nlat, nlon, cutoff in configs:
        for rows in (4, 2, 1, 8):
            cells = []
            for chunk in (16, 32, 64):
                chunks, useful = tiling(nlat, nlon, cutoff, rows, chunk)
                cells.append(f"{chunk:2d} columns: chunks {chunks:.2e} useful {useful:.2f}")
            print(f"{name:18s} {rows} x {64 // rows:<2d}  " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
