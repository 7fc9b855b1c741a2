#include <cuda_runtime.h>

#include "gpu/device_info.h"

namespace s2attn {

int CudaRuntimeVersion() {
  int version = 0;
  return cudaRuntimeGetVersion(&version) == cudaSuccess ? version : -1;
}

}  // namespace s2attn
