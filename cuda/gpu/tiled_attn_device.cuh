// Building blocks of the tiled tensor-core kernels (tiled_attn_fwd.cu, tiled_attn_dq.cu, tiled_attn_dkv.cu):
// unit and segment geometry, the staged chunk stream, and the warp-level tile products.
//
// Work decomposition. A block of kWarps warps owns a *unit*: kTilePoints consecutive longitudes
// of one row of the walking grid (query grid for forward and dq, key grid for dk/dv) of one
// (batch, head); warp u owns points 16u..16u+15 and keeps their rows of the walking operands as
// MMA fragments. The block walks the *segments* of its row (jax_s2attn.plan.SegmentTable: one
// row of the other grid, with each residue's arc on it). Per segment the unit's arcs are nested
// in one contiguous window of the other grid's longitudes, [lo_cta, hi_cta) unwrapped: point w
// with arc start s_w = lo_r + S*(w / R) and length len_r sees window column c iff
// 0 <= c - (s_w - lo_cta) < len_r (a band). If the window spans the whole ring, it becomes
// the ring itself from longitude 0 (ring mode) and the test is taken modulo nlon.
// The window is staged in chunks of kChunk columns (cp.async, kStages deep, one flat stream
// across segments so the pipeline never drains between short segments), handed from the threads
// that stage a chunk to the warps that multiply it by mbarriers per stage, not by block barriers,
// so a warp with less work on a chunk goes on to the next. The geometry of up to
// kSlots segments is computed at once, one segment per thread, into shared memory; the stream
// only reads it (and drains between such batches, i.e. only on rows with more segments). Each warp
// multiplies only the 16-column blocks its band touches, and evaluates the band mask only on blocks
// that are not entirely inside every one of its points' arcs. Quadrature weights (query walk) or
// the staged queries' lse (key walk, see KeyWalkBias) enter as a per-column bias, which also masks
// the columns outside the other grid's window (-inf). benchmarks/tile_walk.py emulates this walk
// on the host (coverage and tile statistics).
//
// Everything a block computes is owned by that block and summed in a fixed order: results are
// bitwise reproducible, without atomics.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "common/arc_walk.h"
#include "gpu/device_common.cuh"
#include "gpu/mbarrier_sm90.cuh"
#include "gpu/mma_sm80.cuh"
#include "gpu/nbhd_attn_kernels.h"

