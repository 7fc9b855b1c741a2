// Launchers of the scheduled tensor-core kernels (sm_90a: wgmma and tensor-map copies), which walk the plan's
// block-sparse schedules (jax_s2attn/schedule.py, docs/block-schedule.md) instead of its segment tables: the
// forward and dq walk the forward schedule (query tiles over key chunks), dk/dv the backward one (key tiles over
// query chunks). Whole grids, or the local blocks of a window's schedule (jax_s2attn/schedule.py, "Windows"):
// the grids below are the arrays', `ring_nlon` the other grid's whole ring. Plain C++ and CUDA runtime types.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/kernel_limits.h"
#include "gpu/nbhd_attn_kernels.h"

namespace s2attn {

// The fields of a chunk of the schedule (other row, longitude, offset, valid, flags, staging; the schedule's shape:
// common/kernel_limits.h).
constexpr int kSchedChunkFields = 6;

// One call of a scheduled target, passed to the kernels by value. Activations are contiguous row-major
// [batch, nlat, nlon, heads, head_dim] of `dtype` (bfloat16 or float16), 16-byte aligned; "walk" is the
// grid whose tiles the schedule lists (queries for the forward and dq, keys for dk/dv), "other" the grid of
// its chunks.
struct SchedAttnParams {
  ActivationType dtype = ActivationType::kBF16;
  int32_t head_dim = 64;  // Dk == Dv, one of kSchedHeadDims
  // float32, or `dtype`: each element the float32 result rounded to nearest (out, dq, dk, dv).
  ActivationType result_dtype = ActivationType::kF32;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* dout = nullptr;   // dq, dk/dv
  const float* lse = nullptr;   // dq, dk/dv: [batch, nlat_q, nlon_q, heads]
  const float* delta = nullptr;  // dq, dk/dv: sum(dout * out, -1) - dlse, like lse
  // The dq that forms delta (jax_s2attn_sched_bwd_dq_delta), in place of `delta`: the forward's float32 out
  // ([batch, nlat_q, nlon_q, heads, D]) and dlse (like lse); it forms delta of its walking points, uses it and
  // writes it to delta_out (like lse) for dk/dv.
  const float* forward_out = nullptr;
  const float* dlse = nullptr;
  float* delta_out = nullptr;
  // The walk's schedule (device memory; the kernels clamp every index they derive from it).
  // [num_tiles, 2]: first walking row, first walking longitude; with ring_grids [num_tiles, kSchedTileRuns, 2]:
  // runs (first walking point, points <= kSchedRunPoints).
  const int32_t* tiles = nullptr;
  const int32_t* tile_offsets = nullptr;  // [num_tiles + 1]
  const int32_t* chunks = nullptr;        // [num_chunks, kSchedChunkFields]
  const int32_t* records = nullptr;       // [num_stagings, kSchedTileRows, classes, 2]
  const float* quad_weights = nullptr;    // [nlat_k]: the key arrays' rows; with ring_grids [nlon_k]: per point
  // Ring grids (jax_s2attn.ring_schedule): flat fields as grids of one row (nlat_q = nlat_k = 1, nlon the points),
  // tiles of runs, one record per point (classes == kSchedTileCols); chunks name row 0 and lie on one key ring.
  bool ring_grids = false;
  int64_t num_tiles = 0, num_chunks = 0, num_stagings = 0;
  int32_t classes = 1, shift = 1;
  int64_t batch = 0, heads = 0;
  int32_t nlat_q = 0, nlon_q = 0, nlat_k = 0, nlon_k = 0;  // the arrays' grids
  // Longitudes of the other grid's ring (the modulus of RING chunks): nlon_k of the key grid for the forward
  // and dq, nlon_q for dk/dv; the arrays' own for whole grids.
  int32_t ring_nlon = 0;
  float scale = 1.f;
  // Results.
  void* out = nullptr;        // forward: [batch, nlat_q, nlon_q, heads, D] of result_dtype
  // forward, beside an `out` in `dtype`: null, or the same out in float32 (what the backward forms delta from)
  float* out_f32 = nullptr;
  float* lse_out = nullptr;   // forward: like lse
  void* dq = nullptr;         // like q, of result_dtype
  void* dk = nullptr;         // like k, of result_dtype
  void* dv = nullptr;         // like v, of result_dtype
};

// Whether this build compiled the scheduled kernels for sm_90a; and whether, also, the current device runs them
// (compute capability 9.0). The handlers refuse a call where it does not.
bool SchedAttnBuiltForSm90a();
bool SchedAttnAvailable();

// out and lse (a query without neighbours: out 0, lse -inf); dq (and, given forward_out, dlse and delta_out in
// place of delta, delta of every walking point of the listed tiles); dk and dv (cuda/README.md, "Scheduled
// targets").
cudaError_t LaunchSchedAttnFwd(cudaStream_t stream, const SchedAttnParams& params);
cudaError_t LaunchSchedAttnDq(cudaStream_t stream, const SchedAttnParams& params);
cudaError_t LaunchSchedAttnDkv(cudaStream_t stream, const SchedAttnParams& params);

}  // namespace s2attn
