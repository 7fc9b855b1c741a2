// Device and launch helpers shared by the kernel families in cuda/gpu (the arc-segment kernels of nbhd_attn_*.cu
// and the stencil kernels of stencil_attn_*.cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "common/arc_walk.h"
#include "gpu/nbhd_attn_kernels.h"
#include "gpu/packed_pair.cuh"

namespace s2attn {
namespace gpu {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -__builtin_huge_valf();

// How far (log2 units) the online softmaxes of the forward kernels (scheduled and stencil) let a logit rise
// above its running maximum before the maximum moves: the maxima move, and the accumulators are rescaled,
// only on rises beyond it (P <= 2^8, far inside fp16's range and float32's).
constexpr float kRescaleSlackLog2 = 8.f;

// Largest grid extent in y and z; larger grids are split into several launches. A macro only
// so that the CPU emulation tests (tests/cuda_emulation) can exercise the split with a small one.
#ifndef S2ATTN_MAX_GRID_YZ
#define S2ATTN_MAX_GRID_YZ 65535
#endif
constexpr int64_t kMaxGridYZ = S2ATTN_MAX_GRID_YZ;

// 2^x by the special-function unit (max relative error ~2^-22; exp2(-inf) = 0).
__device__ __forceinline__ float Exp2(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else  // the kernels compiled for the host (tests/cuda_emulation)
  return exp2f(x);
#endif
}

// log2(e) * lse, with +inf for a row without neighbours (lse = -inf), so that exp2(x - it) = 0.
__device__ __forceinline__ float Log2Lse(float lse) { return lse == kNegInf ? -kNegInf : lse * kLog2e; }

// The block's dynamic shared memory.
__device__ __forceinline__ float* DynamicShared() {
  extern __shared__ float s2attn_dynamic_shared[];
  return s2attn_dynamic_shared;
}

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }

// The window operand. A window that does not fit its arrays and grid (only possible with a
// corrupted operand: the host cannot read it) is treated as empty, so nothing is read out of
// bounds and the results are zeros.
__device__ __forceinline__ Windows ReadDeviceWindows(const NbhdAttnGpuParams& p) {
  int32_t raw[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) raw[i] = __ldg(p.window + i);
  Windows w = ReadWindows(raw);
  if (!w.q.Fits(p.nq_lat, p.nq_lon, p.nlat_q, p.nlon_q)) w.q = GridWindow{0, 0, 0, 0};
  if (!w.k.Fits(p.nk_lat, p.nk_lon, p.nlat_k, p.nlon_k)) w.k = GridWindow{0, 0, 0, 0};
  return w;
}

inline bool Aligned16(std::initializer_list<const void*> pointers) {
  for (const void* p : pointers) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  }
  return true;
}

// The (row rank, batch * head) a block works on. The grid is (longitude tile, batch * head,
// row rank) and blocks start in that order (x fastest), so the longest rows (row_order is
// sorted longest first, but for a plan's stencil rows) of every head start first and short rows fill the tail.
struct BlockRow {
  int32_t rank, batch_head;
};

__device__ __forceinline__ BlockRow BlockRowOf(const NbhdAttnGpuParams& p) {
  return BlockRow{p.first_rank + static_cast<int32_t>(blockIdx.z),
                  p.first_batch_head + static_cast<int32_t>(blockIdx.y)};
}

// Launches `kernel` on a (tiles, batch * heads, rows) grid, split into several launches where
// y or z would pass kMaxGridYZ (params.first_rank / first_batch_head say where each starts).
inline cudaError_t LaunchRowGrid(void (*kernel)(NbhdAttnGpuParams), cudaStream_t stream, const NbhdAttnGpuParams& p,
                                 int64_t rows, int64_t tiles, int threads, size_t shared_bytes) {
  const int64_t batch_heads = p.batch * p.heads;  // < 2^31 (checked by the handlers)
  if (tiles == 0 || batch_heads == 0 || rows == 0) return cudaSuccess;
  NbhdAttnGpuParams params = p;
  void* args[] = {&params};
  // Launches in row-rank order, so the longest rows still start first when split.
  for (int64_t rank = 0; rank < rows; rank += kMaxGridYZ) {
    for (int64_t batch_head = 0; batch_head < batch_heads; batch_head += kMaxGridYZ) {
      params.first_rank = static_cast<int32_t>(rank);
      params.first_batch_head = static_cast<int32_t>(batch_head);
      const dim3 grid(static_cast<unsigned>(tiles),
                      static_cast<unsigned>(std::min<int64_t>(batch_heads - batch_head, kMaxGridYZ)),
                      static_cast<unsigned>(std::min<int64_t>(rows - rank, kMaxGridYZ)));
      const cudaError_t status =
          cudaLaunchKernel(reinterpret_cast<const void*>(kernel), grid, dim3(threads), args, shared_bytes, stream);
      if (status != cudaSuccess) return status;
    }
  }
  return cudaGetLastError();
}

}  // namespace gpu
}  // namespace s2attn