namespace s2attn {
namespace gpu {
namespace tiled {

// Pipeline shape: defaults here, a kernel's own shape defined before the include
// (tiled_narrow_shape.cuh), any of them overridden by a benchmark build (-DS2ATTN_TILED_CHUNK=32 ...);
// benchmarks/occupancy.py reports what a shape costs in registers, shared memory and resident
// warps. Everything below lives in an inline namespace named after the shape, so kernels of
// different shapes link into one module without sharing (ODR-violating) definitions. StageChunk
// gives every staged column a whole number of threads: the block's threads (32 * warps) must be a
// multiple of the chunk.
#ifndef S2ATTN_TILED_CHUNK
#define S2ATTN_TILED_CHUNK 64
#endif
#ifndef S2ATTN_TILED_STAGES
#define S2ATTN_TILED_STAGES 3
#endif
#ifndef S2ATTN_TILED_WARPS
#define S2ATTN_TILED_WARPS 4
#endif
#ifndef S2ATTN_TILED_MIN_BLOCKS
#define S2ATTN_TILED_MIN_BLOCKS 3
#endif
// How many of a kernel's own operands (OwnOperand below) wait in shared memory instead of registers.
#ifndef S2ATTN_TILED_OWN_SHARED
#define S2ATTN_TILED_OWN_SHARED 0
#endif
#define S2ATTN_TILED_SHAPE_NAME_(chunk, stages, warps, blocks, own) \
  shape_c##chunk##_s##stages##_w##warps##_b##blocks##_o##own
#define S2ATTN_TILED_SHAPE_NAME(chunk, stages, warps, blocks, own) \
  S2ATTN_TILED_SHAPE_NAME_(chunk, stages, warps, blocks, own)
// The inline namespace of this translation unit's shape (tiled_attn_dispatch.cuh opens it too).
#define S2ATTN_TILED_SHAPE                                                                           \
  S2ATTN_TILED_SHAPE_NAME(S2ATTN_TILED_CHUNK, S2ATTN_TILED_STAGES, S2ATTN_TILED_WARPS, S2ATTN_TILED_MIN_BLOCKS, \
                          S2ATTN_TILED_OWN_SHARED)
inline namespace S2ATTN_TILED_SHAPE {

constexpr int kWarps = S2ATTN_TILED_WARPS;
constexpr int kWarpPoints = 16;                      // rows of one MMA tile
constexpr int kTilePoints = kWarps * kWarpPoints;    // walking points per block
constexpr int kChunk = S2ATTN_TILED_CHUNK;           // staged columns per pipeline stage
constexpr int kBlock = 16;                           // columns per MMA k-step of P.V
constexpr int kBlocksPerChunk = kChunk / kBlock;
static_assert(kChunk % kBlock == 0 && kChunk <= 128, "chunks are whole MMA blocks");
constexpr int kThreads = 32 * kWarps;
constexpr int kStages = S2ATTN_TILED_STAGES;
// A stage is restaged once every warp is done with its chunk, i.e. after the chunk that follows it
// is multiplied: kStages - 2 chunks are in flight while one is multiplied.
static_assert(kStages >= 3, "at least one chunk in flight while one is multiplied");
// Blocks per SM the launch bounds ask for (register cap 65536 / (kThreads * blocks)): enough
// staged chunks in flight per SM to cover L2 latency, which bounds the short walks.
template <int D>
constexpr int MinBlocksPerSm() {
  return D <= 64 ? S2ATTN_TILED_MIN_BLOCKS : 2;
}
// A kernel's own operands (the walking rows' fragments it multiplies every chunk by: q in the forward,
// q and dout in dq, k and v in dk/dv) are held in registers for the whole walk, except the first
// OwnOperandsShared() of them, which wait in shared memory (after the pipeline's, see OwnOperand)
// and are read back before each product: fewer registers for more resident warps. D = 128 keeps
// them in registers: its stages already fill the shared memory of two blocks.
template <int D>
__host__ __device__ constexpr int OwnOperandsShared() {
  return D <= 64 ? S2ATTN_TILED_OWN_SHARED : 0;
}
// Segments whose geometry a block computes at once (one per thread, in parallel, into shared
// memory) before walking their chunks; a row with more segments is walked in several batches.
constexpr int kSlots = kThreads < 64 ? kThreads : 64;
// Added to a column in window mode so that the wrapped band test can never hold.
constexpr int32_t kNoWrap = int32_t{1} << 30;

// Shared memory of one stage: two staged operands [kChunk][kStride] of T (K and V for the
// query walk, Q and dout for the key walk), then the column bias and the column delta.
template <int D>
struct StageLayout {
  // Rows padded by 16 bytes: the 8 rows one ldmatrix reads then fall in different banks.
  static constexpr int kStride = D + 8;
  static constexpr int kOperandElems = kChunk * kStride;
  static constexpr size_t kOperandBytes = size_t{kOperandElems} * 2;
  static constexpr size_t kStageBytes = 2 * kOperandBytes + 2 * kChunk * sizeof(float);
  static constexpr size_t kStagesBytes = kStages * kStageBytes;
  // Then the segment slots of the batch being walked (SegmentSlot, defined below), then the
  // pipeline's barriers: per stage one for "staged" and one for "released".
  static constexpr size_t kSlotBytes = 40 + 16 * kWarps;
  static constexpr size_t kBarriersOffset = kStagesBytes + kSlots * kSlotBytes;
  static constexpr size_t kSharedBytes = kBarriersOffset + 2 * kStages * sizeof(uint64_t);
  static_assert(kOperandBytes % 16 == 0 && kStageBytes % 16 == 0, "stages must stay 16-byte aligned");
};

template <typename T, int D>
struct Stage {
  T* a;             // [kChunk][kStride]: K (query walk) or Q (key walk)
  T* b;             // [kChunk][kStride]: V (query walk) or dout (key walk)
  float* bias;      // [kChunk]: log2 w (query walk; -inf masks the column) or lse (key walk, see KeyWalkBias)
  float* delta;     // [kChunk]: delta of the staged query (key walk only)

  // The 16 staged rows of MMA block kb of the chunk.
  __device__ const T* BlockA(int kb) const { return a + kBlock * kb * StageLayout<D>::kStride; }
  __device__ const T* BlockB(int kb) const { return b + kBlock * kb * StageLayout<D>::kStride; }

  __device__ static Stage At(int index) {
    using L = StageLayout<D>;
    char* base = reinterpret_cast<char*>(DynamicShared()) + index * L::kStageBytes;
    return Stage{reinterpret_cast<T*>(base), reinterpret_cast<T*>(base + L::kOperandBytes),
                 reinterpret_cast<float*>(base + 2 * L::kOperandBytes),
                 reinterpret_cast<float*>(base + 2 * L::kOperandBytes) + kChunk};
  }
};

// ------------------------------------------------------------------------------ geometry

// Arc starts of a range of walking points on one segment: the union [uni_lo, uni_hi) and the
// intersection [int_lo, int_hi) of their unwrapped arcs (empty when lo >= hi), and whether
// every point's arc is the full ring. Points whose residue has no arc on the segment empty the
// intersection. O(R): one first/last point per residue.
struct ArcSpan {
  int32_t uni_lo, uni_hi, int_lo, int_hi;
  bool all_rings;
};

// Segment arc starts lie in [0, 2 * nlon_other): for R > 1 the plan unwraps the starts of one
// segment consistently (SegmentTable) so that neighbouring residues stay side by side.
__device__ __forceinline__ int32_t SegmentLo(const int32_t* seg, int32_t r, int32_t nlon_other) {
  return min(max(__ldg(seg + 1 + r), 0), 2 * nlon_other - 1);
}

// x mod n for 0 <= x < 3n (arc starts: lo < 2n plus S * (w / R) < n).
__device__ __forceinline__ int32_t WrapTwice(int32_t x, int32_t n) {
  if (x >= n) x -= n;
  return x >= n ? x - n : x;
}

__device__ __forceinline__ int32_t SegmentLen(const int32_t* seg, int32_t residues, int32_t r, int32_t nlon_other) {
  return min(max(__ldg(seg + 1 + residues + r), 0), nlon_other);
}

// w / R and w % R, without a division in the common R == 1 (self-attention, downsampling).
struct Residue {
  int32_t position, residue;
};

__device__ __forceinline__ Residue ResidueOf(int32_t w, int32_t residues) {
  if (residues == 1) return Residue{w, 0};
  return Residue{w / residues, w % residues};
}

__device__ __forceinline__ ArcSpan SpanOf(const int32_t* seg, int32_t residues, int32_t shift, int32_t nlon_other,
                                          int32_t w_first, int32_t w_last) {
  ArcSpan span{INT_MAX, INT_MIN, INT_MIN, INT_MAX, true};
  const Residue first_point = ResidueOf(w_first, residues), last_point = ResidueOf(w_last, residues);
  for (int32_t r = 0; r < residues; ++r) {
    // The first and last point of the range with residue r, as positions w / R.
    const int32_t first = first_point.position + (r < first_point.residue ? 1 : 0);
    const int32_t last = last_point.position - (r > last_point.residue ? 1 : 0);
    if (first > last) continue;
    const int32_t len = SegmentLen(seg, residues, r, nlon_other);
    if (len == 0) {
      span.int_lo = INT_MAX;
      span.all_rings = false;
      continue;
    }
    const int32_t lo = SegmentLo(seg, r, nlon_other);
    const int32_t start_first = lo + shift * first;
    const int32_t start_last = lo + shift * last;
    span.uni_lo = min(span.uni_lo, start_first);
    span.uni_hi = max(span.uni_hi, start_last + len);
    span.int_lo = max(span.int_lo, start_last);
    span.int_hi = min(span.int_hi, start_first + len);
    span.all_rings = span.all_rings && len == nlon_other;
  }
  return span;
}

// The block's window on one segment. chunks == 0: nothing to visit (no arc, or the row lies
// outside the other grid's window).
struct SegmentWindow {
  int32_t index;      // segment index
  int32_t local_row;  // row of the other grid's local arrays
  int32_t base;       // global longitude of window column 0
  int32_t lo;         // unwrapped start of column 0 (0 in ring mode)
  int32_t width;      // columns
  int32_t wrap;       // nlon_other in ring mode, else kNoWrap
  int32_t chunks;
  float log2_weight;  // log2 of the row's quadrature weight (query walk)
  int64_t row_offset;  // elements from the staged operands' local (0, 0) to the row (FillSlot)
};

// Static description of one walk: which table, which grids, which points the block owns.
struct Walk {
  const int32_t* offsets;
  const int32_t* segments;
  int32_t num_segments;
  int32_t residues, shift;
  int32_t nlat_other, nlon_other;  // global other grid
  GridWindow other;                // the other grid's window
  int32_t walk_row;                // global row of the walking grid
  int32_t block_first, block_last; // global longitudes of the block's real points (first > last: none)
};

__device__ __forceinline__ const int32_t* SegmentAt(const Walk& walk, int32_t index) {
  return walk.segments + int64_t{index} * (1 + 2 * walk.residues);
}

__device__ __forceinline__ SegmentWindow WindowOf(const Walk& walk, int32_t index, const float* quad_weights) {
  SegmentWindow win{index, -1, 0, 0, 0, kNoWrap, 0, 0.f, 0};
  const int32_t* seg = SegmentAt(walk, index);
  const int32_t row = __ldg(seg);
  if (row < 0 || row >= walk.nlat_other || walk.block_first > walk.block_last) return win;
  win.local_row = walk.other.LocalRow(row);
  if (win.local_row < 0) return win;
  const ArcSpan span = SpanOf(seg, walk.residues, walk.shift, walk.nlon_other, walk.block_first, walk.block_last);
  if (span.uni_lo >= span.uni_hi) return win;
  if (span.uni_hi - span.uni_lo >= walk.nlon_other) {  // ring mode
    win.width = walk.nlon_other;
    win.wrap = walk.nlon_other;
  } else {
    win.lo = span.uni_lo;
    win.base = WrapTwice(span.uni_lo, walk.nlon_other);
    win.width = span.uni_hi - span.uni_lo;
  }
  win.chunks = (win.width + kChunk - 1) / kChunk;
  // Only the query walk stages keys with a weight (the key walk stages queries; its rows index the
  // query grid, past the end of quad_weights when that grid has more rows).
  if (quad_weights != nullptr) win.log2_weight = log2f(__ldg(quad_weights + row));
  return win;
}

// Local column of the other grid's arrays for window column c, or -1 (past the window's
// width or outside the other grid's window).
__device__ __forceinline__ int32_t LocalColumn(const Walk& walk, const SegmentWindow& win, int32_t c) {
  if (c >= win.width) return -1;
  int32_t lon = win.base + c;
  if (lon >= walk.nlon_other) lon -= walk.nlon_other;
  const int32_t local = lon - walk.other.lon0;
  return (local >= 0 && local < walk.other.nlon) ? local : -1;
}

// What a warp multiplies on one segment: the window columns its band touches, [lo, hi), and
// the columns inside every one of its points' arcs, [full_lo, full_hi) (no mask needed there).
struct WarpSpan {
  int32_t lo, hi, full_lo, full_hi;
};

// The segment geometry a block computes once per segment, in shared memory while it is walked.
struct SegmentSlot {
  SegmentWindow win;
  WarpSpan warp[kWarps];
};
static_assert(sizeof(SegmentWindow) == 40 && sizeof(SegmentSlot) == StageLayout<64>::kSlotBytes,
              "StageLayout reserves kSlotBytes per slot");

// A thread's view of one segment: its warp's span and the arc (offset into the window, length)
// of each of the thread's two rows (g and g + 8 of the tile).
struct WarpBand {
  int32_t lo, hi, full_lo, full_hi;
  int32_t off[2], len[2];

  // Whether the warp multiplies the 16-column block starting at window column `first` (of a
  // window `width` columns wide).
  __device__ bool Touches(int32_t first, int32_t width) const {
    return first < hi && first + kBlock > lo && first < width;
  }
  // Whether every column of that block lies on every one of the warp's arcs (no mask needed).
  __device__ bool Covers(int32_t first) const { return first >= full_lo && first + kBlock <= full_hi; }
};

// Arc of one walking point (global longitude w) on a segment, in window coordinates.
__device__ __forceinline__ void PointArc(const Walk& walk, const int32_t* seg, const SegmentWindow& win, int32_t w,
                                         bool real, int32_t* off, int32_t* len) {
  const Residue at = ResidueOf(w, walk.residues);
  const int32_t l = real ? SegmentLen(seg, walk.residues, at.residue, walk.nlon_other) : 0;
  const int32_t start = SegmentLo(seg, at.residue, walk.nlon_other) + walk.shift * at.position;
  *off = win.wrap == kNoWrap ? start - win.lo : WrapTwice(start, walk.nlon_other);
  *len = l;
}

// The span of the warp whose points are the walking longitudes [first, last] (none if first > last).
__device__ __forceinline__ WarpSpan WarpSpanOf(const Walk& walk, const int32_t* seg, const SegmentWindow& win,
                                               int32_t first, int32_t last) {
  WarpSpan band{0, 0, 0, 0};
  if (first > last) return band;
  const ArcSpan span = SpanOf(seg, walk.residues, walk.shift, walk.nlon_other, first, last);
  if (span.uni_lo >= span.uni_hi) return band;
  if (win.wrap != kNoWrap) {
    band.hi = win.width;
    band.full_hi = span.all_rings ? win.width : 0;
  } else {
    band.lo = span.uni_lo - win.lo;
    band.hi = span.uni_hi - win.lo;
    band.full_lo = span.int_lo - win.lo;
    band.full_hi = span.int_hi - win.lo;
  }
  return band;
}

// Segment `index`'s window (with its row's offset in operands of `row_stride` elements per row)
// and every warp's span on it.
__device__ __forceinline__ void FillSlot(const Walk& walk, int32_t index, const float* quad_weights,
                                         int64_t row_stride, SegmentSlot* slot) {
  SegmentWindow win = WindowOf(walk, index, quad_weights);
  win.row_offset = win.local_row * row_stride;
  slot->win = win;
  const int32_t* seg = SegmentAt(walk, index);
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const int32_t first = walk.block_first + w * kWarpPoints;
    const int32_t last = min(first + kWarpPoints - 1, walk.block_last);
    slot->warp[w] = win.chunks > 0 ? WarpSpanOf(walk, seg, win, first, last) : WarpSpan{0, 0, 0, 0};
  }
}

// The thread's band on a slot: its warp's span plus its two rows' arcs.
__device__ __forceinline__ WarpBand BandOf(const Walk& walk, const SegmentSlot& slot, const int32_t (&row_lon)[2],
                                           const bool (&row_real)[2]) {
  const WarpSpan span = slot.warp[threadIdx.x / 32];
  WarpBand band{span.lo, span.hi, span.full_lo, span.full_hi, {0, 0}, {0, 0}};
  const int32_t* seg = SegmentAt(walk, slot.win.index);
  for (int h = 0; h < 2; ++h) PointArc(walk, seg, slot.win, row_lon[h], row_real[h], &band.off[h], &band.len[h]);
  return band;
}

template <bool kRing>
__device__ __forceinline__ void MaskOffArcOf(float (&x)[2][4], int32_t first, const WarpBand& band, int32_t wrap) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    // The thread's column j of the block (8n + e % 2 past column 2t) lies on row h's arc iff
    // j - rel < len, unsigned; in ring mode also one turn later (arcs through longitude 0).
    const int32_t rel = band.off[h] - first - 2 * static_cast<int32_t>(threadIdx.x % 4);
    const uint32_t len = static_cast<uint32_t>(band.len[h]);
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int32_t col = 8 * n + j;
        bool on = static_cast<uint32_t>(col - rel) < len;
        if (kRing) on = on || static_cast<uint32_t>(col + wrap - rel) < len;
        if (!on) x[n][2 * h + j] = kNegInf;
      }
    }
  }
}

