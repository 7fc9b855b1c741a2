// Device building blocks of the neighbourhood-attention kernels (included by the .cu files
// only): element widening, the two channel layouts, the arc walk in groups of neighbours, the
// block schedule and the host-side variant dispatch and launch.
//
// Work decomposition (all three kernels): a *team* of Ch::kLanes consecutive lanes owns one
// walking point (query for forward/dq, key for dk/dv) of one (batch, head); each lane holds a
// slice of that point's channels. The team walks the point's arcs as contiguous runs of the
// other grid (arc_walk.h), kNeighbourGroup neighbours at a time: the group's rows are loaded
// together, reduced with shuffles inside the team, then accumulated. Control flow is uniform
// inside a team, so shuffles name the team's lanes only and teams of one warp may diverge.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "common/arc_walk.h"
#include "common/ring_walk.h"
#include "gpu/device_common.cuh"
#include "gpu/nbhd_attn_kernels.h"
#include "gpu/packed_pair.cuh"

namespace s2attn {
namespace gpu {

// Neighbours whose rows are loaded together (one max/rescale per group in the forward).
constexpr int kNeighbourGroup = 4;
// Threads per block of the vector kernels; the general kernels use up to kGeneralMaxWarps.
constexpr int kVectorBlockThreads = 256;
// Resident 256-thread blocks per SM the launch bounds ask for, i.e. register caps of 80 for
// the forward vector kernels (24 warps per SM) and 128 for the rest (16 warps; the backward
// holds four head vectors and two tiles per lane). ptxas -v (sm_90, CUDA 13.0): no spills but
// 16 bytes in the float32 Dk = 128 forward. Left to itself ptxas picks counts that spill or
// waste occupancy.
constexpr int kFwdVectorBlocksPerSm = 3;
constexpr int kBlocksPerSm = 2;
constexpr int kGeneralMaxWarps = 4;
// Shared memory of one general-kernel block (the default limit, no opt-in needed).
constexpr int64_t kGeneralSharedBytes = 48 * 1024;
// Four consecutive elements of T, loaded as one vector (16 bytes of float32, 8 bytes of a
// 16-bit type) and widened to float. Four channels per lane keep the register footprint of
// the backward kernels (four head vectors and two tiles per lane) within 128 registers.
template <typename T>
struct Pack4 {
  static_assert(sizeof(T) == 2, "Pack4 widens float32, bfloat16 and float16");
  using Raw = uint2;
  static __device__ __forceinline__ void Widen(const Raw& r, float (&x)[4]) {
    const float2 low = UnpackPair<T>(r.x), high = UnpackPair<T>(r.y);
    x[0] = low.x;
    x[1] = low.y;
    x[2] = high.x;
    x[3] = high.y;
  }
};

template <>
struct Pack4<float> {
  using Raw = uint4;
  static __device__ __forceinline__ void Widen(const Raw& r, float (&x)[4]) {
    x[0] = __uint_as_float(r.x);
    x[1] = __uint_as_float(r.y);
    x[2] = __uint_as_float(r.z);
    x[3] = __uint_as_float(r.w);
  }
};

// Which lane of a team holds total j after the reduce-scatter of TeamAllReduce.
template <int kLanes, int kCount>
__host__ __device__ constexpr int ReducedLane(int j) {
  int lane = 0;
  for (int width = kCount, offset = kLanes / 2; width > 1; width /= 2, offset /= 2) {
    if (j >= width / 2) {
      lane += offset;
      j -= width / 2;
    }
  }
  return lane;
}

// Sums kCount per-lane partials over a team of kLanes lanes (`lane` = index in the team,
// `base` = the team's first lane in the warp) and leaves every total, bitwise equal, in
// every lane. Reduce-scatter first (each step sends the half of the values the partner keeps),
// butterfly once one value is left, then gather the totals from the lanes that hold them:
// (kCount - 1) + log2(kLanes / kCount) + kCount shuffles, e.g. 9 instead of 16 for 4 values
// over 16 lanes.
template <int kLanes, int kCount>
__device__ __forceinline__ void TeamAllReduce(float (&v)[kCount], unsigned mask, int lane, int base) {
  static_assert((kCount & (kCount - 1)) == 0 && kCount <= kLanes, "a power of two of at most kLanes values");
  float a[kCount];
#pragma unroll
  for (int i = 0; i < kCount; ++i) a[i] = v[i];
#pragma unroll
  for (int step = 0; (kCount >> step) > 1; ++step) {
    const int half = (kCount >> step) / 2;
    const int offset = kLanes >> (step + 1);
    const bool upper = (lane & offset) != 0;
#pragma unroll
    for (int i = 0; i < half; ++i) {
      const float send = upper ? a[i] : a[i + half];
      const float keep = upper ? a[i + half] : a[i];
      a[i] = keep + __shfl_xor_sync(mask, send, offset);
    }
  }
#pragma unroll
  for (int offset = kLanes / (2 * kCount); offset > 0; offset /= 2) a[0] += __shfl_xor_sync(mask, a[0], offset);
#pragma unroll
  for (int j = 0; j < kCount; ++j) v[j] = __shfl_sync(mask, a[0], base + ReducedLane<kLanes, kCount>(j));
}

// ------------------------------------------------------------------ channel layouts
//
// Both layouts offer the same operations on this lane's slice of a head vector:
//   Vec NewVec(dim)                 zeroed accumulator / register copy of one head vector
//   Load(vec, row, scale)           vec = scale * row (row = first element of the head vector)
//   LoadRows<kRows>(first, stride)  a Tile of kRows rows `stride` elements apart
//   Dots(a, tile, s)                s[u] = partial dot of a with row u (this lane's channels)
//   Sum(s)                          all-reduce partials over the team (bitwise equal in all lanes)
//   Accumulate(acc, w, tile)        acc += sum_u w[u] * row u
//   Scale, Store(row, vec, scale), StoreZero, Leader (one lane per team)

// Fast path: Dk == Dv == kDim in {32, 64, 128}, 16-byte aligned buffers. Each lane owns four
// consecutive channels (one vector load per row); a team is kDim / 4 lanes.
template <typename T, int kDim>
class VectorChannels {
 public:
  static constexpr int kPerLane = 4;
  static constexpr int kLanes = kDim / kPerLane;
  static constexpr bool kUsesShared = false;
  static_assert(kDim % kPerLane == 0 && kLanes >= 2 && kLanes <= 32 && (kLanes & (kLanes - 1)) == 0,
                "a team must be a power-of-two part of a warp");

