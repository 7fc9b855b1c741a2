// Launchers of the CUDA neighbourhood-attention kernels (plain C++ and CUDA runtime types;
// no XLA or nanobind headers). The handlers in nbhd_attn_ffi.cc validate everything they can
// see on the host and fill one NbhdAttnGpuParams; the kernels clamp whatever lives in device
// memory (window, row order, arc tables) so that bad table values can never index out of bounds.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace s2attn {

// Element type of q, k, v and dout. Accumulation is float32, and so is every result but the
// gradients and the forward's out of the stencil kernels, which may be stored in the activations' type
// (gradient_dtype, out_narrow).
enum class ActivationType : int { kF32, kBF16, kF16 };

// One call of any of the three targets, passed to the kernels by value. Activations are
// contiguous row-major [batch, nlat, nlon, heads, dim] (leading dims flattened into batch);
// "q grid" = query/output grid, "k grid" = key/input grid, sizes in elements.
struct NbhdAttnGpuParams {
  ActivationType dtype = ActivationType::kF32;

  // Inputs (device memory). Unused ones are null.
  const void* q = nullptr;        // [batch, nq_lat, nq_lon, heads, dk]
  const void* k = nullptr;        // [batch, nk_lat, nk_lon, heads, dk]
  const void* v = nullptr;        // [batch, nk_lat, nk_lon, heads, dv]
  const void* dout = nullptr;     // [batch, nq_lat, nq_lon, heads, dv]   (backward)
  const float* lse = nullptr;     // [batch, nq_lat, nq_lon, heads]        (backward)
  const float* delta = nullptr;   // [batch, nq_lat, nq_lon, heads]        (backward)
  // Stencil dq only, instead of `delta`: the cotangent of lse, from which and its walk's probabilities the kernel
  // forms delta = sum_j p_j (dout . v_j) / sum_j p_j - dlse of its own queries and writes it to `delta_out`.
  const float* dlse = nullptr;  // [batch, nq_lat, nq_lon, heads]

  // Tables (device memory; the first copy when the operand holds several).
  const int32_t* window = nullptr;       // [8] q_lat0, q_lon0, q_nlat, q_nlon, k_lat0, k_lon0, k_nlat, k_nlon
  const int32_t* row_order = nullptr;    // [local rows of the walking grid], longest first (the arc kernels)
  const int32_t* arc_offsets = nullptr;  // [num_patterns + 1]
  const int32_t* arcs = nullptr;         // [num_arcs, 3] = (global row, lo, len) on the other grid
  const float* quad_weights = nullptr;   // [nlat_k] weight of every global key row
  // Stencil kernels only (stencil_attn_kernels.h): the pairs of walking rows (2i, 2i + 1; query rows, or key rows
  // for dk/dv) they take, as rows of (first walking row, first row of the other grid it stages); a pair's rank in
  // it orders the blocks. Whole grids only.
  const int32_t* stencil_pairs = nullptr;  // [num_stencil_pairs, 2]
  int32_t num_stencil_pairs = 0;

  // Results (device memory). Unused ones are null.
  float* out = nullptr;      // [batch, nq_lat, nq_lon, heads, dv]
  float* lse_out = nullptr;  // [batch, nq_lat, nq_lon, heads]
  // Stencil forward only, in place of `out`: out in `dtype` (the float32 result rounded to nearest).
  void* out_narrow = nullptr;  // [batch, nq_lat, nq_lon, heads, dv]
  void* dq = nullptr;        // like q, of gradient_dtype
  float* delta_out = nullptr;  // [batch, nq_lat, nq_lon, heads] (stencil dq forming delta)
  void* dk = nullptr;        // like k, of gradient_dtype
  void* dv = nullptr;        // like v, of gradient_dtype
  // kF32, or `dtype` (stencil kernels only): each gradient element is its float32 sum rounded to
  // nearest, the bits a float32 result cast by XLA would have, at half the bytes written.
  ActivationType gradient_dtype = ActivationType::kF32;

  int64_t batch = 0;
  int64_t heads = 0;               // batch * heads < 2^31
  int64_t head_dim_k = 0;  // Dk of q and k
  int64_t head_dim_v = 0;  // Dv of v and dout
  int32_t nq_lat = 0, nq_lon = 0;  // local (array) extent of the q grid, padding included
  int32_t nk_lat = 0, nk_lon = 0;  // local (array) extent of the k grid, padding included
  int32_t nlat_q = 0, nlon_q = 0;  // global q grid
  int32_t nlat_k = 0, nlon_k = 0;  // global k grid
  int32_t residues = 1;            // R of the arc table being walked
  int32_t shift = 1;               // S of the arc table being walked
  int64_t num_arcs = 0;            // rows of `arcs` (all copies: only an index bound)
  float scale = 1.0f;              // logit scale

  // Ring targets only (LaunchRingAttn*): flat fields [batch, points, heads, dim] between ring grids, walking the
  // patterns of common/ring_walk.h: `arc_offsets` and `arcs` hold pattern_offsets and pattern_arcs (num_arcs
  // their rows), `row_order` the walking rings most points first, and `window` is unused. quad_weights holds
  // num_weights input rings' weights.
  const int32_t* walk_rings = nullptr;  // [num_walk_rings, 4]
  int32_t num_walk_rings = 0;
  int32_t max_ring_points = 0;   // points of the largest walking ring
  int64_t num_patterns = 0;
  int64_t num_weights = 0;
  int32_t walk_points = 0;       // points of the walking grid (queries for forward and dq, keys for dk/dv)
  int32_t visited_points = 0;    // points of the other grid

  // Set by the launchers, which split grids past 65535 blocks in y or z into several launches:
  // the row rank and the batch * head index of this launch's blockIdx.z = 0 and blockIdx.y = 0.
  int32_t first_rank = 0;
  int32_t first_batch_head = 0;
};

// The largest Dk + Dv of the arc kernels (the general path keeps two vectors of Dk + Dv floats per warp in
// shared memory), and whether they support these head dims. The handlers turn `false` into INVALID_ARGUMENT.
int64_t NbhdAttnMaxHeadDims();
bool NbhdAttnHeadDimsSupported(int64_t head_dim_k, int64_t head_dim_v);

// Each launcher enqueues its kernel on `stream` and returns cudaGetLastError() of the launch.
// They never synchronise. Results are fully written (padding included), without atomics.

// out, lse_out from q, k, v walking the forward arcs (walking grid = q grid).
cudaError_t LaunchNbhdAttnFwd(cudaStream_t stream, const NbhdAttnGpuParams& params);

// dq from q, k, v, dout, lse, delta walking the forward arcs (walking grid = q grid).
cudaError_t LaunchNbhdAttnBwdDq(cudaStream_t stream, const NbhdAttnGpuParams& params);

// dk, dv from q, k, v, dout, lse, delta walking the backward arcs (walking grid = k grid).
cudaError_t LaunchNbhdAttnBwdDkv(cudaStream_t stream, const NbhdAttnGpuParams& params);

// The same three between ring grids (the ring fields above): the queries' patterns for the forward and dq, the
// keys' for dk/dv.
cudaError_t LaunchRingAttnFwd(cudaStream_t stream, const NbhdAttnGpuParams& params);
cudaError_t LaunchRingAttnBwdDq(cudaStream_t stream, const NbhdAttnGpuParams& params);
cudaError_t LaunchRingAttnBwdDkv(cudaStream_t stream, const NbhdAttnGpuParams& params);

}  // namespace s2attn
