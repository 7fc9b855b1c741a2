// Attention forward, dq and dk/dv driven by the plan's block-sparse schedules (jax_s2attn/schedule.py), on Hopper:
// experimental/scheduled_attention.py builds the plan, writes the schedule and random inputs into a
// directory, runs this program on it and checks its results against float64.
//
// A block takes one tile of the schedule (blocks in the schedule's work order, longest first). Its
// producer warp asks for tensor-map boxes of the tile's 4 x 16 walking points, then, per chunk of the tile's
// list, copies the chunk's description into shared memory (read 32 chunks at a time, a lane per chunk)
// and asks for two boxes (K and V; Q and dO for dk/dv), into a kStages-deep mbarrier ring. Its consumer warpgroup
// multiplies: S = Q K^T (wgmma, Q and K in shared memory), the chunk's mask, the online softmax in log2
// units with the key row's log2 weight folded into the exponent, O += P V (m64n64k16, P from registers,
// rounded once to bf16) and the row sums of that rounded P (m64n8k16 against a tile of ones: out divides
// by them, so that its weights sum to one like the backward's P, which keeps a delta formed from out
// consistent with them on smooth fields; lse comes from float32 sums). Per chunk it issues the next S, rescales O and the sums and issues this
// chunk's products, then runs the next chunk's mask and softmax while they run (FlashAttention-3's
// intra-warpgroup order: no instruction touches the registers of a wgmma in flight, so ptxas keeps them
// asynchronous).
//
// The geometry is all on the host. Per chunk the kernel reads (other row, longitude, offset, valid,
// flags, staging) and, per point, the staging record (start, length) of its row and class; FULL chunks
// take no mask, partial chunks one interval test per element (an add, an unsigned compare, a select),
// RING chunks (the window is the whole ring) two; the flags branch once per chunk, never per element.
//
// dq walks the same schedule with q and dout staged once per tile: per chunk S = Q K^T and dP = dO V^T
// (one group), then dS = P (dP - delta) with P from the forward's lse, and dq += dS K while the next
// chunk's products run. dk/dv walks the backward schedule (key tiles, k and v staged once; chunks of q and
// dout with their queries' lse and delta): S^T, dP^T, then dv += P^T dO and dk += dS^T Q.
//
// bf16, one head of 64 channels, any two grids the plan supports (the schedule carries the direction's
// classes and shift). Results: out (bf16; float32 for the differentiated forward) and lse (float32, natural
// log); dq, dk, dv (float32). Standalone: not part of the package.
//
// Usage: scheduled_attention forward|dq|dkv <directory> [reps]  (the directory as scheduled_attention.py writes it)
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <type_traits>
#include <vector>

#include "bench_common.h"
#include "gpu/device_common.cuh"
#include "gpu/mbarrier_sm90.cuh"
#include "gpu/tma_sm90.cuh"
#include "gpu/wgmma_sm90.cuh"

