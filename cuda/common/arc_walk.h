// Arc walking: the one definition of "which neighbours inside a window" shared by the
// CPU handlers and the CUDA kernels. Plain C++ with no XLA or CUDA headers, so any
// translation unit (.cc or .cu) can include it; every function is __host__ __device__
// under nvcc.
//
// Geometry (cuda/README.md): a walking point at global (lat, lon) uses pattern
// `lat*R + lon % R` of its arc table; each arc (row, lo, len) of that pattern covers
// the other grid's longitudes (lo + S*(lon / R) + j) mod nlon_other, j < len, on global
// latitude `row`. Only the part inside the other grid's window is visited.
//
// Typical walk (no integer division or modulo per neighbour):
//
//   const Windows win = ReadWindows(window);
//   const WalkStart ws = WalkStartOf(lat, lon, residues, shift);  // lat, lon global
//   for (int32_t a = offsets[ws.pattern]; a < offsets[ws.pattern + 1]; ++a) {
//     const int32_t* arc = arcs + 3 * a;                            // (row, lo, len)
//     const int32_t local_row = win.k.LocalRow(arc[0]);
//     if (local_row < 0) continue;
//     const ArcPieces pieces = ClipArc(arc[1], arc[2], ws.offset, nlon_other, win.k.lon0, win.k.nlon);
//     for (int32_t p = 0; p < pieces.count; ++p)
//       for (int32_t c = pieces.col[p]; c < pieces.col[p] + pieces.len[p]; ++c)
//         visit(local_row, c);                                      // stride 1 in longitude
//   }
//
// Visiting order is the arc's own order (from its first longitude onwards), except that
// a full ring is walked from longitude 0 so that it is one contiguous piece whenever its
// window is.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define S2ATTN_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define S2ATTN_HOST_DEVICE inline
#endif

namespace s2attn {

// One grid's block of a (possibly sharded) call: local element [i, j] is global point
// (lat0 + i, lon0 + j); only i < nlat, j < nlon are real, the rest of the local array
// is padding. Windows never wrap in longitude.
struct GridWindow {
  int32_t lat0, lon0, nlat, nlon;

  // Local row of global latitude `row`, or -1 when the row is outside the window.
  S2ATTN_HOST_DEVICE int32_t LocalRow(int32_t row) const {
    const int32_t local = row - lat0;
    return (local >= 0 && local < nlat) ? local : -1;
  }

  // True when the window is non-negative, fits the local array [local_rows, local_cols]
  // and the global grid [nlat_global, nlon_global]. Handlers that cannot report errors
  // (device code) should treat a window that does not fit as empty.
  S2ATTN_HOST_DEVICE bool Fits(int64_t local_rows, int64_t local_cols, int64_t nlat_global,
                               int64_t nlon_global) const {
    return lat0 >= 0 && lon0 >= 0 && nlat >= 0 && nlon >= 0 && nlat <= local_rows && nlon <= local_cols &&
           int64_t{lat0} + nlat <= nlat_global && int64_t{lon0} + nlon <= nlon_global;
  }
};

// The `window` operand, int32[8]: (q_lat0, q_lon0, q_nlat, q_nlon, k_lat0, k_lon0, k_nlat, k_nlon).
struct Windows {
  GridWindow q, k;
};

S2ATTN_HOST_DEVICE Windows ReadWindows(const int32_t* window) {
  return Windows{{window[0], window[1], window[2], window[3]}, {window[4], window[5], window[6], window[7]}};
}

// Value `i` of the `window` operand where both windows are whole grids, q of nlat_q x nlon_q and k of
// nlat_k x nlon_k: (0, 0, nlat_q, nlon_q, 0, 0, nlat_k, nlon_k).
S2ATTN_HOST_DEVICE int32_t WholeWindowValue(int i, int32_t nlat_q, int32_t nlon_q, int32_t nlat_k, int32_t nlon_k) {
  const int field = i % 4;
  if (field < 2) return 0;  // lat0, lon0
  return i < 4 ? (field == 2 ? nlat_q : nlon_q) : (field == 2 ? nlat_k : nlon_k);
}

// Where the walking point at global (lat, lon) reads its arcs: the pattern index into
// arc_offsets and the longitude offset S*(lon / R) added to every arc start.
// offset < nlon_other for every valid table (cuda/README.md).
struct WalkStart {
  int32_t pattern, offset;
};

S2ATTN_HOST_DEVICE WalkStart WalkStartOf(int32_t lat, int32_t lon, int32_t residues, int32_t shift) {
  return WalkStart{lat * residues + lon % residues, shift * (lon / residues)};
}

// The part of one arc inside a longitude window: at most two runs of consecutive local
// columns (two when the arc wraps through longitude 0 and both ends are in the window),
// in visiting order.
struct ArcPieces {
  int32_t count;   // 0, 1 or 2
  int32_t col[2];  // local column (relative to the window's lon0) of each run's first neighbour
  int32_t len[2];  // run lengths, >= 1
};

// Clips the arc (lo, len) of a walking point with start offset `offset` to the window
// [win_lon0, win_lon0 + win_nlon) of a grid with `nlon` longitudes.
// Requires 0 <= lo < nlon, 0 <= offset < nlon, 1 <= len <= nlon, and a window inside [0, nlon).
S2ATTN_HOST_DEVICE ArcPieces ClipArc(int32_t lo, int32_t len, int32_t offset, int32_t nlon, int32_t win_lon0,
                                     int32_t win_nlon) {
  int32_t start = lo + offset;  // < 2*nlon: one conditional subtract wraps it
  if (start >= nlon) start -= nlon;
  if (len >= nlon) start = 0;  // full ring: same set, one piece
  const int32_t win_end = win_lon0 + win_nlon;
  ArcPieces pieces{0, {0, 0}, {0, 0}};
  // Unwrapped, the arc is [start, start + len) with start + len <= 2*nlon: the run before
  // the seam lies in [start, nlon) and the wrapped run in [nlon, start + len).
  const int32_t head_lo = start > win_lon0 ? start : win_lon0;
  const int32_t head_hi = start + len < win_end ? start + len : win_end;
  if (head_hi > head_lo) {
    pieces.col[pieces.count] = head_lo - win_lon0;
    pieces.len[pieces.count] = head_hi - head_lo;
    ++pieces.count;
  }
  const int32_t tail_end = start + len - nlon;  // > 0 only when the arc wraps
  const int32_t tail_hi = tail_end < win_end ? tail_end : win_end;
  if (tail_hi > win_lon0) {
    pieces.col[pieces.count] = 0;
    pieces.len[pieces.count] = tail_hi - win_lon0;
    ++pieces.count;
  }
  return pieces;
}

}  // namespace s2attn
