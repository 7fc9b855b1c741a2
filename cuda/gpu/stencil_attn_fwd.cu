// Stencil forward: out and lse of the query rows whose arcs are all short (within kMaxHalf longitudes of
// the point), on CUDA cores. At the default cutoff most rows are such rows (84 % of 721x1440), where the
// tiled kernels' 64-point units multiply whole 16-column blocks for ~5 neighbours (benchmarks/NOTES.md,
// sessions 13-15); jax_s2attn.plan picks the row pairs, and the tiled forward's launcher runs this kernel
// on them and the tiled one on every other row.
//
// A block owns kRows query rows (one stencil pair) x kLons longitudes of one (batch, head). It stages the
// <= kMaxOtherRows key rows the pair sees, kLons + 2 kMaxHalf columns each (K and V, every copy in flight
// at once), then kLanes = D / 16 lanes per point walk the point's arcs there: 16 channels per lane, dot
// products summed over the lanes by shuffles, float32 throughout. The softmax is exact and online, P is
// never rounded, so out is float32-accurate (the backward forms delta from it). Results are owned by one
// thread each and summed in a fixed order: bitwise reproducible.
#include "gpu/stencil_attn_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cstdint>

#include "gpu/device_common.cuh"
#include "gpu/mbarrier_sm90.cuh"
#include "gpu/mma_sm80.cuh"