  struct Vec {
    float x[kPerLane];
  };
  template <int kRows>
  struct Tile {
    typename Pack4<T>::Raw raw[kRows];
  };

  __device__ explicit VectorChannels(float* /*warp_shared*/)
      : lane_(static_cast<int>(threadIdx.x % kLanes)),
        base_(static_cast<int>(threadIdx.x % 32) / kLanes * kLanes),
        mask_(kLanes == 32 ? 0xffffffffu : ((1u << (kLanes % 32)) - 1u) << base_) {}

  __device__ bool Leader() const { return lane_ == 0; }

  __device__ Vec NewVec(int64_t /*dim*/) const {
    Vec v;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) v.x[i] = 0.f;
    return v;
  }

  __device__ void Load(Vec& v, const T* row, float scale) const {
    float x[kPerLane];
    Pack4<T>::Widen(LoadRaw(row), x);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) v.x[i] = x[i] * scale;
  }

  template <int kRows>
  __device__ Tile<kRows> LoadRows(const T* first_row, int64_t stride) const {
    Tile<kRows> t;
#pragma unroll
    for (int u = 0; u < kRows; ++u) t.raw[u] = LoadRaw(first_row + u * stride);
    return t;
  }

  template <int kRows>
  __device__ void Dots(const Vec& a, const Tile<kRows>& t, float (&s)[kRows]) const {
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      float x[kPerLane];
      Pack4<T>::Widen(t.raw[u], x);
      float d = 0.f;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) d = fmaf(a.x[i], x[i], d);
      s[u] = d;
    }
  }

  template <int kRows>
  __device__ void Accumulate(Vec& acc, const float (&w)[kRows], const Tile<kRows>& t) const {
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      float x[kPerLane];
      Pack4<T>::Widen(t.raw[u], x);
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) acc.x[i] = fmaf(w[u], x[i], acc.x[i]);
    }
  }

  template <int kCount>
  __device__ void Sum(float (&s)[kCount]) const {
    TeamAllReduce<kLanes>(s, mask_, lane_, base_);
  }

  __device__ void Scale(Vec& v, float f) const {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) v.x[i] *= f;
  }

  __device__ void Store(float* row, const Vec& v, float scale) const {
    *reinterpret_cast<float4*>(row + lane_ * kPerLane) =
        make_float4(v.x[0] * scale, v.x[1] * scale, v.x[2] * scale, v.x[3] * scale);
  }

  __device__ void StoreZero(float* row, int64_t /*dim*/) const { Store(row, NewVec(0), 0.f); }

 private:
  __device__ typename Pack4<T>::Raw LoadRaw(const T* row) const {
    return __ldg(reinterpret_cast<const typename Pack4<T>::Raw*>(row + lane_ * kPerLane));
  }

  int lane_;       // index in the team: this lane owns channels [4 * lane_, 4 * lane_ + 4)
  int base_;       // the team's first lane in the warp
  unsigned mask_;  // the team's lanes
};

