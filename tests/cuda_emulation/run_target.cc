// C entry points of the CUDA launchers for Python (ctypes): one call of forward, dq, dkv (the arc kernels or the
// stencil targets), the stencil dq that forms delta, a ring target, a scheduled target, the scheduled dq that forms
// delta, or delta on the default stream.
// Shared by the host emulation (tests/test_cuda_emulated.py, g++) and the standalone GPU harness
// (tests/gpu_kernel_sanitizer.py, nvcc): pointers are host memory in the first and device memory in the second,
// except `sizes`, which is always host memory.
#include <cstdint>

#include "gpu/delta_kernel.h"
#include "gpu/nbhd_attn_kernels.h"
#include "gpu/sched_attn_kernels.h"
#include "gpu/stencil_attn_kernels.h"

namespace {

// The launch parameters of one call of the arguments below (the results are left to the caller).
s2attn::NbhdAttnGpuParams ParamsOf(int dtype, int gradient_dtype, const void* q, const void* k, const void* v,
                                   const void* dout, const float* lse, const int32_t* window,
                                   const int32_t* row_order, const int32_t* arc_offsets, const int32_t* arcs,
                                   const float* quad_weights, const int64_t* sizes, float scale) {
  s2attn::NbhdAttnGpuParams p;
  p.dtype = static_cast<s2attn::ActivationType>(dtype);
  p.gradient_dtype = static_cast<s2attn::ActivationType>(gradient_dtype);
  p.q = q;
  p.k = k;
  p.v = v;
  p.dout = dout;
  p.lse = lse;
  p.window = window;
  p.row_order = row_order;
  p.arc_offsets = arc_offsets;
  p.arcs = arcs;
  p.quad_weights = quad_weights;
  p.batch = sizes[0];
  p.heads = sizes[1];
  p.head_dim_k = sizes[2];
  p.head_dim_v = sizes[3];
  p.nq_lat = static_cast<int32_t>(sizes[4]);
  p.nq_lon = static_cast<int32_t>(sizes[5]);
  p.nk_lat = static_cast<int32_t>(sizes[6]);
  p.nk_lon = static_cast<int32_t>(sizes[7]);
  p.nlat_q = static_cast<int32_t>(sizes[8]);
  p.nlon_q = static_cast<int32_t>(sizes[9]);
  p.nlat_k = static_cast<int32_t>(sizes[10]);
  p.nlon_k = static_cast<int32_t>(sizes[11]);
  p.residues = static_cast<int32_t>(sizes[12]);
  p.shift = static_cast<int32_t>(sizes[13]);
  p.num_arcs = sizes[14];
  p.scale = scale;
  return p;
}

}  // namespace

// target: 0 forward (results out, lse), 1 dq (dq), 2 dkv (dk, dv) of the arc-segment kernels; 3, 4, 5 the same of
// the stencil targets, whose `arc_offsets`/`arcs` carry the walk's segment table (num_arcs = its row count) and
// which write only the rows of `stencil_pairs`. sizes: batch, heads, dk, dv, nq_lat, nq_lon, nk_lat, nk_lon,
// nlat_q, nlon_q, nlat_k, nlon_k, residues, shift, num_arcs. dtype and gradient_dtype: ActivationType
// of the activations and of the gradient results (the forward's lse and result0 out are float32).
// `result2`: null, or for the stencil forward out in `dtype`, in place of a float32 out (result0 null).
// `stencil_pairs` ([num_pairs, 2]; null and 0 for none): for the stencil targets, the walking row pairs they walk.
// Returns the launcher's cudaError_t.
extern "C" int RunNbhdAttnTarget(int target, int dtype, int gradient_dtype, const void* q, const void* k,
                                 const void* v, const void* dout, const float* lse, const float* delta,
                                 const int32_t* window, const int32_t* row_order, const int32_t* arc_offsets,
                                 const int32_t* arcs, const float* quad_weights, void* result0, void* result1,
                                 void* result2, const int64_t* sizes, float scale, const int32_t* stencil_pairs,
                                 int64_t num_pairs) {
  if (target < 0 || target > 5 || (result2 != nullptr && target != 3)) return cudaErrorInvalidValue;
  if (num_pairs != 0 && target < 3) return cudaErrorInvalidValue;
  s2attn::NbhdAttnGpuParams p = ParamsOf(dtype, gradient_dtype, q, k, v, dout, lse, window, row_order, arc_offsets,
                                         arcs, quad_weights, sizes, scale);
  p.delta = delta;
  p.stencil_pairs = stencil_pairs;
  p.num_stencil_pairs = static_cast<int32_t>(num_pairs);
  const bool stencil = target >= 3;
  switch (target % 3) {
    case 0:
      p.out = static_cast<float*>(result0);
      p.lse_out = static_cast<float*>(result1);
      p.out_narrow = result2;
      return stencil ? s2attn::LaunchStencilAttnFwd(nullptr, p) : s2attn::LaunchNbhdAttnFwd(nullptr, p);
    case 1:
      p.dq = result0;
      return stencil ? s2attn::LaunchStencilAttnBwdDq(nullptr, p) : s2attn::LaunchNbhdAttnBwdDq(nullptr, p);
    default:
      p.dk = result0;
      p.dv = result1;
      return stencil ? s2attn::LaunchStencilAttnBwdDkv(nullptr, p) : s2attn::LaunchNbhdAttnBwdDkv(nullptr, p);
  }
}

