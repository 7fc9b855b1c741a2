// Warp-specialised forward prototype (benchmarks/ws_forward.sh builds and runs it): stage 2 of the
// design note on the problem the tiled forward solves, to measure what it costs before it is built into
// the module. A producer warp streams K/V chunks as tensor-map boxes (no staging code in the warps that
// multiply); kConsumers warpgroups multiply each chunk with wgmma (m64 tiles, no ldmatrix; Q from
// shared memory or registers) and run the online softmax. Query tiles are 2-D so that m64 wastes
// little: a warpgroup owns 4 rows x 16 longitudes (warp w = query row w), a block 4 rows x 16 kConsumers
// longitudes, every warpgroup reading the staged chunks of one key row (skipping chunks off its band).
//
// Self-attention on an equiangular grid, bf16, one head of 64 channels. Neighbourhoods follow the
// geodesic-disk rule through per-(query row, key row) half-widths in longitude computed here (the
// plan's rule without its epsilon); quadrature weights are positive stand-ins (timing does not depend
// on them). Every output element is poisoned (NaN) before the run and must be written; out and lse of
// sampled queries are checked against a float64 host reference. Standalone: not part of the package.
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

#include "bench/bench_common.h"
#include "gpu/device_common.cuh"
#include "gpu/mbarrier_sm90.cuh"
#include "gpu/tma_sm90.cuh"
#include "gpu/wgmma_sm90.cuh"

