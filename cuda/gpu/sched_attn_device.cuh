// The scheduled kernels (sched_attn_kernels.h): forward, dq and dk/dv on the plan's block-sparse schedules, for
// sm_90a. Included by sched_attn_fwd.cu, sched_attn_dq.cu and sched_attn_dkv.cu, which instantiate one kind each,
// at each head dim of kSchedHeadDims (32, 64, 128; a box and a swizzled tile per block of up to 64 elements a row).
//
// A consumer warpgroup takes one tile of the schedule (4 x 16 walking points; tiles in the schedule's order,
// longest first) and one (batch, head) slab (blockIdx.y); a block runs ConsumersOf(kind) of them on consecutive
// tiles (three for dk/dv at head dims 32 and 64, under setmaxnreg; else one), each with its own producer warp
// and stages. A producer warp asks for tensor-map boxes of its tile's points, then, per chunk of the tile's list,
// copies the chunk's description into shared memory (read 32 chunks at a time, a lane per chunk) and asks for
// two boxes of 32 points of one row of the other grid (k and v; q and dout for dk/dv) into a kStages-deep mbarrier
// ring. The consumer warpgroup multiplies in FlashAttention-3's
// intra-warpgroup order (WalkChunks): it issues the next chunk's products, then this chunk's accumulating ones,
// then forms the next chunk's scores while those run, so that no instruction touches the registers of a wgmma in
// flight and ptxas keeps every wgmma asynchronous.
//
// The geometry is the host's: per chunk the kernels read (other row, longitude, offset, valid, flags, staging)
// and, per point, the staging's (start, length) record of its tile row and residue class; FULL chunks take no
// mask, partial and RING ones a 32-bit word of kept columns per accumulator row (formed once per chunk) and one
// bit test and one select per element. The key row's log2 quadrature weight is folded into the exponent. The
// operands' wgmma descriptors are formed once and moved to a stage by one addition.
//
// Forward: S = Q K^T, the mask and the online softmax in log2 units, O += P V with P rounded once to the
// activations' type and the row sums of that rounded P (P V and P 1 as one m64n72k16, the ones tile V's ninth
// block of 8 columns): out is divided by them, so that its weights sum to one as the backward's P = exp(s - lse)
// do, and a delta formed from a float32 out stays consistent with the backward on smooth fields
// (docs/performance.md, "Accuracy without a second P·V product"); lse comes from float32 sums. The maxima move
// lazily: only when a row's logits rise by more than kRescaleSlackLog2, so that O is rarely rescaled. dq: S and
// dP = dO V^T, dS = P (dP - delta), dq += dS K, with delta given or formed by the block at its entry from dout and
// the float32 out (then written for dk/dv). dk/dv (the backward schedule, the chunk's queries' lse and delta
// staged by the producer): S^T and dP^T, dv += P^T dO, dk += dS^T Q. Every result row is written once, by its
// block: no atomics, bitwise deterministic.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "gpu/device_common.cuh"
#include "gpu/mbarrier_sm90.cuh"
#include "gpu/registers_sm90.cuh"
#include "gpu/sched_attn_kernels.h"
#include "gpu/tma_sm90.cuh"
#include "gpu/wgmma_sm90.cuh"