// The stencil dq that forms delta (the target jax_s2attn_stencil_bwd_dq_delta): target 4's arguments with dlse
// in place of delta; results dq and delta.
extern "C" int RunStencilDqFormingDelta(int dtype, int gradient_dtype, const void* q, const void* k, const void* v,
                                        const void* dout, const float* lse, const float* dlse,
                                        const int32_t* window, const int32_t* row_order,
                                        const int32_t* arc_offsets, const int32_t* arcs, const float* quad_weights,
                                        void* dq, float* delta, const int64_t* sizes, float scale,
                                        const int32_t* stencil_pairs, int64_t num_pairs) {
  s2attn::NbhdAttnGpuParams p = ParamsOf(dtype, gradient_dtype, q, k, v, dout, lse, window, row_order, arc_offsets,
                                         arcs, quad_weights, sizes, scale);
  p.stencil_pairs = stencil_pairs;
  p.num_stencil_pairs = static_cast<int32_t>(num_pairs);
  p.dlse = dlse;
  p.dq = dq;
  p.delta_out = delta;
  return s2attn::LaunchStencilAttnBwdDq(nullptr, p);
}

// A ring target (the arc kernels between ring grids): `kind` 0 forward (results out, lse), 1 dq (dq), 2 dkv (dk,
// dv), walking the tables of common/ring_walk.h (the queries' walk for 0 and 1, the keys' for 2). sizes: batch,
// heads, dk, dv, walk_points, visited_points, num_walk_rings, max_ring_points, num_patterns, num_arcs, num_weights.
// Activations are dtype's, results float32. Returns the launcher's cudaError_t.
extern "C" int RunRingTarget(int kind, int dtype, const void* q, const void* k, const void* v, const void* dout,
                             const float* lse, const float* delta, const int32_t* walk_rings,
                             const int32_t* ring_order, const int32_t* pattern_offsets, const int32_t* pattern_arcs,
                             const float* quad_weights, void* result0, void* result1, const int64_t* sizes,
                             float scale) {
  s2attn::NbhdAttnGpuParams p;
  p.dtype = static_cast<s2attn::ActivationType>(dtype);
  p.q = q, p.k = k, p.v = v, p.dout = dout, p.lse = lse, p.delta = delta;
  p.walk_rings = walk_rings, p.row_order = ring_order;
  p.arc_offsets = pattern_offsets, p.arcs = pattern_arcs, p.quad_weights = quad_weights;
  p.batch = sizes[0], p.heads = sizes[1], p.head_dim_k = sizes[2], p.head_dim_v = sizes[3];
  p.walk_points = static_cast<int32_t>(sizes[4]), p.visited_points = static_cast<int32_t>(sizes[5]);
  p.num_walk_rings = static_cast<int32_t>(sizes[6]), p.max_ring_points = static_cast<int32_t>(sizes[7]);
  p.num_patterns = sizes[8], p.num_arcs = sizes[9], p.num_weights = sizes[10];
  p.scale = scale;
  switch (kind) {
    case 0:
      p.out = static_cast<float*>(result0);
      p.lse_out = static_cast<float*>(result1);
      return s2attn::LaunchRingAttnFwd(nullptr, p);
    case 1:
      p.dq = result0;
      return s2attn::LaunchRingAttnBwdDq(nullptr, p);
    case 2:
      p.dk = result0;
      p.dv = result1;
      return s2attn::LaunchRingAttnBwdDkv(nullptr, p);
    default:
      return cudaErrorInvalidValue;
  }
}

// delta[r] = sum_c dout[r, c] * out[r, c] - dlse[r] for `rows` rows of `dv` channels.
// Returns the launcher's cudaError_t.
extern "C" int RunDelta(int dtype, const void* dout, const float* out, const float* dlse, float* delta, int64_t rows,
                        int64_t dv) {
  s2attn::DeltaGpuParams p;
  p.dtype = static_cast<s2attn::ActivationType>(dtype);
  p.dout = dout;
  p.out = out;
  p.dlse = dlse;
  p.delta = delta;
  p.rows = rows;
  p.dv = dv;
  return s2attn::LaunchDelta(nullptr, p);
}