// Sets the logits x (score tile layout) of the 16-column block starting at window column
// `first` to -inf where the column lies off the arc of the thread's row; `wrap` folds ring-mode
// arcs through longitude 0. Only for blocks the band does not cover.
__device__ __forceinline__ void MaskOffArc(float (&x)[2][4], int32_t first, const WarpBand& band, int32_t wrap) {
  if (wrap == kNoWrap) {
    MaskOffArcOf<false>(x, first, band, wrap);
  } else {
    MaskOffArcOf<true>(x, first, band, wrap);
  }
}

// ------------------------------------------------------------------------------ the chunk stream

// Where the staged operands come from: rows [batch, nlat, nlon, heads, D] of the other grid.
// Pointers are to the unit's (batch, head) at local (0, 0), so a staged column's address is one
// product per row and one per column away.
template <typename T>
struct StagedSource {
  const T* a;
  const T* b;
  const float* lse;    // key walk: lse and delta of the staged queries; null for the query walk
  const float* delta;
  int64_t row_stride;        // elements between local rows
  int64_t point_row_stride;  // the same in lse / delta
  int32_t col_stride;        // elements between local columns (heads * D)
  int32_t point_col_stride;  // the same in lse / delta (heads)
};

// A thread's part in staging a chunk, the same for every chunk: kColumnThreads threads per column;
// with each copy, the threads of a column copy neighbouring 16-byte pieces (whole 32-byte sectors:
// cp.async.cg reads L2 sectors, not L1 lines), and a quarter-warp's columns are kColumnThreads
// apart so that its eight shared-memory stores fall in different banks.
struct StagingLane {
  int32_t col;   // column of the chunk
  int32_t part;  // first 16-byte piece of the column's row
};

