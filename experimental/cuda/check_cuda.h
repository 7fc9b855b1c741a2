// The experimental programs' error handling: a CUDA call that fails prints its error and line, and the calling
// function returns false.
#pragma once

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