namespace s2attn {
namespace gpu {
namespace sched {

namespace sm90 = s2attn::gpu::sm90;

constexpr int kTileRows = kSchedTileRows, kTileCols = kSchedTileCols;  // one wgmma M of 64 walking points
constexpr int kChunk = kSchedChunkCols;                                // the N of S = Q K^T
constexpr int kStages = 4;
// Operand rows are blocks of up to 64 16-bit elements, each block its own swizzled tile of all the rows: at head
// dim 32 one block of 64-byte rows (the 64-byte swizzle), at 64 one of 128-byte rows (the 128-byte swizzle), at 128
// two of those (wgmma_sm90.cuh).
template <int kD>
constexpr int kBlockOf = kD < 64 ? kD : 64;  // elements a row of a block
template <int kD>
constexpr int kBlocks = kD / kBlockOf<kD>;
constexpr int kFull = 1, kRing = 2;  // jax_s2attn.schedule.FULL, RING
constexpr int kRingPointsShift = 2;  // on ring grids a RING chunk's flags hold its ring's points from this bit
constexpr int kTileRuns = kSchedTileRuns, kRunPoints = kSchedRunPoints;  // a ring grids' tile
static_assert(kTileRuns * kRunPoints == kTileRows * kTileCols && kRunPoints == 8,
              "a ring grids' tile: two runs a warp, the two accumulator rows of a thread in two runs");
static_assert(kTileRows * kTileCols == 64 && kTileRows == 4, "a tile is the warpgroup's 64 rows, a warp per row");
static_assert(kChunk == 32, "S = Q K^T is one m64n32 product per k16 step");

// A staged chunk: rows of the other grid, k and v (forward, dq) or q and dout (dk/dv), each kBlocks blocks of
// kChunk rows.
template <typename T, int kD>
struct alignas(1024) Stage {
  static_assert(kD == 32 || kD == 64 || kD == 128, "head dims 32, 64 and 128");
  T a[kChunk * kD];
  T b[kChunk * kD];
};

// Operands of a tile's 64 walking points, staged once per block (tile row x longitude, as the box lays them out),
// kBlocks blocks of 64 rows.
template <typename T, int kD>
struct alignas(1024) PointTile {
  T rows[kTileRows * kTileCols * kD];
};

// Bytes of one block of a chunk's rows and of a tile's.
template <int kD>
constexpr int kChunkBlockBytes = kChunk * kBlockOf<kD> * 2;
template <int kD>
constexpr int kTileBlockBytes = kTileRows * kTileCols * kBlockOf<kD> * 2;

// A chunk's rows of ones, 64 elements a row with the 128-byte swizzle (any layout reads them as ones), for the row
// sums of the forward's P: at head dim 64 its P V reaches them as V's columns 64..71, whose block starts the
// descriptor's leading offset past V's, so that P's row sums come out of the same wgmma; at 32 and 128 they are
// an m64n8 product of their own.
template <typename T>
struct alignas(1024) OnesTile {
  T rows[kChunk * 64];
};
struct NoTile {};

// What the producer warp copies from the schedule for a staged chunk (before the stage's barrier).
struct ChunkInfo {
  int offset, valid, flags;
  float bias;                             // log2 of the chunk's keys' quadrature weight (one row, or one ring)
  int2 records[kTileRows * kTileCols];    // the staging's (start, length) per tile row and class
  float lse_log2[kChunk], delta[kChunk];  // dk/dv: of the chunk's queries (+inf and 0 past `valid`)
};

// Forward and dq walk the forward schedule (query tiles over key chunks), dk/dv the backward one.
enum class Kind { kForward, kDq, kDkv };
// Walking-grid tiles a kernel stages once: q; q and dout; k and v.
__host__ __device__ constexpr int TilesOf(Kind kind) { return kind == Kind::kForward ? 1 : 2; }
// Consumer warpgroups a block runs, each on its own tile of the schedule (the block's tiles are consecutive in the
// schedule's longest-first order, so of about one length) with its own producer warp and ring of stages. dk/dv at
// head dims 32 and 64 runs three: it holds S, dP, dk and dv, and as blocks of one consumer only two fit an SM at
// the registers it needs, while one block of three under setmaxnreg gives each consumer kConsumerRegisters.
// Elsewhere one.
constexpr int kManyConsumers = 3;
__host__ __device__ constexpr int ConsumersOf(Kind kind, int head_dim) {
  return kind == Kind::kDkv && head_dim <= 64 ? kManyConsumers : 1;
}
// Threads: the consumer warpgroups, then the producers: one warp for one consumer, else a warpgroup whose warp c
// serves consumer c (setmaxnreg takes whole warpgroups).
__host__ __device__ constexpr int ThreadsOf(Kind kind, int head_dim) {
  return ConsumersOf(kind, head_dim) == 1 ? 128 + 32 : 128 * (ConsumersOf(kind, head_dim) + 1);
}
// Blocks per SM each kind asks for (dq holds S, dP and dq: with more blocks, and so fewer registers, ptxas
// serialises its wgmmas). At head dim 128 the accumulators double and a block's shared memory nearly does.
__host__ __device__ constexpr int BlocksPerSm(Kind kind, int head_dim) {
  if (ConsumersOf(kind, head_dim) > 1) return 1;
  if (head_dim > 64) return kind == Kind::kDkv ? 1 : 2;
  return kind == Kind::kForward ? 4 : kind == Kind::kDq ? 3 : 2;
}
// Registers a thread in a block of several consumers (setmaxnreg, multiples of 8): the consumers raise theirs to
// what dk/dv needs (at 136 ptxas serialises its wgmmas), the producer warpgroup lowers its to what is left of the
// SM's 65,536.
constexpr int kConsumerRegisters = 144;
constexpr int kProducerRegisters = (65536 / 128 - kManyConsumers * kConsumerRegisters) / 8 * 8;  // 80
static_assert(kProducerRegisters >= 24, "the consumer warpgroups and a producer warpgroup in one SM's registers");

template <typename T, Kind kKind, int kD>
struct Shared {
  Stage<T, kD> stages[kStages];
  PointTile<T, kD> tiles[TilesOf(kKind)];
  // After every stage: the descriptor's leading offset from a stage's V to the ones must be positive (where it is
  // not, SwizzledDescriptorAt falls back to 1 and the host emulation's products go wrong).
  std::conditional_t<kKind == Kind::kForward, OnesTile<T>, NoTile> ones;
  ChunkInfo info[kStages];
  uint64_t full[kStages];
  uint64_t empty[kStages];
  uint64_t tiles_full;
};

// The walking tiles (q; q, dout; k, v) and the other grid's chunks (k, v; or q, dout): 5-D maps of
// [batch, nlat, nlon, heads, D] activations (innermost first: D, heads, nlon, nlat, batch). Ring grids are one row
// of all their points, and their tile maps take boxes of one run (kRunPoints points).
struct Maps {
  CUtensorMap tiles[2], a, b;
};

// One launch: a call's slabs from `first_slab` (blockIdx.y counts on from it).
struct Problem {
  int nlat_walk, nlon_walk, nlat_other, nlon_other, heads;  // the arrays' grids
  // Ring grids (SchedAttnParams::ring_grids): tiles of kTileRuns runs, quadrature weights per key point.
  bool ring_grids;
  int ring_nlon;                                            // the other grid's ring (RING chunks' modulus)
  int64_t first_slab;
  const int* tiles;
  const int* tile_offsets;
  const int* chunks;
  const int2* records;
  int num_chunks, num_stagings, classes, shift;
  int num_tiles;
  const float* quad_weights;  // [key rows]
  float scale, scale_log2;    // softmax scale, and times log2(e)
  const float* lse;           // dq: the walking points'; dk/dv: the other grid's
  const float* delta;
  // dq forming delta (delta_out not null): dout, the forward's float32 out and dlse of the walking points.
  const void* dout;
  const float* forward_out;
  const float* dlse;
  float* delta_out;
  bool f32_results;  // results in float32, else in the activations' type
  void* out;
  float* out_f32;  // forward: null, or beside an `out` in the activations' type the same out in float32
  float* lse_out;
  void* dq;
  void* dk;
  void* dv;
};

// A block's slab: batch index and head.
struct Slab {
  int64_t batch;
  int head;
};

__device__ __forceinline__ Slab SlabOf(const Problem& p) {
  const int64_t slab = p.first_slab + blockIdx.y;
  return {slab / p.heads, static_cast<int>(slab % p.heads)};
}

// Index of point (row, lon) of a grid of nlat x nlon in the slab's [batch, nlat, nlon, heads] layout.
__device__ __forceinline__ size_t PointIndex(const Problem& p, const Slab& slab, int nlat, int nlon, int row,
                                             int lon) {
  return ((static_cast<size_t>(slab.batch) * nlat + row) * nlon + lon) * p.heads + slab.head;
}

// log2 of the quadrature weight of key row `row` of `rows` (clamped to them): on ring grids the weights are per
// key point, and `row` a key point.
__device__ __forceinline__ float KeyBias(const Problem& p, int row, int rows) {
  return log2f(__ldg(p.quad_weights + min(max(row, 0), rows - 1)));
}

// Run `run` of tile `tile` on ring grids: (first point, points).
__device__ __forceinline__ int2 RunOf(const Problem& p, int tile, int run) {
  return make_int2(__ldg(p.tiles + (static_cast<size_t>(tile) * kTileRuns + run) * 2),
                   __ldg(p.tiles + (static_cast<size_t>(tile) * kTileRuns + run) * 2 + 1));
}

// Tile `tile`'s chunks [first, first + count) of the schedule, clamped to its chunk list.
__device__ __forceinline__ int2 TileChunks(const Problem& p, int tile) {
  const int begin = min(max(__ldg(p.tile_offsets + tile), 0), p.num_chunks);
  const int end = min(max(__ldg(p.tile_offsets + tile + 1), begin), p.num_chunks);
  return make_int2(begin, end - begin);
}

// A producer lane's share of a staging's records (at most a tile's points).
constexpr int kRecordsPerLane = kTileRows * kTileCols / 32;

// dk/dv's producer loads a chunk's queries' lse and delta this many chunks before it stages the chunk, so that
// its loop does not wait on global memory once per chunk.
constexpr int kQueryRowsAhead = 4;
static_assert(kChunk == 32, "a chunk's query rows are loaded a lane per column");

// Lane `lane`'s query of a chunk of 32 queries at (row, lon) with `valid` columns: its lse (+inf off the grid or
// past `valid`, so that P = 0 there) and delta (0 there), as loaded; Log2Lse converts the lse when it is staged.
__device__ __forceinline__ float2 QueryRowOf(const Problem& p, const Slab& slab, int row, int lon, int valid,
                                             int lane) {
  const bool real = lane < valid && static_cast<unsigned>(row) < static_cast<unsigned>(p.nlat_other) &&
                    static_cast<unsigned>(lon + lane) < static_cast<unsigned>(p.nlon_other);
  if (!real) return make_float2(-kNegInf, 0.f);
  const size_t point = PointIndex(p, slab, p.nlat_other, p.nlon_other, row, lon + lane);
  return make_float2(__ldg(p.lse + point), __ldg(p.delta + point));
}

// A producer warp (of tile `tile`): the tile's points, then per chunk of its list the chunk's description and its two boxes
// (lane 0 asks for the boxes). The descriptions are read 32 chunks at a time, lane x the chunk x of the batch
// (with its records when a tile row has one class), so that the loop waits on global memory once per batch;
// dk/dv's lse and delta of a chunk's queries (a lane per column) kQueryRowsAhead chunks ahead. Every lane
// arrives on the stage's barrier after its writes.
template <typename T, Kind kKind, int kD>
__device__ void Produce(const Problem& p, const Maps& maps, Shared<T, kKind, kD>& s, int tile, int first,
                        int count) {
  const Slab slab = SlabOf(p);
  const int lane = threadIdx.x % 32, per_staging = kTileRows * p.classes;
  const int nlat_keys = kKind == Kind::kDkv ? p.nlat_walk : p.nlat_other;
  const int batch = static_cast<int>(slab.batch);
  if (lane == 0) {
    sm90::MbarrierArriveExpectBytes(&s.tiles_full, TilesOf(kKind) * sizeof(PointTile<T, kD>));
    for (int i = 0; i < TilesOf(kKind); ++i) {
#pragma unroll
      for (int block = 0; block < kBlocks<kD>; ++block) {
        T* rows = s.tiles[i].rows + block * kTileBlockBytes<kD> / 2;
        if (p.ring_grids) {  // a box per run, kRunPoints rows each (whole swizzle patterns of the tile's layout)
          for (int run = 0; run < kTileRuns; ++run) {
            sm90::LoadBox5d(rows + run * kRunPoints * kBlockOf<kD>, &maps.tiles[i], block * kBlockOf<kD>, slab.head,
                            RunOf(p, tile, run).x, 0, batch, &s.tiles_full);
          }
        } else {
          sm90::LoadBox5d(rows, &maps.tiles[i], block * kBlockOf<kD>, slab.head, __ldg(p.tiles + 2 * tile + 1),
                          __ldg(p.tiles + 2 * tile), batch, &s.tiles_full);
        }
      }
    }
  }
  for (int batch_start = 0; batch_start < count; batch_start += 32) {
    int field[kSchedChunkFields] = {};
    float bias = 0.f;
    int2 records[kTileRows] = {};
    if (batch_start + lane < count) {
      const int* chunk = p.chunks + static_cast<size_t>(first + batch_start + lane) * kSchedChunkFields;
#pragma unroll
      for (int f = 0; f < kSchedChunkFields; ++f) field[f] = __ldg(chunk + f);
      field[3] = min(max(field[3], 0), kChunk);                // valid
      field[5] = min(max(field[5], 0), p.num_stagings - 1);    // staging
      if (kKind != Kind::kDkv) {  // a chunk lies on one key ring: its first point's weight is every point's
        bias = p.ring_grids ? KeyBias(p, field[1], p.nlon_other) : KeyBias(p, field[0], nlat_keys);
      }
      if (p.classes == 1) {
#pragma unroll
        for (int a = 0; a < kTileRows; ++a) {
          records[a] = __ldg(p.records + static_cast<size_t>(field[5]) * kTileRows + a);
        }
      }
    }
    const int in_batch = min(32, count - batch_start);
    const auto query_row = [&](int k) {  // chunk k of the batch's lse and delta for this lane (dk/dv)
      return QueryRowOf(p, slab, __shfl_sync(0xffffffffu, field[0], k), __shfl_sync(0xffffffffu, field[1], k),
                        __shfl_sync(0xffffffffu, field[3], k), lane);
    };
    constexpr int kAhead = kKind == Kind::kDkv ? kQueryRowsAhead : 1;  // forward, dq: one chunk per step
    float2 ahead[kAhead] = {};
    if constexpr (kKind == Kind::kDkv) {
#pragma unroll
      for (int j = 0; j < kAhead; ++j) {
        if (j < in_batch) ahead[j] = query_row(j);
      }
    }
    // Several classes a row: the lanes copy a staging's records together, loaded a chunk ahead so that the
    // loads' latency overlaps the wait for the stage.
    int2 next_records[kRecordsPerLane] = {};
    const auto load_records = [&](int k) {
      const int2* from = p.records + static_cast<size_t>(__shfl_sync(0xffffffffu, field[5], k)) * per_staging;
#pragma unroll
      for (int r = 0; r < kRecordsPerLane; ++r) {
        if (lane + 32 * r < per_staging) next_records[r] = __ldg(from + lane + 32 * r);
      }
    };
    if (p.classes != 1) load_records(0);
    for (int k0 = 0; k0 < in_batch; k0 += kAhead) {
#pragma unroll
      for (int j = 0; j < kAhead; ++j) {  // unrolled: ahead[j] stays a register
        const int k = k0 + j, i = batch_start + k, stage = i % kStages;
        if (k >= in_batch) break;
        MbarrierWait(&s.empty[stage], ((i / kStages) & 1) ^ 1);
        ChunkInfo& info = s.info[stage];
        if (lane == k) {
          info.offset = field[2], info.valid = field[3], info.flags = field[4], info.bias = bias;
          if (p.classes == 1) {
#pragma unroll
            for (int a = 0; a < kTileRows; ++a) info.records[a] = records[a];
          }
        }
        if (p.classes != 1) {
#pragma unroll
          for (int r = 0; r < kRecordsPerLane; ++r) {
            if (lane + 32 * r < per_staging) info.records[lane + 32 * r] = next_records[r];
          }
          if (k + 1 < in_batch) load_records(k + 1);
        }
        if constexpr (kKind == Kind::kDkv) {  // the chunk's queries' lse and delta, a lane per column
          info.lse_log2[lane] = Log2Lse(ahead[j].x);
          info.delta[lane] = ahead[j].y;
          if (k + kAhead < in_batch) ahead[j] = query_row(k + kAhead);
        }
        const int row = __shfl_sync(0xffffffffu, field[0], k), lon = __shfl_sync(0xffffffffu, field[1], k);
        if (lane == 0) {
          sm90::MbarrierArriveExpectBytes(&s.full[stage], sizeof(Stage<T, kD>));
#pragma unroll
          for (int block = 0; block < kBlocks<kD>; ++block) {
            const int at = block * kChunkBlockBytes<kD> / 2, d0 = block * kBlockOf<kD>;
            sm90::LoadBox5d(s.stages[stage].a + at, &maps.a, d0, slab.head, lon, row, batch, &s.full[stage]);
            sm90::LoadBox5d(s.stages[stage].b + at, &maps.b, d0, slab.head, lon, row, batch, &s.full[stage]);
          }
        } else {
          MbarrierArrive(&s.full[stage]);
        }
      }
    }
  }
}

// Column n of the thread's accumulator element e (m64nN layout of wgmma_sm90.cuh), less 2 t.
__host__ __device__ constexpr int ColumnOf(int e) { return 8 * (e / 4) + (e % 2); }

// The thread's walking points: of tile `tile`, tile row `warp` (of its warpgroup), longitudes lane / 4 and lane / 4 + 8 of the tile, with their
// residue classes and steps; `real[h]` whether the point is on the walking grid (only those are written). On
// ring grids point lane / 4 of runs 2 warp and 2 warp + 1 (row 0), a record per point, real where the run has it.
struct ThreadPoints {
  int row, lon[2], u[2], step[2];
  bool real[2];
};

__device__ __forceinline__ ThreadPoints PointsOf(const Problem& p, int tile) {
  const int warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
  ThreadPoints points;
  points.row = p.ring_grids ? 0 : __ldg(p.tiles + 2 * tile) + warp;
  const int first_lon = p.ring_grids ? 0 : __ldg(p.tiles + 2 * tile + 1);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int column = lane / 4 + 8 * h;
    points.u[h] = column % p.classes, points.step[h] = column / p.classes;
    bool in_run = true;
    if (p.ring_grids) {
      const int2 run = RunOf(p, tile, 2 * warp + h);
      points.lon[h] = run.x + lane / 4;
      in_run = lane / 4 < run.y;
    } else {
      points.lon[h] = first_lon + column;
    }
    points.real[h] = in_run && static_cast<unsigned>(points.row) < static_cast<unsigned>(p.nlat_walk) &&
                     static_cast<unsigned>(points.lon[h]) < static_cast<unsigned>(p.nlon_walk);
  }
  return points;
}

// The bits of columns [0, n) of a chunk, n clamped to [0, 32] (on the device one funnel shift of the clamp).
__device__ __forceinline__ uint32_t ColumnsBelow(int n) {
#if defined(S2ATTN_HOST_EMULATION)
  return n >= 32 ? ~0u : (1u << max(n, 0)) - 1u;
#else
  return __funnelshift_lc(~0u, 0u, static_cast<unsigned>(max(n, 0)));
#endif
}

// The bits of columns [lo, hi) of a chunk (the bounds clamped to [0, 32]).
__device__ __forceinline__ uint32_t ColumnBits(int lo, int hi) { return ColumnsBelow(hi) & ~ColumnsBelow(lo); }

// A partial chunk's mask for the thread's two accumulator rows h: bit c of keep[h] says whether column 2 t + c is
// kept (n with start <= n < start + length and n < valid; RING chunks with start modulo the ring's points, and also
// the arc's part past the ring's end, from the chunk's first column). The ring's points are ring_nlon, or on ring
// grids the RING chunk's own, in its flags (kRingPointsShift).
struct ChunkMask {
  uint32_t keep[2];
};

__device__ __forceinline__ ChunkMask MaskOf(const Problem& p, const ChunkInfo& info, int warp, const int (&u)[2],
                                            const int (&step)[2], int t) {
  ChunkMask m;
  const int offset = info.offset, valid = info.valid;
  const bool ring = info.flags & kRing;
  const int ring_points = p.ring_grids ? info.flags >> kRingPointsShift : p.ring_nlon;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int2 record = info.records[warp * p.classes + u[h]];
    int start = record.x + p.shift * step[h] - offset;
    const int length = record.y;
    uint32_t keep;
    if (ring) {
      // start modulo ring_points: |start| < 2 ring_points for the points that are written (offset and record.x
      // in [0, ring_points), shift * step < ring_points; tests/test_schedule.py and tests/test_ring_schedule.py
      // check it). Other points may get wrong masks: their rows are computed, not written.
      start += start < 0 ? ring_points : 0;
      start -= start >= ring_points ? ring_points : 0;
      keep = length >= ring_points ? ColumnBits(0, valid)
                                   : ColumnBits(start, min(start + length, valid)) |
                                         ColumnBits(0, min(start + length - ring_points, valid));
    } else {
      keep = ColumnBits(start, min(start + length, valid));
    }
    m.keep[h] = keep >> (2 * t);
  }
  return m;
}

// Drops the columns a partial chunk's mask does not keep (score -inf): one bit test and one select per element.
__device__ __forceinline__ void ApplyMask(float (&s)[kChunk / 2], const ChunkMask& m) {
#pragma unroll
  for (int e = 0; e < kChunk / 2; ++e) s[e] = m.keep[(e >> 1) & 1] >> ColumnOf(e) & 1u ? s[e] : kNegInf;
}

// The scores of chunk `info` with its mask applied (FULL chunks: none; one branch per chunk on its flags).
__device__ __forceinline__ void Mask(float (&s)[kChunk / 2], const Problem& p, const ChunkInfo& info, int warp,
                                     const ThreadPoints& points, int t) {
  if (!(info.flags & kFull)) ApplyMask(s, MaskOf(p, info, warp, points.u, points.step, t));
}

// The online softmax of a chunk's scores in place (s becomes P, not yet rounded), logits in log2 units
// scale_log2 * s + bias: the maxima (lazily, kRescaleSlackLog2) and the float32 sums (lse's) move on;
// `correction` is what O and the rounded P's row sums must be multiplied by.
__device__ __forceinline__ void Exponentiate(float (&s)[kChunk / 2], float bias, float scale_log2, float (&m)[2],
                                             float (&l)[2], float (&correction)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float row_max = kNegInf;
#pragma unroll
    for (int e = 2 * h; e < kChunk / 2; e += (e % 2 == 0 ? 1 : 3)) row_max = fmaxf(row_max, s[e]);
    row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 1));
    row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 2));
    const float top = fmaf(row_max, scale_log2, bias);
    const float m_new = top > m[h] + kRescaleSlackLog2 ? top : m[h];  // the first finite logits always move it
    const float base = m_new == kNegInf ? 0.f : m_new;                  // no -inf - -inf
    correction[h] = Exp2(m[h] - base);
    m[h] = m_new;
    l[h] *= correction[h];
    const float offset_log2 = bias - base;
