// What the standalone programs of experimental/cuda share: error checks that print and return false, and the
// driver's tensor-map encoder, obtained through the runtime (no -lcuda).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

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

// A device copy of `host` in `*device` (cudaMalloc'ed, at least one element; the caller frees it).
template <typename E>
cudaError_t Upload(const std::vector<E>& host, E** device) {
  cudaError_t e = cudaMalloc(device, (host.empty() ? 1 : host.size()) * sizeof(E));
  if (e == cudaSuccess) e = cudaMemcpy(*device, host.data(), host.size() * sizeof(E), cudaMemcpyHostToDevice);
  return e;
}

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