namespace {

using s2attn::gpu::Exp2;
using s2attn::gpu::kLn2;
using s2attn::gpu::MbarrierArrive;
using s2attn::gpu::MbarrierInit;
using s2attn::gpu::MbarrierInitFence;
using s2attn::gpu::MbarrierWait;
using s2attn::gpu::PackPair;
namespace sm90 = s2attn::gpu::sm90;
using T = __nv_bfloat16;

#ifndef SF_STAGES
#define SF_STAGES 4
#endif
// Blocks per SM the kernels ask for (dq holds S, dP and dq, dk/dv S, dP, dk and dv: with more blocks, and
// so fewer registers, ptxas serialises their wgmmas).
#ifndef SF_MIN_BLOCKS
#define SF_MIN_BLOCKS 4
#endif
#ifndef SF_DQ_BLOCKS
#define SF_DQ_BLOCKS 3
#endif
#ifndef SF_DKV_BLOCKS
#define SF_DKV_BLOCKS 2
#endif
// Diagnostic builds of the forward, wrong on purpose (docs/performance.md, "Fast path v2"): 1 no mask,
// 2 no softmax (P = the masked scores), 3 no products, 4 the consumers only wait for and release each chunk.
#ifndef SF_DIAGNOSTIC
#define SF_DIAGNOSTIC 0
#endif
constexpr int kD = 64;
constexpr int kTileRows = 4, kTileCols = 16;  // the schedule's tile: one wgmma M of 64 queries
#ifndef SF_CHUNK
#define SF_CHUNK 32
#endif
constexpr int kChunk = SF_CHUNK;  // the schedule's chunk_cols: 32 or 64 (the N of S = Q K^T)
constexpr int kStages = SF_STAGES;
static_assert(kStages >= 2, "a consumer holds one stage while it waits for the next");
constexpr int kThreads = 128 + 32;  // one consumer warpgroup, one producer warp
constexpr int kChunkBytes = kChunk * kD * 2;
constexpr int kChunkFields = 6;  // (other row, longitude, offset, valid, flags, staging)
constexpr int kFull = 1, kRing = 2;  // jax_s2attn.schedule.FULL, RING

// A staged chunk: rows of the other grid, k and v (forward, dq) or q and dout (dk/dv).
struct alignas(1024) Stage {
  T a[kChunk * kD];
  T b[kChunk * kD];
};

// 16 rows of ones in the swizzled tile layout: the B of the forward's row sums (P times a column of ones: the
// sums of P as rounded for P V, which out is divided by).
struct alignas(1024) OnesTile {
  T rows[16 * kD];
};
struct NoTile {};

// Operands of a tile's 64 walking points, staged once per block.
struct alignas(1024) PointTile {
  T rows[kTileRows * kTileCols * kD];  // tile row x longitude, as the box lays them out
};

// What the producer warp copies from the schedule for a staged chunk (before the stage's barrier).
struct ChunkInfo {
  int offset, valid, flags;
  float bias;                           // log2 of the key row's quadrature weight
  int2 records[kTileRows * kTileCols];  // the staging's (start, length) per tile row and class
  float lse_log2[kChunk], delta[kChunk];  // dk/dv: of the chunk's queries (+inf and 0 past `valid`)
};

// The kernels: forward and dq walk the forward schedule (query tiles over key chunks), dk/dv the backward
// one (key tiles over query chunks).
enum class Kind { kForward, kDq, kDkv };
// Walking-grid tiles a kernel stages once: q; q and dout; k and v.
__host__ __device__ constexpr int TilesOf(Kind kind) { return kind == Kind::kForward ? 1 : 2; }

template <Kind kKind>
struct Shared {
  Stage stages[kStages];
  PointTile tiles[TilesOf(kKind)];
  std::conditional_t<kKind == Kind::kForward, OnesTile, NoTile> ones;
  ChunkInfo info[kStages];
  uint64_t full[kStages];
  uint64_t empty[kStages];
  uint64_t q_full;
};

// The walking tiles (q; q, dout; k, v) and the other grid's chunks (k, v; or q, dout).
struct Maps {
  CUtensorMap tiles[2], a, b;
};

struct Problem {
  int nlat_walk, nlon_walk, nlon_other;  // the walking grid (queries; keys for dk/dv), the other grid's nlon
  const int* tiles;         // [tiles, 2]: first query row, first query longitude
  const int* tile_offsets;  // [tiles + 1]
  const int* chunks;        // [chunks, kChunkFields]
  const int2* records;      // [stagings, kTileRows, classes]: (start, length)
  int classes, shift;
  const float* bias;  // [key rows]: log2 of the key rows' quadrature weights
  float scale, scale_log2;  // softmax scale, and times log2(e)
  T* out;                   // [queries, kD]: the forward's result (inference: bf16)
  float* out_f32;           // [queries, kD] or null: the forward's result in float32 instead (what delta is formed from)
  float* lse;               // [queries], natural log: the forward's result, dq's and dk/dv's operand
  const float* delta;       // [queries]: sum(dout * out), dq's and dk/dv's operand
  float* dq;                // [queries, kD]: dq's result
  float *dk, *dv;           // [keys, kD]: dk/dv's results
};

// The producer warp: the tile's queries, then per chunk of its list the chunk's description and K and V
// (lane 0 asks for the boxes). The descriptions are read 32 chunks at a time, lane x the chunk x of the
// batch (with its records when a tile row has one class), so that the loop waits on global memory once
// per batch, not once per chunk. Every lane arrives on the stage's barrier after its writes.
template <Kind kKind>
__device__ void Produce(const Problem& p, const Maps& maps, Shared<kKind>& s, int first, int count) {
  const int tile = blockIdx.x, lane = threadIdx.x % 32, per_staging = kTileRows * p.classes;
  if (lane == 0) {
    sm90::MbarrierArriveExpectBytes(&s.q_full, TilesOf(kKind) * sizeof(PointTile));
    for (int i = 0; i < TilesOf(kKind); ++i) {
      sm90::LoadBox3d(s.tiles[i].rows, &maps.tiles[i], 0, p.tiles[2 * tile + 1], p.tiles[2 * tile], &s.q_full);
    }
  }
  for (int batch = 0; batch < count; batch += 32) {
    int field[kChunkFields] = {};
    float bias = 0.f;
    int2 records[kTileRows] = {};
    if (batch + lane < count) {
      const int* chunk = p.chunks + size_t(first + batch + lane) * kChunkFields;
#pragma unroll
      for (int f = 0; f < kChunkFields; ++f) field[f] = __ldg(chunk + f);
      if (kKind != Kind::kDkv) bias = __ldg(p.bias + field[0]);  // dk/dv: the key row is the tile's
      if (p.classes == 1) {
#pragma unroll
        for (int a = 0; a < kTileRows; ++a) records[a] = __ldg(p.records + size_t(field[5]) * kTileRows + a);
      }
    }
    for (int k = 0; k < 32 && batch + k < count; ++k) {
      const int i = batch + k, stage = i % kStages;
      MbarrierWait(&s.empty[stage], ((i / kStages) & 1) ^ 1);
      ChunkInfo& info = s.info[stage];
      if (lane == k) {
        info.offset = field[2], info.valid = field[3], info.flags = field[4], info.bias = bias;
        if (p.classes == 1) {
#pragma unroll
          for (int a = 0; a < kTileRows; ++a) info.records[a] = records[a];
        }
      }
      if (p.classes != 1) {  // several classes a row: the lanes copy the staging's records together
        const int2* from = p.records + size_t(__shfl_sync(0xffffffffu, field[5], k)) * per_staging;
        for (int x = lane; x < per_staging; x += 32) info.records[x] = __ldg(from + x);
      }
      const int row = __shfl_sync(0xffffffffu, field[0], k), lon = __shfl_sync(0xffffffffu, field[1], k);
      if constexpr (kKind == Kind::kDkv) {  // the chunk's queries' lse and delta, a lane per column
        const int valid = __shfl_sync(0xffffffffu, field[3], k);
        for (int x = lane; x < kChunk; x += 32) {
          const size_t point = size_t(row) * p.nlon_other + lon + x;
          info.lse_log2[x] = x < valid ? s2attn::gpu::Log2Lse(__ldg(p.lse + point)) : INFINITY;
          info.delta[x] = x < valid ? __ldg(p.delta + point) : 0.f;
        }
      }
      if (lane == 0) {
        sm90::MbarrierArriveExpectBytes(&s.full[stage], 2 * kChunkBytes);
        sm90::LoadBox3d(s.stages[stage].a, &maps.a, 0, lon, row, &s.full[stage]);
        sm90::LoadBox3d(s.stages[stage].b, &maps.b, 0, lon, row, &s.full[stage]);
      } else {
        MbarrierArrive(&s.full[stage]);
      }
    }
  }
}

// Column n of the thread's accumulator element e (m64nN layout of wgmma_sm90.cuh), less 2 t.
__host__ __device__ constexpr int ColumnOf(int e) { return 8 * (e / 4) + (e % 2); }

// A chunk as one thread needs it: the key row's log2 weight and, per accumulator row h, the columns it
// keeps: n with unsigned(n - lo) < count, or (RING) that or n < count2 (the arc's part past longitude
// nlon, from the chunk's first column).
struct ChunkMask {
  int flags;
  float bias;
  int lo[2], count[2], count2[2];
};

__device__ __forceinline__ ChunkMask MaskOf(const Problem& p, const ChunkInfo& info, int warp, const int (&u)[2],
                                            const int (&step)[2]) {
  ChunkMask m;
  const int offset = info.offset, valid = info.valid;
  m.flags = info.flags;
  m.bias = info.bias;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int2 record = info.records[warp * p.classes + u[h]];
    int start = record.x + p.shift * step[h] - offset;
    const int length = record.y;
    m.count2[h] = 0;
    if (m.flags & kRing) {
      // start modulo nlon: |start| < 2 nlon for the points that are written (offset and record.x in
      // [0, nlon), shift * step < nlon; tests/test_schedule.py checks it). Points past the grid may get
      // wrong masks: their rows are computed, not written.
      start += start < 0 ? p.nlon_other : 0;
      start -= start >= p.nlon_other ? p.nlon_other : 0;
      if (length >= p.nlon_other) {
        m.lo[h] = 0, m.count[h] = valid;
      } else {
        m.lo[h] = start, m.count[h] = max(0, min(start + length, valid) - start);
        m.count2[h] = max(0, min(start + length - p.nlon_other, valid));  // the part past longitude nlon, from 0
      }
    } else {
      m.lo[h] = start, m.count[h] = max(0, min(start + length, valid) - start);
    }
  }
  return m;
}