#pragma unroll
    for (int e = 2 * h; e < kChunk / 2; e += (e % 2 == 0 ? 1 : 3)) {
      s[e] = Exp2(fmaf(s[e], scale_log2, offset_log2));
      l[h] += s[e];
    }
  }
}

// The forward's accumulator: O in its first kD / 2 registers (columns 0..kD-1 of an m64nkD tile), then the rounded
// P's row sums as the 4 registers of 8 more columns (at head dim 64 one m64n72 tile).
template <int kD>
constexpr int kForwardAccumulators = kD / 2 + 4;

// O and the row sums times the corrections, skipped when no maximum of the warp moved (every correction
// exactly 1).
template <int N>
__device__ __forceinline__ void Rescale(float (&o)[N], const float (&correction)[2]) {
  if (__any_sync(0xffffffffu, correction[0] != 1.f || correction[1] != 1.f)) {
#pragma unroll
    for (int e = 0; e < N; ++e) o[e] *= correction[(e >> 1) & 1];
  }
}

// Descriptors of a block's operands for the consumer's walk, formed once: of its walking tiles and of stage 0's
// two chunks (first blocks; K-major reads step to the next block by kTileBlockUnits, kChunkBlockUnits), of those
// chunks as an MN-major B of kD columns (a_wide, b_wide: at head dim 128 with the second block as the next one),
// and for the forward's row sums: at head dim 64 of stage 0's V with the ones tile as its next block (b_ones;
// the ones tile stays where it is: DescriptorFirstBlockPlus), at 32 and 128 of the ones tile alone (ones). Stage
// i's lie kStageUnits i further.
struct Descriptors {
  uint64_t tiles[2], a, b, a_wide, b_wide, b_ones, ones;
};
template <int kD>
constexpr uint32_t kTileBlockUnits = kTileBlockBytes<kD> / 16;
template <int kD>
constexpr uint32_t kChunkBlockUnits = kChunkBlockBytes<kD> / 16;