template <int D>
__device__ __forceinline__ StagingLane StagingLaneOf() {
  constexpr int kColumnThreads = kThreads / kChunk;
  static_assert(kThreads % kChunk == 0 && 8 % kColumnThreads == 0 && (D / 8) % kColumnThreads == 0,
                "whole pieces per staging thread");
  const int lane = threadIdx.x % 32, quarter = lane / 8;
  return StagingLane{static_cast<int32_t>((threadIdx.x / 32) * (32 / kColumnThreads) +
                                          (quarter / kColumnThreads) * 8 + quarter % kColumnThreads +
                                          (lane % 8 / kColumnThreads) * kColumnThreads),
                     lane % kColumnThreads};
}

// Stages chunk `chunk` of `win` into `stage` (cp.async for real columns, zeros elsewhere) with its
// per-column values: the bias log2 w (query walk, written) or lse and delta (key walk, copied).
// All threads of the block take part, each as its StagingLane says.
template <typename T, int D>
__device__ __forceinline__ void StageChunk(const Walk& walk, const SegmentWindow& win, int32_t chunk,
                                           const StagedSource<T>& src, const Stage<T, D>& stage,
                                           const StagingLane& lane) {
  using L = StageLayout<D>;
  const int32_t col = lane.col;
  const int32_t local = LocalColumn(walk, win, chunk * kChunk + col);
  T* dst_a = stage.a + col * L::kStride + lane.part * 8;
  T* dst_b = stage.b + col * L::kStride + lane.part * 8;
  constexpr int kStep = 8 * (kThreads / kChunk);  // elements between a thread's pieces
  // Columns past the window or outside the other grid's window are staged as zeros (by the same
  // copies, reading nothing), so every thread takes the same path.
  const bool real = local >= 0;
  const int64_t at = real ? win.row_offset + int64_t{local} * src.col_stride + lane.part * 8 : 0;
#pragma unroll
  for (int i = 0; i < D; i += kStep) {
    CopyAsync16OrZero(dst_a + i, src.a + at + i, real);
    CopyAsync16OrZero(dst_b + i, src.b + at + i, real);
  }
  if (lane.part != 0) return;
  if (src.lse == nullptr) {
    stage.bias[col] = local >= 0 ? win.log2_weight : kNegInf;
  } else if (local >= 0) {
    // Copied, not loaded: a load here would hold up the thread's next instructions until it lands.
    const int64_t point = win.local_row * src.point_row_stride + int64_t{local} * src.point_col_stride;
    CopyAsync4(stage.bias + col, src.lse + point);
    CopyAsync4(stage.delta + col, src.delta + point);
  } else {
    stage.bias[col] = -kNegInf;  // KeyWalkBias(+inf) = -inf masks the column
    stage.delta[col] = 0.f;
  }
}

