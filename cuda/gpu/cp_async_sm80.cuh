// Asynchronous global -> shared copies (sm_80+ PTX cp.async), used by the stencil kernels to stage
// their windows, and the shared-memory address the PTX of mbarrier_sm90.cuh, tma_sm90.cuh and
// wgmma_sm90.cuh takes. One concern: issuing the copies; when they landed is told by an mbarrier
// (CopyAsyncArriveOn, mbarrier_sm90.cuh).
//
// Compiled for the host (tests/cuda_emulation, S2ATTN_HOST_EMULATION), the copies are declared here
// and implemented by the emulation runtime, where they land at the call.
#pragma once

#include <cstdint>

namespace s2attn {
namespace gpu {

#if defined(S2ATTN_HOST_EMULATION)

// Copies 16 bytes global -> shared (immediately, in the emulation).
void CopyAsync16(void* shared_dst, const void* global_src);
// Copies 4 bytes global -> shared (immediately, in the emulation).
void CopyAsync4(void* shared_dst, const void* global_src);

#else

// The shared-state-space address of a pointer into shared memory.
__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, bypassing L1 (the staged windows are reused from shared memory, not L1).
__device__ __forceinline__ void CopyAsync16(void* shared_dst, const void* global_src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(SharedAddress(shared_dst)), "l"(global_src));
}

// 4 bytes global -> shared (cp.async takes sizes below 16 only through L1, .ca).
__device__ __forceinline__ void CopyAsync4(void* shared_dst, const void* global_src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(SharedAddress(shared_dst)), "l"(global_src));
}

#endif

}  // namespace gpu
}  // namespace s2attn