// The descriptor of a block of rows of head dim kD at `tile` (the swizzle of its rows' width).
template <int kD>
__device__ __forceinline__ uint64_t BlockDescriptor(const void* tile) {
  if constexpr (kBlockOf<kD> == 64) {
    return sm90::SwizzledTileDescriptor(tile);
  } else {
    return sm90::Swizzled64TileDescriptor(tile);
  }
}

// `descriptor` with its low word (start and leading offset) hidden from the compiler, so that it stays in one
// register instead of being formed again from the shared window's base before every wgmma.
__device__ __forceinline__ uint64_t Kept(uint64_t descriptor) {
  uint32_t low = uint32_t(descriptor);
#if !defined(S2ATTN_HOST_EMULATION)
  asm volatile("" : "+r"(low));
#endif
  return (descriptor & ~uint64_t{0xFFFFFFFF}) | low;
}

template <typename T, Kind kKind, int kD>
__device__ __forceinline__ Descriptors DescriptorsOf(const Shared<T, kKind, kD>& s) {
  Descriptors d{};
#pragma unroll
  for (int i = 0; i < TilesOf(kKind); ++i) d.tiles[i] = Kept(BlockDescriptor<kD>(s.tiles[i].rows));
  d.a = Kept(BlockDescriptor<kD>(s.stages[0].a));
  d.b = Kept(BlockDescriptor<kD>(s.stages[0].b));
  if constexpr (kBlocks<kD> == 1) {
    d.a_wide = d.a, d.b_wide = d.b;
  } else {
    d.a_wide = Kept(sm90::SwizzledTileDescriptor(s.stages[0].a, s.stages[0].a + kChunk * kBlockOf<kD>));
    d.b_wide = Kept(sm90::SwizzledTileDescriptor(s.stages[0].b, s.stages[0].b + kChunk * kBlockOf<kD>));
  }
  if constexpr (kKind == Kind::kForward && kD == 64) {
    d.b_ones = Kept(sm90::SwizzledTileDescriptor(s.stages[0].b, s.ones.rows));
  } else if constexpr (kKind == Kind::kForward) {
    d.ones = Kept(sm90::SwizzledTileDescriptor(s.ones.rows));
  }
  return d;
}

// Stages lie this many 16-byte units apart.
template <typename T, int kD>
constexpr uint32_t kStageUnits = sizeof(Stage<T, kD>) / 16;