// The key walk's bias of a staged query column of log-sum-exp `lse`: -log2e * lse, and -inf (the
// column is masked) for lse = +inf (outside the query window) and lse = -inf (a query without
// neighbours).
__device__ __forceinline__ float KeyWalkBias(float lse) { return lse == kNegInf ? kNegInf : -kLog2e * lse; }

// The segment slots of the block (shared memory after the stages).
template <int D>
__device__ __forceinline__ SegmentSlot* Slots() {
  return reinterpret_cast<SegmentSlot*>(reinterpret_cast<char*>(DynamicShared()) + StageLayout<D>::kStagesBytes);
}

// One position of the chunk stream: a slot of the batch and one of its segment's chunks
// (slot == count: past the end).
struct ChunkCursor {
  int32_t slot, chunk;
};

// The first slot at or after `slot` with something to visit.
__device__ __forceinline__ ChunkCursor FirstChunk(const SegmentSlot* slots, int32_t slot, int32_t count) {
  while (slot < count && slots[slot].win.chunks == 0) ++slot;
  return ChunkCursor{slot, 0};
}

__device__ __forceinline__ ChunkCursor Advance(const SegmentSlot* slots, const ChunkCursor& at, int32_t count) {
  if (at.chunk + 1 < slots[at.slot].win.chunks) return ChunkCursor{at.slot, at.chunk + 1};
  return FirstChunk(slots, at.slot + 1, count);
}

// A position in the ring of stages: chunk round * kStages + stage of the block's stream (numbered
// across slot batches), counted up without divisions.
struct StagePosition {
  uint32_t stage = 0, round = 0;

  __device__ void Next() {
    if (++stage == kStages) {
      stage = 0;
      ++round;
    }
  }
};

// The pipeline of staged chunks: a chunk lives in its position's stage; that stage's "staged"
// barrier completes (once per round) when every thread staged its part of the chunk, its "released"
// barrier when every thread is done multiplying it.
template <typename T, int D>
struct ChunkPipeline {
  uint64_t* staged;    // [kStages]
  uint64_t* released;  // [kStages]

  __device__ static ChunkPipeline Create() {
    uint64_t* barriers = reinterpret_cast<uint64_t*>(reinterpret_cast<char*>(DynamicShared()) +
                                                     StageLayout<D>::kBarriersOffset);
    return ChunkPipeline{barriers, barriers + kStages};
  }
  // By one thread, before the block's first barrier.
  __device__ void Init() const {
    for (int s = 0; s < kStages; ++s) {
      MbarrierInit(&staged[s], 2 * kThreads);  // per thread: its copies landed, its plain stores done
      MbarrierInit(&released[s], kThreads);
    }
  }
  // Stages the thread's part of chunk `chunk` of `win` at position `at` once every thread is done
  // with the chunk of the previous round, which used the same stage.
  __device__ void Issue(const StagePosition& at, const Walk& walk, const SegmentWindow& win, int32_t chunk,
                        const StagedSource<T>& src, const StagingLane& lane) const {
    if (at.round > 0) MbarrierWait(&released[at.stage], (at.round - 1) & 1);
    StageChunk<T, D>(walk, win, chunk, src, Stage<T, D>::At(at.stage), lane);
    CopyAsyncArriveOn(&staged[at.stage]);
    MbarrierArrive(&staged[at.stage]);
  }
  __device__ void WaitStaged(const StagePosition& at) const { MbarrierWait(&staged[at.stage], at.round & 1); }
  __device__ void Release(const StagePosition& at) const { MbarrierArrive(&released[at.stage]); }
};

