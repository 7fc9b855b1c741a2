// Warp-specialised forward, dq and dk/dv prototype (experimental/ws_attention.sh builds and runs it): a
// tensor-map and wgmma design for the problem the tiled kernels solve, as a standalone program that times
// it and checks it against float64. A block walks 2-D tiles of one grid and a producer warp streams
// 32-point chunks of one row of the other as tensor-map boxes (no staging code in the warps that
// multiply), after each warpgroup's own tiles; kConsumers warpgroups multiply each chunk with wgmma (m64
// tiles, no ldmatrix) and run the masked softmax:
//   forward: walks queries (q), streams k, v: online softmax, O += P V;
//   dq:      walks queries (q, dout), streams k, v: P from lse, dS = P (dP - delta), dq += dS K;
//   dk/dv:   walks keys (k, v), streams q and dout (their lse and delta read directly): dv += P^T dO,
//            dk += dS^T Q.
// Tiles are 4 rows x 16 longitudes per warpgroup (warp w = row w), a block 4 rows x 16 kConsumers
// longitudes, every warpgroup reading the staged chunks of one streamed row (skipping chunks off its
// band).
//
// Self-attention on an equiangular grid, bf16, one head of 64 channels. Neighbourhoods follow the
// geodesic-disk rule through per-(query row, key row) half-widths in longitude computed here (the
// plan's rule without its epsilon; symmetric, so one table serves both walks); quadrature weights are
// positive stand-ins (timing does not depend on them). Every result is poisoned (NaN) before the run
// and must be written; out, lse and dq of sampled queries and dk, dv of sampled keys are checked
// against a float64 host reference (the backward from delta = sum(dout * out) of the kernel's own
// float32 out for dq, and the kernels' lse and that delta for dk/dv, as the op forms them). Standalone:
// not part of the package.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "bench_common.h"
#include "bench_reference.h"
#include "gpu/device_common.cuh"
#include "gpu/mbarrier_sm90.cuh"
#include "gpu/tma_sm90.cuh"
#include "gpu/wgmma_sm90.cuh"