namespace {

// The launch parameters of a scheduled call of the arguments below (RunScheduledTarget's; the results and the
// per-point operands are left to the caller).
s2attn::SchedAttnParams SchedParamsOf(int dtype, int result_dtype, const void* q, const void* k, const void* v,
                                      const void* dout, const float* lse, const int32_t* tiles,
                                      const int32_t* tile_offsets, const int32_t* chunks, const int32_t* records,
                                      const float* quad_weights, const int64_t* sizes, float scale) {
  s2attn::SchedAttnParams p;
  p.dtype = static_cast<s2attn::ActivationType>(dtype);
  p.result_dtype = static_cast<s2attn::ActivationType>(result_dtype);
  p.q = q, p.k = k, p.v = v, p.dout = dout, p.lse = lse;
  p.tiles = tiles, p.tile_offsets = tile_offsets, p.chunks = chunks, p.records = records;
  p.quad_weights = quad_weights;
  p.batch = sizes[0], p.heads = sizes[1];
  p.nlat_q = static_cast<int32_t>(sizes[2]), p.nlon_q = static_cast<int32_t>(sizes[3]);
  p.nlat_k = static_cast<int32_t>(sizes[4]), p.nlon_k = static_cast<int32_t>(sizes[5]);
  p.num_tiles = sizes[6], p.num_chunks = sizes[7], p.num_stagings = sizes[8];
  p.classes = static_cast<int32_t>(sizes[9]), p.shift = static_cast<int32_t>(sizes[10]);
  p.head_dim = static_cast<int32_t>(sizes[11]);
  p.ring_nlon = static_cast<int32_t>(sizes[12]);
  p.ring_grids = sizes[13] != 0;
  p.scale = scale;
  return p;
}

}  // namespace

// A scheduled target (sched_attn_kernels.h): `kind` 0 forward (results out, lse), 1 dq (dq), 2 dkv (dk, dv), on the
// walk's schedule (tiles, tile_offsets, chunks, records). sizes: batch, heads, nlat_q, nlon_q, nlat_k, nlon_k (the
// arrays' grids), num_tiles, num_chunks, num_stagings, classes, shift, head_dim, ring_nlon, ring_grids (tiles of
// runs: a ring grids' schedule). dtype and
// result_dtype: ActivationType of the activations and of out, dq, dk, dv (lse is float32). Returns the launcher's
// cudaError_t.
extern "C" int RunScheduledTarget(int kind, int dtype, int result_dtype, const void* q, const void* k, const void* v,
                                  const void* dout, const float* lse, const float* delta, const int32_t* tiles,
                                  const int32_t* tile_offsets, const int32_t* chunks, const int32_t* records,
                                  const float* quad_weights, void* result0, void* result1, const int64_t* sizes,
                                  float scale) {
  s2attn::SchedAttnParams p = SchedParamsOf(dtype, result_dtype, q, k, v, dout, lse, tiles, tile_offsets, chunks,
                                            records, quad_weights, sizes, scale);
  p.delta = delta;
  switch (kind) {
    case 0:
      p.out = result0;
      p.lse_out = static_cast<float*>(result1);
      return s2attn::LaunchSchedAttnFwd(nullptr, p);
    case 1:
      p.dq = result0;
      return s2attn::LaunchSchedAttnDq(nullptr, p);
    case 2:
      p.dk = result0;
      p.dv = result1;
      return s2attn::LaunchSchedAttnDkv(nullptr, p);
    default:
      return cudaErrorInvalidValue;
  }
}

// The scheduled dq that forms delta (the target jax_s2attn_sched_bwd_dq_delta): RunScheduledTarget's dq arguments
// with the forward's float32 out and dlse in place of delta; results dq and delta.
extern "C" int RunScheduledDqFormingDelta(int dtype, int result_dtype, const void* q, const void* k, const void* v,
                                          const void* dout, const float* lse, const float* forward_out,
                                          const float* dlse, const int32_t* tiles, const int32_t* tile_offsets,
                                          const int32_t* chunks, const int32_t* records, const float* quad_weights,
                                          void* dq, float* delta, const int64_t* sizes, float scale) {
  s2attn::SchedAttnParams p = SchedParamsOf(dtype, result_dtype, q, k, v, dout, lse, tiles, tile_offsets, chunks,
                                            records, quad_weights, sizes, scale);
  p.forward_out = forward_out, p.dlse = dlse;
  p.dq = dq, p.delta_out = delta;
  return s2attn::LaunchSchedAttnDq(nullptr, p);
}