// Stage `stage`'s descriptor of a chunk operand whose stage-0 descriptor is `first`.
template <typename T, int kD>
__device__ __forceinline__ uint64_t AtStage(uint64_t first, int stage) {
  return sm90::DescriptorPlus(first, stage * kStageUnits<T, kD>);
}

// Issues S = A B^T of a tile and a staged chunk's rows (kD / 16 k16 steps, 4 a block, by their first blocks'
// descriptors), to be committed by the caller.
template <typename T, int kD>
__device__ __forceinline__ void IssueTransposed(float (&s)[kChunk / 2], uint64_t a, uint64_t b) {
  sm90::FenceRegisters(s);
  sm90::WgmmaFence();
#pragma unroll
  for (int ks = 0; ks < kD / 16; ++ks) {
    const uint32_t block = ks / (kBlockOf<kD> / 16), step = 2 * (ks % (kBlockOf<kD> / 16));
    sm90::WgmmaM64N32K16SharedA<T>(s, sm90::DescriptorPlus(a, block * kTileBlockUnits<kD> + step),
                                   sm90::DescriptorPlus(b, block * kChunkBlockUnits<kD> + step), ks > 0);
  }
}

// Scores rounded to T as the A fragments of a product (columns 16 kk .. 16 kk + 15 of the score tile).
template <typename T>
__device__ __forceinline__ void Pack(uint32_t (&a)[kChunk / 16][4], const float (&scores)[kChunk / 2]) {
#pragma unroll
  for (int kk = 0; kk < kChunk / 16; ++kk) {
#pragma unroll
    for (int i = 0; i < 4; ++i) a[kk][i] = PackPair<T>(scores[8 * kk + 2 * i], scores[8 * kk + 2 * i + 1]);
  }
}

// d += A B for one k16 step: A in registers, B an MN-major tile of kD columns (its k16 rows by `rows`).
template <typename T, int kD>
__device__ __forceinline__ void WgmmaRowsK16(float (&d)[kD / 2], const uint32_t (&a)[4], uint64_t rows) {
  if constexpr (kD == 32) {
    sm90::WgmmaM64N32K16<T, 1>(d, a, rows, 1);
  } else if constexpr (kD == 64) {
    sm90::WgmmaM64N64K16<T, 1>(d, a, rows, 1);
  } else {
    static_assert(kD == 128, "head dims 32, 64 and 128");
    sm90::WgmmaM64N128K16<T, 1>(d, a, rows, 1);
  }
}

// A k16 step's rows of an MN-major chunk operand lie this many 16-byte units past the previous step's (the ones
// tile's: kRowsK16Units<64>).
template <int kD>
constexpr uint32_t kRowsK16Units = 16 * kBlockOf<kD> * 2 / 16;

// Issues d += A B as one group: A the rounded scores of a chunk (dS; P^T, dS^T), B a staged chunk's rows (by their
// MN-major descriptor, a_wide or b_wide).
template <typename T, int kD>
__device__ __forceinline__ void IssueAccumulate(float (&d)[kD / 2], uint32_t (&a)[kChunk / 16][4], uint64_t rows) {
#pragma unroll
  for (int kk = 0; kk < kChunk / 16; ++kk) sm90::FenceRegisters(a[kk]);
  sm90::FenceRegisters(d);
  sm90::WgmmaFence();
#pragma unroll
  for (int kk = 0; kk < kChunk / 16; ++kk) {
    WgmmaRowsK16<T, kD>(d, a[kk], sm90::DescriptorPlus(rows, kRowsK16Units<kD> * kk));
  }
  sm90::WgmmaCommit();
}

// Issues [O | sums] += P [V | 1] as one group (P the rounded probabilities of a chunk): at head dim 64 by `rows`,
// the descriptor of its staged V with the ones tile as V's next block of columns (one m64n72 a k16 step); at 32
// and 128 by `rows`, V's MN-major descriptor, and `ones`, the ones tile's (an m64nkD and an m64n8 a k16 step).
template <typename T, int kD>
__device__ __forceinline__ void IssueProductsAndSums(float (&o)[kForwardAccumulators<kD>],
                                                     uint32_t (&prob)[kChunk / 16][4], uint64_t rows, uint64_t ones) {
#pragma unroll
  for (int kk = 0; kk < kChunk / 16; ++kk) sm90::FenceRegisters(prob[kk]);
  sm90::FenceRegisters(o);
  sm90::WgmmaFence();
#pragma unroll
  for (int kk = 0; kk < kChunk / 16; ++kk) {
    if constexpr (kD == 64) {
      sm90::WgmmaM64N72K16<T>(o, prob[kk], sm90::DescriptorPlus(rows, kRowsK16Units<kD> * kk), 1);
    } else {
      auto& values = reinterpret_cast<float(&)[kD / 2]>(o);
      auto& sums = reinterpret_cast<float(&)[4]>(o[kD / 2]);
      WgmmaRowsK16<T, kD>(values, prob[kk], sm90::DescriptorPlus(rows, kRowsK16Units<kD> * kk));
      sm90::WgmmaM64N8K16<T, 1>(sums, prob[kk], sm90::DescriptorPlus(ones, kRowsK16Units<64> * kk), 1);
    }
  }
  sm90::WgmmaCommit();
}

// A consumer warpgroup's walk over its tile's chunks, in FlashAttention-3's intra-warpgroup order: with chunk j's
// operands formed and rounded, issue_scores(stage j + 1) (kScoreGroups groups, committed), issue_products(stage j)
// (kProductGroups groups), then per score group g: wait for it, fence_scores(g), form(j + 1, g), while the later
// groups run; then wait for the products, release stage j, round() chunk j + 1. fence_products fences the
// registers the products completed.
template <int kScoreGroups, int kProductGroups, typename SharedState, typename IssueScores, typename Form,
          typename IssueProducts, typename Round, typename FenceScores, typename FenceProducts>
__device__ __forceinline__ void WalkChunks(SharedState& s, int count, const IssueScores& issue_scores, const Form& form,
                                           const IssueProducts& issue_products, const Round& round,
                                           const FenceScores& fence_scores, const FenceProducts& fence_products) {
  static_assert(kScoreGroups == 1 || kScoreGroups == 2, "one or two groups of scores a chunk");
  // Chunk i's score groups, each formed as soon as it is complete; kLater groups were committed after them.
  const auto form_scores = [&](auto later, int i) {
    constexpr int kLater = decltype(later)::value;
    if constexpr (kScoreGroups == 2) {
      sm90::WgmmaWait<kLater + 1>();
      fence_scores(0);
      form(i, 0);
    }
    sm90::WgmmaWait<kLater>();
    fence_scores(kScoreGroups - 1);
    form(i, kScoreGroups - 1);
  };
  MbarrierWait(&s.full[0], 0);
  issue_scores(0);
  form_scores(std::integral_constant<int, 0>{}, 0);
  round();
  for (int j = 0; j + 1 < count; ++j) {
    const int next = (j + 1) % kStages;
    MbarrierWait(&s.full[next], ((j + 1) / kStages) & 1);
    issue_scores(next);
    issue_products(j % kStages);
    form_scores(std::integral_constant<int, kProductGroups>{}, j + 1);
    sm90::WgmmaWait<0>();
    fence_products();
    MbarrierArrive(&s.empty[j % kStages]);
    round();
  }
  issue_products((count - 1) % kStages);
  sm90::WgmmaWait<0>();
  fence_products();
}

// The backward's two score groups: group 0 completes S (or S^T) in `scores`, group 1 dP (or dP^T) in `dp`.
template <int N>
__device__ __forceinline__ void FenceScoreGroup(int group, float (&scores)[N], float (&dp)[N]) {
  if (group == 0) {
    sm90::FenceRegisters(scores);
  } else {
    sm90::FenceRegisters(dp);
  }
}