// General path: any Dk, Dv (odd sizes, Dk != Dv, unaligned buffers). One warp per point;
// lane l owns channels l, l + 32, ...; head vectors live in this warp's slice of shared
// memory, where every lane touches only its own channels (no barriers, no bank conflicts).
template <typename T>
class GeneralChannels {
 public:
  static constexpr int kLanes = 32;
  static constexpr bool kUsesShared = true;

  struct Vec {
    float* x;
    int64_t dim;
  };
  template <int kRows>
  struct Tile {
    const T* first_row;
    int64_t stride;
  };

  __device__ explicit GeneralChannels(float* warp_shared)
      : lane_(static_cast<int>(threadIdx.x % 32)), next_(warp_shared) {}

  __device__ bool Leader() const { return lane_ == 0; }

  // Carves the next `dim` floats out of the warp's shared slice.
  __device__ Vec NewVec(int64_t dim) {
    Vec v{next_, dim};
    next_ += dim;
    for (int64_t c = lane_; c < dim; c += 32) v.x[c] = 0.f;
    return v;
  }

  __device__ void Load(Vec& v, const T* row, float scale) const {
    for (int64_t c = lane_; c < v.dim; c += 32) v.x[c] = ToFloat(__ldg(row + c)) * scale;
  }

  template <int kRows>
  __device__ Tile<kRows> LoadRows(const T* first_row, int64_t stride) const {
    return Tile<kRows>{first_row, stride};
  }

  template <int kRows>
  __device__ void Dots(const Vec& a, const Tile<kRows>& t, float (&s)[kRows]) const {
#pragma unroll
    for (int u = 0; u < kRows; ++u) s[u] = 0.f;
    for (int64_t c = lane_; c < a.dim; c += 32) {
      const float x = a.x[c];
#pragma unroll
      for (int u = 0; u < kRows; ++u) {
        s[u] = fmaf(x, ToFloat(__ldg(t.first_row + u * t.stride + c)), s[u]);
      }
    }
  }

  template <int kRows>
  __device__ void Accumulate(Vec& acc, const float (&w)[kRows], const Tile<kRows>& t) const {
    for (int64_t c = lane_; c < acc.dim; c += 32) {
      float y = acc.x[c];
#pragma unroll
      for (int u = 0; u < kRows; ++u) {
        y = fmaf(w[u], ToFloat(__ldg(t.first_row + u * t.stride + c)), y);
      }
      acc.x[c] = y;
    }
  }

  template <int kCount>
  __device__ void Sum(float (&s)[kCount]) const {
    TeamAllReduce<kLanes>(s, 0xffffffffu, lane_, 0);
  }

  __device__ void Scale(Vec& v, float f) const {
    for (int64_t c = lane_; c < v.dim; c += 32) v.x[c] *= f;
  }

  __device__ void Store(float* row, const Vec& v, float scale) const {
    for (int64_t c = lane_; c < v.dim; c += 32) row[c] = v.x[c] * scale;
  }

  __device__ void StoreZero(float* row, int64_t dim) const {
    for (int64_t c = lane_; c < dim; c += 32) row[c] = 0.f;
  }

 private:
  int lane_;
  float* next_;
};

// ------------------------------------------------------------------ walking