namespace {

using s2attn::gpu::Exp2;
using s2attn::gpu::kLn2;
using s2attn::gpu::kLog2e;
using s2attn::gpu::MbarrierArrive;
using s2attn::gpu::MbarrierInit;
using s2attn::gpu::MbarrierInitFence;
using s2attn::gpu::MbarrierWait;
using s2attn::gpu::PackPair;
using s2attn::gpu::PackRemainder;
namespace sm90 = s2attn::gpu::sm90;
using namespace bench;  // T, kD, kScale, kRing and the float64 truth

// Build parameters: other shapes with -DWS_CONSUMERS=... -DWS_STAGES=... on the nvcc line;
// WS_MIN_BLOCKS (forward, dq) and WS_DKV_BLOCKS (dk/dv) ask for that many blocks per SM (with
// -maxrregcount where the schedulers' register files need it).
// The defaults are the fastest forward measured (docs/performance.md): one warpgroup per block, its
// queries in shared memory, 4 blocks per SM (95-96 registers).
#ifndef WS_CONSUMERS
#define WS_CONSUMERS 1
#endif
#ifndef WS_STAGES
#define WS_STAGES 4
#endif
#ifndef WS_MIN_BLOCKS
#define WS_MIN_BLOCKS 4
#endif
#ifndef WS_DKV_BLOCKS
#define WS_DKV_BLOCKS 2
#endif
constexpr int kChunk = 32;             // key longitudes per staged chunk
constexpr int kStages = WS_STAGES;
constexpr int kTileRows = 4;           // query rows of a block, one per warp of each warpgroup
constexpr int kGroupLons = 16;         // longitudes of a warpgroup's tile (4 x 16 = m64)
constexpr int kConsumers = WS_CONSUMERS;  // warpgroups per block
constexpr int kBlockLons = kGroupLons * kConsumers;
constexpr int kThreads = 128 * kConsumers + 32;  // and one producer warp
constexpr int kChunkBytes = kChunk * kD * 2;

// The three kernels. A block *walks* tiles of one grid (the queries for the forward and dq, the keys
// for dk/dv: self-attention, so both walks read the same half-widths) and *streams* chunks of the
// other: keys and values, or queries and dout (whose lse and delta dk/dv reads from global memory).
enum class Kind { kForward, kDq, kDkv };
__host__ __device__ constexpr int TilesOf(Kind kind) { return kind == Kind::kForward ? 1 : 2; }  // q; q, dout; k, v

// What the producer tells the consumers about a staged chunk (written before the stage's barrier).
struct ChunkInfo {
  int row;                  // streamed row; -1: the stream ended
  int lon;                  // longitude of the chunk's first column
  int valid;                // columns [0, valid) belong to the window part (the rest: zeros, or points past it)
  int reach;                // largest of half[]
  float bias;               // log2 of the streamed row's quadrature weight (the key's, when keys stream)
  int half[kTileRows];      // per walked row: longitudes each side of a point it sees (-1: none, kRing)
};

struct alignas(1024) Stage {
  T a[kChunk * kD];  // k (forward, dq) or q (dk/dv)
  T b[kChunk * kD];  // v (forward, dq) or dout (dk/dv)
};

// Operand tiles of a warpgroup's 64 walked points, staged once per block (TilesOf).
struct alignas(1024) PointTile {
  T rows[4 * kGroupLons * kD];  // walked row (warp) x longitude, as the tensor-map box lays them out
};

template <Kind kKind>
struct Shared {
  Stage stages[kStages];
  PointTile tiles[kConsumers][TilesOf(kKind)];
  ChunkInfo info[kStages];
  uint64_t full[kStages];
  uint64_t empty[kStages];
  uint64_t tiles_full;
};

// The tensor maps a kernel reads: its walked tiles and the streamed chunks.
struct Maps {
  CUtensorMap tiles[2];
  CUtensorMap a, b;
};

struct Problem {
  int nlat, nlon;
  float* out;            // [nlat, nlon, kD]: the forward's result
  float* lse;            // [nlat, nlon], natural log: the forward's result, dq's and dk/dv's operand
  const float* delta;    // [nlat, nlon]: sum(dout * out) per query, dq's and dk/dv's operand
  float* dq;             // [nlat, nlon, kD]: dq's result
  float* dk;             // [nlat, nlon, kD]: dk/dv's results
  float* dv;
  const int* half;       // [nlat, nlat]: half-width of query row i on key row j (-1: none, kRing); symmetric
  const int* key_rows;   // [blocks along latitude, 2]: first and last row the block's walked rows see
  const float* bias;     // [nlat]: log2 of the quadrature weights
  float scale;           // softmax scale
  float scale_log2;      // softmax scale times log2(e)
};

// A longitude difference x in [-1.5 nlon, 1.5 nlon) brought into [-nlon / 2, nlon / 2).
__host__ __device__ __forceinline__ int WrapDifference(int x, int nlon) {
  if (x >= nlon / 2) x -= nlon;
  if (x < -nlon / 2) x += nlon;
  return x;
}

// The window of a block whose first longitude is first_lon on a key row seen up to `reach` longitudes
// each side: the union of its queries' arcs, as at most two parts [begin, end) cut at longitude 0.
struct Window {
  int count = 1;
  int parts[2][2];
};

__host__ __device__ inline Window WindowOf(int first_lon, int reach, int nlon) {
  Window w;
  const int lo = first_lon - reach, hi = first_lon + kBlockLons + reach;
  if (hi - lo >= nlon) {
    w.parts[0][0] = 0, w.parts[0][1] = nlon;
  } else if (lo < 0) {
    w.parts[0][0] = lo + nlon, w.parts[0][1] = nlon, w.parts[1][0] = 0, w.parts[1][1] = hi, w.count = 2;
  } else if (hi > nlon) {
    w.parts[0][0] = lo, w.parts[0][1] = nlon, w.parts[1][0] = 0, w.parts[1][1] = hi - nlon, w.count = 2;
  } else {
    w.parts[0][0] = lo, w.parts[0][1] = hi;
  }
  return w;
}

// Whether the chunk of `valid` columns from longitude `lon` meets the band of the warpgroup whose first
// longitude is group_lon (bands close to the whole ring are taken whole: the test does not see them wrap).
__host__ __device__ inline bool Touches(int lon, int valid, int reach, int group_lon, int nlon) {
  const int offset = WrapDifference(lon - group_lon, nlon);
  return group_lon < nlon && (2 * reach + kGroupLons + 2 * kChunk >= nlon ||
                              (offset + valid - 1 >= -reach && offset <= kGroupLons - 1 + reach));
}

struct StagePosition {
  int stage = 0;
  uint32_t phase = 0;
  __device__ void Advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// One thread: the warpgroups' walked tiles (TilesOf boxes each), then every chunk of every streamed row
// the block's walked rows see, in row order (the half-width table is symmetric: self-attention). A row's
// window is the union of the block's arcs, cut at longitude 0 into at most two parts, each staged from
// its start in chunks (boxes past nlon are zero-filled by the copy engine and marked invalid).
template <Kind kKind>
__device__ void Produce(const Problem& p, const Maps& maps, Shared<kKind>& s) {
  constexpr int kTiles = TilesOf(kKind);
  const int first_query_row = blockIdx.y * kTileRows, first_lon = blockIdx.x * kBlockLons;
  sm90::MbarrierArriveExpectBytes(&s.tiles_full, kConsumers * kTiles * sizeof(PointTile));
  for (int group = 0; group < kConsumers; ++group) {
    for (int i = 0; i < kTiles; ++i) {
      sm90::LoadBox3d(s.tiles[group][i].rows, &maps.tiles[i], 0, first_lon + group * kGroupLons, first_query_row,
                      &s.tiles_full);
    }
  }
  StagePosition at;
  for (int row = p.key_rows[2 * blockIdx.y]; row <= p.key_rows[2 * blockIdx.y + 1]; ++row) {
    ChunkInfo info;
    info.row = row;
    info.bias = p.bias[row];
    info.reach = -1;
    for (int r = 0; r < kTileRows; ++r) {
      const int query_row = first_query_row + r;
      info.half[r] = query_row < p.nlat ? p.half[query_row * p.nlat + row] : -1;
      info.reach = max(info.reach, info.half[r]);
    }
    if (info.reach < 0) continue;
    const Window window = WindowOf(first_lon, info.reach, p.nlon);
    for (int part = 0; part < window.count; ++part) {
      const int end = window.parts[part][1];
      for (int lon = window.parts[part][0]; lon < end; lon += kChunk) {
        MbarrierWait(&s.empty[at.stage], at.phase ^ 1);
        info.lon = lon;
        info.valid = min(kChunk, end - lon);
        s.info[at.stage] = info;
        Stage& stage = s.stages[at.stage];
        sm90::MbarrierArriveExpectBytes(&s.full[at.stage], 2 * kChunkBytes);
        sm90::LoadBox3d(stage.a, &maps.a, 0, lon, row, &s.full[at.stage]);
        sm90::LoadBox3d(stage.b, &maps.b, 0, lon, row, &s.full[at.stage]);
        at.Advance();
      }
    }
  }
  MbarrierWait(&s.empty[at.stage], at.phase ^ 1);
  s.info[at.stage].row = -1;
  MbarrierArrive(&s.full[at.stage]);
}

// Every staged chunk in order, `multiply(stage, info)` for those that meet the warpgroup's band; every
// thread releases every stage (the ordering compute-sanitizer's racecheck models; one arrival per warp
// after __syncwarp is as fast, but racecheck then reports the other lanes' reads of the chunk's
// description as racing with its next write).
template <Kind kKind, typename Multiply>
__device__ void ForEachChunk(const Problem& p, Shared<kKind>& s, int group_lon, Multiply&& multiply) {
  StagePosition at;
  for (;;) {
    MbarrierWait(&s.full[at.stage], at.phase);
    const ChunkInfo& info = s.info[at.stage];
    if (info.row < 0) break;
    if (Touches(info.lon, info.valid, info.reach, group_lon, p.nlon)) multiply(s.stages[at.stage], info);
    MbarrierArrive(&s.empty[at.stage]);
    at.Advance();
  }
}

// The score tile's element e of a thread: row half (e >> 1) & 1 (query lons[h]), chunk column n.
__device__ __forceinline__ int ColumnOf(int e, int t) { return 8 * (e / 4) + 2 * t + (e % 2); }

// How a chunk meets the arcs of a warp's 16 walked points (the same for all its lanes).
enum class Cover {
  kNone,     // no column in any arc: every logit would be -inf
  kPartial,  // tested per element
  kFull,     // all kChunk columns valid and in every arc: no test
};

// The thread's logits of a chunk in log2 units, scale_log2 * s + offset[h], and -inf off the arcs of its
// two queries: column n is in the arc of the query at lons[h] iff |start + n| <= half, i.e. in
// [first, first + count), except where an arc comes within a chunk of the whole ring and start + n must
// be wrapped once more per column (half is the warp's: a uniform branch, kept outside the element loop,
// where it costs 1.8x). Returns the warp's cover; with kNone, scores are left as they are. The
// per-element test runs only where the cover is partial (55 % of warp-chunks at 721x1440 tc 0.03,
// 36 % at the default cutoff).
__device__ __forceinline__ Cover ArcLogits(float (&scores)[kChunk / 2], const ChunkInfo& info, int half,
                                           const int (&lons)[2], int t, int nlon, float scale_log2,
                                           const float (&offset)[2]) {
  const bool near_ring = half >= 0 && half > nlon / 2 - kChunk;
  // The chunk's first column relative to the query at lons[h], and [first, first + count): its columns
  // in that arc unless near_ring. (Recomputed for the per-element test rather than held across the
  // votes: with all six values held, dq spills 60 bytes.)
  struct Arc {
    int start, first, count;
  };
  const auto arc_of = [&](int h) {
    Arc a;
    a.start = WrapDifference(info.lon - lons[h], nlon);
    a.first = max(0, -half - a.start);
    a.count = max(0, min(info.valid, half - a.start + 1) - a.first);
    return a;
  };
  const int count[2] = {arc_of(0).count, arc_of(1).count};
  // A whole ring's half-width makes first 0 and count the chunk's valid columns; other near-ring arcs
  // are always tested.
  const bool count_is_exact = !near_ring || half >= kRing;
  if (__all_sync(0xffffffffu, count_is_exact && count[0] == kChunk && count[1] == kChunk)) {
#pragma unroll
    for (int e = 0; e < kChunk / 2; ++e) scores[e] = fmaf(scores[e], scale_log2, offset[(e >> 1) & 1]);
    return Cover::kFull;
  }
  if (__all_sync(0xffffffffu, !near_ring && count[0] == 0 && count[1] == 0)) return Cover::kNone;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const Arc a = arc_of(h);
    const auto keep = [&](int e, bool in_arc) {
      scores[e] = in_arc ? fmaf(scores[e], scale_log2, offset[h]) : -INFINITY;
    };
    if (near_ring) {
#pragma unroll
      for (int e = 2 * h; e < kChunk / 2; e += (e % 2 == 0 ? 1 : 3)) {
        const int n = ColumnOf(e, t);
        const int distance = a.start + n - (a.start + n >= nlon / 2 ? nlon : 0);
        keep(e, n < info.valid && unsigned(distance + half) <= unsigned(2 * half));
      }
    } else {
#pragma unroll
      for (int e = 2 * h; e < kChunk / 2; e += (e % 2 == 0 ? 1 : 3)) {
        keep(e, unsigned(ColumnOf(e, t) - a.first) < unsigned(a.count));
      }
    }
  }
  return Cover::kPartial;
}

// The A fragments of a score tile (columns 16 kk .. 16 kk + 15 of the accumulator) as kParts parts:
// rounded to T, then, when kParts is 2, what that rounding left, rounded to T again (about twice T's
// bits: the forward's P, as in the module's forward, whose out is delta's residual).
template <int kParts>
__device__ __forceinline__ void PackTile(uint32_t (&a)[kParts][kChunk / 16][4], const float (&x)[kChunk / 2]) {
  static_assert(kParts == 1 || kParts == 2, "one or two parts");
#pragma unroll
  for (int kk = 0; kk < kChunk / 16; ++kk) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float lo = x[8 * kk + 2 * i], hi = x[8 * kk + 2 * i + 1];
      a[0][kk][i] = PackPair<T>(lo, hi);
      if constexpr (kParts == 2) a[1][kk][i] = PackRemainder<T>(lo, hi, a[0][kk][i]);
    }
  }
}