// Drops the columns the chunk's mask does not keep (score -inf).
__device__ __forceinline__ void ApplyMask(float (&s)[kChunk / 2], const ChunkMask& m, int t) {
  if (SF_DIAGNOSTIC == 1 || (m.flags & kFull)) return;
  // The flags are the warpgroup's: one branch per chunk, none per element (bitwise or, no short circuit).
  const bool ring = m.flags & kRing;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int base = 2 * t - m.lo[h];
    const unsigned count = m.count[h], count2 = m.count2[h];
    if (ring) {
#pragma unroll
      for (int e = 2 * h; e < kChunk / 2; e += (e % 2 == 0 ? 1 : 3)) {
        const bool keep = (unsigned(base + ColumnOf(e)) < count) | (unsigned(2 * t + ColumnOf(e)) < count2);
        s[e] = keep ? s[e] : -INFINITY;
      }
    } else {
#pragma unroll
      for (int e = 2 * h; e < kChunk / 2; e += (e % 2 == 0 ? 1 : 3)) {
        s[e] = unsigned(base + ColumnOf(e)) < count ? s[e] : -INFINITY;
      }
    }
  }
}

// The online softmax of a chunk's scores in place (s becomes P, not yet rounded), logits in log2 units
// scale_log2 * s + bias: the maxima and the float32 sums (lse's) move on; `correction` is what O and the
// rounded P's row sums must be multiplied by.
__device__ __forceinline__ void Exponentiate(float (&s)[kChunk / 2], float bias, float scale_log2, float (&m)[2],
                                             float (&l)[2], float (&correction)[2]) {
  if (SF_DIAGNOSTIC == 2) {
    correction[0] = correction[1] = 1.f;
    return;
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float row_max = -INFINITY;
#pragma unroll
    for (int e = 2 * h; e < kChunk / 2; e += (e % 2 == 0 ? 1 : 3)) row_max = fmaxf(row_max, s[e]);
    row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 1));
    row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 2));
    const float m_new = fmaxf(m[h], fmaf(row_max, scale_log2, bias));
    const float base = m_new == -INFINITY ? 0.f : m_new;  // no -inf - -inf
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

// O and the row sums (m64n8 accumulators: the same row layout) times the corrections, skipped when no
// maximum of the warp moved (every correction exactly 1).
__device__ __forceinline__ void Rescale(float (&o)[kD / 2], float (&sums)[4], const float (&correction)[2]) {
  if (__any_sync(0xffffffffu, correction[0] != 1.f || correction[1] != 1.f)) {
#pragma unroll
    for (int e = 0; e < kD / 2; ++e) o[e] *= correction[(e >> 1) & 1];
#pragma unroll
    for (int e = 0; e < 4; ++e) sums[e] *= correction[(e >> 1) & 1];
  }
}

// Issues S = A B^T of a query tile and a staged chunk's rows (4 k16 steps), to be committed by the caller.
__device__ __forceinline__ void IssueTransposed(float (&s)[kChunk / 2], const PointTile& q, const T* rows) {
  if (SF_DIAGNOSTIC == 3) return;
  const uint64_t a = sm90::SwizzledTileDescriptor(q.rows), b = sm90::SwizzledTileDescriptor(rows);
  sm90::FenceRegisters(s);
  sm90::WgmmaFence();
#pragma unroll
  for (int ks = 0; ks < kD / 16; ++ks) {
#if SF_CHUNK == 32
    sm90::WgmmaM64N32K16SharedA<T>(s, sm90::DescriptorPlus(a, 2 * ks), sm90::DescriptorPlus(b, 2 * ks), ks > 0);
#elif SF_CHUNK == 64
    sm90::WgmmaM64N64K16SharedA<T>(s, sm90::DescriptorPlus(a, 2 * ks), sm90::DescriptorPlus(b, 2 * ks), ks > 0);
#else
#error "SF_CHUNK: chunks of 32 or 64 columns"
#endif
  }
}

// P rounded to bf16 as the A fragments of P V (columns 16 kk .. 16 kk + 15 of the score tile).
__device__ __forceinline__ void Pack(uint32_t (&a)[kChunk / 16][4], const float (&prob)[kChunk / 2]) {
#pragma unroll
  for (int kk = 0; kk < kChunk / 16; ++kk) {
#pragma unroll
    for (int i = 0; i < 4; ++i) a[kk][i] = PackPair<T>(prob[8 * kk + 2 * i], prob[8 * kk + 2 * i + 1]);
  }
}

