// Two floats in one register of two 16-bit values (bfloat16 or float16), and back: the tensor cores' A and B
// fragments, the rows the arc and stencil kernels widen, the 16-bit results of every kernel.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace s2attn {
namespace gpu {

// Two floats rounded to one register of two T (bf16 or f16), `lo` in the low half.
template <typename T>
__device__ __forceinline__ uint32_t PackPair(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t PackPair<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

template <>
__device__ __forceinline__ uint32_t PackPair<__half>(float lo, float hi) {
  const __half2 pair = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

// The two floats of a PackPair register, exactly (every T value is a float).
template <typename T>
__device__ __forceinline__ float2 UnpackPair(uint32_t pair);

// bfloat16 is the upper half of a float32: one shift and one mask (the conversion intrinsic moves the upper
// half down and back up, three instructions a pair; the stencil kernels widen every staged element).
template <>
__device__ __forceinline__ float2 UnpackPair<__nv_bfloat16>(uint32_t pair) {
  return make_float2(__uint_as_float(pair << 16), __uint_as_float(pair & 0xffff0000u));
}

template <>
__device__ __forceinline__ float2 UnpackPair<__half>(uint32_t pair) {
  return __half22float2(*reinterpret_cast<const __half2*>(&pair));
}

}  // namespace gpu
}  // namespace s2attn
