// Launcher of the delta kernel (plain C++ and CUDA runtime types; no XLA or nanobind headers).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "gpu/nbhd_attn_kernels.h"

namespace s2attn {

// One jax_s2attn_delta call: `rows` contiguous (point, head) rows of `dv` channels.
struct DeltaGpuParams {
  ActivationType dtype = ActivationType::kF32;
  const void* dout = nullptr;    // [rows, dv] in `dtype`
  const float* out = nullptr;    // [rows, dv]
  const float* dlse = nullptr;   // [rows]
  float* delta = nullptr;        // [rows] result
  int64_t rows = 0;
  int64_t dv = 0;
};

// Enqueues delta[r] = sum_c dout[r, c] * out[r, c] - dlse[r] on `stream` and returns
// cudaGetLastError() of the launch; never synchronises. Every row is summed by one warp in an
// order that depends only on dv, so results are bitwise reproducible.
cudaError_t LaunchDelta(cudaStream_t stream, const DeltaGpuParams& params);

}  // namespace s2attn
