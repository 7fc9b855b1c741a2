// Hopper (sm_90) tensor-map copies: one thread asks the copy engine for a box of a global tensor,
// written to shared memory (swizzled as the map says) and announced to an mbarrier by its byte count.
// Boxes that reach past the tensor's edges are filled with zeros. The maps are built on the host
// (cuTensorMapEncodeTiled) and passed as __grid_constant__ kernel parameters.
//
// Compiled for the host (tests/cuda_emulation, S2ATTN_HOST_EMULATION), the functions are declared here
// and implemented by the emulation runtime, whose cuTensorMapEncodeTiled (through
// cudaGetDriverEntryPointByVersion) writes maps only it reads; boxes land at the call.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "gpu/cp_async_sm80.cuh"

namespace s2attn {
namespace gpu {
namespace sm90 {

#if defined(S2ATTN_HOST_EMULATION)

void MbarrierArriveExpectBytes(uint64_t* barrier, uint32_t bytes);
void LoadBox3d(void* destination, const CUtensorMap* map, int x, int y, int z, uint64_t* barrier);
void LoadBox5d(void* destination, const CUtensorMap* map, int x, int y, int z, int w, int v, uint64_t* barrier);

#else

// The thread's arrival on `barrier` for this phase, which also completes only after `bytes` more bytes
// of copies landed.
__device__ __forceinline__ void MbarrierArriveExpectBytes(uint64_t* barrier, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(SharedAddress(barrier)), "r"(bytes)
               : "memory");
}

// Box of a 3-D map at element coordinates (x innermost, y, z) into `destination`, counted on `barrier`.
__device__ __forceinline__ void LoadBox3d(void* destination, const CUtensorMap* map, int x, int y, int z,
                                          uint64_t* barrier) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::
          "r"(SharedAddress(destination)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(z), "r"(SharedAddress(barrier))
      : "memory");
}

// Box of a 5-D map at element coordinates (x innermost, ..., v outermost), counted on `barrier`.
__device__ __forceinline__ void LoadBox5d(void* destination, const CUtensorMap* map, int x, int y, int z, int w, int v,
                                          uint64_t* barrier) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5, %6}], "
      "[%7];\n" ::"r"(SharedAddress(destination)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(z), "r"(w), "r"(v), "r"(SharedAddress(barrier))
      : "memory");
}

#endif

// Host side: cuTensorMapEncodeTiled through the runtime (no link against the driver library), or null where the
// driver lacks it. Looked up once.
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

inline EncodeTiled FindEncodeTiled() {
  static const EncodeTiled encode = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found;
    const bool ok = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000, cudaEnableDefault,
                                                     &found) == cudaSuccess &&
                    found == cudaDriverEntryPointSuccess;
    return ok ? reinterpret_cast<EncodeTiled>(function) : nullptr;
  }();
  return encode;
}

}  // namespace sm90
}  // namespace gpu
}  // namespace s2attn
