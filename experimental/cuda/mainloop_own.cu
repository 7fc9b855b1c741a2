// The streaming attention main loop on the project's own PTX wrappers (gpu/tma_sm90.cuh, gpu/mbarrier_sm90.cuh,
// gpu/wgmma_sm90.cuh): one of the two versions experimental/mainloop_primitives.sh compares, the other on CuTe and
// CUTLASS primitives (mainloop_cute.cu). Compiled as a translation unit of its own, so that the build
// times each version; mainloop_primitives.cu declares its entry point, PrepareOwnMainLoop.
//
// The shape of the scheduled forward (gpu/sched_attn_device.cuh) at head dim 64, without its mask and softmax: a block
// is a consumer warpgroup (warps 0-3) and a producer warp (warp 4), 160 threads, 4 blocks an SM, no setmaxnreg
// (it takes whole warpgroups, and the producer is one warp). Lane 0 of the producer asks for the block's Q tile
// (64 rows x 64, one box) and then, per chunk, for K's and V's boxes of 32 rows x 64 into a ring of kStages stages
// guarded by full and empty mbarriers. The consumer, in the scheduled forward's order (WalkChunks): with chunk j's P
// in registers it issues S(j + 1) = Q K(j + 1)^T (SS, 4 m64n32k16), then O += P(j) V(j) (RS, 2 m64n64k16, V MN-major),
// scales S(j + 1) while the product runs, waits for it, releases stage j and rounds S(j + 1) to bf16 as P(j + 1).
// At the end the thread's rows of O (float32) go to `out`.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <functional>

#include "gpu/device_common.cuh"
#include "gpu/mbarrier_sm90.cuh"
#include "gpu/tma_sm90.cuh"
#include "gpu/wgmma_sm90.cuh"
#include "mainloop_shape.h"