// Issues d += A B as one group: A the rounded scores of a chunk (P or dS), B a staged chunk's rows (V or K).
__device__ __forceinline__ void IssueAccumulate(float (&o)[kD / 2], uint32_t (&a)[kChunk / 16][4], const T* b) {
  if (SF_DIAGNOSTIC == 3) return;
  const uint64_t rows = sm90::SwizzledTileDescriptor(b);
#pragma unroll
  for (int kk = 0; kk < kChunk / 16; ++kk) sm90::FenceRegisters(a[kk]);
  sm90::FenceRegisters(o);
  sm90::WgmmaFence();
#pragma unroll
  for (int kk = 0; kk < kChunk / 16; ++kk) {
    sm90::WgmmaM64N64K16<T, 1>(o, a[kk], sm90::DescriptorPlus(rows, 128 * kk), 1);
  }
  sm90::WgmmaCommit();
}

// Issues O += P V and the row sums += P 1 as one group (P the rounded probabilities of a chunk, V its staged
// rows, 1 the ones tile: every k16 step reads the same 16 rows of ones).
__device__ __forceinline__ void IssueProductsAndSums(float (&o)[kD / 2], float (&sums)[4],
                                                     uint32_t (&prob)[kChunk / 16][4], const T* v, const T* ones) {
  if (SF_DIAGNOSTIC == 3) return;
  const uint64_t rows = sm90::SwizzledTileDescriptor(v), column = sm90::SwizzledTileDescriptor(ones);
#pragma unroll
  for (int kk = 0; kk < kChunk / 16; ++kk) sm90::FenceRegisters(prob[kk]);
  sm90::FenceRegisters(o);
  sm90::FenceRegisters(sums);
  sm90::WgmmaFence();
#pragma unroll
  for (int kk = 0; kk < kChunk / 16; ++kk) {
    sm90::WgmmaM64N64K16<T, 1>(o, prob[kk], sm90::DescriptorPlus(rows, 128 * kk), 1);
    sm90::WgmmaM64N8K16<T, 1>(sums, prob[kk], column, 1);
  }
  sm90::WgmmaCommit();
}

// A consumer warpgroup's walk over its tile's chunks, in FlashAttention-3's intra-warpgroup order, so that
// no instruction touches the registers of a wgmma in flight. With chunk j's operands formed and rounded:
// issue_scores(stage j + 1) (one group, committed), issue_products(stage j) (kProductGroups groups), wait
// for the scores, form(j + 1) while the products run, wait for them, release stage j, round() chunk j + 1.
// fence_scores / fence_products fence the registers each wait completed.
template <int kProductGroups, typename SharedState, typename IssueScores, typename Form, typename IssueProducts,
          typename Round, typename FenceScores, typename FenceProducts>
__device__ __forceinline__ void WalkChunks(SharedState& s, int count, const IssueScores& issue_scores, const Form& form,
                                           const IssueProducts& issue_products, const Round& round,
                                           const FenceScores& fence_scores, const FenceProducts& fence_products) {
  MbarrierWait(&s.full[0], 0);
  issue_scores(s.stages[0]);
  sm90::WgmmaWait<0>();
  fence_scores();
  form(0);
  round();
  for (int j = 0; j + 1 < count; ++j) {
    const int next = (j + 1) % kStages;
    MbarrierWait(&s.full[next], ((j + 1) / kStages) & 1);
    issue_scores(s.stages[next]);
    issue_products(s.stages[j % kStages]);
    sm90::WgmmaWait<kProductGroups>();
    fence_scores();
    form(j + 1);
    sm90::WgmmaWait<0>();
    fence_products();
    MbarrierArrive(&s.empty[j % kStages]);
    round();
  }
  issue_products(s.stages[(count - 1) % kStages]);
  sm90::WgmmaWait<0>();
  fence_products();
}

// The forward of the consumer warpgroup: per chunk S = Q K^T, the mask and online softmax, O += P V and the
// row sums of the rounded P (both rescaled just before the products are issued); out and lse at the end.
__device__ void ConsumeForward(const Problem& p, Shared<Kind::kForward>& s, int count) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = lane % 4;
  const int tile = blockIdx.x;
  const int query_row = p.tiles[2 * tile] + warp;
  int column[2] = {lane / 4, lane / 4 + 8}, u[2], step[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) u[h] = column[h] % p.classes, step[h] = column[h] / p.classes;
  float o[kD / 2] = {}, sums[4] = {}, m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, scores[kChunk / 2];
  float correction[2];
  uint32_t prob[kChunk / 16][4];
  const auto softmax = [&](int i) {  // S(i) complete in scores: P(i) into prob
    const ChunkMask mask = MaskOf(p, s.info[i % kStages], warp, u, step);
    ApplyMask(scores, mask, t);
    Exponentiate(scores, mask.bias, p.scale_log2, m, l, correction);
  };
  MbarrierWait(&s.q_full, 0);
  if (SF_DIAGNOSTIC == 4) {
    for (int j = 0; j < count; ++j) {
      MbarrierWait(&s.full[j % kStages], (j / kStages) & 1);
      MbarrierArrive(&s.empty[j % kStages]);
    }
    return;
  }
  WalkChunks<1>(
      s, count,
      [&](const Stage& stage) {
        IssueTransposed(scores, s.tiles[0], stage.a);
        sm90::WgmmaCommit();
      },
      softmax,
      [&](const Stage& stage) {
        Rescale(o, sums, correction);
        IssueProductsAndSums(o, sums, prob, stage.b, s.ones.rows);
      },
      [&] { Pack(prob, scores); }, [&] { sm90::FenceRegisters(scores); },
      [&] {
        sm90::FenceRegisters(o);
        sm90::FenceRegisters(sums);
      });

  const int first_lon = p.tiles[2 * tile + 1];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    // lse from the float32 sums; out divided by the sums of P as rounded for P V (every column of row h's
    // sums holds the whole row's), so that its weights sum to one as the backward's P = exp(s - lse) do.
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    const int lon = first_lon + column[h];
    if (query_row >= p.nlat_walk || lon >= p.nlon_walk) continue;
    const size_t point = size_t(query_row) * p.nlon_walk + lon;
    const float inverse = sums[2 * h] > 0.f ? 1.f / sums[2 * h] : 0.f;
    if (t == 0) p.lse[point] = l[h] > 0.f ? (m[h] + log2f(l[h])) * kLn2 : -INFINITY;
    if (p.out_f32 != nullptr) {
#pragma unroll
      for (int j = 0; j < kD / 8; ++j) {
        *reinterpret_cast<float2*>(p.out_f32 + point * kD + 8 * j + 2 * t) =
            make_float2(o[4 * j + 2 * h] * inverse, o[4 * j + 2 * h + 1] * inverse);
      }
    } else {
#pragma unroll
      for (int j = 0; j < kD / 8; ++j) {
        *reinterpret_cast<uint32_t*>(p.out + point * kD + 8 * j + 2 * t) =
            PackPair<T>(o[4 * j + 2 * h] * inverse, o[4 * j + 2 * h + 1] * inverse);
      }
    }
  }
}