// Runs `compute(stage, win, chunk, band)` for every chunk of every segment of the block's row,
// in order, with kStages - 2 chunks in flight (cp.async) while one is multiplied.
// Segment geometry is computed kSlots segments at a time, one per thread, into shared memory, so
// the stream itself only reads it. Chunks are handed over by barriers per stage, not per block:
// a warp that finished chunk n can multiply chunk n + 1 while another still works on chunk n
// (warps' bands differ, so their work per chunk does too). All threads of the block must call
// it (it synchronises the block between slot batches).
template <typename T, int D, typename Compute>
__device__ __forceinline__ void ForEachChunk(const Walk& walk, const StagedSource<T>& src, const float* quad_weights,
                                             const int32_t (&row_lon)[2], const bool (&row_real)[2],
                                             Compute&& compute) {
  if (walk.block_first > walk.block_last) return;  // padding row or no real point
  const int32_t end = min(max(__ldg(walk.offsets + walk.walk_row + 1), 0), walk.num_segments);
  const int32_t begin = min(max(__ldg(walk.offsets + walk.walk_row), 0), end);
  SegmentSlot* slots = Slots<D>();
  const ChunkPipeline<T, D> pipe = ChunkPipeline<T, D>::Create();
  if (threadIdx.x == 0) pipe.Init();
  StagePosition issued, consumed;  // the next chunk to stage and to multiply
  const StagingLane lane = StagingLaneOf<D>();
  for (int32_t first = begin, count = 0; first < end; first += count) {
    count = min(end - first, kSlots);
    __syncthreads();  // barriers initialised; the previous batch's slots are no longer read
    if (static_cast<int32_t>(threadIdx.x) < count) {
      FillSlot(walk, first + threadIdx.x, quad_weights, src.row_stride, &slots[threadIdx.x]);
    }
    __syncthreads();
    ChunkCursor cur = FirstChunk(slots, 0, count);
    if (cur.slot == count) continue;
    ChunkCursor head = cur;  // the next chunk to stage
    for (int s = 0; s < kStages - 1 && head.slot < count; ++s) {
      pipe.Issue(issued, walk, slots[head.slot].win, head.chunk, src, lane);
      issued.Next();
      head = Advance(slots, head, count);
    }
    WarpBand band = BandOf(walk, slots[cur.slot], row_lon, row_real);
    for (;;) {
      pipe.WaitStaged(consumed);
      compute(Stage<T, D>::At(consumed.stage), slots[cur.slot].win, cur.chunk, band);
      pipe.Release(consumed);
      consumed.Next();
      if (head.slot < count) {
        pipe.Issue(issued, walk, slots[head.slot].win, head.chunk, src, lane);
        issued.Next();
        head = Advance(slots, head, count);
      }
      const ChunkCursor next = Advance(slots, cur, count);
      if (next.slot == count) break;
      if (next.chunk == 0) band = BandOf(walk, slots[next.slot], row_lon, row_real);
      cur = next;
    }
  }
}

// ------------------------------------------------------------------------------ tile products

__device__ __forceinline__ uint32_t LoadPair(const void* p) { return __ldg(static_cast<const uint32_t*>(p)); }

// A fragments (16 rows x D) of the warp's own rows g (row0) and g + 8 (row1); null rows are 0.
template <typename T, int D>
__device__ __forceinline__ void LoadOwnFragments(uint32_t (&a)[D / 16][4], const T* row0, const T* row1) {
  const int t = threadIdx.x % 4;
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    a[ks][0] = row0 ? LoadPair(row0 + 16 * ks + 2 * t) : 0u;
    a[ks][1] = row1 ? LoadPair(row1 + 16 * ks + 2 * t) : 0u;
    a[ks][2] = row0 ? LoadPair(row0 + 16 * ks + 8 + 2 * t) : 0u;
    a[ks][3] = row1 ? LoadPair(row1 + 16 * ks + 8 + 2 * t) : 0u;
  }
}

// The staged-chunk column of the thread's score element e of n8 tile n in 16-column block kb: the
// score tile layout of RowProducts, columns 8n + 2t + e % 2 of the block (t = lane % 4).
__device__ __forceinline__ int ScoreColumn(int kb, int n, int e, int t) {
  return kBlock * kb + 8 * n + 2 * t + (e & 1);
}

// s = A . B^T for the 16 staged rows starting at `rows` (two n8 tiles: rows 0-7 and 8-15).
template <typename T, int D>
__device__ __forceinline__ void RowProducts(float (&s)[2][4], const uint32_t (&a)[D / 16][4], const T* rows) {
  constexpr int kStride = StageLayout<D>::kStride;
  const int lane = threadIdx.x % 32;
  // ldmatrix.x4 matrices: (rows 0-7, cols 0-7), (rows 0-7, cols 8-15), (rows 8-15, cols 0-7), (rows 8-15, cols 8-15).
  const T* lane_row = rows + ((lane & 7) + (lane >> 4) * 8) * kStride + ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int n = 0; n < 2; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) s[n][e] = 0.f;
  }
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    uint32_t b[4];
    LdMatrixX4(b, lane_row + 16 * ks);
    const uint32_t b0[2] = {b[0], b[1]};
    const uint32_t b1[2] = {b[2], b[3]};
    MmaM16N8K16<T>(s[0], a[ks], b0);
    MmaM16N8K16<T>(s[1], a[ks], b1);
  }
}

// Own operand number kOperand of the kernel (see OwnOperandsShared): `held` are its fragments as
// LoadOwnFragments gave them; Park moves them to shared memory if this operand waits there, Products
// multiplies them with 16 staged rows (RowProducts) from wherever they are. Shared memory holds
// [operand][ks][thread] 16-byte entries: conflict-free, and each thread reads only what it wrote (no
// barrier).
template <int kOperand, int D>
struct OwnOperand {
  static constexpr bool kShared = kOperand < OwnOperandsShared<D>();
  static constexpr size_t kEntries = size_t{D / 16} * kThreads;

