// What the native kernels accept, in one place. The kernels follow these constants, every module's
// build_info() reports them, and Python (jax_s2attn/_native.py) reads them for its checks and messages.
// Plain C++ (compiled by the host compiler and by nvcc).
#pragma once

namespace s2attn {

// Activation dtypes (jax names) of the arc-segment kernels (CPU and CUDA; float32 accumulation).
inline constexpr const char* kArcDtypes[] = {"float32", "bfloat16", "float16"};

// The shape a row pair of the CUDA stencil kernels must fit (gpu/stencil_attn_kernels.h), which the plan's
// stencil pairs follow: the pair stages at most kStencilMaxOtherRows consecutive rows of the other grid, and
// every arc of its points lies within kStencilMaxHalf longitudes of the point (a 7-column window, sized for
// the default cutoff's few neighbours per point).
inline constexpr int kStencilMaxOtherRows = 4;
inline constexpr int kStencilMaxHalf = 3;

// The block schedule the scheduled kernels walk (gpu/sched_attn_kernels.h; jax_s2attn.schedule): tiles of
// kSchedTileRows x kSchedTileCols walking points, chunks of kSchedChunkCols points of the other grid, and the
// head dim (Dk == Dv) and activation dtypes they take.
inline constexpr int kSchedTileRows = 4;
inline constexpr int kSchedTileCols = 16;
inline constexpr int kSchedChunkCols = 32;
// On ring grids (flat fields, one row of all points to the kernels) a tile is kSchedTileRuns runs of up to
// kSchedRunPoints consecutive points of one ring each (jax_s2attn.ring_schedule).
inline constexpr int kSchedTileRuns = 8;
inline constexpr int kSchedRunPoints = 8;
inline constexpr int kSchedHeadDims[] = {32, 64, 128};
inline constexpr const char* kSchedDtypes[] = {"bfloat16", "float16"};

// Activation dtypes and head dims (Dk == Dv) the CUDA stencil kernels are instantiated for
// (gpu/sixteen_bit_dispatch.cuh): those of the scheduled tensor-core kernels, beside which they take the rows of
// short arcs.
inline constexpr const auto& kStencilDtypes = kSchedDtypes;
inline constexpr const auto& kStencilHeadDims = kSchedHeadDims;

}  // namespace s2attn