namespace {

using s2attn::gpu::Exp2;
using s2attn::gpu::MbarrierArrive;
using s2attn::gpu::MbarrierInit;
using s2attn::gpu::MbarrierInitFence;
using s2attn::gpu::MbarrierWait;
namespace sm90 = s2attn::gpu::sm90;
using T = __nv_bfloat16;

constexpr int kD = 64;                 // channels: one 128-byte row per point, one swizzle span
// Build parameters: other shapes with -DWS_CONSUMERS=... -DWS_STAGES=... on the nvcc line;
// WS_QUERIES_SHARED=1 stages each warpgroup's queries by a tensor-map box and multiplies Q K^T from
// shared memory (16 registers fewer), WS_MIN_BLOCKS asks for that many blocks per SM (with
// -maxrregcount where the schedulers' register files need it).
// The defaults are the fastest build measured (NOTES, session 9): one warpgroup per block, its
// queries in shared memory, 4 blocks per SM (94 registers).
#ifndef WS_CONSUMERS
#define WS_CONSUMERS 1
#endif
#ifndef WS_STAGES
#define WS_STAGES 4
#endif
#ifndef WS_QUERIES_SHARED
#define WS_QUERIES_SHARED 1
#endif
#ifndef WS_MIN_BLOCKS
#define WS_MIN_BLOCKS 4
#endif
constexpr bool kQueriesShared = WS_QUERIES_SHARED;
constexpr int kChunk = 32;             // key longitudes per staged chunk
constexpr int kStages = WS_STAGES;
constexpr int kTileRows = 4;           // query rows of a block, one per warp of each warpgroup
constexpr int kGroupLons = 16;         // longitudes of a warpgroup's tile (4 x 16 = m64)
constexpr int kConsumers = WS_CONSUMERS;  // warpgroups per block
constexpr int kBlockLons = kGroupLons * kConsumers;
constexpr int kThreads = 128 * kConsumers + 32;  // and one producer warp
constexpr int kChunkBytes = kChunk * kD * 2;
constexpr int kRing = 1 << 20;         // half-width of a key row every query of the row sees whole

// What the producer tells the consumers about a staged chunk (written before the stage's barrier).
struct ChunkInfo {
  int row;                  // key row; -1: the stream ended
  int lon;                  // longitude of the chunk's first column
  int valid;                // columns [0, valid) belong to the window part (the rest: zeros, or keys past it)
  int reach;                // largest of half[]
  float bias;               // log2 of the key row's quadrature weight
  int half[kTileRows];      // per query row: longitudes each side of a query it sees (-1: none, kRing)
};

struct alignas(1024) Stage {
  T k[kChunk * kD];
  T v[kChunk * kD];
};

struct alignas(1024) QueryTile {
  T q[4 * kGroupLons * kD];  // rows: query row (warp) x longitude, as the box lays them out
};

struct Shared {
  Stage stages[kStages];
  QueryTile queries[kQueriesShared ? kConsumers : 1];
  ChunkInfo info[kStages];
  uint64_t full[kStages];
  uint64_t empty[kStages];
  uint64_t queries_full;
};

struct Problem {
  int nlat, nlon;
  const T* q;            // [nlat, nlon, kD]
  float* out;            // [nlat, nlon, kD]
  float* lse;            // [nlat, nlon], natural log
  const int* half;       // [nlat, nlat]: half-width of query row i on key row j (-1: none, kRing)
  const int* key_rows;   // [blocks along latitude, 2]: first and last key row of the block's query rows
  const float* bias;     // [nlat]: log2 of the quadrature weights
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

// One thread: every chunk of every key row the block's queries see, in key-row order. A row's window
// is the union of the block's arcs, cut at longitude 0 into at most two parts, each staged from its
// start in chunks (boxes past nlon are zero-filled by the copy engine and marked invalid).
__device__ void Produce(const Problem& p, const CUtensorMap* queries, const CUtensorMap* keys,
                        const CUtensorMap* values, Shared& s) {
  const int first_query_row = blockIdx.y * kTileRows, first_lon = blockIdx.x * kBlockLons;
  if (kQueriesShared) {
    sm90::MbarrierArriveExpectBytes(&s.queries_full, kConsumers * sizeof(QueryTile));
    for (int group = 0; group < kConsumers; ++group) {
      sm90::LoadBox3d(s.queries[group].q, queries, 0, first_lon + group * kGroupLons, first_query_row,
                      &s.queries_full);
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
        sm90::MbarrierArriveExpectBytes(&s.full[at.stage], 2 * kChunkBytes);
        sm90::LoadBox3d(s.stages[at.stage].k, keys, 0, lon, row, &s.full[at.stage]);
        sm90::LoadBox3d(s.stages[at.stage].v, values, 0, lon, row, &s.full[at.stage]);
        at.Advance();
      }
    }
  }
  MbarrierWait(&s.empty[at.stage], at.phase ^ 1);
  s.info[at.stage].row = -1;
  MbarrierArrive(&s.full[at.stage]);
}

__device__ __forceinline__ uint32_t PackPair(float lo, float hi) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

// A consumer warpgroup: its 64 queries' fragments in registers, then every chunk: S = Q K^T (wgmma),
// mask and online softmax in registers, O += P V (wgmma, P from the S registers), release the stage.
__device__ void Consume(const Problem& p, Shared& s, int group) {
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int query_row = blockIdx.y * kTileRows + warp;
  const int group_lon = blockIdx.x * kBlockLons + group * kGroupLons;
  const int lons[2] = {group_lon + g, group_lon + g + 8};  // of the thread's two accumulator rows
  uint32_t q[kQueriesShared ? 1 : kD / 16][4];
  if (kQueriesShared) {
    MbarrierWait(&s.queries_full, 0);
  } else {
    const T* rows[2];
    for (int h = 0; h < 2; ++h) {
      rows[h] = p.q + (size_t(min(query_row, p.nlat - 1)) * p.nlon + lons[h] % p.nlon) * kD;
    }
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
      q[ks][0] = *reinterpret_cast<const uint32_t*>(rows[0] + 16 * ks + 2 * t);
      q[ks][1] = *reinterpret_cast<const uint32_t*>(rows[1] + 16 * ks + 2 * t);
      q[ks][2] = *reinterpret_cast<const uint32_t*>(rows[0] + 16 * ks + 2 * t + 8);
      q[ks][3] = *reinterpret_cast<const uint32_t*>(rows[1] + 16 * ks + 2 * t + 8);
    }
  }
  const uint64_t queries = sm90::SwizzledTileDescriptor(s.queries[kQueriesShared ? group : 0].q);
  float o[kD / 2] = {}, m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, scores[kChunk / 2];
  StagePosition at;
  for (;;) {
    MbarrierWait(&s.full[at.stage], at.phase);
    const ChunkInfo& info = s.info[at.stage];
    if (info.row < 0) break;
    const int lon = info.lon, valid = info.valid, reach = info.reach, half = info.half[warp];
    const bool touched = Touches(lon, valid, reach, group_lon, p.nlon);
    if (touched) {
      const Stage& stage = s.stages[at.stage];
      const uint64_t keys = sm90::SwizzledTileDescriptor(stage.k);
      sm90::WgmmaFence();
#pragma unroll
      for (int ks = 0; ks < kD / 16; ++ks) {
        if constexpr (kQueriesShared) {
          sm90::WgmmaM64N32K16SharedA<T>(scores, queries + 2 * ks, keys + 2 * ks, ks > 0);
        } else {
          sm90::WgmmaM64N32K16<T, 0>(scores, q[ks], keys + 2 * ks, ks > 0);
        }
      }
      sm90::WgmmaCommit();
      sm90::WgmmaWait<0>();
      sm90::FenceRegisters(scores);
      float row_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // Column n of the chunk is in the arc of the query at lons[h] iff |start + n| <= half: columns
        // [first, first + count), except where an arc comes within a chunk of the whole ring and
        // start + n must be wrapped once more per column (half is the warp's: a uniform branch).
        const int start = WrapDifference(lon - lons[h], p.nlon);
        const int first = max(0, -half - start), count = max(0, min(valid, half - start + 1) - first);
        const auto keep = [&](int e, bool in_arc) {
          scores[e] = in_arc ? fmaf(scores[e], p.scale_log2, info.bias) : -INFINITY;
          row_max[h] = fmaxf(row_max[h], scores[e]);
        };
        if (half >= 0 && half > p.nlon / 2 - kChunk) {  // outside the loop: inside it, it cost 1.8x (NOTES)
#pragma unroll
          for (int e = 2 * h; e < kChunk / 2; e += (e % 2 == 0 ? 1 : 3)) {
            const int n = 8 * (e / 4) + 2 * t + (e % 2);
            const int distance = start + n - (start + n >= p.nlon / 2 ? p.nlon : 0);
            keep(e, n < valid && unsigned(distance + half) <= unsigned(2 * half));
          }
        } else {
#pragma unroll
          for (int e = 2 * h; e < kChunk / 2; e += (e % 2 == 0 ? 1 : 3)) {
            keep(e, unsigned(8 * (e / 4) + 2 * t + (e % 2) - first) < unsigned(count));
          }
        }
      }
      uint32_t pv[kChunk / 16][4];
      float correction[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 1));
        row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], 2));
        const float m_new = fmaxf(m[h], row_max[h]);
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
#pragma unroll
      for (int kk = 0; kk < kChunk / 16; ++kk) {
        pv[kk][0] = PackPair(scores[8 * kk + 0], scores[8 * kk + 1]);
        pv[kk][1] = PackPair(scores[8 * kk + 2], scores[8 * kk + 3]);
        pv[kk][2] = PackPair(scores[8 * kk + 4], scores[8 * kk + 5]);
        pv[kk][3] = PackPair(scores[8 * kk + 6], scores[8 * kk + 7]);
      }
      const uint64_t values = sm90::SwizzledTileDescriptor(stage.v);
      sm90::FenceRegisters(o);
      sm90::WgmmaFence();