// Stores the thread's rows of a 64 x kD float32 accumulator, times `factor`, into [walking points, kD] rows
// (points past the walking grid are not written).
__device__ __forceinline__ void StoreRows(const Problem& p, float* to, const float (&d)[kD / 2], float factor) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = lane % 4, tile = blockIdx.x;
  const int row = p.tiles[2 * tile] + warp;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int lon = p.tiles[2 * tile + 1] + lane / 4 + 8 * h;
    if (row >= p.nlat_walk || lon >= p.nlon_walk) continue;
    float* point = to + (size_t(row) * p.nlon_walk + lon) * kD + 2 * t;
#pragma unroll
    for (int j = 0; j < kD / 8; ++j) {
      *reinterpret_cast<float2*>(point + 8 * j) = make_float2(d[4 * j + 2 * h] * factor, d[4 * j + 2 * h + 1] * factor);
    }
  }
}

// dq of the consumer warpgroup, in the forward's order: per chunk j + 1 issue S(j+1) = Q K^T and
// dP(j+1) = dO V^T as one group, issue dq += dS(j) K(j), wait for the first group, then form
// dS(j+1) = P (dP - delta) with P = exp2(S scale log2(e) + bias - lse log2(e)) on the chunk's mask while
// dq's product runs. dq times the scale at the end.
__device__ void ConsumeDq(const Problem& p, Shared<Kind::kDq>& s, int count) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = lane % 4;
  const int tile = blockIdx.x;
  const int query_row = p.tiles[2 * tile] + warp, first_lon = p.tiles[2 * tile + 1];
  int column[2] = {lane / 4, lane / 4 + 8}, u[2], step[2];
  float lse_log2[2] = {0.f, 0.f}, delta[2] = {0.f, 0.f};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    u[h] = column[h] % p.classes, step[h] = column[h] / p.classes;
    const int lon = first_lon + column[h];
    if (query_row < p.nlat_walk && lon < p.nlon_walk) {
      const size_t point = size_t(query_row) * p.nlon_walk + lon;
      lse_log2[h] = s2attn::gpu::Log2Lse(p.lse[point]);
      delta[h] = p.delta[point];
    }
  }
  float dq[kD / 2] = {}, scores[kChunk / 2], dp[kChunk / 2];
  uint32_t ds[kChunk / 16][4];
  const auto issue_scores = [&](const Stage& stage) {
    IssueTransposed(scores, s.tiles[0], stage.a);
    IssueTransposed(dp, s.tiles[1], stage.b);
    sm90::WgmmaCommit();
  };
  const auto score_gradients = [&](int i) {  // S(i), dP(i) complete: dS(i) into scores
    const ChunkMask mask = MaskOf(p, s.info[i % kStages], warp, u, step);
    ApplyMask(scores, mask, t);
#pragma unroll
    for (int e = 0; e < kChunk / 2; ++e) {
      const int h = (e >> 1) & 1;
      scores[e] = Exp2(fmaf(scores[e], p.scale_log2, mask.bias - lse_log2[h])) * (dp[e] - delta[h]);
    }
  };
  MbarrierWait(&s.q_full, 0);
  WalkChunks<1>(
      s, count, issue_scores, score_gradients, [&](const Stage& stage) { IssueAccumulate(dq, ds, stage.a); },
      [&] { Pack(ds, scores); },
      [&] {
        sm90::FenceRegisters(scores);
        sm90::FenceRegisters(dp);
      },
      [&] { sm90::FenceRegisters(dq); });
  StoreRows(p, p.dq, dq, p.scale);
}

