// Launchers of the stencil kernels (stencil_attn_fwd.cu, stencil_attn_dq.cu, stencil_attn_dkv.cu): the rows of
// short arcs, on CUDA cores (NbhdAttnGpuParams::stencil_pairs). The stencil targets run them beside the scheduled
// kernels, whose schedule leaves out the pairs' tiles (jax_s2attn.schedule, "Stencil rows"). Plain C++ and CUDA
// runtime types.
#pragma once

#include <cuda_runtime_api.h>

#include "common/kernel_limits.h"
#include "gpu/nbhd_attn_kernels.h"

namespace s2attn {
namespace gpu {
namespace stencil {

// The shape a row pair must fit (common/kernel_limits.h; jax_s2attn.plan picks the pairs by it): a block walks
// kRows consecutive rows, stages at most kMaxOtherRows consecutive rows of the other grid, and every arc of its
// points lies within kMaxHalf longitudes of the point.
constexpr int kRows = 2;
constexpr int kMaxOtherRows = kStencilMaxOtherRows;
constexpr int kMaxHalf = kStencilMaxHalf;

// out (or out_narrow) and lse_out of the query rows of p.stencil_pairs, for T = __nv_bfloat16 or __half
// and Dk == Dv == D in {32, 64, 128}; needs R == S == 1 and whole windows (rows of a call with any other
// window get zeros and lse = -inf, as if they had no neighbours).
template <typename T, int D>
cudaError_t LaunchStencilFwd(cudaStream_t stream, const NbhdAttnGpuParams& p);

// dq (and, given dlse in place of delta, delta formed from the walk's probabilities into delta_out) of the same
// rows; the same requirements.
template <typename T, int D>
cudaError_t LaunchStencilDq(cudaStream_t stream, const NbhdAttnGpuParams& p);

// dk and dv of the key rows of p.stencil_pairs (the backward walk's pairs); the same requirements.
template <typename T, int D>
cudaError_t LaunchStencilDkv(cudaStream_t stream, const NbhdAttnGpuParams& p);

}  // namespace stencil
}  // namespace gpu

// Whether the stencil targets run this call: 16-bit activations, Dk == Dv in kStencilHeadDims, results of float32
// or the activations' type, 16-byte aligned activations, and row pairs to walk. The handlers turn `false` into
// INVALID_ARGUMENT.
bool StencilAttnSupported(const NbhdAttnGpuParams& p);

// The stencil targets: the launchers above for the call's type and head dim, writing only the rows of
// p.stencil_pairs (out or out_narrow and lse_out; dq, with p.delta, or given dlse also delta_out; dk and dv);
// cudaErrorInvalidValue where StencilAttnSupported is false, where the pairs' rows are more than the walking
// grid's, or where a result (the forward: exactly one of out and out_narrow) or the dq's delta (or delta_out
// beside dlse) is missing.
cudaError_t LaunchStencilAttnFwd(cudaStream_t stream, const NbhdAttnGpuParams& p);
cudaError_t LaunchStencilAttnBwdDq(cudaStream_t stream, const NbhdAttnGpuParams& p);
cudaError_t LaunchStencilAttnBwdDkv(cudaStream_t stream, const NbhdAttnGpuParams& p);

}  // namespace s2attn