#pragma unroll
      for (int kk = 0; kk < kChunk / 16; ++kk) sm90::WgmmaM64N64K16<T, 1>(o, pv[kk], values + 128 * kk, 1);
      sm90::WgmmaCommit();
      sm90::WgmmaWait<0>();
      sm90::FenceRegisters(o);
    }
    // Every thread arrives: the ordering compute-sanitizer's racecheck models (one arrival per warp after
    // __syncwarp measured the same, but racecheck then reports the other lanes' reads of the chunk's
    // description as racing with its next write).
    MbarrierArrive(&s.empty[at.stage]);
    at.Advance();
  }
  if (query_row >= p.nlat || group_lon >= p.nlon) return;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    const float inverse = l[h] > 0.f ? 1.f / l[h] : 0.f;
    const size_t point = size_t(query_row) * p.nlon + lons[h];
#pragma unroll
    for (int j = 0; j < kD / 8; ++j) {
      const float2 pair = make_float2(o[4 * j + 2 * h] * inverse, o[4 * j + 2 * h + 1] * inverse);
      *reinterpret_cast<float2*>(p.out + point * kD + 8 * j + 2 * t) = pair;
    }
    if (t == 0) p.lse[point] = l[h] > 0.f ? (m[h] + log2f(l[h])) * 0.6931471805599453f : -INFINITY;
  }
}

