// Host side of the 16-bit kernels on NbhdAttnGpuParams (the stencil kernels): the instantiation that runs a call.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>

#include "gpu/nbhd_attn_kernels.h"

namespace s2attn {
namespace gpu {

// Whether 16-bit kernels instantiated for head dims `dims` take this call's types: bfloat16 or float16
// activations, Dk == Dv in `dims`, gradients of float32 or the activations' type.
template <size_t N>
bool SixteenBitTypes(const NbhdAttnGpuParams& p, const int (&dims)[N]) {
  const bool sixteen_bit = p.dtype == ActivationType::kBF16 || p.dtype == ActivationType::kF16;
  bool head_dims = false;
  for (const int d : dims) head_dims = head_dims || (p.head_dim_k == d && p.head_dim_v == d);
  const bool gradients = p.gradient_dtype == ActivationType::kF32 || p.gradient_dtype == p.dtype;
  return sixteen_bit && head_dims && gradients;
}

template <typename T, int D>
struct SixteenBitVariant {
  using Element = T;
  static constexpr int kDim = D;
};

// Calls launch(SixteenBitVariant<T, D>{}) for T the activations' type (bfloat16 or float16) and D = Dk in
// {32, 64, 128}, the head dims the kernels are instantiated for; anything else is cudaErrorInvalidValue (the
// launchers check what else they need first).
template <typename Launch>
cudaError_t DispatchSixteenBit(const NbhdAttnGpuParams& p, Launch&& launch) {
  const auto by_dim = [&](auto element) -> cudaError_t {
    using T = decltype(element);
    switch (p.head_dim_k) {
      case 32: return launch(SixteenBitVariant<T, 32>{});
      case 64: return launch(SixteenBitVariant<T, 64>{});
      case 128: return launch(SixteenBitVariant<T, 128>{});
      default: return cudaErrorInvalidValue;
    }
  };
  if (p.dtype == ActivationType::kBF16) return by_dim(__nv_bfloat16{});
  return p.dtype == ActivationType::kF16 ? by_dim(__half{}) : cudaErrorInvalidValue;
}

}  // namespace gpu
}  // namespace s2attn
