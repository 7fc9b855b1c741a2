// Hopper (sm_90a) register reallocation between the warpgroups of a block (setmaxnreg). One concern: a warpgroup
// gives up registers it does not need (a producer that only issues copies) so that another can take them (a
// consumer holding wgmma accumulators) beyond the even share the launch bounds give every thread. Every warp of
// the warpgroup executes the same call; counts are multiples of 8 in [24, 256]. ptxas allocates the code after a
// call within its count. A raise waits until the registers are free, so the giving warpgroup lowers first or
// concurrently.
//
// Compiled for the host (tests/cuda_emulation, S2ATTN_HOST_EMULATION), both are no-ops: the emulation has no
// register file.
#pragma once

namespace s2attn {
namespace gpu {
namespace sm90 {

template <int kRegisters>
__device__ __forceinline__ void LowerRegisters() {
  static_assert(kRegisters % 8 == 0 && kRegisters >= 24 && kRegisters <= 256, "setmaxnreg: 24 .. 256, by 8");
#if !defined(S2ATTN_HOST_EMULATION)
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
#endif
}

template <int kRegisters>
__device__ __forceinline__ void RaiseRegisters() {
  static_assert(kRegisters % 8 == 0 && kRegisters >= 24 && kRegisters <= 256, "setmaxnreg: 24 .. 256, by 8");
#if !defined(S2ATTN_HOST_EMULATION)
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
#endif
}

}  // namespace sm90
}  // namespace gpu
}  // namespace s2attn