namespace own_mainloop {

namespace gpu = s2attn::gpu;
namespace sm90 = s2attn::gpu::sm90;
using T = __nv_bfloat16;

using namespace mainloop_shape;

// The tiles a block stages, each 1024-byte aligned (the 128-byte swizzle's pattern; every size is a multiple of
// 1024 bytes).
struct alignas(1024) Tiles {
  T q[kQueryRows * kHeadDim];
  T k[kStages][kChunkRows * kHeadDim];
  T v[kStages][kChunkRows * kHeadDim];
};
constexpr uint32_t kQBytes = kQueryRows * kHeadDim * sizeof(T);
constexpr uint32_t kChunkTileBytes = kChunkRows * kHeadDim * sizeof(T);  // one of K's or V's boxes
static_assert(kQBytes % 1024 == 0 && kChunkTileBytes % 1024 == 0, "tiles of whole swizzle patterns");

struct Shared {
  Tiles tiles;
  uint64_t full[kStages];   // a stage's K and V landed: the producer's one arrival and the boxes' bytes
  uint64_t empty[kStages];  // the consumer's 128 threads are done with a stage
  uint64_t q_full;
};

// 3-D maps of rows of 64 bf16: (element, row of the box, box) with boxes of a Q tile and of a K or V chunk.
struct Maps {
  CUtensorMap q, k, v;
};

// The chunks a block walks: ChunkOf(block, i, stride, total_chunks) for i < chunks_per_block.
struct Walk {
  int chunks_per_block, total_chunks, stride;
};

// Descriptors step 16-byte units: a k16 step of a K-major operand is 32 bytes along its rows, of the MN-major V
// 16 rows; stages lie one tile apart.
constexpr uint32_t kKMajorK16Units = 32 / 16;
constexpr uint32_t kMnMajorK16Units = 16 * kHeadDim * sizeof(T) / 16;
constexpr uint32_t kStageUnits = kChunkTileBytes / 16;

// Lane 0 of the producer warp: the Q tile, then every chunk's K and V into the ring.
__device__ __forceinline__ void Produce(const Maps& maps, Shared& s, const Walk& walk) {
  sm90::MbarrierArriveExpectBytes(&s.q_full, kQBytes);
  sm90::LoadBox3d(s.tiles.q, &maps.q, 0, 0, blockIdx.x, &s.q_full);
  for (int i = 0; i < walk.chunks_per_block; ++i) {
    const int stage = i % kStages;
    // The stage's previous use released (the first pass waits on the phase before a fresh barrier's first).
    gpu::MbarrierWait(&s.empty[stage], ((i / kStages) & 1) ^ 1);
    const int chunk = ChunkOf(blockIdx.x, i, walk.stride, walk.total_chunks);
    sm90::MbarrierArriveExpectBytes(&s.full[stage], 2 * kChunkTileBytes);
    sm90::LoadBox3d(s.tiles.k[stage], &maps.k, 0, 0, chunk, &s.full[stage]);
    sm90::LoadBox3d(s.tiles.v[stage], &maps.v, 0, 0, chunk, &s.full[stage]);
  }
}

// The consumer warpgroup: the chunks' products into O, then O to the block's 64 rows of `out`.
__device__ __forceinline__ void Consume(Shared& s, float* out, int count, float scale) {
  const uint64_t q = sm90::SwizzledTileDescriptor(s.tiles.q);
  const uint64_t k = sm90::SwizzledTileDescriptor(s.tiles.k[0]);
  const uint64_t v = sm90::SwizzledTileDescriptor(s.tiles.v[0]);
  float scores[kChunkRows / 2];   // m64n32 accumulator
  float o[kHeadDim / 2] = {};     // m64n64 accumulator
  uint32_t prob[kChunkRows / 16][4];  // P as the A fragments of the product's two k16 steps
  const auto issue_scores = [&](int stage) {  // S = Q K^T: 4 k16 steps, one group
    sm90::FenceRegisters(scores);
    sm90::WgmmaFence();
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks) {
      sm90::WgmmaM64N32K16SharedA<T>(scores, sm90::DescriptorPlus(q, ks * kKMajorK16Units),
                                     sm90::DescriptorPlus(k, stage * kStageUnits + ks * kKMajorK16Units), ks > 0);
    }
    sm90::WgmmaCommit();
  };
  const auto issue_products = [&](int stage) {  // O += P V: 2 k16 steps, one group
#pragma unroll
    for (int kk = 0; kk < kChunkRows / 16; ++kk) sm90::FenceRegisters(prob[kk]);
    sm90::FenceRegisters(o);
    sm90::WgmmaFence();  // P's registers were written since the last wgmma
#pragma unroll
    for (int kk = 0; kk < kChunkRows / 16; ++kk) {
      sm90::WgmmaM64N64K16<T, 1>(o, prob[kk], sm90::DescriptorPlus(v, stage * kStageUnits + kk * kMnMajorK16Units),
                                 1);
    }
    sm90::WgmmaCommit();
  };
  const auto scale_scores = [&] {
#pragma unroll
    for (int e = 0; e < kChunkRows / 2; ++e) scores[e] *= scale;
  };
  const auto round_scores = [&] {  // accumulator columns 16 kk .. 16 kk + 15 are k16 step kk's A fragment
#pragma unroll
    for (int kk = 0; kk < kChunkRows / 16; ++kk) {
#pragma unroll
      for (int i = 0; i < 4; ++i) prob[kk][i] = gpu::PackPair<T>(scores[8 * kk + 2 * i], scores[8 * kk + 2 * i + 1]);
    }
  };

  gpu::MbarrierWait(&s.q_full, 0);
  gpu::MbarrierWait(&s.full[0], 0);
  issue_scores(0);
  sm90::WgmmaWait<0>();
  sm90::FenceRegisters(scores);
  scale_scores();
  round_scores();
  for (int j = 0; j + 1 < count; ++j) {
    const int next = (j + 1) % kStages;
    gpu::MbarrierWait(&s.full[next], ((j + 1) / kStages) & 1);
    issue_scores(next);
    issue_products(j % kStages);
    sm90::WgmmaWait<1>();  // S(j + 1) complete, P(j) V(j) may still run
    sm90::FenceRegisters(scores);
    scale_scores();
    sm90::WgmmaWait<0>();  // P(j) V(j) complete: stage j and P's registers are free
    sm90::FenceRegisters(o);
    gpu::MbarrierArrive(&s.empty[j % kStages]);
    round_scores();
  }
  issue_products((count - 1) % kStages);
  sm90::WgmmaWait<0>();
  sm90::FenceRegisters(o);
  gpu::MbarrierArrive(&s.empty[(count - 1) % kStages]);