__device__ __forceinline__ int64_t Clamp(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : (x > hi ? hi : x); }

// Calls visit(local_row, local_col, count) for every run of consecutive neighbours, inside
// the window `other` (nlon_other global longitudes), of the walking point at global (lat, lon).
template <typename Visit>
__device__ __forceinline__ void ForEachRun(const NbhdAttnGpuParams& p, const GridWindow& other, int32_t nlon_other,
                                           int32_t lat, int32_t lon, Visit&& visit) {
  const WalkStart start = WalkStartOf(lat, lon, p.residues, p.shift);
  // Offsets come from device memory: clamp them so a bad table cannot index outside `arcs`.
  const int64_t begin = Clamp(__ldg(p.arc_offsets + start.pattern), 0, p.num_arcs);
  const int64_t end = Clamp(__ldg(p.arc_offsets + start.pattern + 1), begin, p.num_arcs);
  for (int64_t a = begin; a < end; ++a) {
    const int32_t* arc = p.arcs + 3 * a;
    const int32_t row = other.LocalRow(__ldg(arc));
    if (row < 0) continue;
    const ArcPieces pieces = ClipArc(__ldg(arc + 1), __ldg(arc + 2), start.offset, nlon_other, other.lon0, other.nlon);
    for (int32_t i = 0; i < pieces.count; ++i) {  // selects keep the pieces in registers
      visit(row, i == 0 ? pieces.col[0] : pieces.col[1], i == 0 ? pieces.len[0] : pieces.len[1]);
    }
  }
}

// ------------------------------------------------------------------ geometries
//
// Where a team's walking point lies and which runs of the other grid it visits, for the two kinds of call.
// A geometry G (constructed from the params in the kernel) offers
//   Rows(), Cols()                 the launch grid's walking rows and the columns of the widest
//   At(i, j) -> WalkPoint          walking row i (from row_order), column j
//   WalkPoints(), OtherPoints()    points of one batch entry's walking and other arrays
//   WalkWeightIndex(i)             the quadrature weight of walking row i's points (dk/dv)
//   ForEachRun(i, j, visit)        visit(weight_index, first, count) per run of `count` consecutive points of the
//                                  other grid from point `first` (in one batch entry's array), whose weight is
//                                  quad_weights[weight_index] (used by the forward and dq)

struct WalkPoint {
  int64_t local;  // index in one batch entry's walking array
  bool exists;    // false past the end of a ring: no result element to write
  bool real;      // false for padding of a window: zeros to write
};

// The regular grids of a NeighborhoodPlan: rows and columns of the local arrays, clipped to the windows.
// kWalkKeys: the keys walk (dk/dv), else the queries.
template <bool kWalkKeys>
class GridGeometry {
 public:
  __device__ explicit GridGeometry(const NbhdAttnGpuParams& p) : p_(p), win_(ReadDeviceWindows(p)) {}

  __device__ int32_t Rows() const { return kWalkKeys ? p_.nk_lat : p_.nq_lat; }
  __device__ int32_t Cols() const { return kWalkKeys ? p_.nk_lon : p_.nq_lon; }
  __device__ int64_t WalkPoints() const { return int64_t{Rows()} * Cols(); }
  __device__ int64_t OtherPoints() const {
    return kWalkKeys ? int64_t{p_.nq_lat} * p_.nq_lon : int64_t{p_.nk_lat} * p_.nk_lon;
  }
  __device__ WalkPoint At(int32_t i, int32_t j) const {
    return WalkPoint{int64_t{i} * Cols() + j, true, i < Walk().nlat && j < Walk().nlon};
  }
  __device__ int32_t WalkWeightIndex(int32_t i) const { return Walk().lat0 + i; }

  template <typename Visit>
  __device__ __forceinline__ void ForEachRun(int32_t i, int32_t j, Visit&& visit) const {
    const GridWindow& other = kWalkKeys ? win_.q : win_.k;
    const int32_t other_cols = kWalkKeys ? p_.nq_lon : p_.nk_lon;
    gpu::ForEachRun(p_, other, kWalkKeys ? p_.nlon_q : p_.nlon_k, Walk().lat0 + i, Walk().lon0 + j,
                    [&](int32_t row, int32_t col, int32_t count) {
                      visit(other.lat0 + row, int64_t{row} * other_cols + col, count);
                    });
  }

