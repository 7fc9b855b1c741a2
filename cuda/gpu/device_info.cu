#include <cuda_runtime.h>

#include "gpu/device_info.h"
#include "gpu/sched_attn_kernels.h"

namespace s2attn {

int CudaRuntimeVersion() {
  int version = 0;
  return cudaRuntimeGetVersion(&version) == cudaSuccess ? version : -1;
}

// S2ATTN_SCHED_SM90A: the build compiles the kernels for sm_90a (cuda/CMakeLists.txt); the scheduled kernels are
// empty in any other.
bool SchedAttnBuiltForSm90a() {
#if defined(S2ATTN_SCHED_SM90A)
  return true;
#else
  return false;
#endif
}

bool SchedAttnAvailable() {
#if defined(S2ATTN_SCHED_SM90A)
  int device = 0, major = 0, minor = 0;
  return cudaGetDevice(&device) == cudaSuccess &&
         cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
         cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess && major == 9 &&
         minor == 0;
#else
  return false;
#endif
}

}  // namespace s2attn