// Stores the thread's rows of a 64 x kD float32 accumulator (the first kD columns of d), times `factor`, into `to`
// ([slab points, kD] of the walking grid; float32 where `f32`, else T).
template <typename T, int kD, int N>
__device__ __forceinline__ void StoreRows(const Problem& p, const ThreadPoints& points, void* to, const float (&d)[N],
                                          const float (&factor)[2], bool f32) {
  static_assert(N >= kD / 2, "an accumulator of kD columns or more");
  const Slab slab = SlabOf(p);
  const int t = threadIdx.x % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (!points.real[h]) continue;
    const size_t at = PointIndex(p, slab, p.nlat_walk, p.nlon_walk, points.row, points.lon[h]) * kD + 2 * t;
    if (f32) {
      float* row = static_cast<float*>(to) + at;
#pragma unroll
      for (int j = 0; j < kD / 8; ++j) {
        *reinterpret_cast<float2*>(row + 8 * j) = make_float2(d[4 * j + 2 * h] * factor[h], d[4 * j + 2 * h + 1] * factor[h]);
      }
    } else {
      T* row = static_cast<T*>(to) + at;
#pragma unroll
      for (int j = 0; j < kD / 8; ++j) {
        *reinterpret_cast<uint32_t*>(row + 8 * j) =
            PackPair<T>(d[4 * j + 2 * h] * factor[h], d[4 * j + 2 * h + 1] * factor[h]);
      }
    }
  }
}

// The forward of the consumer warpgroup: per chunk S = Q K^T, the mask and online softmax, O += P V and the row
// sums of the rounded P (both rescaled just before the products are issued); out and lse at the end.
template <typename T, int kD>
__device__ void ConsumeForward(const Problem& p, Shared<T, Kind::kForward, kD>& s, int tile, int count) {
  const int warp = threadIdx.x / 32 % 4, t = threadIdx.x % 4;
  const ThreadPoints points = PointsOf(p, tile);
  float o[kForwardAccumulators<kD>] = {}, m[2] = {kNegInf, kNegInf}, l[2] = {0.f, 0.f}, scores[kChunk / 2];
  float correction[2];
  uint32_t prob[kChunk / 16][4];
  const Descriptors d = DescriptorsOf(s);
  const auto softmax = [&](int i, int) {  // S(i) complete in scores: P(i) in place
    const ChunkInfo& info = s.info[i % kStages];
    Mask(scores, p, info, warp, points, t);
    Exponentiate(scores, info.bias, p.scale_log2, m, l, correction);
  };
  MbarrierWait(&s.tiles_full, 0);
  WalkChunks<1, 1>(
      s, count,
      [&](int stage) {
        IssueTransposed<T, kD>(scores, d.tiles[0], AtStage<T, kD>(d.a, stage));
        sm90::WgmmaCommit();
      },
      softmax,
      [&](int stage) {
        Rescale(o, correction);
        if constexpr (kD == 64) {
          IssueProductsAndSums<T, kD>(o, prob, sm90::DescriptorFirstBlockPlus(d.b_ones, stage * kStageUnits<T, kD>), 0);
        } else {
          IssueProductsAndSums<T, kD>(o, prob, AtStage<T, kD>(d.b_wide, stage), d.ones);
        }
      },
      [&] { Pack<T>(prob, scores); }, [&](int) { sm90::FenceRegisters(scores); }, [&] { sm90::FenceRegisters(o); });
  // lse from the float32 sums; out divided by the sums of P as rounded for P V (every column of the sums' 8 of
  // row h holds the whole row's: o[kD / 2 + 2 h]).
  const Slab slab = SlabOf(p);
  float inverse[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    const float sum = o[kD / 2 + 2 * h];
    inverse[h] = sum > 0.f ? 1.f / sum : 0.f;
    if (points.real[h] && t == 0) {
      p.lse_out[PointIndex(p, slab, p.nlat_walk, p.nlon_walk, points.row, points.lon[h])] =
          !(l[h] == 0.f) ? (m[h] + log2f(l[h])) * kLn2 : kNegInf;  // no neighbour: -inf; a NaN sum stays NaN
    }
  }
  StoreRows<T, kD>(p, points, p.out, o, inverse, p.f32_results);
  if (p.out_f32 != nullptr) StoreRows<T, kD>(p, points, p.out_f32, o, inverse, true);
}

// dq forming delta: delta = sum(dout * out, -1) - dlse of the thread's two walking points (0 off the grid). A
// point's four threads each sum its channels 8 j + 2 t and 8 j + 2 t + 1 in order, then the four sums are added
// across them (xor 1, then 2): a fixed order, the same bits in every run and in all four threads. t = 0 writes it.
template <typename T, int kD>
__device__ __forceinline__ void FormDelta(const Problem& p, const ThreadPoints& points, float (&delta)[2]) {
  const Slab slab = SlabOf(p);
  const int t = threadIdx.x % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = 0.f;
    size_t point = 0;
    if (points.real[h]) {
      point = PointIndex(p, slab, p.nlat_walk, p.nlon_walk, points.row, points.lon[h]);
      const float* out = p.forward_out + point * kD + 2 * t;
      const T* dout = static_cast<const T*>(p.dout) + point * kD + 2 * t;
#pragma unroll
      for (int j = 0; j < kD / 8; ++j) {
        const float2 o = __ldg(reinterpret_cast<const float2*>(out + 8 * j));
        const float2 g = UnpackPair<T>(__ldg(reinterpret_cast<const uint32_t*>(dout + 8 * j)));
        sum = fmaf(g.x, o.x, sum);
        sum = fmaf(g.y, o.y, sum);
      }
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    delta[h] = points.real[h] ? sum - __ldg(p.dlse + point) : 0.f;
    if (points.real[h] && t == 0) p.delta_out[point] = delta[h];
  }
}

// dq of the consumer warpgroup, in the forward's order: per chunk j + 1 issue S(j+1) = Q K^T and dP(j+1) = dO V^T
// as two groups, issue dq += dS(j) K(j), wait for S, form P = exp2(S scale log2(e) + bias - lse log2(e)) on the
// chunk's mask while dP and dq's product run, wait for dP, then form dS(j+1) = P (dP - delta).
template <typename T, int kD>
__device__ void ConsumeDq(const Problem& p, Shared<T, Kind::kDq, kD>& s, int tile, int count) {
  const int warp = threadIdx.x / 32 % 4, t = threadIdx.x % 4;
  const ThreadPoints points = PointsOf(p, tile);
  const Slab slab = SlabOf(p);
  float lse_log2[2] = {0.f, 0.f}, delta[2] = {0.f, 0.f};
  if (p.delta_out != nullptr) FormDelta<T, kD>(p, points, delta);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (points.real[h]) {
      const size_t point = PointIndex(p, slab, p.nlat_walk, p.nlon_walk, points.row, points.lon[h]);
      lse_log2[h] = Log2Lse(__ldg(p.lse + point));
      if (p.delta_out == nullptr) delta[h] = __ldg(p.delta + point);
    }
  }
  float dq[kD / 2] = {}, scores[kChunk / 2], dp[kChunk / 2];
  uint32_t ds[kChunk / 16][4];
  const Descriptors d = DescriptorsOf(s);
  const auto issue_scores = [&](int stage) {  // S, then dP: two groups
    IssueTransposed<T, kD>(scores, d.tiles[0], AtStage<T, kD>(d.a, stage));
    sm90::WgmmaCommit();
    IssueTransposed<T, kD>(dp, d.tiles[1], AtStage<T, kD>(d.b, stage));
    sm90::WgmmaCommit();
  };
  // S(i) complete: P(i) into scores, while dP(i) runs; then dP(i) complete: dS(i) into scores.
  const auto score_gradients = [&](int i, int group) {
    if (group == 0) {
      const ChunkInfo& info = s.info[i % kStages];
      Mask(scores, p, info, warp, points, t);
#pragma unroll
      for (int e = 0; e < kChunk / 2; ++e) {
        scores[e] = Exp2(fmaf(scores[e], p.scale_log2, info.bias - lse_log2[(e >> 1) & 1]));
      }
    } else {
#pragma unroll
      for (int e = 0; e < kChunk / 2; ++e) scores[e] *= dp[e] - delta[(e >> 1) & 1];
    }
  };
  MbarrierWait(&s.tiles_full, 0);
  WalkChunks<2, 1>(
      s, count, issue_scores, score_gradients,
      [&](int stage) { IssueAccumulate<T, kD>(dq, ds, AtStage<T, kD>(d.a_wide, stage)); },
      [&] { Pack<T>(ds, scores); },
      [&](int group) { FenceScoreGroup(group, scores, dp); },
      [&] { sm90::FenceRegisters(dq); });
  const float scale[2] = {p.scale, p.scale};
  StoreRows<T, kD>(p, points, p.dq, dq, scale, p.f32_results);
}