// dk and dv of the consumer warpgroup over a tile of 4 x 16 keys, walking the backward schedule: per chunk
// of 32 queries j + 1 issue S^T(j+1) = K Q^T and dP^T(j+1) = V dO^T as one group, issue dv += P^T(j) dO(j)
// and dk += dS^T(j) Q(j), wait for the first group, then form P^T = exp2(S^T scale log2(e) + key weight -
// lse log2(e)) and dS^T = P^T (dP^T - delta) on the chunk's mask (the queries' lse and delta staged with
// the chunk) while both products run. dk times the scale at the end.
__device__ void ConsumeDkv(const Problem& p, Shared<Kind::kDkv>& s, int count) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = lane % 4;
  const int tile = blockIdx.x;
  const int key_row = p.tiles[2 * tile] + warp;
  const float key_bias = key_row < p.nlat_walk ? p.bias[key_row] : 0.f;
  int column[2] = {lane / 4, lane / 4 + 8}, u[2], step[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) u[h] = column[h] % p.classes, step[h] = column[h] / p.classes;
  float dk[kD / 2] = {}, dv[kD / 2] = {}, scores[kChunk / 2], dp[kChunk / 2];
  uint32_t prob[kChunk / 16][4], grad[kChunk / 16][4];
  const auto issue_scores = [&](const Stage& stage) {
    IssueTransposed(scores, s.tiles[0], stage.a);
    IssueTransposed(dp, s.tiles[1], stage.b);
    sm90::WgmmaCommit();
  };
  const auto gradients = [&](int i) {  // S^T(i), dP^T(i) complete: P^T(i) into scores, dS^T(i) into dp
    const ChunkInfo& info = s.info[i % kStages];
    const ChunkMask mask = MaskOf(p, info, warp, u, step);
    ApplyMask(scores, mask, t);
#pragma unroll
    for (int e = 0; e < kChunk / 2; ++e) {
      const int n = 2 * t + ColumnOf(e);
      scores[e] = Exp2(fmaf(scores[e], p.scale_log2, key_bias - info.lse_log2[n]));
      dp[e] = scores[e] * (dp[e] - info.delta[n]);
    }
  };
  MbarrierWait(&s.q_full, 0);
  WalkChunks<2>(
      s, count, issue_scores, gradients,
      [&](const Stage& stage) {
        IssueAccumulate(dv, prob, stage.b);
        IssueAccumulate(dk, grad, stage.a);
      },
      [&] {
        Pack(prob, scores);
        Pack(grad, dp);
      },
      [&] {
        sm90::FenceRegisters(scores);
        sm90::FenceRegisters(dp);
      },
      [&] {
        sm90::FenceRegisters(dk);
        sm90::FenceRegisters(dv);
      });
  StoreRows(p, p.dk, dk, p.scale);
  StoreRows(p, p.dv, dv, 1.f);
}

// The results of a tile without chunks (its points see no other point): zeros, and lse -inf. One consumer
// thread per (tile row, accumulator row pair), as the consumers write.
template <Kind kKind>
__device__ void WriteEmpty(const Problem& p) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = lane % 4, tile = blockIdx.x;
  const int row = p.tiles[2 * tile] + warp;
  for (int h = 0; h < 2; ++h) {
    const int lon = p.tiles[2 * tile + 1] + lane / 4 + 8 * h;
    if (row >= p.nlat_walk || lon >= p.nlon_walk) continue;
    const size_t point = size_t(row) * p.nlon_walk + lon;
    for (int j = 0; j < kD / 8; ++j) {
      const size_t at = point * kD + 8 * j + 2 * t;
      if constexpr (kKind == Kind::kForward) {
        if (p.out_f32 != nullptr) {
          *reinterpret_cast<float2*>(p.out_f32 + at) = make_float2(0.f, 0.f);
        } else {
          *reinterpret_cast<uint32_t*>(p.out + at) = PackPair<T>(0.f, 0.f);
        }
      } else if constexpr (kKind == Kind::kDq) {
        *reinterpret_cast<float2*>(p.dq + at) = make_float2(0.f, 0.f);
      } else {
        *reinterpret_cast<float2*>(p.dk + at) = make_float2(0.f, 0.f);
        *reinterpret_cast<float2*>(p.dv + at) = make_float2(0.f, 0.f);
      }
    }
    if (kKind == Kind::kForward && t == 0) p.lse[point] = -INFINITY;
  }
}

template <Kind kKind>
__global__ void __launch_bounds__(kThreads, kKind == Kind::kForward ? SF_MIN_BLOCKS
                                            : kKind == Kind::kDq    ? SF_DQ_BLOCKS
                                                                    : SF_DKV_BLOCKS)
    ScheduledAttention(Problem p, const __grid_constant__ Maps maps) {
  auto* base = reinterpret_cast<unsigned char*>(s2attn::gpu::DynamicShared());
  base += (1024 - reinterpret_cast<uintptr_t>(base) % 1024) % 1024;
  auto& s = *reinterpret_cast<Shared<kKind>*>(base);
  const int first = p.tile_offsets[blockIdx.x], count = p.tile_offsets[blockIdx.x + 1] - first;
  if (count == 0) {
    if (threadIdx.x < 128) WriteEmpty<kKind>(p);
    return;
  }
  if constexpr (kKind == Kind::kForward) {  // the ones tile: 2 KiB, 16 bytes a thread
    const uint4 ones = make_uint4(0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u);  // bf16 1.0 pairs
    for (int i = threadIdx.x; i < int(sizeof(OnesTile) / 16); i += kThreads) {
      reinterpret_cast<uint4*>(s.ones.rows)[i] = ones;
    }
    sm90::FenceSharedForWgmma();
  }
  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      MbarrierInit(&s.full[i], 32);
      MbarrierInit(&s.empty[i], 128);
    }
    MbarrierInit(&s.q_full, 1);
    MbarrierInitFence();
  }
  __syncthreads();
  if (threadIdx.x / 32 == 4) {
    Produce<kKind>(p, maps, s, first, count);
  } else if constexpr (kKind == Kind::kForward) {
    ConsumeForward(p, s, count);
  } else if constexpr (kKind == Kind::kDq) {
    ConsumeDq(p, s, count);
  } else {
    ConsumeDkv(p, s, count);
  }
}

// ------------------------------------------------------------------------------------------ host

template <typename X>
bool ReadFile(const std::string& path, std::vector<X>* data) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) {
    std::printf("cannot read %s\n", path.c_str());
    return false;
  }
  const size_t bytes = in.tellg();
  data->resize(bytes / sizeof(X));
  in.seekg(0);
  in.read(reinterpret_cast<char*>(data->data()), bytes);
  return bool(in);
}

template <typename X>
bool WriteFile(const std::string& path, const std::vector<X>& data) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(data.data()), data.size() * sizeof(X));
  return bool(out);
}