__global__ void __launch_bounds__(kThreads, WS_MIN_BLOCKS)
    WarpSpecialisedForward(Problem p, const __grid_constant__ CUtensorMap queries,
                           const __grid_constant__ CUtensorMap keys, const __grid_constant__ CUtensorMap values) {
  const auto raw = reinterpret_cast<uintptr_t>(s2attn::gpu::DynamicShared());
  Shared& s = *reinterpret_cast<Shared*>((raw + 1023) & ~uintptr_t{1023});
  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      MbarrierInit(&s.full[i], 1);
      MbarrierInit(&s.empty[i], 128 * kConsumers);
    }
    MbarrierInit(&s.queries_full, 1);
    MbarrierInitFence();
  }
  __syncthreads();
  const int warp = threadIdx.x / 32;
  if (warp == 4 * kConsumers) {
    if (threadIdx.x % 32 == 0) Produce(p, &queries, &keys, &values, s);
  } else {
    Consume(p, s, warp / 4);
  }
}

// ------------------------------------------------------------------------------------------ host

// Half-widths of the geodesic disk: query row i sees key (j, c) iff the angular distance of the points
// is <= cutoff, i.e. |c - lon| <= half[i][j] around its own longitude.
std::vector<int> HalfWidths(int nlat, int nlon, double cutoff) {
  std::vector<int> half(size_t(nlat) * nlat, -1);
  const double pi = 3.14159265358979323846, step = 2 * pi / nlon;
  for (int i = 0; i < nlat; ++i) {
    for (int j = 0; j < nlat; ++j) {
      const double ti = pi * i / (nlat - 1), tj = pi * j / (nlat - 1);
      const double sines = std::sin(ti) * std::sin(tj);
      int& h = half[size_t(i) * nlat + j];
      if (sines < 1e-12) {
        h = std::fabs(ti - tj) <= cutoff ? kRing : -1;
        continue;
      }
      const double c = (std::cos(cutoff) - std::cos(ti) * std::cos(tj)) / sines;
      if (c > 1) continue;
      h = c <= -1 ? kRing : int(std::floor(std::acos(c) / step + 1e-9));
      if (2 * h + 1 >= nlon) h = kRing;
    }
  }
  return half;
}

struct Config {
  const char* name;
  int nlat, nlon;
  double cutoff;
};