// S = A B^T of the chunk (4 k16 steps) for a walked tile `tile` and the staged rows `chunk`.
__device__ __forceinline__ void MultiplyTransposed(float (&d)[kChunk / 2], const PointTile& tile, const T* chunk) {
  const uint64_t a = sm90::SwizzledTileDescriptor(tile.rows), b = sm90::SwizzledTileDescriptor(chunk);
#pragma unroll
  for (int ks = 0; ks < kD / 16; ++ks) {
    sm90::WgmmaM64N32K16SharedA<T>(d, sm90::DescriptorPlus(a, 2 * ks), sm90::DescriptorPlus(b, 2 * ks), ks > 0);
  }
}

// The backward's two products of a chunk, completed: S = tiles[0] a^T and dP = tiles[1] b^T (dq: Q K^T and
// dO V^T; dk/dv: K Q^T and V dO^T).
__device__ __forceinline__ void MultiplyBackward(float (&scores)[kChunk / 2], float (&dp)[kChunk / 2],
                                                 const PointTile (&tiles)[2], const Stage& stage) {
  sm90::WgmmaFence();
  MultiplyTransposed(scores, tiles[0], stage.a);
  MultiplyTransposed(dp, tiles[1], stage.b);
  sm90::WgmmaCommit();
  sm90::WgmmaWait<0>();
  sm90::FenceRegisters(scores);
  sm90::FenceRegisters(dp);
}

