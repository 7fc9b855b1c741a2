// The shape of the main loop that experimental/mainloop_primitives.sh measures, shared by its two versions and its
// driver: the scheduled forward's at head dim 64 (cuda/gpu/sched_attn_device.cuh).
#pragma once

#include <cstdint>

namespace mainloop_shape {

inline constexpr int kHeadDim = 64;    // a row of 128 bytes: the 128-byte swizzle
inline constexpr int kQueryRows = 64;  // a block's queries: the wgmma M
inline constexpr int kChunkRows = 32;  // keys a chunk: the N of S = Q K^T
inline constexpr int kStages = 4;      // the K/V ring
inline constexpr int kConsumerThreads = 128, kThreads = kConsumerThreads + 32;  // a warpgroup and a producer warp
inline constexpr int kBlocksPerSm = 4;

// The chunk of K and V that block `block` multiplies at its step `i`: the blocks' walks start `stride` chunks apart
// and wrap around the `total_chunks` chunks (the kernels' walk and the host reference's).
__host__ __device__ inline int ChunkOf(int block, int i, int stride, int total_chunks) {
  return static_cast<int>((static_cast<int64_t>(block) * stride + i) % total_chunks);
}

}  // namespace mainloop_shape