  __device__ static uint4* Entries() {
    return reinterpret_cast<uint4*>(reinterpret_cast<char*>(DynamicShared()) + StageLayout<D>::kSharedBytes) +
           kOperand * kEntries + threadIdx.x;
  }
  __device__ static void Park(const uint32_t (&held)[D / 16][4]) {
    if constexpr (kShared) {
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        Entries()[ks * kThreads] = make_uint4(held[ks][0], held[ks][1], held[ks][2], held[ks][3]);
      }
    }
  }
  template <typename T>
  __device__ static void Products(float (&s)[2][4], const uint32_t (&held)[D / 16][4], const T* rows) {
    if constexpr (kShared) {
      uint32_t a[D / 16][4];
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        const uint4 x = Entries()[ks * kThreads];
        a[ks][0] = x.x;
        a[ks][1] = x.y;
        a[ks][2] = x.z;
        a[ks][3] = x.w;
      }
      RowProducts<T, D>(s, a, rows);
    } else {
      RowProducts<T, D>(s, held, rows);
    }
  }
};

// Dynamic shared memory of a block: the pipeline's, then the own operands that wait there.
template <int D>
constexpr size_t BlockSharedBytes() {
  return StageLayout<D>::kSharedBytes + OwnOperandsShared<D>() * OwnOperand<0, D>::kEntries * sizeof(uint4);
}

// The A fragments of P in the score tile layout of RowProducts, as kParts registers of T each: P
// rounded to T, then, when kParts is 2, what that rounding left, rounded to T again, so that the
// parts carry about twice T's significant bits.
template <typename T, int kParts>
__device__ __forceinline__ void SplitFragments(uint32_t (&pa)[kParts][4], const float (&p)[2][4]) {
  static_assert(kParts == 1 || kParts == 2, "P in one or two parts");
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float a = p[i / 2][2 * (i % 2)], b = p[i / 2][2 * (i % 2) + 1];
    pa[0][i] = PackPair<T>(a, b);
    if constexpr (kParts == 2) pa[1][i] = PackRemainder<T>(a, b, pa[0][i]);
  }
}

// acc += P . B for the 16 staged rows starting at `rows` (B is 16 x D), P given as the score
// tile layout of RowProducts, multiplied in kParts parts (SplitFragments).
template <typename T, int D, int kParts = 1>
__device__ __forceinline__ void AccumulateRows(float (&acc)[D / 8][4], const float (&p)[2][4], const T* rows) {
  constexpr int kStride = StageLayout<D>::kStride;
  const int lane = threadIdx.x % 32;
  uint32_t pa[kParts][4];
  SplitFragments<T, kParts>(pa, p);
  // ldmatrix.x4.trans matrices: (rows 0-7, cols 0-7), (rows 8-15, cols 0-7), (rows 0-7, cols 8-15),
  // (rows 8-15, cols 8-15).
  const T* lane_row = rows + ((lane & 7) + ((lane >> 3) & 1) * 8) * kStride + (lane >> 4) * 8;
#pragma unroll
  for (int np = 0; np < D / 16; ++np) {
    uint32_t b[4];
    LdMatrixX4Trans(b, lane_row + 16 * np);
    const uint32_t b0[2] = {b[0], b[1]};
    const uint32_t b1[2] = {b[2], b[3]};
#pragma unroll
    for (int part = 0; part < kParts; ++part) {
      MmaM16N8K16<T>(acc[2 * np], pa[part], b0);
      MmaM16N8K16<T>(acc[2 * np + 1], pa[part], b1);
    }
  }
}

// Two adjacent result elements, float32 or rounded to nearest in a 16-bit type.
template <bool kRemainder = false>
__device__ __forceinline__ void StorePair(float* dst, float a, float b) {
  static_assert(!kRemainder, "a float32 result has no rounding remainder");
  *reinterpret_cast<float2*>(dst) = make_float2(a, b);
}

// a and b rounded to T, or with kRemainder what that rounding left of them, rounded to T again.
template <bool kRemainder = false, typename T>
__device__ __forceinline__ void StorePair(T* dst, float a, float b) {
  *reinterpret_cast<uint32_t*>(dst) = PackPart<T, kRemainder>(a, b);
}

// Stores the thread's part of a 16 x D float accumulator tile, scaled per row, as elements of
// type O (with kRemainder, 16-bit O only: the remainders of their rounding, StorePair); rows without a
// destination (null) are skipped, rows not kept are written as zeros (by select: a discarded row's
// accumulator may hold inf or NaN, e.g. a padding key row in a block whose mask was skipped).
template <int D, bool kRemainder = false, typename O>
__device__ __forceinline__ void StoreRows(O* row0, O* row1, const float (&acc)[D / 8][4], float scale0,
                                          float scale1, bool keep0, bool keep1) {
  const int t = threadIdx.x % 4;
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    if (row0) {
      StorePair<kRemainder>(row0 + 8 * n + 2 * t, keep0 ? acc[n][0] * scale0 : 0.f, keep0 ? acc[n][1] * scale0 : 0.f);
    }
    if (row1) {
      StorePair<kRemainder>(row1 + 8 * n + 2 * t, keep1 ? acc[n][2] * scale1 : 0.f, keep1 ? acc[n][3] * scale1 : 0.f);
    }
  }
}

template <int D>
__device__ __forceinline__ void ZeroAccumulator(float (&acc)[D / 8][4]) {
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
  }
}

// Sum over the four lanes that share a tile row.
__device__ __forceinline__ float RowSum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