// Issues d += A B for the A fragments of a chunk's score tile (PackTile's parts, summed) and the staged
// rows `b` (keys = k; MN-major) as one wgmma group: d and a stay the wgmmas' until a wait completes it.
template <int kParts>
__device__ __forceinline__ void IssueAccumulate(float (&d)[kD / 2], const uint32_t (&a)[kParts][kChunk / 16][4],
                                                const T* b) {
  const uint64_t rows = sm90::SwizzledTileDescriptor(b);
  sm90::FenceRegisters(d);
  sm90::WgmmaFence();
#pragma unroll
  for (int kk = 0; kk < kChunk / 16; ++kk) {
#pragma unroll
    for (int part = 0; part < kParts; ++part) {
      sm90::WgmmaM64N64K16<T, 1>(d, a[part][kk], sm90::DescriptorPlus(rows, 128 * kk), 1);
    }
  }
  sm90::WgmmaCommit();
}

// d += A B, completed.
template <int kParts>
__device__ __forceinline__ void AccumulateTile(float (&d)[kD / 2], const uint32_t (&a)[kParts][kChunk / 16][4],
                                               const T* b) {
  IssueAccumulate(d, a, b);
  sm90::WgmmaWait<0>();
  sm90::FenceRegisters(d);
}

// The thread's place in its warpgroup's tile.
struct TilePosition {
  int warp, t, query_row, group_lon;
  int lons[2];  // of the thread's two accumulator rows
  __device__ TilePosition(int group) {
    warp = (threadIdx.x / 32) % 4;
    const int lane = threadIdx.x % 32;
    t = lane % 4;
    query_row = blockIdx.y * kTileRows + warp;
    group_lon = blockIdx.x * kBlockLons + group * kGroupLons;
    lons[0] = group_lon + lane / 4, lons[1] = group_lon + lane / 4 + 8;
  }
  __device__ bool Writes(int nlat, int nlon) const { return query_row < nlat && group_lon < nlon; }
};

// Stores the thread's part of a 64 x kD accumulator tile times `factor[h]` into [nlat, nlon, kD] rows.
__device__ __forceinline__ void StoreTile(float* out, const float (&d)[kD / 2], const float (&factor)[2],
                                          const TilePosition& at, int nlon) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const size_t point = size_t(at.query_row) * nlon + at.lons[h];
#pragma unroll
    for (int j = 0; j < kD / 8; ++j) {
      const float2 pair = make_float2(d[4 * j + 2 * h] * factor[h], d[4 * j + 2 * h + 1] * factor[h]);
      *reinterpret_cast<float2*>(out + point * kD + 8 * j + 2 * at.t) = pair;
    }
  }
}

// The online softmax of a chunk's logits (log2 units, -inf off the arcs) in place, scores becoming P:
// the row maxima m and sums l move on, and o is rescaled when a maximum of the warp moved.
__device__ __forceinline__ void OnlineSoftmax(float (&scores)[kChunk / 2], float (&m)[2], float (&l)[2],
                                              float (&o)[kD / 2]) {
  float correction[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float row_max = -INFINITY;
#pragma unroll
    for (int e = 2 * h; e < kChunk / 2; e += (e % 2 == 0 ? 1 : 3)) row_max = fmaxf(row_max, scores[e]);
    row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 1));
    row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 2));
    const float m_new = fmaxf(m[h], row_max);
    const float base = m_new == -INFINITY ? 0.f : m_new;  // no -inf - -inf
    correction[h] = Exp2(m[h] - base);
    m[h] = m_new;
    l[h] *= correction[h];
#pragma unroll
    for (int e = 2 * h; e < kChunk / 2; e += (e % 2 == 0 ? 1 : 3)) {
      scores[e] = Exp2(scores[e] - base);
      l[h] += scores[e];
    }
  }
  // O is rescaled only when some row of the warp has a new maximum (otherwise every correction is
  // exactly 1): the same bits, without 32 multiplies per chunk once the maxima settle.
  if (__any_sync(0xffffffffu, correction[0] != 1.f || correction[1] != 1.f)) {
#pragma unroll
    for (int e = 0; e < kD / 2; ++e) o[e] *= correction[(e >> 1) & 1];
  }
}