// Device time of `launch`: the median over reps of bursts of 10 launches, by events, printed as "<name>_ms".
template <typename Launch>
bool Time(const char* name, int reps, const Launch& launch) {
  std::vector<float> ms;
  cudaEvent_t begin, end;
  CHECK_CUDA(cudaEventCreate(&begin));
  CHECK_CUDA(cudaEventCreate(&end));
  for (int r = 0; r < reps; ++r) {
    CHECK_CUDA(cudaEventRecord(begin));
    for (int i = 0; i < 10; ++i) CHECK_CUDA(launch());
    CHECK_CUDA(cudaEventRecord(end));
    CHECK_CUDA(cudaEventSynchronize(end));
    float elapsed;
    CHECK_CUDA(cudaEventElapsedTime(&elapsed, begin, end));
    ms.push_back(elapsed / 10);
  }
  std::sort(ms.begin(), ms.end());
  if (!ms.empty()) std::printf("%s_ms %.4f\n", name, ms[ms.size() / 2]);
  return true;
}

template <Kind kKind>
bool Launch(const Problem& p, const Maps& maps, int num_tiles, int reps, const char* name) {
  const int shared = sizeof(Shared<kKind>) + 1024;
  CHECK_CUDA(cudaFuncSetAttribute(ScheduledAttention<kKind>, cudaFuncAttributeMaxDynamicSharedMemorySize, shared));
  Problem problem = p;
  Maps tensor_maps = maps;
  void* args[2] = {&problem, &tensor_maps};
  // Through cudaLaunchKernel (not <<< >>>), so that the program also builds for the host emulation.
  const auto launch = [&] {
    return cudaLaunchKernel(ScheduledAttention<kKind>, dim3(num_tiles), dim3(kThreads), args, shared, 0);
  };
  CHECK_CUDA(launch());
  CHECK_CUDA(cudaDeviceSynchronize());
  return Time(name, reps, launch);
}

// A float32 result of the device, NaN-poisoned, then written to `path` after the launch.
struct Result {
  float* device = nullptr;
  size_t size = 0;
  std::string path;
};

