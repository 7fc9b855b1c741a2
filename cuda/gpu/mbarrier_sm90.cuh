// Shared-memory barrier objects (PTX mbarrier: sm_80, try_wait sm_90). One concern: a phase of a barrier
// completes after `count` arrivals (of threads, and of threads' cp.async copies once they landed; a phase
// can also wait for the bytes of tensor-map boxes, tma_sm90.cuh); a waiter then sees everything the arrivers
// wrote before arriving, copies included. Users: the stencil kernels' staging barrier, on which every thread
// arrives once for its cp.async copies (.noinc) and once for itself (stencil_attn_device.cuh); the scheduled
// kernels' rings of full and empty stage barriers, by which a producer warp hands a stage's boxes to its
// consumer warpgroup and gets the stage back once read (sched_attn_device.cuh).
//
// Compiled for the host (tests/cuda_emulation, S2ATTN_HOST_EMULATION), the functions are
// declared here and implemented by the emulation runtime (copies land at once there).
#pragma once

#include <cstdint>

#include "gpu/cp_async_sm80.cuh"

namespace s2attn {
namespace gpu {

#if defined(S2ATTN_HOST_EMULATION)

void MbarrierInit(uint64_t* barrier, uint32_t count);
void MbarrierArrive(uint64_t* barrier);
void CopyAsyncArriveOn(uint64_t* barrier);
void MbarrierWait(uint64_t* barrier, uint32_t parity);
inline void MbarrierInitFence() {}

#else

// One thread initialises; the block must synchronise before anyone else uses the barrier.
__device__ __forceinline__ void MbarrierInit(uint64_t* barrier, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(SharedAddress(barrier)), "r"(count) : "memory");
}

// After one thread initialised a block's barriers: makes the initialisation visible to the copy engine
// (tensor-map copies complete on them) as well; the block still synchronises before using them.
__device__ __forceinline__ void MbarrierInitFence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival (release: the thread's earlier shared-memory stores are visible to the waiters).
__device__ __forceinline__ void MbarrierArrive(uint64_t* barrier) {
  asm volatile("{\n .reg .b64 state;\n mbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(SharedAddress(barrier))
               : "memory");
}

// One arrival of the thread once every cp.async copy it issued so far landed (.noinc: the arrival
// counts towards the barrier's count, so a thread that also arrives for its plain stores arrives
// twice per phase). The form without .noinc (net zero on the count) is not used: compute-sanitizer's
// synccheck counts it as an arrival and reports the phases as broken.
__device__ __forceinline__ void CopyAsyncArriveOn(uint64_t* barrier) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(SharedAddress(barrier)) : "memory");
}

// Waits until the phase of the given parity (0 for the first phase, then alternating) completed.
// try_wait (sm_90) suspends the thread for a while inside the instruction; test_wait (sm_80, for
// builds of older targets) only tests.
__device__ __forceinline__ void MbarrierWait(uint64_t* barrier, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
#if __CUDA_ARCH__ >= 900
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
#else
        "{\n .reg .pred p;\n mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
#endif
        : "=r"(done)
        : "r"(SharedAddress(barrier)), "r"(parity)
        : "memory");
  } while (!done);
}

#endif

}  // namespace gpu
}  // namespace s2attn