namespace s2attn {
namespace gpu {
namespace stencil {
namespace {

constexpr int kThreads = 256;
constexpr int kLaneChannels = 16;  // two 16-byte pieces of a row per lane

template <int D>
struct Shape {
  static constexpr int kLanes = D / kLaneChannels;               // 2, 4, 8
  static constexpr int kLons = kThreads / (kLanes * kRows);      // 64, 32, 16
  static constexpr int kWindow = kLons + 2 * kMaxHalf;           // staged columns per key row
  static constexpr int kStride = D + 8;  // padded: a quarter-warp's points read rows in different banks
  static constexpr int kPieces = D / 8;  // 16-byte pieces per row
};

// The block's shared memory, under the 48 KiB that needs no opt-in.
template <typename T, int D>
struct Staged {
  T k[kMaxOtherRows][Shape<D>::kWindow][Shape<D>::kStride];
  T v[kMaxOtherRows][Shape<D>::kWindow][Shape<D>::kStride];
  uint64_t landed;  // completes once every thread's copies landed
};
static_assert(sizeof(Staged<__half, 32>) <= 48 * 1024 && sizeof(Staged<__half, 64>) <= 48 * 1024 &&
                  sizeof(Staged<__half, 128>) <= 48 * 1024,
              "stencil blocks fit the default 48 KiB of shared memory");

// Whether the call is what the stencil rows need: whole grids (no sharding windows, no padding), one
// residue and shift (arcs relative to their point), equal longitude counts.
__device__ __forceinline__ bool WholeGrids(const NbhdAttnGpuParams& p) {
  const Windows w = ReadDeviceWindows(p);
  const auto whole = [](const GridWindow& g, int32_t local_lat, int32_t local_lon, int32_t nlat, int32_t nlon) {
    return g.lat0 == 0 && g.lon0 == 0 && g.nlat == nlat && g.nlon == nlon && local_lat == nlat && local_lon == nlon;
  };
  return whole(w.q, p.nq_lat, p.nq_lon, p.nlat_q, p.nlon_q) && whole(w.k, p.nk_lat, p.nk_lon, p.nlat_k, p.nlon_k) &&
         p.nlon_q == p.nlon_k && p.residues == 1 && p.shift == 1;
}

// One arc of a point in the staged window: staged row, column of the first neighbour relative to the
// point's own column (kMaxHalf + the arc's start offset), length, log2 of the row's quadrature weight.
struct StagedArc {
  int32_t row, column, len;
  float log2_weight;
};

// The arc of segment (key_row, lo, len) for points of a pair whose staged rows start at `other0`, or an
// empty one where it does not fit the stencil (never for the plan's pairs; a corrupted table stays in
// bounds). The plan's rule (jax_s2attn.plan): the arc starts `lo` (or lo - nlon past kMaxHalf)
// longitudes from its point and must end within kMaxHalf.
__device__ __forceinline__ StagedArc ArcOf(const int32_t* segment, int32_t other0, const NbhdAttnGpuParams& p) {
  const int32_t key_row = __ldg(segment), lo = __ldg(segment + 1), len = __ldg(segment + 2);
  const int32_t start = lo > kMaxHalf ? lo - p.nlon_k : lo;
  // Each bound alone first, so that no sum of table values can overflow.
  const bool fits = key_row >= other0 && key_row - other0 < kMaxOtherRows && key_row < p.nk_lat &&
                    start >= -kMaxHalf && start <= kMaxHalf && len >= 0 && len <= 2 * kMaxHalf + 1 &&
                    start + len - 1 <= kMaxHalf;
  if (!fits) return StagedArc{0, 0, 0, 0.f};
  return StagedArc{key_row - other0, kMaxHalf + start, len, log2f(__ldg(p.quad_weights + key_row))};
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

// x . y over the point's kLanes lanes (consecutive lanes of one warp; every lane takes part). Two partial
// sums halve the dependent chain of FMAs.
template <int kLanes>
__device__ __forceinline__ float LaneDot(const float (&x)[kLaneChannels], const float (&y)[kLaneChannels]) {
  float even = 0.f, odd = 0.f;
#pragma unroll
  for (int e = 0; e < kLaneChannels; e += 2) {
    even = fmaf(x[e], y[e], even);
    odd = fmaf(x[e + 1], y[e + 1], odd);
  }
  float dot = even + odd;
#pragma unroll
  for (int offset = 1; offset < kLanes; offset *= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
  return dot;
}

__device__ __forceinline__ void StoreLane(float* dst, const float (&x)[kLaneChannels]) {
#pragma unroll
  for (int c = 0; c < kLaneChannels; c += 4) {
    *reinterpret_cast<float4*>(dst + c) = make_float4(x[c], x[c + 1], x[c + 2], x[c + 3]);
  }
}

template <typename T>
__device__ __forceinline__ void StoreLane(T* dst, const float (&x)[kLaneChannels]) {
#pragma unroll
  for (int c = 0; c < kLaneChannels; c += 8) {
    *reinterpret_cast<uint4*>(dst + c) = make_uint4(PackPair<T>(x[c], x[c + 1]), PackPair<T>(x[c + 2], x[c + 3]),
                                                    PackPair<T>(x[c + 4], x[c + 5]), PackPair<T>(x[c + 6], x[c + 7]));
  }
}

// Online softmax in log2 units with the quadrature weight as a bias: x = log2(e) * scale * q.k + log2(w),
// p = exp2(x - m), lse = ln(2) * (m + log2(l)).
template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 4) StencilFwdKernel(const NbhdAttnGpuParams p) {
  using S = Shape<D>;
  Staged<T, D>& s = *reinterpret_cast<Staged<T, D>*>(DynamicShared());
  const BlockRow block = BlockRowOf(p);
  const int32_t heads = static_cast<int32_t>(p.heads);
  const int32_t batch = block.batch_head / heads, head = block.batch_head % heads;
  // The pair's first query row and first staged key row, clamped into the arrays (device memory).
  const int32_t row0 = min(max(__ldg(p.stencil_pairs + 2 * block.rank), 0), p.nq_lat - 1);
  const int32_t other0 = min(max(__ldg(p.stencil_pairs + 2 * block.rank + 1), 0), p.nk_lat - 1);
  const int32_t nlon = p.nk_lon;
  const int32_t lon0 = static_cast<int32_t>(blockIdx.x) * S::kLons;
  const int64_t column_stride = int64_t{heads} * D;  // elements between neighbouring points of a row

  if (threadIdx.x == 0) MbarrierInit(&s.landed, 2 * kThreads);
  __syncthreads();
  const int64_t key_base = (int64_t{batch} * p.nk_lat * nlon * heads + head) * D;
  const T* k = static_cast<const T*>(p.k) + key_base;
  const T* v = static_cast<const T*>(p.v) + key_base;
  for (int e = threadIdx.x; e < kMaxOtherRows * S::kWindow * S::kPieces; e += kThreads) {
    const int piece = e % S::kPieces, col = (e / S::kPieces) % S::kWindow, r = e / (S::kPieces * S::kWindow);
    if (other0 + r >= p.nk_lat) continue;  // never read
    int32_t lon = (lon0 - kMaxHalf + col) % nlon;
    if (lon < 0) lon += nlon;
    const int64_t at = (int64_t{other0 + r} * nlon + lon) * column_stride + 8 * piece;
    CopyAsync16(&s.k[r][col][8 * piece], k + at);
    CopyAsync16(&s.v[r][col][8 * piece], v + at);
  }
  CopyAsyncArriveOn(&s.landed);
  MbarrierArrive(&s.landed);

  // The thread's point and lane. A warp's points lie in one row; points past the grid (the last tile's,
  // a pair's missing second row) walk a clamped point and write nothing.
  const int lane = threadIdx.x % S::kLanes, point_in_block = threadIdx.x / S::kLanes;
  const int32_t row = row0 + point_in_block / S::kLons, lon = lon0 + point_in_block % S::kLons;
  const bool real = row < p.nq_lat && lon < p.nq_lon;
  const int32_t walk_row = min(row, p.nq_lat - 1);
  const int64_t point = ((int64_t{batch} * p.nq_lat + walk_row) * p.nq_lon + min(lon, p.nq_lon - 1)) * heads + head;
  float q[kLaneChannels];
  LoadLane<T>(q, static_cast<const T*>(p.q) + point * D + lane * kLaneChannels, p.scale * kLog2e);
  // The row's arcs, read while the copies are in flight.
  StagedArc arcs[kMaxOtherRows];
  const bool whole = WholeGrids(p);
  const int32_t segments = static_cast<int32_t>(min(p.num_arcs, int64_t{INT32_MAX}));  // bounds every copy
  const int32_t end = min(max(__ldg(p.arc_offsets + walk_row + 1), 0), segments);
  const int32_t begin = min(max(__ldg(p.arc_offsets + walk_row), 0), end);
#pragma unroll
  for (int i = 0; i < kMaxOtherRows; ++i) {
    arcs[i] = whole && begin + i < end ? ArcOf(p.arcs + 3 * int64_t{begin + i}, other0, p) : StagedArc{0, 0, 0, 0.f};
  }
  MbarrierWait(&s.landed, 0);

  float acc[kLaneChannels] = {};
  float m = kNegInf, l = 0.f;
  const int32_t column0 = point_in_block % S::kLons;
#pragma unroll 1
  for (int i = 0; i < kMaxOtherRows; ++i) {
    const StagedArc arc = arcs[i];
    const T* k_row = &s.k[arc.row][column0 + arc.column][lane * kLaneChannels];
    const T* v_row = &s.v[arc.row][column0 + arc.column][lane * kLaneChannels];
    for (int32_t j = 0; j < arc.len; ++j) {
      float x[kLaneChannels];
      LoadLane<T>(x, k_row + j * S::kStride, 1.f);
      const float logit = LaneDot<S::kLanes>(q, x) + arc.log2_weight, m_new = fmaxf(m, logit);
      const float base = m_new == kNegInf ? 0.f : m_new;  // nothing seen yet: p = 0
      const float decay = Exp2(m - base), weight = Exp2(logit - base);
      m = m_new;
      l = fmaf(l, decay, weight);
      LoadLane<T>(x, v_row + j * S::kStride, 1.f);
#pragma unroll
      for (int c = 0; c < kLaneChannels; ++c) acc[c] = fmaf(acc[c], decay, weight * x[c]);
    }
  }
  if (!real) return;
  // No neighbour: 0, -inf. A NaN sum stays NaN (not "no neighbour"); a discarded acc may hold NaN.
  const bool seen = !(l == 0.f);
  const float inverse = seen ? 1.f / l : 0.f;
#pragma unroll
  for (int c = 0; c < kLaneChannels; ++c) acc[c] = seen ? acc[c] * inverse : 0.f;
  if (lane == 0) p.lse_out[point] = seen ? (m + log2f(l)) * kLn2 : kNegInf;
  const int64_t at = point * D + lane * kLaneChannels;
  if (p.out != nullptr) {
    StoreLane(p.out + at, acc);
  } else {  // out in T: the same float32 values, rounded to nearest
    StoreLane(static_cast<T*>(p.out_narrow) + at, acc);
  }
}

}  // namespace

template <typename T, int D>
cudaError_t LaunchStencilFwd(cudaStream_t stream, const NbhdAttnGpuParams& p) {
  const int64_t tiles = (int64_t{p.nq_lon} + Shape<D>::kLons - 1) / Shape<D>::kLons;
  return LaunchRowGrid(StencilFwdKernel<T, D>, stream, p, p.num_stencil_pairs, tiles, kThreads,
                       sizeof(Staged<T, D>));
}

template cudaError_t LaunchStencilFwd<__nv_bfloat16, 32>(cudaStream_t, const NbhdAttnGpuParams&);
template cudaError_t LaunchStencilFwd<__nv_bfloat16, 64>(cudaStream_t, const NbhdAttnGpuParams&);
template cudaError_t LaunchStencilFwd<__nv_bfloat16, 128>(cudaStream_t, const NbhdAttnGpuParams&);
template cudaError_t LaunchStencilFwd<__half, 32>(cudaStream_t, const NbhdAttnGpuParams&);
template cudaError_t LaunchStencilFwd<__half, 64>(cudaStream_t, const NbhdAttnGpuParams&);
template cudaError_t LaunchStencilFwd<__half, 128>(cudaStream_t, const NbhdAttnGpuParams&);

}  // namespace stencil
}  // namespace gpu
}  // namespace s2attn
