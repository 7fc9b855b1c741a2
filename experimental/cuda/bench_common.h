// What the standalone programs of experimental/cuda share: error checks that print and return false, and the
// driver's tensor-map encoder, obtained through the runtime (no -lcuda).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdio>

#define CHECK_CUDA(x)                                                              \
  do {                                                                             \
    const cudaError_t e = (x);                                                     \
    if (e != cudaSuccess) {                                                        \
      std::printf("CUDA error %s at line %d\n", cudaGetErrorString(e), __LINE__); \
      return false;                                                                \
    }                                                                              \
  } while (0)

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// cuTensorMapEncodeTiled, or nullptr (with a message) where the driver lacks it.
inline EncodeTiled FindEncodeTiled() {
  void* encode = nullptr;
  cudaDriverEntryPointQueryResult found;
  if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &encode, 12000, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    std::printf("cuTensorMapEncodeTiled not found\n");
    return nullptr;
  }
  return reinterpret_cast<EncodeTiled>(encode);
}