// Zero probabilities or score gradients for a warp whose queries see none of the chunk: the results the
// masked path gives (every exponential 0; maxima, sums and O unchanged), bit for bit (a masked score
// gradient could be -0 there: the same sums).
__device__ __forceinline__ void Clear(float (&x)[kChunk / 2]) {
#pragma unroll
  for (int e = 0; e < kChunk / 2; ++e) x[e] = 0.f;
}

// The forward of a consumer warpgroup: per chunk S = Q K^T, the masked online softmax in registers,
// O += P V with P from the S registers; out and lse at the end.
__device__ void ConsumeForward(const Problem& p, Shared<Kind::kForward>& s, int group) {
  const TilePosition at(group);
  MbarrierWait(&s.tiles_full, 0);
  float o[kD / 2] = {}, m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, scores[kChunk / 2];
  ForEachChunk(p, s, at.group_lon, [&](const Stage& stage, const ChunkInfo& info) {
    sm90::WgmmaFence();
    MultiplyTransposed(scores, s.tiles[group][0], stage.a);
    sm90::WgmmaCommit();
    sm90::WgmmaWait<0>();
    sm90::FenceRegisters(scores);
    if (ArcLogits(scores, info, info.half[at.warp], at.lons, at.t, p.nlon, p.scale_log2,
                  {info.bias, info.bias}) == Cover::kNone) {
      Clear(scores);
    } else {
      OnlineSoftmax(scores, m, l, o);
    }
    uint32_t pv[2][kChunk / 16][4];  // P in two parts: out is delta's residual
    PackTile(pv, scores);
    AccumulateTile(o, pv, stage.b);
  });
  if (!at.Writes(p.nlat, p.nlon)) return;
  float inverse[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    inverse[h] = l[h] > 0.f ? 1.f / l[h] : 0.f;
    if (at.t == 0) {
      p.lse[size_t(at.query_row) * p.nlon + at.lons[h]] =
          l[h] > 0.f ? (m[h] + log2f(l[h])) * kLn2 : -INFINITY;
    }
  }
  StoreTile(p.out, o, inverse, at, p.nlon);
}

// dq of a consumer warpgroup: per chunk S = Q K^T and dP = dO V^T, P = exp(S - lse) on the arcs,
// dS = P (dP - delta), dq += dS K (K's staged rows taken MN-major); dq times the scale at the end.
__device__ void ConsumeDq(const Problem& p, Shared<Kind::kDq>& s, int group) {
  const TilePosition at(group);
  float lse_log2[2] = {0.f, 0.f}, delta[2] = {0.f, 0.f};
  if (at.Writes(p.nlat, p.nlon)) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const size_t point = size_t(at.query_row) * p.nlon + at.lons[h];
      lse_log2[h] = p.lse[point] * kLog2e;
      delta[h] = p.delta[point];
    }
  }
  MbarrierWait(&s.tiles_full, 0);
  float dq[kD / 2] = {}, scores[kChunk / 2], dp[kChunk / 2];
  ForEachChunk(p, s, at.group_lon, [&](const Stage& stage, const ChunkInfo& info) {
    MultiplyBackward(scores, dp, s.tiles[group], stage);
    if (ArcLogits(scores, info, info.half[at.warp], at.lons, at.t, p.nlon, p.scale_log2,
                  {info.bias - lse_log2[0], info.bias - lse_log2[1]}) == Cover::kNone) {
      Clear(scores);
    } else {
#pragma unroll
      for (int e = 0; e < kChunk / 2; ++e) scores[e] = Exp2(scores[e]) * (dp[e] - delta[(e >> 1) & 1]);
    }
    uint32_t ds[1][kChunk / 16][4];
    PackTile(ds, scores);
    AccumulateTile(dq, ds, stage.a);
  });
  if (at.Writes(p.nlat, p.nlon)) StoreTile(p.dq, dq, {p.scale, p.scale}, at, p.nlon);
}

// dk and dv of a consumer warpgroup walking 4 x 16 keys: per chunk of 32 queries S^T = K Q^T and
// dP^T = V dO^T, P^T = exp2(S^T + key weight - lse) on the arcs, dS^T = P^T (dP^T - delta), then
// dv += P^T dO and dk += dS^T Q (the staged query rows MN-major); dk times the scale at the end.
__device__ void ConsumeDkv(const Problem& p, Shared<Kind::kDkv>& s, int group) {
  const TilePosition at(group);  // rows: key rows, lons: key longitudes
  const float key_bias = at.query_row < p.nlat ? p.bias[at.query_row] : 0.f;
  MbarrierWait(&s.tiles_full, 0);
  float dk[kD / 2] = {}, dv[kD / 2] = {}, scores[kChunk / 2], dp[kChunk / 2];
  ForEachChunk(p, s, at.group_lon, [&](const Stage& stage, const ChunkInfo& info) {
    // The lse and delta of the thread's 8 query columns, read before the products to hide their latency
    // (a tensor-map box of them faults on the H200 as an illegal instruction, cause unknown).
    float lse_log2[kChunk / 4], delta[kChunk / 4];
#pragma unroll
    for (int i = 0; i < kChunk / 4; ++i) {
      const int lon = info.lon + ColumnOf(4 * (i / 2) + i % 2, at.t);
      const size_t point = size_t(info.row) * p.nlon + (lon >= p.nlon ? lon - p.nlon : lon);
      lse_log2[i] = __ldg(p.lse + point) * kLog2e;
      delta[i] = __ldg(p.delta + point);
    }
    MultiplyBackward(scores, dp, s.tiles[group], stage);
    if (ArcLogits(scores, info, info.half[at.warp], at.lons, at.t, p.nlon, p.scale_log2,
                  {key_bias, key_bias}) == Cover::kNone) {
      Clear(scores);
      Clear(dp);
    } else {
#pragma unroll
      for (int e = 0; e < kChunk / 2; ++e) {
        const int i = 2 * (e / 4) + e % 2;  // the column's place among the thread's 8
        // (A query without neighbours has lse -inf: -inf - -inf must give 0, not NaN.)
        const float logit = scores[e];
        scores[e] = logit == -INFINITY ? 0.f : Exp2(logit - lse_log2[i]);
        dp[e] = scores[e] * (dp[e] - delta[i]);
      }
    }
    // Both products in flight together, one wait (faster than a wait each: docs/performance.md).
    uint32_t probabilities[1][kChunk / 16][4], score_gradients[1][kChunk / 16][4];
    PackTile(probabilities, scores);
    IssueAccumulate(dv, probabilities, stage.b);
    PackTile(score_gradients, dp);
    IssueAccumulate(dk, score_gradients, stage.a);
    sm90::WgmmaWait<0>();
    sm90::FenceRegisters(dv);
    sm90::FenceRegisters(dk);
  });
  if (!at.Writes(p.nlat, p.nlon)) return;
  StoreTile(p.dk, dk, {p.scale, p.scale}, at, p.nlon);
  StoreTile(p.dv, dv, {1.f, 1.f}, at, p.nlon);
}

