// The backward's delta = sum(dout * out, -1) - dlse: one warp per (point, head) row.
#include "gpu/delta_kernel.h"

#include <algorithm>

#include "gpu/device_common.cuh"

namespace s2attn {
namespace gpu {
namespace {

constexpr int kDeltaWarps = 8;
// Rows a warp sums at once: their loads are independent, so a warp keeps that many times more
// bytes in flight (one row at a time leaves the kernel at ~45 % of the HBM bandwidth).
constexpr int kRowsPerWarp = 4;
// Enough blocks to fill any GPU; a grid-stride loop covers the remaining rows. A macro only so
// that the CPU emulation tests (tests/cuda_emulation) can exercise the loop with a small one.
#ifndef S2ATTN_MAX_DELTA_BLOCKS
#define S2ATTN_MAX_DELTA_BLOCKS 65536
#endif
constexpr int64_t kMaxDeltaBlocks = S2ATTN_MAX_DELTA_BLOCKS;

// Per row, lane l sums channels l, l + 32, ... in sequence; then a fixed butterfly adds the 32
// lane sums. Nothing in the order depends on the launch, so every program gets the same bits.
template <typename T>
__global__ void __launch_bounds__(32 * kDeltaWarps) DeltaKernel(const DeltaGpuParams p) {
  const T* dout = static_cast<const T*>(p.dout);
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t stride = int64_t{gridDim.x} * kDeltaWarps * kRowsPerWarp;
  for (int64_t first = (int64_t{blockIdx.x} * kDeltaWarps + threadIdx.x / 32) * kRowsPerWarp; first < p.rows;
       first += stride) {
    int64_t offset[kRowsPerWarp];  // past the last row: the last row again, summed but not stored
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) offset[r] = min(first + r, p.rows - 1) * p.dv;
    float sum[kRowsPerWarp] = {};
    // The rows, not the channels, give the independent loads; unrolled, this loop takes 80-128 registers.
#pragma unroll 1
    for (int64_t c = lane; c < p.dv; c += 32) {
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        sum[r] = fmaf(ToFloat(__ldg(dout + offset[r] + c)), __ldg(p.out + offset[r] + c), sum[r]);
      }
    }
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
#pragma unroll
      for (int lanes = 16; lanes > 0; lanes /= 2) sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], lanes);
      if (lane == 0 && first + r < p.rows) p.delta[first + r] = sum[r] - __ldg(p.dlse + first + r);
    }
  }
}

template <typename T>
cudaError_t Launch(cudaStream_t stream, const DeltaGpuParams& p) {
  DeltaGpuParams params = p;
  void* args[] = {&params};
  constexpr int64_t kRowsPerBlock = kDeltaWarps * kRowsPerWarp;
  const int64_t blocks = std::min<int64_t>((p.rows + kRowsPerBlock - 1) / kRowsPerBlock, kMaxDeltaBlocks);
  // Typed: the host emulation then copies a DeltaGpuParams (its untyped launch takes the attention
  // kernels' NbhdAttnGpuParams).
  const cudaError_t status =
      cudaLaunchKernel(DeltaKernel<T>, dim3(static_cast<unsigned>(blocks)), dim3(32 * kDeltaWarps), args, 0, stream);
  return status != cudaSuccess ? status : cudaGetLastError();
}

}  // namespace
}  // namespace gpu

cudaError_t LaunchDelta(cudaStream_t stream, const DeltaGpuParams& p) {
  if (p.rows == 0) return cudaSuccess;
  switch (p.dtype) {
    case ActivationType::kF32: return gpu::Launch<float>(stream, p);
    case ActivationType::kBF16: return gpu::Launch<__nv_bfloat16>(stream, p);
    case ActivationType::kF16: return gpu::Launch<__half>(stream, p);
  }
  return cudaErrorInvalidValue;  // unreachable: the handler accepts only these three
}

}  // namespace s2attn
