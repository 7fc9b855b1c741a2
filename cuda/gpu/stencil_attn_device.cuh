// Building blocks of the stencil kernels (stencil_attn_fwd.cu, stencil_attn_dq.cu, stencil_attn_dkv.cu): the
// rows whose arcs are all short (within kMaxHalf longitudes of the point), on CUDA cores. At the default
// cutoff most rows are such rows (84 % of 721x1440), where a tensor-core tile of 64 points multiplies whole
// chunks of columns for ~5 neighbours (docs/performance.md); jax_s2attn.plan picks the row pairs, the stencil
// targets run these kernels on them and the scheduled targets take every other row.
//
// A block owns kRows walking rows (one stencil pair: query rows, or key rows for dk/dv) x kLons longitudes of
// one (batch, head). It stages the <= kMaxOtherRows rows of the other grid the pair sees, kLons + 2 kMaxHalf
// columns each (K and V; for the key walk Q, dout and the queries' lse and delta; every copy in flight at
// once), then kLanes = D / 16 lanes per point walk the point's arcs there: 16 channels per lane, dot products
// summed over the lanes by shuffles, float32 throughout (P and dS never rounded). Results are owned by one
// thread each and summed in a fixed order: bitwise reproducible.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cstdint>

#include "gpu/cp_async_sm80.cuh"
#include "gpu/device_common.cuh"
#include "gpu/mbarrier_sm90.cuh"
#include "gpu/sixteen_bit_dispatch.cuh"
#include "gpu/stencil_attn_kernels.h"