// The forward, dq or dk/dv: one producer warp after the consumer warpgroups. dk/dv holds two
// accumulators (168 registers): WS_DKV_BLOCKS (2) blocks per SM, not WS_MIN_BLOCKS (at 3 it spills 224
// bytes).
template <Kind kKind>
__global__ void __launch_bounds__(kThreads, kKind == Kind::kDkv ? WS_DKV_BLOCKS : WS_MIN_BLOCKS)
    WarpSpecialised(Problem p, const __grid_constant__ Maps maps) {
  // Rounded up to the swizzled tiles' 1024-byte alignment by pointer arithmetic on the shared array, so
  // that the compiler knows every read of s is a shared one (an integer round trip makes them generic
  // loads with 64-bit addresses).
  auto* base = reinterpret_cast<unsigned char*>(s2attn::gpu::DynamicShared());
  base += (1024 - reinterpret_cast<uintptr_t>(base) % 1024) % 1024;
  auto& s = *reinterpret_cast<Shared<kKind>*>(base);
  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      MbarrierInit(&s.full[i], 1);
      MbarrierInit(&s.empty[i], 128 * kConsumers);
    }
    MbarrierInit(&s.tiles_full, 1);
    MbarrierInitFence();
  }
  __syncthreads();
  const int warp = threadIdx.x / 32;
  if (warp == 4 * kConsumers) {
    if (threadIdx.x % 32 == 0) Produce<kKind>(p, maps, s);
  } else if constexpr (kKind == Kind::kForward) {
    ConsumeForward(p, s, warp / 4);
  } else if constexpr (kKind == Kind::kDq) {
    ConsumeDq(p, s, warp / 4);
  } else {
    ConsumeDkv(p, s, warp / 4);
  }
}

// ------------------------------------------------------------------------------------------ host