// mode "forward": out.bf16, out.f32 and lse.f32 from the directory's schedule (meta.f32, tiles.i32, ...) and inputs;
// "dq": dq.f32 from them and dout.bf16, lse.f32, delta.f32; "dkv": dk.f32 and dv.f32 from the same inputs and
// the backward walk's schedule in <directory>/backward. Every result is poisoned (NaN) before its launch.
bool Run(const std::string& mode, const std::string& dir, int reps) {
  const bool forward = mode == "forward", dkv = mode == "dkv";
  const std::string walk = dkv ? dir + "/backward" : dir;
  // meta: nlat_walk nlon_walk nlat_other nlon_other classes shift tile_rows tile_cols chunk_cols scale
  std::vector<float> meta;
  if (!ReadFile(walk + "/meta.f32", &meta) || meta.size() != 10) return false;
  const int nlat_walk = int(meta[0]), nlon_walk = int(meta[1]), nlat_other = int(meta[2]), nlon_other = int(meta[3]);
  if (int(meta[6]) != kTileRows || int(meta[7]) != kTileCols || int(meta[8]) != kChunk) {
    std::printf("the schedule's shape is not the kernel's %dx%d, %d columns\n", kTileRows, kTileCols, kChunk);
    return false;
  }
  // Queries on the walking grid (forward, dq) or on the other one (dk/dv).
  const int nlat_q = dkv ? nlat_other : nlat_walk, nlon_q = dkv ? nlon_other : nlon_walk;
  const int nlat_k = dkv ? nlat_walk : nlat_other, nlon_k = dkv ? nlon_walk : nlon_other;
  std::vector<int> tiles, offsets, chunks, records;
  std::vector<float> bias, lse, delta;
  std::vector<T> q, k, v, dout;
  for (auto [name, data] : {std::pair{"tiles", &tiles}, std::pair{"tile_offsets", &offsets},
                            std::pair{"chunks", &chunks}, std::pair{"records", &records}}) {
    if (!ReadFile(walk + "/" + name + ".i32", data)) return false;
  }
  if (!ReadFile(dir + "/bias.f32", &bias) || !ReadFile(dir + "/q.bf16", &q) || !ReadFile(dir + "/k.bf16", &k) ||
      !ReadFile(dir + "/v.bf16", &v)) {
    return false;
  }
  if (!forward && (!ReadFile(dir + "/dout.bf16", &dout) || !ReadFile(dir + "/lse.f32", &lse) ||
                   !ReadFile(dir + "/delta.f32", &delta))) {
    return false;
  }
  const int num_tiles = int(tiles.size() / 2), classes = int(meta[4]);
  const size_t points_q = size_t(nlat_q) * nlon_q, points_k = size_t(nlat_k) * nlon_k;
  // The files must be what the meta says: the kernels index them unchecked.
  int stagings = 0;
  for (size_t c = 5; c < chunks.size(); c += kChunkFields) stagings = std::max(stagings, chunks[c] + 1);
  const bool sizes_agree =
      tiles.size() == size_t(2 * num_tiles) && offsets.size() == size_t(num_tiles + 1) &&
      chunks.size() == size_t(kChunkFields) * size_t(offsets.back()) && classes >= 1 && classes <= kTileCols &&
      records.size() >= size_t(stagings) * kTileRows * classes * 2 && bias.size() == size_t(nlat_k) &&
      q.size() == points_q * kD && k.size() == points_k * kD && v.size() == points_k * kD &&
      (forward || (dout.size() == points_q * kD && lse.size() == points_q && delta.size() == points_q));
  if (!sizes_agree) {
    std::printf("the directory's files do not match its meta\n");
    return false;
  }
  Problem p{};
  p.nlat_walk = nlat_walk, p.nlon_walk = nlon_walk, p.nlon_other = nlon_other;
  p.classes = classes, p.shift = int(meta[5]);
  p.scale = meta[9], p.scale_log2 = meta[9] * 1.4426950408889634f;
  int *d_tiles, *d_offsets, *d_chunks, *d_records;
  float *d_bias, *d_lse = nullptr, *d_delta = nullptr;
  T *d_q, *d_k, *d_v, *d_dout = nullptr, *d_out = nullptr;
  CHECK_CUDA(Upload(tiles, &d_tiles));
  CHECK_CUDA(Upload(offsets, &d_offsets));
  CHECK_CUDA(Upload(chunks, &d_chunks));
  CHECK_CUDA(Upload(records, &d_records));
  CHECK_CUDA(Upload(bias, &d_bias));
  CHECK_CUDA(Upload(q, &d_q));
  CHECK_CUDA(Upload(k, &d_k));
  CHECK_CUDA(Upload(v, &d_v));
  std::vector<Result> results;
  if (forward) {
    CHECK_CUDA(cudaMalloc(&d_out, points_q * kD * sizeof(T)));
    CHECK_CUDA(cudaMemset(d_out, 0xff, points_q * kD * sizeof(T)));  // poison: NaN
    results.push_back({nullptr, points_q, dir + "/lse.f32"});
    results.push_back({nullptr, points_q * kD, dir + "/out.f32"});
  } else {
    CHECK_CUDA(Upload(dout, &d_dout));
    CHECK_CUDA(Upload(lse, &d_lse));
    CHECK_CUDA(Upload(delta, &d_delta));
    if (dkv) {
      results.push_back({nullptr, points_k * kD, dir + "/dk.f32"});
      results.push_back({nullptr, points_k * kD, dir + "/dv.f32"});
    } else {
      results.push_back({nullptr, points_q * kD, dir + "/dq.f32"});
    }
  }
  for (Result& r : results) {
    CHECK_CUDA(cudaMalloc(&r.device, r.size * sizeof(float)));
    CHECK_CUDA(cudaMemset(r.device, 0xff, r.size * sizeof(float)));
  }
  p.tiles = d_tiles, p.tile_offsets = d_offsets, p.chunks = d_chunks;
  p.records = reinterpret_cast<const int2*>(d_records);
  p.bias = d_bias, p.out = d_out, p.delta = d_delta;
  p.lse = forward ? results[0].device : d_lse;
  if (dkv) p.dk = results[0].device, p.dv = results[1].device;
  if (mode == "dq") p.dq = results[0].device;

  const EncodeTiled encode = FindEncodeTiled();
  if (encode == nullptr) return false;
  Maps maps;
  const cuuint32_t element_strides[3] = {1, 1, 1};
  // Walking tiles: q (forward), q and dout (dq), k and v (dk/dv); chunks: k and v, or q and dout.
  T* const tile_data[2] = {dkv ? d_k : d_q, dkv ? d_v : (forward ? d_q : d_dout)};
  T* const chunk_data[2] = {dkv ? d_q : d_k, dkv ? d_dout : d_v};
  const struct {
    CUtensorMap* map;
    T* data;
    int nlat, nlon, box_lons, box_rows;
  } specs[4] = {{&maps.tiles[0], tile_data[0], nlat_walk, nlon_walk, kTileCols, kTileRows},
                {&maps.tiles[1], tile_data[1], nlat_walk, nlon_walk, kTileCols, kTileRows},
                {&maps.a, chunk_data[0], nlat_other, nlon_other, kChunk, 1},
                {&maps.b, chunk_data[1], nlat_other, nlon_other, kChunk, 1}};
  for (const auto& spec : specs) {
    const cuuint64_t dims[3] = {kD, cuuint64_t(spec.nlon), cuuint64_t(spec.nlat)};
    const cuuint64_t strides[2] = {kD * sizeof(T), spec.nlon * kD * sizeof(T)};
    const cuuint32_t box[3] = {kD, cuuint32_t(spec.box_lons), cuuint32_t(spec.box_rows)};
    if (encode(spec.map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, spec.data, dims, strides, box, element_strides,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
      std::printf("cuTensorMapEncodeTiled failed\n");
      return false;
    }
  }
  // The forward twice: out in bf16 (inference), then in float32 (the differentiated forward's residual).
  Problem differentiated = p;
  if (forward) differentiated.out_f32 = results[1].device;
  const bool launched = forward ? Launch<Kind::kForward>(p, maps, num_tiles, reps, "forward") &&
                                      Launch<Kind::kForward>(differentiated, maps, num_tiles, reps, "forward_f32")
                        : dkv   ? Launch<Kind::kDkv>(p, maps, num_tiles, reps, "dkv")
                                : Launch<Kind::kDq>(p, maps, num_tiles, reps, "dq");
  if (!launched) return false;
  for (const Result& r : results) {
    std::vector<float> host(r.size);
    CHECK_CUDA(cudaMemcpy(host.data(), r.device, r.size * sizeof(float), cudaMemcpyDeviceToHost));
    if (!WriteFile(r.path, host)) return false;
  }
  if (forward) {
    std::vector<T> out(points_q * kD);
    CHECK_CUDA(cudaMemcpy(out.data(), d_out, out.size() * sizeof(T), cudaMemcpyDeviceToHost));
    if (!WriteFile(dir + "/out.bf16", out)) return false;
  }
  for (void* x : {(void*)d_tiles, (void*)d_offsets, (void*)d_chunks, (void*)d_records, (void*)d_bias, (void*)d_q,
                  (void*)d_k, (void*)d_v, (void*)d_dout, (void*)d_out, (void*)d_lse, (void*)d_delta}) {
    if (x != nullptr) CHECK_CUDA(cudaFree(x));
  }
  for (const Result& r : results) CHECK_CUDA(cudaFree(r.device));
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (argc < 3 || (mode != "forward" && mode != "dq" && mode != "dkv")) {
    std::printf("usage: scheduled_attention forward|dq|dkv <directory> [reps]\n");
    return 2;
  }
  return Run(mode, argv[2], argc > 3 ? std::atoi(argv[3]) : 0) ? 0 : 1;
}
