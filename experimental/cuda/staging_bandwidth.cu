// Staging bandwidth of the H200 (experimental/staging_bandwidth.sh builds and runs it): blocks stream
// contiguous chunks of a buffer into shared memory, the way a kernel stages windows of K/V rows,
// either with cp.async.cg (16 bytes per thread and copy, `kDepth` chunks in flight) or with
// tensor-map boxes of kRows x 128 bytes (a chunk of K rows at D = 64 in bf16) issued by one thread,
// `kDepth` in flight on mbarriers. A buffer smaller than the L2 measures L2 -> shared, a large one
// HBM -> shared. Standalone: not part of the Python package.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "check_cuda.h"
#include "gpu/tma_sm90.cuh"  // the driver's tensor-map encoder, through the runtime (no -lcuda)

namespace {

constexpr int kIterations = 2000;  // chunks per block and launch

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Chunks visited by a block: scattered start, then every gridDim.x-th chunk, wrapping around.
__device__ __forceinline__ size_t FirstChunk(size_t chunks) { return (blockIdx.x * size_t{2654435761u}) % chunks; }

// The last bytes staged reach a global write only in a case that never happens, so nothing is
// optimised away.
__device__ __forceinline__ void KeepAlive(const char* staged, unsigned* sink) {
  if (staged[0] == 123 && staged[1] == 45) atomicAdd(sink, 1u);
}

template <int kChunkBytes, int kDepth>
__global__ void StageByCpAsync(const char* __restrict__ buffer, size_t chunks, unsigned* sink) {
  extern __shared__ __align__(1024) char stages[];
  size_t chunk = FirstChunk(chunks);
  for (int i = 0; i < kIterations; ++i) {
    char* dst = stages + (i % kDepth) * kChunkBytes;
    const char* src = buffer + chunk * kChunkBytes;
    for (int piece = threadIdx.x; piece < kChunkBytes / 16; piece += blockDim.x) {
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(SharedAddress(dst + 16 * piece)),
                   "l"(src + 16 * piece));
    }
    asm volatile("cp.async.commit_group;\n");
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kDepth - 1));
    chunk += gridDim.x;
    if (chunk >= chunks) chunk -= chunks;
  }
  asm volatile("cp.async.wait_group 0;\n");
  __syncthreads();
  if (threadIdx.x == 0) KeepAlive(stages, sink);
}

template <int kRows, int kDepth>
__global__ void StageByTensorMap(const __grid_constant__ CUtensorMap map, size_t chunks, unsigned* sink) {
  extern __shared__ __align__(1024) char stages[];
  constexpr int kBytes = kRows * 128;
  __shared__ __align__(8) uint64_t full[kDepth];
  if (threadIdx.x != 0) return;  // one thread issues and waits
  for (int s = 0; s < kDepth; ++s) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(SharedAddress(&full[s])));
  }
  asm volatile("fence.mbarrier_init.release.cluster;\n");
  size_t chunk = FirstChunk(chunks);
  const auto issue = [&](int i) {
    const int s = i % kDepth;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(SharedAddress(&full[s])),
                 "r"(kBytes));
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
            SharedAddress(stages + s * kBytes)),
        "l"(&map), "r"(0), "r"(static_cast<int>(chunk * kRows)), "r"(SharedAddress(&full[s]))
        : "memory");
    chunk += gridDim.x;
    if (chunk >= chunks) chunk -= chunks;
  };
  for (int i = 0; i < kDepth; ++i) issue(i);
  for (int i = 0; i < kIterations; ++i) {
    const int s = i % kDepth;
    uint32_t done = 0;
    while (!done) {
      asm volatile(
          "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
          : "=r"(done)
          : "r"(SharedAddress(&full[s])), "r"((i / kDepth) & 1)
          : "memory");
    }
    if (i + kDepth < kIterations) issue(i + kDepth);
  }
  KeepAlive(stages, sink);
}