__device__ __forceinline__ float RowMax(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

// ------------------------------------------------------------------------------ block setup

// The unit of one block: its walking row, its points, the thread's two tile rows.
struct Unit {
  bool live;          // false: nothing to do (bad row order entry or past the grid)
  bool padding_row;   // the row lies outside the walking window: results are zeros
  int32_t local_row;  // row of the walking grid's local arrays
  int32_t batch, head;
  int32_t first_col;  // local column of the block's first point
  int32_t row_col[2];     // local column of the thread's rows g and g + 8
  bool row_exists[2];     // inside the local arrays
  bool row_real[2];       // inside the walking window
  int32_t row_lon[2];     // global longitude of the thread's rows
  int64_t row_point[2];   // (point, head) index of the thread's rows in [batch, rows, cols, heads]
};

__device__ __forceinline__ Unit UnitOf(const NbhdAttnGpuParams& p, const GridWindow& walk_win, int32_t rows,
                                       int32_t cols) {
  Unit u{};
  const BlockRow block = BlockRowOf(p);
  const int32_t heads = static_cast<int32_t>(p.heads);
  u.live = block.rank < rows && block.batch_head < p.batch * heads;
  if (!u.live) return u;
  u.local_row = __ldg(p.row_order + block.rank);
  u.live = u.local_row >= 0 && u.local_row < rows;  // a bad row_order entry is skipped
  u.batch = block.batch_head / heads;
  u.head = block.batch_head % heads;
  u.padding_row = u.local_row >= walk_win.nlat;
  u.first_col = static_cast<int32_t>(blockIdx.x) * kTilePoints;
  const int warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4;
  for (int h = 0; h < 2; ++h) {
    u.row_col[h] = u.first_col + warp * kWarpPoints + g + 8 * h;
    u.row_exists[h] = u.row_col[h] < cols;
    u.row_real[h] = !u.padding_row && u.row_col[h] < walk_win.nlon;
    u.row_lon[h] = walk_win.lon0 + u.row_col[h];
    u.row_point[h] = ((int64_t{u.batch} * rows + u.local_row) * cols + u.row_col[h]) * heads + u.head;
  }
  return u;
}

// The thread's row h of a [batch, rows, cols, heads, d] array, or null unless the row is real
// (inside the walking window) / exists (inside the local arrays).
template <typename P>
__device__ __forceinline__ P* RealRow(P* base, int d, const Unit& u, int h) {
  return u.row_real[h] ? base + u.row_point[h] * d : nullptr;
}

template <typename P>
__device__ __forceinline__ P* ExistingRow(P* base, int d, const Unit& u, int h) {
  return u.row_exists[h] ? base + u.row_point[h] * d : nullptr;
}

// Stores the unit's tile of a gradient (dq, dk or dv: [batch, rows, cols, heads, D] at `base`)
// times `scale`, in p.gradient_dtype (float32 or T); rows outside the walking window get zeros.
template <typename T, int D>
__device__ __forceinline__ void StoreGradient(void* base, const NbhdAttnGpuParams& p, const Unit& u,
                                              const float (&acc)[D / 8][4], float scale) {
  const auto store = [&](auto* rows) {
    StoreRows<D>(ExistingRow(rows, D, u, 0), ExistingRow(rows, D, u, 1), acc, scale, scale, u.row_real[0],
                 u.row_real[1]);
  };
  if (p.gradient_dtype == ActivationType::kF32) {
    store(static_cast<float*>(base));
  } else {
    store(static_cast<T*>(base));
  }
}

// The staged operands a, b (and for the key walk lse, delta) of the other grid, local arrays
// [batch, nlat, nlon, heads, d], for the unit's (batch, head).
template <typename T>
__device__ __forceinline__ StagedSource<T> SourceOf(const void* a, const void* b, const float* lse,
                                                    const float* delta, const Unit& u, int32_t nlat, int32_t nlon,
                                                    int64_t heads, int d) {
  const int64_t bh_point = int64_t{u.batch} * nlat * nlon * heads + u.head;  // (0, 0) in lse / delta
  StagedSource<T> src;
  src.a = static_cast<const T*>(a) + bh_point * d;
  src.b = static_cast<const T*>(b) + bh_point * d;
  src.lse = lse == nullptr ? nullptr : lse + bh_point;
  src.delta = delta == nullptr ? nullptr : delta + bh_point;
  src.point_row_stride = nlon * heads;
  src.row_stride = src.point_row_stride * d;
  src.point_col_stride = static_cast<int32_t>(heads);
  src.col_stride = static_cast<int32_t>(heads * d);
  return src;
}

// The walk of a unit over `offsets`/`segments` (p.arc_offsets / p.arcs hold the segment table).
__device__ __forceinline__ Walk WalkOf(const NbhdAttnGpuParams& p, const Unit& u, const GridWindow& walk_win,
                                       const GridWindow& other, int32_t nlat_other, int32_t nlon_other) {
  Walk w;
  w.offsets = p.arc_offsets;
  w.segments = p.arcs;
  // num_arcs counts every copy of a broadcast table; one copy's offsets are int32.
  w.num_segments = static_cast<int32_t>(p.num_arcs < INT32_MAX ? p.num_arcs : INT32_MAX);
  w.residues = p.residues;
  w.shift = p.shift;
  w.nlat_other = nlat_other;
  w.nlon_other = nlon_other;
  w.other = other;
  w.walk_row = walk_win.lat0 + u.local_row;
  const int32_t real_end = u.padding_row ? 0 : walk_win.nlon;  // local columns [0, real_end) are real
  w.block_first = walk_win.lon0 + u.first_col;
  w.block_last = walk_win.lon0 + min(u.first_col + kTilePoints, real_end) - 1;
  return w;
}

}  // inline namespace (the pipeline shape)
}  // namespace tiled
}  // namespace gpu
}  // namespace s2attn