bool Run(const Config& config, EncodeTiled encode, int reps) {
  const int nlat = config.nlat, nlon = config.nlon;
  if (nlon % kGroupLons != 0) {  // a warpgroup's 16 longitudes are written whole
    std::printf("%s: nlon %d is not a multiple of %d\n", config.name, nlon, kGroupLons);
    return false;
  }
  const size_t points = size_t(nlat) * nlon;
  const std::vector<int> half = HalfWidths(nlat, nlon, config.cutoff);
  const int row_blocks = (nlat + kTileRows - 1) / kTileRows;
  std::vector<int> key_rows(2 * row_blocks);
  for (int b = 0; b < row_blocks; ++b) {
    int first = nlat, last = -1;
    for (int i = b * kTileRows; i < std::min(nlat, (b + 1) * kTileRows); ++i) {
      for (int j = 0; j < nlat; ++j) {
        if (half[size_t(i) * nlat + j] >= 0) first = std::min(first, j), last = std::max(last, j);
      }
    }
    key_rows[2 * b] = first, key_rows[2 * b + 1] = last;
  }
  std::vector<float> bias(nlat), weight(nlat);
  const double pi = 3.14159265358979323846;
  for (int j = 0; j < nlat; ++j) {
    weight[j] = float(std::max(std::sin(pi * j / (nlat - 1)), 0.5 * std::sin(pi / (nlat - 1))) * pi / (nlat - 1));
    bias[j] = std::log2(weight[j]);
  }
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal;
  std::vector<T> host[3];
  for (auto& x : host) {
    x.resize(points * kD);
    for (T& e : x) e = __float2bfloat16(normal(rng));
  }
  T* device[3];
  float *out, *lse, *dbias;
  int *dhalf, *dkey_rows;
  for (int i = 0; i < 3; ++i) {
    CHECK_CUDA(cudaMalloc(&device[i], points * kD * sizeof(T)));
    CHECK_CUDA(cudaMemcpy(device[i], host[i].data(), points * kD * sizeof(T), cudaMemcpyHostToDevice));
  }
  CHECK_CUDA(cudaMalloc(&out, points * kD * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&lse, points * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&dhalf, half.size() * sizeof(int)));
  CHECK_CUDA(cudaMalloc(&dkey_rows, key_rows.size() * sizeof(int)));
  CHECK_CUDA(cudaMalloc(&dbias, nlat * sizeof(float)));
  CHECK_CUDA(cudaMemcpy(dhalf, half.data(), half.size() * sizeof(int), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dkey_rows, key_rows.data(), key_rows.size() * sizeof(int), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dbias, bias.data(), nlat * sizeof(float), cudaMemcpyHostToDevice));
  // Maps of q (boxes of a warpgroup's 4 x 16 queries), k and v (boxes of one chunk).
  CUtensorMap maps[3];
  const cuuint64_t dims[3] = {kD, cuuint64_t(nlon), cuuint64_t(nlat)};
  const cuuint64_t strides[2] = {kD * sizeof(T), nlon * kD * sizeof(T)};
  const cuuint32_t boxes[2][3] = {{kD, kGroupLons, kTileRows}, {kD, kChunk, 1}}, element_strides[3] = {1, 1, 1};
  for (int i = 0; i < 3; ++i) {
    if (encode(&maps[i], CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, device[i], dims, strides, boxes[i > 0], element_strides,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
      std::printf("cuTensorMapEncodeTiled failed\n");
      return false;
    }
  }
  const Problem problem{nlat, nlon, device[0], out, lse, dhalf, dkey_rows, dbias, 0.125f * 1.4426950408889634f};
  const int shared = sizeof(Shared) + 1024;
  CHECK_CUDA(cudaFuncSetAttribute(WarpSpecialisedForward, cudaFuncAttributeMaxDynamicSharedMemorySize, shared));
  const dim3 grid((nlon + kBlockLons - 1) / kBlockLons, row_blocks);
  CHECK_CUDA(cudaMemset(out, 0xff, points * kD * sizeof(float)));  // NaN
  CHECK_CUDA(cudaMemset(lse, 0xff, points * sizeof(float)));
  // Launched through cudaLaunchKernel (not <<< >>>), so that the program also builds for the host
  // emulation of tests/cuda_emulation.
  void* args[] = {const_cast<Problem*>(&problem), &maps[0], &maps[1], &maps[2]};
  const auto forward = [&] { return cudaLaunchKernel(WarpSpecialisedForward, grid, dim3(kThreads), args, shared, 0); };
  CHECK_CUDA(forward());
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> got(points * kD), got_lse(points);
  CHECK_CUDA(cudaMemcpy(got.data(), out, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(got_lse.data(), lse, got_lse.size() * sizeof(float), cudaMemcpyDeviceToHost));
  const size_t unwritten = std::count_if(got.begin(), got.end(), [](float x) { return std::isnan(x); }) +
                           std::count_if(got_lse.begin(), got_lse.end(), [](float x) { return std::isnan(x); });

  // float64 reference of sampled queries (one on each pole row among them).
  double error = 0, scale_ref = 0, lse_error = 0;
  struct {
    int row, lon, channel;
    double expected, got;
  } worst{};
  std::uniform_int_distribution<int> any_row(0, nlat - 1), any_lon(0, nlon - 1);
  std::vector<double> acc(kD);
  for (int sample = 0; sample < 1500; ++sample) {
    const int i = sample < 2 ? (nlat - 1) * sample : any_row(rng), lon = any_lon(rng);
    double top = -1e300;
    std::vector<std::pair<double, size_t>> logits;
    for (int j = 0; j < nlat; ++j) {
      const int h = half[size_t(i) * nlat + j];
      if (h < 0) continue;
      const int width = h >= kRing ? nlon : 2 * h + 1, first = h >= kRing ? 0 : lon - h;
      for (int c = 0; c < width; ++c) {
        const size_t key = size_t(j) * nlon + ((first + c) % nlon + nlon) % nlon;
        double dot = 0;
        for (int d = 0; d < kD; ++d) {
          dot += double(__bfloat162float(host[0][(size_t(i) * nlon + lon) * kD + d])) *
                 __bfloat162float(host[1][key * kD + d]);
        }
        logits.emplace_back(0.125 * dot + std::log(double(weight[j])), key);
        top = std::max(top, logits.back().first);
      }
    }
    double total = 0;
    std::fill(acc.begin(), acc.end(), 0.0);
    for (const auto& [logit, key] : logits) {
      const double e = std::exp(logit - top);
      total += e;
      for (int d = 0; d < kD; ++d) acc[d] += e * __bfloat162float(host[2][key * kD + d]);
    }
    const size_t point = size_t(i) * nlon + lon;
    for (int d = 0; d < kD; ++d) {
      const double wrong = std::fabs(acc[d] / total - got[point * kD + d]);
      if (!(wrong <= error)) worst = {i, lon, d, acc[d] / total, got[point * kD + d]};
      error = std::max(error, wrong);
      scale_ref = std::max(scale_ref, std::fabs(acc[d] / total));
    }
    lse_error = std::max(lse_error, std::fabs(top + std::log(total) - got_lse[point]));
  }
  const double relative = error / scale_ref;
  const bool correct = unwritten == 0 && relative <= 1e-2 && lse_error <= 1e-3 && std::isfinite(relative);

  // Work the stream does (the producer's loop and the consumers' test replayed): chunks staged, chunks
  // multiplied by a warpgroup, and the neighbour pairs among the latter's 64 x kChunk products.
  long long chunks = 0, multiplied = 0, pairs = 0;
  for (int b = 0; b < row_blocks; ++b) {
    for (int j = key_rows[2 * b]; j <= key_rows[2 * b + 1]; ++j) {
      int reach = -1;
      for (int i = b * kTileRows; i < std::min(nlat, (b + 1) * kTileRows); ++i) {
        const int h = half[size_t(i) * nlat + j];
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

  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<float> times;
  for (int rep = 0; rep < reps; ++rep) {
    CHECK_CUDA(cudaEventRecord(start));
    CHECK_CUDA(forward());
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    if (rep >= reps / 7) times.push_back(ms);
  }
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  std::sort(times.begin(), times.end());
  const double ms = times[times.size() / 2];
  std::printf("%-14s %4dx%-5d cutoff %.5f: %.3f ms (min %.3f) | pairs %.3g, chunks %.3g, warpgroup-chunks %.3g, "
              "useful %.2f | unwritten %zu, out rel %.1e, lse abs %.1e %s\n",
              config.name, nlat, nlon, config.cutoff, ms, times.front(), double(pairs), double(chunks),
              double(multiplied), double(pairs) / (double(multiplied) * 64 * kChunk), unwritten, relative,
              lse_error, correct ? "ok" : "WRONG");
  if (!correct) {
    std::printf("  worst: row %d lon %d channel %d: %.6f expected, %.6f written\n", worst.row, worst.lon, worst.channel,
                worst.expected, worst.got);
  }
  for (T* x : device) CHECK_CUDA(cudaFree(x));
  CHECK_CUDA(cudaFree(out));
  CHECK_CUDA(cudaFree(lse));
  CHECK_CUDA(cudaFree(dhalf));
  CHECK_CUDA(cudaFree(dkey_rows));
  CHECK_CUDA(cudaFree(dbias));
  return correct;
}

// Without arguments: every config, timed. `--once`: the smallest config, the checked launch and one timed
// (for compute-sanitizer). `--tiny`: small grids that cross longitude 0, touch the poles and see whole
// rings, one launch each (for the host emulation, tests/test_ws_prototype_emulated.py).
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