 private:
  __device__ const GridWindow& Walk() const { return kWalkKeys ? win_.k : win_.q; }

  const NbhdAttnGpuParams& p_;
  Windows win_;
};

// Ring grids: a row is a walking ring, a column a point of it. The tables are device memory and unchecked: every
// index read from them is clamped (a ring's points into the walking grid, its patterns and arcs into their tables,
// an arc's points into the other grid: ClampedRunsOfArc).
template <bool kWalkKeys>
class RingGeometry {
 public:
  __device__ explicit RingGeometry(const NbhdAttnGpuParams& p) : p_(p) {}

  __device__ int32_t Rows() const { return p_.num_walk_rings; }
  __device__ int32_t Cols() const { return p_.max_ring_points; }
  __device__ int64_t WalkPoints() const { return p_.walk_points; }
  __device__ int64_t OtherPoints() const { return p_.visited_points; }
  __device__ WalkPoint At(int32_t ring, int32_t j) const {
    const int32_t* row = p_.walk_rings + kWalkRingFields * int64_t{ring};
    const int32_t first = ClampToRange(__ldg(row), 0, p_.walk_points);
    const int32_t count = ClampToRange(__ldg(row + 1), 0, p_.walk_points - first);
    return WalkPoint{int64_t{first} + j, j < count, j < count};
  }
  __device__ int32_t WalkWeightIndex(int32_t ring) const { return WeightIndex(ring); }

  template <typename Visit>
  __device__ __forceinline__ void ForEachRun(int32_t ring, int32_t j, Visit&& visit) const {
    const int32_t* row = p_.walk_rings + kWalkRingFields * int64_t{ring};
    const int32_t period = __ldg(row + 3) < 1 ? 1 : __ldg(row + 3);
    const int64_t pattern = Clamp(int64_t{__ldg(row + 2)} + j % period, 0, p_.num_patterns - 1);
    const int32_t position = j / period;
    const int64_t begin = Clamp(__ldg(p_.arc_offsets + pattern), 0, p_.num_arcs);
    const int64_t end = Clamp(__ldg(p_.arc_offsets + pattern + 1), begin, p_.num_arcs);
    for (int64_t a = begin; a < end; ++a) {
      const int32_t* arc = p_.arcs + kRingArcFields * a;
      const RingRuns runs = ClampedRunsOfArc(__ldg(arc + 1), __ldg(arc + 2), __ldg(arc + 3), __ldg(arc + 4),
                                             __ldg(arc + 5), position, p_.visited_points);
      const int32_t weight_index = kWalkKeys ? 0 : WeightIndex(__ldg(arc));
      for (int32_t r = 0; r < runs.count; ++r) {  // selects keep the runs in registers
        visit(weight_index, r == 0 ? runs.first[0] : runs.first[1], r == 0 ? runs.len[0] : runs.len[1]);
      }
    }
  }

 private:
  __device__ int32_t WeightIndex(int32_t ring) const {
    return static_cast<int32_t>(Clamp(ring, 0, p_.num_weights - 1));
  }

  const NbhdAttnGpuParams& p_;
};

template <int kCount>
struct Group {
  static constexpr int kRows = kCount;
};

// The remainder of a run, fewer than 2 * kRows neighbours from `first`: at most one group
// of each power of two from kRows down.
template <int kRows, typename Step>
__device__ __forceinline__ void ForEachTailGroup(int32_t remaining, int32_t first, Step& step) {
  if constexpr (kRows > 0) {
    if (remaining >= kRows) {
      step(Group<kRows>{}, first);
      first += kRows;
      remaining -= kRows;
    }
    ForEachTailGroup<kRows / 2>(remaining, first, step);
  }
}

// Splits a run of `count` neighbours into groups whose rows are loaded together:
// step(Group<kMaxRows>{}, first) while kMaxRows are left, then exact smaller groups, so short
// runs (1 to 3 neighbours near the equator) compute no padding slots.
template <int kMaxRows, typename Step>
__device__ __forceinline__ void ForEachGroup(int32_t count, Step&& step) {
  int32_t t = 0;
  for (; t + kMaxRows <= count; t += kMaxRows) step(Group<kMaxRows>{}, t);
  ForEachTailGroup<kMaxRows / 2>(count - t, t, step);
}