bool Run(const Config& config, EncodeTiled encode, int reps) {
  const int nlat = config.nlat, nlon = config.nlon;
  if (nlon % kGroupLons != 0) {  // a warpgroup's 16 longitudes are written whole
    std::printf("%s: nlon %d is not a multiple of %d\n", config.name, nlon, kGroupLons);
    return false;
  }
  const size_t points = size_t(nlat) * nlon;
  std::mt19937 rng(1234);
  const Inputs in = MakeInputs(config, rng);
  const int row_blocks = (nlat + kTileRows - 1) / kTileRows;
  std::vector<int> key_rows(2 * row_blocks);
  for (int b = 0; b < row_blocks; ++b) {
    const RowSpan span = SpanOfRows(in, b * kTileRows, kTileRows);
    key_rows[2 * b] = span.first, key_rows[2 * b + 1] = span.last;
  }
  std::vector<float> bias(nlat);
  for (int j = 0; j < nlat; ++j) bias[j] = std::log2(in.weight[j]);
  const std::vector<T>* operands[4] = {&in.q, &in.k, &in.v, &in.dout};
  T* device[4];
  for (int i = 0; i < 4; ++i) CHECK_CUDA(Upload(*operands[i], &device[i]));
  float *out, *lse, *delta, *dq, *dk, *dv, *dbias;
  int *dhalf, *dkey_rows;
  for (float** x : {&out, &dq, &dk, &dv}) CHECK_CUDA(cudaMalloc(x, points * kD * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&lse, points * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&delta, points * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&dhalf, in.half.size() * sizeof(int)));
  CHECK_CUDA(cudaMalloc(&dkey_rows, key_rows.size() * sizeof(int)));
  CHECK_CUDA(cudaMalloc(&dbias, nlat * sizeof(float)));
  CHECK_CUDA(cudaMemcpy(dhalf, in.half.data(), in.half.size() * sizeof(int), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dkey_rows, key_rows.data(), key_rows.size() * sizeof(int), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dbias, bias.data(), nlat * sizeof(float), cudaMemcpyHostToDevice));
  // Maps: tiles (boxes of a warpgroup's 4 x 16 points) and chunks (32 points of a row) of q, k, v, dout.
  enum Operand { kQ, kK, kV, kDout };
  CUtensorMap tiles[4], chunk_maps[4];
  const cuuint32_t element_strides[3] = {1, 1, 1};
  for (int i = 0; i < 4; ++i) {
    const cuuint64_t dims[3] = {kD, cuuint64_t(nlon), cuuint64_t(nlat)};
    const cuuint64_t strides[2] = {kD * sizeof(T), nlon * kD * sizeof(T)};
    const cuuint32_t tile_box[3] = {kD, kGroupLons, kTileRows}, chunk_box[3] = {kD, kChunk, 1};
    for (auto [map, box] : {std::pair{&tiles[i], tile_box}, std::pair{&chunk_maps[i], chunk_box}}) {
      if (encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, device[i], dims, strides, box, element_strides,
                 CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                 CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
        std::printf("cuTensorMapEncodeTiled failed\n");
        return false;
      }
    }
  }
  Maps maps[3] = {{{tiles[kQ], tiles[kQ]}, chunk_maps[kK], chunk_maps[kV]},      // forward
                  {{tiles[kQ], tiles[kDout]}, chunk_maps[kK], chunk_maps[kV]},   // dq
                  {{tiles[kK], tiles[kV]}, chunk_maps[kQ], chunk_maps[kDout]}};  // dk/dv
  Problem problem{nlat, nlon, out, lse, delta, dq, dk, dv, dhalf, dkey_rows, dbias, kScale, kScale * kLog2e};
  const int shared_forward = sizeof(Shared<Kind::kForward>) + 1024;
  static_assert(sizeof(Shared<Kind::kDq>) == sizeof(Shared<Kind::kDkv>), "dq and dk/dv: two tiles per warpgroup");
  const int shared_backward = sizeof(Shared<Kind::kDq>) + 1024;
  CHECK_CUDA(cudaFuncSetAttribute(WarpSpecialised<Kind::kForward>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  shared_forward));
  CHECK_CUDA(cudaFuncSetAttribute(WarpSpecialised<Kind::kDq>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  shared_backward));
  CHECK_CUDA(cudaFuncSetAttribute(WarpSpecialised<Kind::kDkv>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  shared_backward));
  const dim3 grid((nlon + kBlockLons - 1) / kBlockLons, row_blocks);
  // Launched through cudaLaunchKernel (not <<< >>>), so that the program also builds for the host
  // emulation of tests/cuda_emulation.
  void* args[3][2] = {{&problem, &maps[0]}, {&problem, &maps[1]}, {&problem, &maps[2]}};
  const auto forward = [&] {
    return cudaLaunchKernel(WarpSpecialised<Kind::kForward>, grid, dim3(kThreads), args[0], shared_forward, 0);
  };
  const auto backward_dq = [&] {
    return cudaLaunchKernel(WarpSpecialised<Kind::kDq>, grid, dim3(kThreads), args[1], shared_backward, 0);
  };
  const auto backward_dkv = [&] {
    return cudaLaunchKernel(WarpSpecialised<Kind::kDkv>, grid, dim3(kThreads), args[2], shared_backward, 0);
  };

  // The forward, then delta = sum(dout * out) from its out (float32, as the op forms it), then dq and
  // dk/dv; every result poisoned (NaN) first.
  for (float* x : {out, dq, dk, dv}) CHECK_CUDA(cudaMemset(x, 0xff, points * kD * sizeof(float)));
  CHECK_CUDA(cudaMemset(lse, 0xff, points * sizeof(float)));
  CHECK_CUDA(forward());
  std::vector<float> got_out(points * kD), got_lse(points), host_delta(points);
  std::vector<float> got_dq(points * kD), got_dk(points * kD), got_dv(points * kD);
  CHECK_CUDA(cudaMemcpy(got_out.data(), out, got_out.size() * sizeof(float), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(got_lse.data(), lse, got_lse.size() * sizeof(float), cudaMemcpyDeviceToHost));
  for (size_t point = 0; point < points; ++point) {
    double sum = 0;
    for (int d = 0; d < kD; ++d) sum += double(__bfloat162float(in.dout[point * kD + d])) * got_out[point * kD + d];
    host_delta[point] = float(sum);
  }
  CHECK_CUDA(cudaMemcpy(delta, host_delta.data(), points * sizeof(float), cudaMemcpyHostToDevice));
  CHECK_CUDA(backward_dq());
  CHECK_CUDA(backward_dkv());
  CHECK_CUDA(cudaMemcpy(got_dq.data(), dq, got_dq.size() * sizeof(float), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(got_dk.data(), dk, got_dk.size() * sizeof(float), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(got_dv.data(), dv, got_dv.size() * sizeof(float), cudaMemcpyDeviceToHost));
  const size_t unwritten =
      CountNaN(got_out) + CountNaN(got_lse) + CountNaN(got_dq) + CountNaN(got_dk) + CountNaN(got_dv);

  // float64 truth of sampled queries (one on each pole row among them) and of sampled keys (their
  // gradients from the kernels' own lse and delta, as the backward takes them).
  Check out_check, dq_check, dk_check, dv_check;
  double lse_error = 0;
  std::uniform_int_distribution<int> any_row(0, nlat - 1), any_lon(0, nlon - 1);
  for (int sample = 0; sample < 1000; ++sample) {
    const int i = sample < 2 ? (nlat - 1) * sample : any_row(rng), lon = any_lon(rng);
    const QueryTruth truth = Truth(in, i, lon);
    const size_t point = size_t(i) * nlon + lon;
    out_check.Add(i, lon, truth.out, &got_out[point * kD]);
    dq_check.Add(i, lon, truth.dq, &got_dq[point * kD]);
    lse_error = std::max(lse_error, std::fabs(truth.lse - got_lse[point]));
  }
  for (int sample = 0; sample < 300; ++sample) {
    const int j = sample < 2 ? (nlat - 1) * sample : any_row(rng), lon = any_lon(rng);
    const KeyTruth truth = TruthOfKey(in, got_lse, host_delta, j, lon);
    const size_t point = size_t(j) * nlon + lon;
    dk_check.Add(j, lon, truth.dk, &got_dk[point * kD]);
    dv_check.Add(j, lon, truth.dv, &got_dv[point * kD]);
  }
  const Check* checks[4] = {&out_check, &dq_check, &dk_check, &dv_check};
  const char* names[4] = {"out", "dq", "dk", "dv"};
  bool correct = unwritten == 0 && lse_error <= 1e-3;
  // out far inside the 16-bit bar: dq's delta is formed from it (the forward's P in two parts).
  for (const Check* c : checks) correct = correct && c->Relative() <= (c == &out_check ? 1e-4 : 1e-2);

  // Work the stream does (the producer's loop and the consumers' test replayed): chunks staged, chunks
  // multiplied by a warpgroup, and the neighbour pairs among the latter's 64 x kChunk products.
  long long chunks = 0, multiplied = 0, pairs = 0;
  for (int b = 0; b < row_blocks; ++b) {
    for (int j = key_rows[2 * b]; j <= key_rows[2 * b + 1]; ++j) {
      int reach = -1;
      for (int i = b * kTileRows; i < std::min(nlat, (b + 1) * kTileRows); ++i) {
        const int h = in.half[size_t(i) * nlat + j];
        reach = std::max(reach, h);
        if (h >= 0) pairs += (long long)nlon * (h >= kRing ? nlon : 2 * h + 1);
      }
      if (reach < 0) continue;
      for (int first_lon = 0; first_lon < nlon; first_lon += kBlockLons) {
        const Window window = WindowOf(first_lon, reach, nlon);
        for (int part = 0; part < window.count; ++part) {
          for (int lon = window.parts[part][0]; lon < window.parts[part][1]; lon += kChunk) {
            ++chunks;
            for (int group = 0; group < kConsumers; ++group) {
              const int valid = std::min(kChunk, window.parts[part][1] - lon);
              multiplied += Touches(lon, valid, reach, first_lon + group * kGroupLons, nlon);
            }
          }
        }
      }
    }
  }

  double ms[3], fastest[3];
  if (!MedianMs(reps, forward, &ms[0], &fastest[0]) || !MedianMs(reps, backward_dq, &ms[1], &fastest[1]) ||
      !MedianMs(reps, backward_dkv, &ms[2], &fastest[2])) {
    return false;
  }
  std::printf("%-14s %4dx%-5d cutoff %.5f: forward %.3f ms (min %.3f), dq %.3f (%.3f), dk/dv %.3f (%.3f) | "
              "pairs %.3g, chunks %.3g, warpgroup-chunks %.3g, useful %.2f | unwritten %zu, lse abs %.1e, rel out "
              "%.1e dq %.1e dk %.1e dv %.1e %s\n",
              config.name, nlat, nlon, config.cutoff, ms[0], fastest[0], ms[1], fastest[1], ms[2], fastest[2],
              double(pairs), double(chunks), double(multiplied), double(pairs) / (double(multiplied) * 64 * kChunk),
              unwritten, lse_error, out_check.Relative(), dq_check.Relative(), dk_check.Relative(),
              dv_check.Relative(), correct ? "ok" : "WRONG");
  for (int c = 0; c < 4 && !correct; ++c) {
    std::printf("  worst %s: row %d lon %d channel %d: %.6f expected, %.6f written\n", names[c], checks[c]->row,
                checks[c]->lon, checks[c]->channel, checks[c]->expected, checks[c]->written);
  }
  for (T* x : device) CHECK_CUDA(cudaFree(x));
  for (float* x : {out, lse, delta, dq, dk, dv, dbias}) CHECK_CUDA(cudaFree(x));
  CHECK_CUDA(cudaFree(dhalf));
  CHECK_CUDA(cudaFree(dkey_rows));
  return correct;
}

// Without arguments: every config, timed. `--once`: the smallest config, the checked launches and one
// timed each (for compute-sanitizer). `--tiny`: small grids that cross longitude 0, touch the poles and
// see whole rings, one launch each (for the host emulation, tests/test_experimental.py).
bool Main(const std::string& mode) {
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs; block of %d threads (%d consumer warpgroups), %d stages of %d key columns\n", prop.name,
              prop.multiProcessorCount, kThreads, kConsumers, kStages, kChunk);
  const EncodeTiled encode = FindEncodeTiled();
  if (encode == nullptr) return false;
  const double pi = 3.14159265358979323846;
  const Config configs[] = {{"qdeg_tc003", 721, 1440, 0.03},
                            {"qdeg_default", 721, 1440, pi / 720},
                            {"hdeg_tc003", 360, 720, 0.03}};
  const Config tiny[] = {{"tiny_wide", 11, 32, 0.7}, {"tiny_narrow", 9, 48, 0.25}, {"tiny_rows", 33, 64, 0.12}};
  bool ok = true;
  if (mode == "--tiny") {
    for (const Config& config : tiny) ok = Run(config, encode, 1) && ok;
    return ok;
  }
  for (const Config& config : configs) {
    if (mode == "--once" && &config != &configs[2]) continue;
    ok = Run(config, encode, mode == "--once" ? 1 : 35) && ok;
  }
  return ok;
}

}  // namespace

int main(int argc, char** argv) { return Main(argc > 1 ? argv[1] : "") ? 0 : 1; }