// dk and dv of the consumer warpgroup over a tile of keys, walking the backward schedule: per chunk of 32 queries
// j + 1 issue S^T(j+1) = K Q^T and dP^T(j+1) = V dO^T as two groups, issue dv += P^T(j) dO(j) and
// dk += dS^T(j) Q(j), wait for S^T, form P^T = exp2(S^T scale log2(e) + key weight - lse log2(e)) on the chunk's
// mask while dP^T and both products run, wait for dP^T, then form dS^T = P^T (dP^T - delta).
template <typename T, int kD>
__device__ void ConsumeDkv(const Problem& p, Shared<T, Kind::kDkv, kD>& s, int tile, int count) {
  const int warp = threadIdx.x / 32 % 4, t = threadIdx.x % 4;
  const ThreadPoints points = PointsOf(p, tile);
  float key_bias[2];  // of the thread's two key points (on regular grids their one row)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    key_bias[h] = p.ring_grids ? KeyBias(p, points.lon[h], p.nlon_walk) : KeyBias(p, points.row, p.nlat_walk);
  }
  float dk[kD / 2] = {}, dv[kD / 2] = {}, scores[kChunk / 2], dp[kChunk / 2];
  uint32_t prob[kChunk / 16][4], grad[kChunk / 16][4];
  const Descriptors d = DescriptorsOf(s);
  const auto issue_scores = [&](int stage) {  // S^T, then dP^T: two groups
    IssueTransposed<T, kD>(scores, d.tiles[0], AtStage<T, kD>(d.a, stage));
    sm90::WgmmaCommit();
    IssueTransposed<T, kD>(dp, d.tiles[1], AtStage<T, kD>(d.b, stage));
    sm90::WgmmaCommit();
  };
  // S^T(i) complete: P^T(i) into scores, while dP^T(i) runs; then dP^T(i) complete: dS^T(i) into dp.
  const auto gradients = [&](int i, int group) {
    const ChunkInfo& info = s.info[i % kStages];
    if (group == 0) {
      Mask(scores, p, info, warp, points, t);
#pragma unroll
      for (int e = 0; e < kChunk / 2; ++e) {
        const float bias = key_bias[(e >> 1) & 1] - info.lse_log2[2 * t + ColumnOf(e)];
        scores[e] = Exp2(fmaf(scores[e], p.scale_log2, bias));
      }
    } else {
#pragma unroll
      for (int e = 0; e < kChunk / 2; ++e) dp[e] = scores[e] * (dp[e] - info.delta[2 * t + ColumnOf(e)]);
    }
  };
  MbarrierWait(&s.tiles_full, 0);
  WalkChunks<2, 2>(
      s, count, issue_scores, gradients,
      [&](int stage) {
        IssueAccumulate<T, kD>(dv, prob, AtStage<T, kD>(d.b_wide, stage));
        IssueAccumulate<T, kD>(dk, grad, AtStage<T, kD>(d.a_wide, stage));
      },
      [&] {
        Pack<T>(prob, scores);
        Pack<T>(grad, dp);
      },
      [&](int group) { FenceScoreGroup(group, scores, dp); },
      [&] {
        sm90::FenceRegisters(dk);
        sm90::FenceRegisters(dv);
      });
  const float scale[2] = {p.scale, p.scale}, one[2] = {1.f, 1.f};
  StoreRows<T, kD>(p, points, p.dk, dk, scale, p.f32_results);
  StoreRows<T, kD>(p, points, p.dv, dv, one, p.f32_results);
}

// The results of a tile without chunks (its points see no other point): zeros, and lse -inf.
template <typename T, Kind kKind, int kD>
__device__ void WriteEmpty(const Problem& p, int tile) {
  const ThreadPoints points = PointsOf(p, tile);
  const float zeros[kD / 2] = {}, factor[2] = {1.f, 1.f};
  if constexpr (kKind == Kind::kForward) {
    StoreRows<T, kD>(p, points, p.out, zeros, factor, p.f32_results);
    if (p.out_f32 != nullptr) StoreRows<T, kD>(p, points, p.out_f32, zeros, factor, true);
    const Slab slab = SlabOf(p);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (points.real[h] && threadIdx.x % 4 == 0) {
        p.lse_out[PointIndex(p, slab, p.nlat_walk, p.nlon_walk, points.row, points.lon[h])] = kNegInf;
      }
    }
  } else if constexpr (kKind == Kind::kDq) {
    StoreRows<T, kD>(p, points, p.dq, zeros, factor, p.f32_results);
    if (p.delta_out != nullptr) {  // dk/dv reads every point's delta, these too
      float delta[2];
      FormDelta<T, kD>(p, points, delta);
    }
  } else {
    StoreRows<T, kD>(p, points, p.dk, zeros, factor, p.f32_results);
    StoreRows<T, kD>(p, points, p.dv, zeros, factor, p.f32_results);
  }
}

template <typename T, Kind kKind, int kD>
__global__ void __launch_bounds__(ThreadsOf(kKind, kD), BlocksPerSm(kKind, kD))
    ScheduledAttention(const Problem p, const __grid_constant__ Maps maps) {
#if defined(S2ATTN_HOST_EMULATION) || (defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL))
  constexpr int kConsumers = ConsumersOf(kKind, kD);
  auto* base = reinterpret_cast<unsigned char*>(DynamicShared());
  base += (1024 - reinterpret_cast<uintptr_t>(base) % 1024) % 1024;
  auto* rings = reinterpret_cast<Shared<T, kKind, kD>*>(base);  // a consumer's each
  if constexpr (kKind == Kind::kForward) {  // the ones tiles: 4 KiB each, 16 bytes a thread
    const uint32_t one = PackPair<T>(1.f, 1.f);
    for (int c = 0; c < kConsumers; ++c) {
      for (int i = threadIdx.x; i < int(sizeof(OnesTile<T>) / 16); i += ThreadsOf(kKind, kD)) {
        reinterpret_cast<uint4*>(rings[c].ones.rows)[i] = make_uint4(one, one, one, one);
      }
    }
    sm90::FenceSharedForWgmma();
  }
  if (threadIdx.x == 0) {
    for (int c = 0; c < kConsumers; ++c) {
      for (int i = 0; i < kStages; ++i) {
        MbarrierInit(&rings[c].full[i], 32);
        MbarrierInit(&rings[c].empty[i], 128);
      }
      MbarrierInit(&rings[c].tiles_full, 1);
    }
    MbarrierInitFence();
  }
  __syncthreads();
  // Warpgroups 0 .. kConsumers - 1 consume, the last produces: its warp c for consumer c. Each role's code lies
  // wholly inside its branch, after its setmaxnreg, so that ptxas allocates it within that count.
  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == kConsumers) {
    if constexpr (kConsumers > 1) sm90::LowerRegisters<kProducerRegisters>();
    const int consumer = kConsumers == 1 ? 0 : threadIdx.x / 32 % 4, tile = blockIdx.x * kConsumers + consumer;
    if (consumer < kConsumers && tile < p.num_tiles) {  // else a spare warp, or past the schedule
      const int2 chunks = TileChunks(p, tile);
      if (chunks.y > 0) Produce<T, kKind, kD>(p, maps, rings[consumer], tile, chunks.x, chunks.y);
    }
  } else {
    if constexpr (kConsumers > 1) sm90::RaiseRegisters<kConsumerRegisters>();
    const int consumer = kConsumers == 1 ? 0 : warpgroup, tile = blockIdx.x * kConsumers + consumer;
    if (tile >= p.num_tiles) return;
    Shared<T, kKind, kD>& s = rings[consumer];
    const int2 chunks = TileChunks(p, tile);
    if (chunks.y == 0) {
      WriteEmpty<T, kKind, kD>(p, tile);
    } else if constexpr (kKind == Kind::kForward) {
      ConsumeForward<T, kD>(p, s, tile, chunks.y);
    } else if constexpr (kKind == Kind::kDq) {
      ConsumeDq<T, kD>(p, s, tile, chunks.y);
    } else {
      ConsumeDkv<T, kD>(p, s, tile, chunks.y);
    }
  }