namespace s2attn {
namespace gpu {
namespace stencil {

constexpr int kThreads = 256;
constexpr int kLaneChannels = 16;  // two 16-byte pieces of a row per lane

template <int D>
struct Shape {
  static constexpr int kLanes = D / kLaneChannels;               // 2, 4, 8
  static constexpr int kLons = kThreads / (kLanes * kRows);      // 64, 32, 16
  static constexpr int kWindow = kLons + 2 * kMaxHalf;           // staged columns per row of the other grid
  static constexpr int kStride = D + 8;  // padded: a quarter-warp's points read rows in different banks
  static constexpr int kPieces = D / 8;  // 16-byte pieces per row
  // ArcOfRow: a warp's points lie in one row, and lane i of every warp reads the row's arc i.
  static_assert(kLanes * kLons * kRows == kThreads && kLanes * kLons % 32 == 0 && 32 % kMaxOtherRows == 0,
                "a warp's points lie in one row");
};

// The block's shared memory, under the 48 KiB that needs no opt-in: the staged rows of the other grid, K (a)
// and V (b) for the query walks, Q (a), dout (b) and the queries' lse and delta for the key walk.
template <typename T, int D, bool kKeyWalk = false>
struct Staged {
  static constexpr int kScalars = kKeyWalk ? Shape<D>::kWindow : 1;  // the query walks stage none
  T a[kMaxOtherRows][Shape<D>::kWindow][Shape<D>::kStride];
  T b[kMaxOtherRows][Shape<D>::kWindow][Shape<D>::kStride];
  float lse[kMaxOtherRows][kScalars];
  float delta[kMaxOtherRows][kScalars];
  uint64_t landed;  // completes once every thread's copies landed
};
static_assert(sizeof(Staged<__half, 32, true>) <= 48 * 1024 && sizeof(Staged<__half, 64, true>) <= 48 * 1024 &&
                  sizeof(Staged<__half, 128, true>) <= 48 * 1024,
              "stencil blocks fit the default 48 KiB of shared memory");

// Whether the call is what the stencil rows need: whole grids (no sharding windows, no padding), one
// residue and shift (arcs relative to their point), equal longitude counts. Lane i % 8 of the warp compares
// window value i with the whole grids'; every lane must call it.
__device__ __forceinline__ bool WholeGrids(const NbhdAttnGpuParams& p) {
  const int i = threadIdx.x % 8;
  const bool lane_whole = __ldg(p.window + i) == WholeWindowValue(i, p.nlat_q, p.nlon_q, p.nlat_k, p.nlon_k);
  const bool unpadded = p.nq_lat == p.nlat_q && p.nq_lon == p.nlon_q && p.nk_lat == p.nlat_k && p.nk_lon == p.nlon_k;
  return __all_sync(0xffffffffu, lane_whole) && unpadded && p.nlon_q == p.nlon_k && p.residues == 1 && p.shift == 1;
}

// One arc of a point in the staged window: staged row, column of the first neighbour relative to the
// point's own column (kMaxHalf + the arc's start offset), length, and for the query walks log2 of the key
// row's quadrature weight (the key walk's weight is its own row's).
struct StagedArc {
  int32_t row, column, len;
  float log2_weight;
};

// The sizes of a walk's grids: the walking one (whose points a block owns) and the other (whose rows it
// stages).
struct WalkGrids {
  int32_t nlat, nlon, other_nlat, other_nlon;
};

template <bool kKeyWalk>
__device__ __forceinline__ WalkGrids GridsOf(const NbhdAttnGpuParams& p) {
  if (kKeyWalk) return WalkGrids{p.nk_lat, p.nk_lon, p.nq_lat, p.nq_lon};
  return WalkGrids{p.nq_lat, p.nq_lon, p.nk_lat, p.nk_lon};
}

// The arc of segment (other_row, lo, len) for points of a pair whose staged rows start at `other0`, or an
// empty one where it does not fit the stencil (never for the plan's pairs; a corrupted table stays in
// bounds). The plan's rule (jax_s2attn.plan): the arc starts `lo` (or lo - nlon past kMaxHalf)
// longitudes from its point and must end within kMaxHalf. Its log2_weight is the caller's (StartBlock).
__device__ __forceinline__ StagedArc ArcOf(int32_t other_row, int32_t lo, int32_t len, int32_t other0,
                                           const WalkGrids& grids) {
  const int32_t start = lo > kMaxHalf ? lo - grids.other_nlon : lo;
  // Each bound alone first, so that no sum of table values can overflow.
  const bool fits = other_row >= other0 && other_row - other0 < kMaxOtherRows && other_row < grids.other_nlat &&
                    start >= -kMaxHalf && start <= kMaxHalf && len >= 0 && len <= 2 * kMaxHalf + 1 &&
                    start + len - 1 <= kMaxHalf;
  if (!fits) return StagedArc{0, 0, 0, 0.f};
  return StagedArc{other_row - other0, kMaxHalf + start, len, 0.f};
}

// A lane's 16 channels of a row (two 16-byte pieces), widened, times `scale`.
template <typename T>
__device__ __forceinline__ void LoadLane(float (&x)[kLaneChannels], const T* row, float scale) {
  const uint4* pieces = reinterpret_cast<const uint4*>(row);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint4 piece = pieces[h];
    const uint32_t words[4] = {piece.x, piece.y, piece.z, piece.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float2 y = UnpackPair<T>(words[w]);
      x[8 * h + 2 * w] = y.x * scale;
      x[8 * h + 2 * w + 1] = y.y * scale;
    }
  }
}

// Makes x opaque to the compiler, so that it keeps the widened values in registers rather than widening
// them again inside the walk (which it otherwise may do to save registers).
__device__ __forceinline__ void KeepWidened(float (&x)[kLaneChannels]) {
#if defined(__CUDA_ARCH__)
#pragma unroll
  for (int c = 0; c < kLaneChannels; ++c) asm volatile("" : "+f"(x[c]));
#endif
}

// Sum over the point's kLanes lanes (consecutive lanes of one warp; every lane takes part) in a fixed
// butterfly.
template <int kLanes>
__device__ __forceinline__ float LaneSum(float x) {
#pragma unroll
  for (int offset = 1; offset < kLanes; offset *= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// x . y over the point's kLanes lanes. Two partial sums halve the dependent chain of FMAs.
template <int kLanes>
__device__ __forceinline__ float LaneDot(const float (&x)[kLaneChannels], const float (&y)[kLaneChannels]) {
  float even = 0.f, odd = 0.f;
#pragma unroll
  for (int e = 0; e < kLaneChannels; e += 2) {
    even = fmaf(x[e], y[e], even);
    odd = fmaf(x[e + 1], y[e + 1], odd);
  }
  return LaneSum<kLanes>(even + odd);
}

__device__ __forceinline__ void StoreLane(float* dst, const float (&x)[kLaneChannels]) {
#pragma unroll
  for (int c = 0; c < kLaneChannels; c += 4) {
    *reinterpret_cast<float4*>(dst + c) = make_float4(x[c], x[c + 1], x[c + 2], x[c + 3]);
  }
}

// x rounded to T.
template <typename T>
__device__ __forceinline__ void StoreLane(T* dst, const float (&x)[kLaneChannels]) {
  const auto pack = [&](int c) { return PackPair<T>(x[c], x[c + 1]); };
#pragma unroll
  for (int c = 0; c < kLaneChannels; c += 8) {
    *reinterpret_cast<uint4*>(dst + c) = make_uint4(pack(c), pack(c + 2), pack(c + 4), pack(c + 6));
  }
}

// What a block knows of the thread's point: its lane, its column in the staged window (less the arcs'
// start), whether it is a point of the grid (else a clamped one that writes nothing), its row (clamped),
// its (point, head) index in [batch, rows, cols, heads] of the walking grid, and arc `threadIdx.x %
// kMaxOtherRows` of its row (by the thread's lane in the warp, not in the point: ArcOfRow gives every arc of
// the warp's row to every lane).
struct WalkPoint {
  int lane;
  int32_t column0;
  bool real;
  int32_t row;
  int64_t point;
  StagedArc lane_arc;
};

// Arc i of the warp's row, from the lane that read it. The lanes of a warp read the row's arcs side by side
// (each arc costs bounds tests and a log2, ~60 instructions, too many for every lane to read every arc and
// keep it on the stack: docs/performance.md). Every lane of the warp must call it.
__device__ __forceinline__ StagedArc ArcOfRow(const WalkPoint& at, int i) {
  constexpr unsigned kWarp = 0xffffffffu;
  return StagedArc{__shfl_sync(kWarp, at.lane_arc.row, i), __shfl_sync(kWarp, at.lane_arc.column, i),
                   __shfl_sync(kWarp, at.lane_arc.len, i), __shfl_sync(kWarp, at.lane_arc.log2_weight, i)};
}

// Starts staging the rows the block's pair of walking rows sees into `s` (query walks: K and V; the key
// walk: Q, dout, lse and delta), every copy in flight at once, and returns the thread's point with its share
// of its row's arcs (ArcOfRow). The caller then loads its own operands (while the copies fly) and waits:
// MbarrierWait(&s.landed, 0). A warp's points lie in one row.
template <typename T, int D, bool kKeyWalk>
__device__ __forceinline__ WalkPoint StartBlock(const NbhdAttnGpuParams& p, Staged<T, D, kKeyWalk>& s) {
  using S = Shape<D>;
  const WalkGrids grids = GridsOf<kKeyWalk>(p);
  const BlockRow block = BlockRowOf(p);
  const int32_t heads = static_cast<int32_t>(p.heads);
  const int32_t batch = block.batch_head / heads, head = block.batch_head % heads;
  // The pair's first walking row and first staged row, clamped into the arrays (device memory).
  const int32_t row0 = min(max(__ldg(p.stencil_pairs + 2 * block.rank), 0), grids.nlat - 1);
  const int32_t other0 = min(max(__ldg(p.stencil_pairs + 2 * block.rank + 1), 0), grids.other_nlat - 1);
  const int32_t nlon = grids.other_nlon;
  const int32_t lon0 = static_cast<int32_t>(blockIdx.x) * S::kLons;

  WalkPoint w;
  w.lane = threadIdx.x % S::kLanes;
  const int point_in_block = threadIdx.x / S::kLanes;
  const int32_t row = row0 + point_in_block / S::kLons, lon = lon0 + point_in_block % S::kLons;
  w.column0 = point_in_block % S::kLons;
  w.real = row < grids.nlat && lon < grids.nlon;
  w.row = min(row, grids.nlat - 1);
  w.point = ((int64_t{batch} * grids.nlat + w.row) * grids.nlon + min(lon, grids.nlon - 1)) * heads + head;
  // The row's arc offsets and the staged rows' quadrature weights, read before the copies are issued and used
  // after them, so that their latency hides behind the copies' (the arcs themselves, which need the offsets,
  // are read after the copies). Lane i of a warp's kMaxOtherRows lanes takes arc i of its row and, for the
  // query walks, the weight of staged row i (clamped into the key grid; rows past it are never read).
  const bool whole = WholeGrids(p);
  const int32_t raw_begin = __ldg(p.arc_offsets + w.row), raw_end = __ldg(p.arc_offsets + w.row + 1);
  const int lane_row = static_cast<int>(threadIdx.x % kMaxOtherRows);
  const float staged_weight =
      kKeyWalk ? 1.f : __ldg(p.quad_weights + max(min(other0 + lane_row, min(grids.other_nlat, p.nlat_k) - 1), 0));

  if (threadIdx.x == 0) MbarrierInit(&s.landed, 2 * kThreads);
  __syncthreads();
  const int64_t row_points = int64_t{nlon} * heads;  // (point, head) indices per row
  const int64_t other_first = (int64_t{batch} * grids.other_nlat + other0) * row_points + head;  // (point, head)
  const T* a = static_cast<const T*>(kKeyWalk ? p.q : p.k) + other_first * D;
  const T* b = static_cast<const T*>(kKeyWalk ? p.dout : p.v) + other_first * D;
  // Each thread copies one 16-byte piece of every kColumnStep-th column of the window, in every staged row:
  // a column's longitude (wrapped) is worked out once for its rows, by one step where the window cannot wrap
  // twice (a division otherwise: rings shorter than the window, or a walking grid wider than this one).
  constexpr int kColumnStep = kThreads / S::kPieces;
  const int piece = threadIdx.x % S::kPieces;
  const int rows = min(kMaxOtherRows, grids.other_nlat - other0);  // the others are never read
  const bool wraps_once = nlon >= S::kWindow && lon0 < nlon;
  for (int col = threadIdx.x / S::kPieces; col < S::kWindow; col += kColumnStep) {
    int32_t lon = lon0 - kMaxHalf + col;
    if (wraps_once) {  // lon in [-kMaxHalf, 2 nlon)
      lon += lon < 0 ? nlon : (lon >= nlon ? -nlon : 0);
    } else {
      lon %= nlon;
      if (lon < 0) lon += nlon;
    }
    const int64_t at = int64_t{lon} * heads;  // (point, head) index less other_first
    // Pointers stepped a row at a time (one 64-bit add a copy), only to rows that are staged.
    const T* a_at = a + at * D + 8 * piece;
    const T* b_at = b + at * D + 8 * piece;
    const float* lse_at = kKeyWalk ? p.lse + other_first + at : nullptr;
    const float* delta_at = kKeyWalk ? p.delta + other_first + at : nullptr;
#pragma unroll
    for (int r = 0; r < kMaxOtherRows; ++r) {
      if (r >= rows) break;
      if (r > 0) {
        a_at += row_points * D;
        b_at += row_points * D;
        if (kKeyWalk) {
          lse_at += row_points;
          delta_at += row_points;
        }
      }
      CopyAsync16(&s.a[r][col][8 * piece], a_at);
      CopyAsync16(&s.b[r][col][8 * piece], b_at);
      if (kKeyWalk && piece == 0) {
        CopyAsync4(&s.lse[r][col], lse_at);
        CopyAsync4(&s.delta[r][col], delta_at);
      }
    }
  }
  CopyAsyncArriveOn(&s.landed);
  MbarrierArrive(&s.landed);

  const int32_t segments = static_cast<int32_t>(min(p.num_arcs, int64_t{INT32_MAX}));  // bounds every read
  const int32_t end = min(max(raw_end, 0), segments);
  const int32_t begin = min(max(raw_begin, 0), end);
  const int32_t arc = begin + lane_row;
  if (whole && arc < end) {
    const int32_t* segment = p.arcs + 3 * int64_t{arc};
    w.lane_arc = ArcOf(__ldg(segment), __ldg(segment + 1), __ldg(segment + 2), other0, grids);
  } else {
    w.lane_arc = StagedArc{0, 0, 0, 0.f};
  }
  if (!kKeyWalk) {  // the key row's weight, from the lane of this group that read it (the key walk's is its own)
    const float log2_weight = log2f(staged_weight);
    const int group = static_cast<int>(threadIdx.x % 32) - lane_row;
    w.lane_arc.log2_weight = __shfl_sync(0xffffffffu, log2_weight, group + w.lane_arc.row);
  }
  return w;
}

// Stores the thread's 16 channels of a [batch, rows, cols, heads, D] result at `at` (elements), float32 or in
// T when `narrow` (the float32 values rounded to nearest).
template <typename T>
__device__ __forceinline__ void StoreResult(void* base, bool narrow, int64_t at, const float (&x)[kLaneChannels]) {
  if (narrow) {
    StoreLane(static_cast<T*>(base) + at, x);
  } else {
    StoreLane(static_cast<float*>(base) + at, x);
  }
}

// One block per pair of rows and kLons longitudes of every (batch, head).
template <typename T, int D, bool kKeyWalk = false>
cudaError_t LaunchPairs(void (*kernel)(NbhdAttnGpuParams), cudaStream_t stream, const NbhdAttnGpuParams& p) {
  const int64_t tiles = (int64_t{kKeyWalk ? p.nk_lon : p.nq_lon} + Shape<D>::kLons - 1) / Shape<D>::kLons;
  return LaunchRowGrid(kernel, stream, p, p.num_stencil_pairs, tiles, kThreads, sizeof(Staged<T, D, kKeyWalk>));
}

static_assert(sizeof(kStencilHeadDims) == 3 * sizeof(int) && kStencilHeadDims[0] == 32 && kStencilHeadDims[1] == 64 &&
                  kStencilHeadDims[2] == 128,
              "DispatchSixteenBit instantiates exactly the stencil head dims of common/kernel_limits.h");

// A stencil target: launch(SixteenBitVariant<T, D>{}) for the call's type and head dim, where
// StencilAttnSupported holds and the pairs' rows fit the walking grid (query rows, or key rows for
// `kKeyWalk`).
template <bool kKeyWalk = false, typename Launch>
cudaError_t DispatchStencil(const NbhdAttnGpuParams& p, Launch&& launch) {
  const bool fits = 2 * int64_t{p.num_stencil_pairs} <= (kKeyWalk ? p.nk_lat : p.nq_lat);
  return StencilAttnSupported(p) && fits ? DispatchSixteenBit(p, launch) : cudaErrorInvalidValue;
}

}  // namespace stencil
}  // namespace gpu
}  // namespace s2attn

// The launcher `NAME<T, D>` of stencil_attn_kernels.h for every type and head dim.
#define S2ATTN_INSTANTIATE_STENCIL_LAUNCHER(NAME)                                            \
  template cudaError_t NAME<__nv_bfloat16, 32>(cudaStream_t, const NbhdAttnGpuParams&);  \
  template cudaError_t NAME<__nv_bfloat16, 64>(cudaStream_t, const NbhdAttnGpuParams&);  \
  template cudaError_t NAME<__nv_bfloat16, 128>(cudaStream_t, const NbhdAttnGpuParams&); \
  template cudaError_t NAME<__half, 32>(cudaStream_t, const NbhdAttnGpuParams&);         \
  template cudaError_t NAME<__half, 64>(cudaStream_t, const NbhdAttnGpuParams&);         \
  template cudaError_t NAME<__half, 128>(cudaStream_t, const NbhdAttnGpuParams&)
