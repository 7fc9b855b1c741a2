// Launchers of the tiled tensor-core kernels (plain C++ and CUDA runtime types). They take the
// same NbhdAttnGpuParams as the arc-segment launchers (nbhd_attn_kernels.h), except that
// `arc_offsets` / `arcs` / `num_arcs` describe the walk's *segment table*
// (jax_s2attn.plan.SegmentTable: offsets per walking row, rows of (row, lo[R], len[R])).
#pragma once

#include <cuda_runtime_api.h>

#include "gpu/nbhd_attn_kernels.h"

namespace s2attn {

// Whether the tiled kernels run this case: 16-bit activations, Dk == Dv in {32, 64, 128},
// gradients of float32 or the activations' type, and 16-byte aligned activations. The handlers
// turn `false` into INVALID_ARGUMENT.
bool TiledAttnSupported(const NbhdAttnGpuParams& params);

// Same results and contract as LaunchNbhdAttnFwd / BwdDq / BwdDkv (cuda/README.md); the forward writes
// `out` or, given `out_narrow` instead, out in the activations' type (exactly one of them).
cudaError_t LaunchTiledAttnFwd(cudaStream_t stream, const NbhdAttnGpuParams& params);
cudaError_t LaunchTiledAttnBwdDq(cudaStream_t stream, const NbhdAttnGpuParams& params);
cudaError_t LaunchTiledAttnBwdDkv(cudaStream_t stream, const NbhdAttnGpuParams& params);

}  // namespace s2attn