// Calls body(local_row, local_col, batch, head) for the walking point of this team, if any
// (block order: BlockRowOf). The teams of a block take consecutive longitudes of one row and so
// read nearly the same neighbours (shared through L1). One point per team and no loop here:
// loop state live across the walk costs registers (spills at the forward's cap of 80). Padding
// points are passed too (the body writes their zeros).
template <typename Body>
__device__ __forceinline__ void ForTeamPoint(const NbhdAttnGpuParams& p, int32_t rows, int32_t cols, int team,
                                             int teams, Body&& body) {
  const int64_t col = int64_t{blockIdx.x} * teams + team;
  const BlockRow block = BlockRowOf(p);
  const int32_t heads = static_cast<int32_t>(p.heads);
  if (col >= cols || block.rank >= rows || block.batch_head >= p.batch * heads) return;
  const int32_t row = __ldg(p.row_order + block.rank);
  if (row < 0 || row >= rows) return;  // a bad row_order entry is skipped
  body(row, static_cast<int32_t>(col), block.batch_head / heads, block.batch_head % heads);
}

// Shared memory of one warp of a general kernel, in floats (0 for the vector kernels).
template <typename Ch>
__host__ __device__ constexpr int64_t WarpSharedWords(int64_t words) {
  return Ch::kUsesShared ? words : 0;
}

// ------------------------------------------------------------------ host: dispatch and launch

template <typename T, typename Ch>
struct Variant {
  using Element = T;
  using Channels = Ch;
};

// Calls launch(Variant<T, Ch>{}) with T the activation type and Ch the vector layout when
// Dk == Dv is 32, 64 or 128 and every activation and result is 16-byte aligned, else the
// general layout.
template <typename T, typename Launch>
cudaError_t DispatchHeadDims(const NbhdAttnGpuParams& p, bool aligned, Launch&& launch) {
  if (aligned && p.head_dim_k == p.head_dim_v) {
    switch (p.head_dim_k) {
      case 32: return launch(Variant<T, VectorChannels<T, 32>>{});
      case 64: return launch(Variant<T, VectorChannels<T, 64>>{});
      case 128: return launch(Variant<T, VectorChannels<T, 128>>{});
      default: break;
    }
  }
  return launch(Variant<T, GeneralChannels<T>>{});
}

template <typename Launch>
cudaError_t DispatchVariant(const NbhdAttnGpuParams& p, bool aligned, Launch&& launch) {
  switch (p.dtype) {
    case ActivationType::kF32: return DispatchHeadDims<float>(p, aligned, launch);
    case ActivationType::kBF16: return DispatchHeadDims<__nv_bfloat16>(p, aligned, launch);
    case ActivationType::kF16: return DispatchHeadDims<__half>(p, aligned, launch);
  }
  return cudaErrorInvalidValue;
}

// Launches `kernel` over every point of a walking grid with `rows` x `cols` local points per
// (batch, head). `warp_words` is the shared memory one warp of a general kernel needs.
template <typename Ch>
cudaError_t LaunchTeams(void (*kernel)(NbhdAttnGpuParams), cudaStream_t stream, const NbhdAttnGpuParams& p,
                        int32_t rows, int32_t cols, int64_t warp_words) {
  int threads = kVectorBlockThreads;
  size_t shared_bytes = 0;
  if (Ch::kUsesShared) {
    const int64_t warp_bytes = warp_words * static_cast<int64_t>(sizeof(float));
    const int64_t warps = warp_bytes == 0 ? kGeneralMaxWarps
                                          : std::min<int64_t>(kGeneralMaxWarps, kGeneralSharedBytes / warp_bytes);
    if (warps < 1) return cudaErrorInvalidValue;  // excluded by NbhdAttnHeadDimsSupported
    threads = static_cast<int>(32 * warps);
    shared_bytes = static_cast<size_t>(warps * warp_bytes);
  }
  const int teams = threads / Ch::kLanes;
  const int64_t tiles = (int64_t{cols} + teams - 1) / teams;
  return LaunchRowGrid(kernel, stream, p, rows, tiles, threads, shared_bytes);
}

}  // namespace gpu
}  // namespace s2attn