  // Accumulator element i: row 16 warp + g + 8 ((i >> 1) & 1), column 8 (i >> 2) + 2 t + (i & 1) (wgmma_sm90.cuh).
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  float* tile = out + static_cast<size_t>(blockIdx.x) * kQueryRows * kHeadDim;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float* row = tile + static_cast<size_t>(16 * warp + g + 8 * h) * kHeadDim + 2 * t;
#pragma unroll
    for (int j = 0; j < kHeadDim / 8; ++j) {
      *reinterpret_cast<float2*>(row + 8 * j) = make_float2(o[4 * j + 2 * h], o[4 * j + 2 * h + 1]);
    }
  }
}

__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    OwnMainLoop(const __grid_constant__ Maps maps, float* out, Walk walk, float scale) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  auto* base = reinterpret_cast<unsigned char*>(gpu::DynamicShared());
  base += (1024 - reinterpret_cast<uintptr_t>(base) % 1024) % 1024;  // the shared window is 1024-byte aligned
  Shared& s = *reinterpret_cast<Shared*>(base);
  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      gpu::MbarrierInit(&s.full[i], 1);
      gpu::MbarrierInit(&s.empty[i], kConsumerThreads);
    }
    gpu::MbarrierInit(&s.q_full, 1);
    gpu::MbarrierInitFence();
  }
  __syncthreads();
  if (threadIdx.x >= kConsumerThreads) {
    if (threadIdx.x == kConsumerThreads) Produce(maps, s, walk);
  } else {
    Consume(s, out, walk.chunks_per_block, scale);
  }
#endif
}

// A map of `boxes` boxes of `rows` rows of 64 bf16 (128-byte rows, the 128-byte swizzle), box after box in memory.
bool EncodeRows(sm90::EncodeTiled encode, CUtensorMap* map, const T* data, int rows, int boxes) {
  const cuuint64_t row_bytes = kHeadDim * sizeof(T);
  const cuuint64_t dims[3] = {kHeadDim, cuuint64_t(rows), cuuint64_t(boxes)};
  const cuuint64_t strides[2] = {row_bytes, row_bytes * rows};
  const cuuint32_t box[3] = {kHeadDim, cuuint32_t(rows), 1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<T*>(data), dims, strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace own_mainloop

// Sets up the own-wrapper main loop over q [blocks * 64, 64], k and v [total_chunks * 32, 64] (bf16, rows
// contiguous) into out [blocks * 64, 64] (float32): its tensor maps and shared-memory limit, once. Returns its launch
// on a stream, or an empty function after printing why it cannot be set up; `kernel`, `threads` and `shared_bytes`
// receive what the resource queries need.
std::function<cudaError_t(cudaStream_t)> PrepareOwnMainLoop(const __nv_bfloat16* q, const __nv_bfloat16* k,
                                                            const __nv_bfloat16* v, float* out, int blocks,
                                                            int chunks_per_block, int total_chunks, int stride,
                                                            float scale, const void** kernel, int* threads,
                                                            int* shared_bytes) {
  using namespace own_mainloop;
  const sm90::EncodeTiled encode = sm90::FindEncodeTiled();
  if (encode == nullptr) {
    std::printf("own: cuTensorMapEncodeTiled not found\n");
    return {};
  }
  Maps maps;
  if (!EncodeRows(encode, &maps.q, q, kQueryRows, blocks) ||
      !EncodeRows(encode, &maps.k, k, kChunkRows, total_chunks) ||
      !EncodeRows(encode, &maps.v, v, kChunkRows, total_chunks)) {
    std::printf("own: cuTensorMapEncodeTiled failed\n");
    return {};
  }
  const int shared = static_cast<int>(sizeof(Shared)) + 1024;  // + the alignment
  const cudaError_t status = cudaFuncSetAttribute(OwnMainLoop, cudaFuncAttributeMaxDynamicSharedMemorySize, shared);
  if (status != cudaSuccess) {
    std::printf("own: cudaFuncSetAttribute: %s\n", cudaGetErrorString(status));
    return {};
  }
  *kernel = reinterpret_cast<const void*>(OwnMainLoop);
  *threads = kThreads;
  *shared_bytes = shared;
  const Walk walk{chunks_per_block, total_chunks, stride};
  return [=](cudaStream_t stream) {
    OwnMainLoop<<<blocks, kThreads, shared, stream>>>(maps, out, walk, scale);
    return cudaGetLastError();
  };
}