#endif
}

// ------------------------------------------------------------------------------------------------ host

// A 5-D map of [batch, nlat, nlon, heads, head_dim] 16-bit activations with boxes of one block of `block` (64 or 32)
// elements, swizzled over its width, of `box_lons` x `box_rows` points of one head (the producer asks for
// head_dim / block boxes per operand).
inline bool EncodeActivations(CUtensorMap* map, ActivationType dtype, const void* data, int64_t batch, int nlat,
                              int nlon, int64_t heads, int head_dim, int block, int box_lons, int box_rows) {
  const sm90::EncodeTiled encode = sm90::FindEncodeTiled();
  if (encode == nullptr) return false;
  const cuuint64_t dims[5] = {cuuint64_t(head_dim), cuuint64_t(heads), cuuint64_t(nlon), cuuint64_t(nlat),
                              cuuint64_t(batch)};
  const cuuint64_t point = cuuint64_t(head_dim) * 2;
  const cuuint64_t strides[4] = {point, point * heads, point * heads * nlon, point * heads * nlon * nlat};
  const cuuint32_t box[5] = {cuuint32_t(block), 1, cuuint32_t(box_lons), cuuint32_t(box_rows), 1};
  const cuuint32_t element_strides[5] = {1, 1, 1, 1, 1};
  const CUtensorMapDataType type =
      dtype == ActivationType::kF16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  return encode(map, type, 5, const_cast<void*>(data), dims, strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, block == 64 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Launches kind kKind of a call on its schedule: tensor maps of the walking and the other grid's operands, then
// one launch per kMaxGridYZ slabs.
template <typename T, Kind kKind, int kD>
cudaError_t LaunchKind(cudaStream_t stream, const SchedAttnParams& g) {
  const bool walk_keys = kKind == Kind::kDkv;
  Problem p{};
  p.nlat_walk = walk_keys ? g.nlat_k : g.nlat_q;
  p.nlon_walk = walk_keys ? g.nlon_k : g.nlon_q;
  p.nlat_other = walk_keys ? g.nlat_q : g.nlat_k;
  p.nlon_other = walk_keys ? g.nlon_q : g.nlon_k;
  p.ring_nlon = g.ring_nlon;
  p.ring_grids = g.ring_grids;
  p.heads = static_cast<int>(g.heads);
  p.tiles = g.tiles, p.tile_offsets = g.tile_offsets, p.chunks = g.chunks;
  p.records = reinterpret_cast<const int2*>(g.records);
  p.num_chunks = static_cast<int>(g.num_chunks), p.num_stagings = static_cast<int>(g.num_stagings);
  p.classes = g.classes, p.shift = g.shift;
  p.num_tiles = static_cast<int>(g.num_tiles);
  p.quad_weights = g.quad_weights;
  p.scale = g.scale, p.scale_log2 = g.scale * kLog2e;
  p.lse = g.lse, p.delta = g.delta;
  p.dout = g.dout, p.forward_out = g.forward_out, p.dlse = g.dlse, p.delta_out = g.delta_out;
  p.f32_results = g.result_dtype == ActivationType::kF32;
  p.out = g.out, p.out_f32 = g.out_f32, p.lse_out = g.lse_out, p.dq = g.dq, p.dk = g.dk, p.dv = g.dv;

  Maps maps;
  const void* walk_data[2] = {walk_keys ? g.k : g.q, walk_keys ? g.v : (kKind == Kind::kForward ? g.q : g.dout)};
  const void* other_data[2] = {walk_keys ? g.q : g.k, walk_keys ? g.dout : g.v};
  for (int i = 0; i < 2; ++i) {
    if (!EncodeActivations(&maps.tiles[i], g.dtype, walk_data[i], g.batch, p.nlat_walk, p.nlon_walk, g.heads, kD,
                           kBlockOf<kD>, g.ring_grids ? kRunPoints : kTileCols, g.ring_grids ? 1 : kTileRows)) {
      return cudaErrorInvalidValue;
    }
  }
  if (!EncodeActivations(&maps.a, g.dtype, other_data[0], g.batch, p.nlat_other, p.nlon_other, g.heads, kD,
                         kBlockOf<kD>, kChunk, 1) ||
      !EncodeActivations(&maps.b, g.dtype, other_data[1], g.batch, p.nlat_other, p.nlon_other, g.heads, kD,
                         kBlockOf<kD>, kChunk, 1)) {
    return cudaErrorInvalidValue;
  }
  constexpr int kConsumers = ConsumersOf(kKind, kD);
  const int shared = kConsumers * static_cast<int>(sizeof(Shared<T, kKind, kD>)) + 1024;  // + the alignment
  cudaError_t status =
      cudaFuncSetAttribute(ScheduledAttention<T, kKind, kD>, cudaFuncAttributeMaxDynamicSharedMemorySize, shared);
  const int64_t slabs = g.batch * g.heads;
  for (int64_t first = 0; status == cudaSuccess && first < slabs; first += kMaxGridYZ) {
    p.first_slab = first;
    void* args[2] = {&p, &maps};
    // Through cudaLaunchKernel (not <<< >>>), so that the kernels also build for the host emulation.
    status = cudaLaunchKernel(ScheduledAttention<T, kKind, kD>,
                              dim3(static_cast<unsigned>((g.num_tiles + kConsumers - 1) / kConsumers),
                                   static_cast<unsigned>(std::min(slabs - first, kMaxGridYZ))),
                              dim3(ThreadsOf(kKind, kD)), args, shared, stream);
  }
  return status;
}

// The launcher of kKind for the call's head dim (kSchedHeadDims) and activation type.
template <Kind kKind, int kD>
cudaError_t LaunchHeadDim(cudaStream_t stream, const SchedAttnParams& g) {
  return g.dtype == ActivationType::kF16 ? LaunchKind<__half, kKind, kD>(stream, g)
                                         : LaunchKind<__nv_bfloat16, kKind, kD>(stream, g);
}

template <Kind kKind>
cudaError_t Launch(cudaStream_t stream, const SchedAttnParams& g) {
  static_assert(sizeof(kSchedHeadDims) / sizeof(int) == 3 && kSchedHeadDims[0] == 32 && kSchedHeadDims[1] == 64 &&
                    kSchedHeadDims[2] == 128,
                "a launcher per head dim of kSchedHeadDims");
  if (g.num_tiles == 0 || g.batch * g.heads == 0) return cudaSuccess;
  if (g.ring_nlon < 1) return cudaErrorInvalidValue;
  switch (g.head_dim) {
    case 32:
      return LaunchHeadDim<kKind, 32>(stream, g);
    case 64:
      return LaunchHeadDim<kKind, 64>(stream, g);
    case 128:
      return LaunchHeadDim<kKind, 128>(stream, g);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace sched
}  // namespace gpu
}  // namespace s2attn