// Best of five timed launches (after one warm-up) of `grid` blocks; prints bytes staged per second.
template <typename Launch>
bool Report(const char* what, size_t buffer_bytes, int chunk_bytes, int depth, int blocks_per_sm, int grid,
            Launch&& launch) {
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  float best = 1e30f;
  for (int rep = 0; rep < 6; ++rep) {
    CHECK_CUDA(cudaEventRecord(start));
    launch();
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0.f;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    if (rep > 0 && ms < best) best = ms;
  }
  const double bytes = double(grid) * kIterations * chunk_bytes;
  std::printf("%-9s buffer %7.1f MB  chunk %5d B  depth %d  blocks/SM %2d  %8.3f ms  %6.2f TB/s\n", what,
              buffer_bytes / 1e6, chunk_bytes, depth, blocks_per_sm, best, bytes / best / 1e9);
  return true;
}

template <int kChunkBytes, int kDepth>
bool RunCpAsync(const char* buffer, size_t bytes, int blocks_per_sm, int sms, unsigned* sink) {
  const auto kernel = StageByCpAsync<kChunkBytes, kDepth>;
  const int shared = kChunkBytes * kDepth;
  CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared));
  const int grid = blocks_per_sm * sms;
  return Report("cp.async", bytes, kChunkBytes, kDepth, blocks_per_sm, grid,
                [&] { kernel<<<grid, 128, shared>>>(buffer, bytes / kChunkBytes, sink); });
}

template <int kRows, int kDepth>
bool RunTensorMap(s2attn::gpu::sm90::EncodeTiled encode, char* buffer, size_t bytes, int blocks_per_sm, int sms, unsigned* sink,
                  CUtensorMapSwizzle swizzle) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {64, bytes / 128}, strides[1] = {128};
  const cuuint32_t box[2] = {64, kRows}, element_strides[2] = {1, 1};
  if (encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, buffer, dims, strides, box, element_strides,
             CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
    std::printf("cuTensorMapEncodeTiled failed\n");
    return false;
  }
  const auto kernel = StageByTensorMap<kRows, kDepth>;
  const int shared = kRows * 128 * kDepth;
  CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared));
  const int grid = blocks_per_sm * sms;
  const char* what = swizzle == CU_TENSOR_MAP_SWIZZLE_128B ? "box swz128" : "box";
  return Report(what, bytes, kRows * 128, kDepth, blocks_per_sm, grid,
                [&] { kernel<<<grid, 32, shared>>>(map, bytes / (kRows * 128), sink); });
}

bool Main() {
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  std::printf("%s: %d SMs, %d MB of L2\n", prop.name, sms, prop.l2CacheSize >> 20);
  const s2attn::gpu::sm90::EncodeTiled encode = s2attn::gpu::sm90::FindEncodeTiled();
  if (encode == nullptr) {
    std::printf("cuTensorMapEncodeTiled not found\n");
    return false;
  }
  const size_t l2_resident = size_t{16} << 20, from_hbm = size_t{4} << 30;
  char* buffer = nullptr;
  unsigned* sink = nullptr;
  CHECK_CUDA(cudaMalloc(&buffer, from_hbm));
  CHECK_CUDA(cudaMalloc(&sink, sizeof(unsigned)));
  CHECK_CUDA(cudaMemset(buffer, 1, from_hbm));
  bool ok = true;
  for (int blocks_per_sm : {4, 8}) {
    ok = ok && RunCpAsync<4096, 2>(buffer, l2_resident, blocks_per_sm, sms, sink);
    ok = ok && RunCpAsync<4096, 4>(buffer, l2_resident, blocks_per_sm, sms, sink);
    ok = ok && RunCpAsync<8192, 4>(buffer, l2_resident, blocks_per_sm, sms, sink);
    for (CUtensorMapSwizzle swizzle : {CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_SWIZZLE_128B}) {
      ok = ok && RunTensorMap<32, 4>(encode, buffer, l2_resident, blocks_per_sm, sms, sink, swizzle);
      ok = ok && RunTensorMap<64, 4>(encode, buffer, l2_resident, blocks_per_sm, sms, sink, swizzle);
    }
  }
  ok = ok && RunCpAsync<8192, 4>(buffer, from_hbm, 4, sms, sink);
  ok = ok && RunTensorMap<64, 4>(encode, buffer, from_hbm, 4, sms, sink, CU_TENSOR_MAP_SWIZZLE_128B);
  CHECK_CUDA(cudaFree(buffer));
  CHECK_CUDA(cudaFree(sink));
  return ok;
}

}  // namespace

int main() { return Main() ? 0 : 1; }
