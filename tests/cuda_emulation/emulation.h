// Host emulation of the few CUDA device facilities the kernels in cuda/gpu use, so that the
// kernels and their launchers compile with a host C++ compiler and run on the CPU (one OS
// thread per CUDA thread). Force-included (-include) before each .cu file; the runtime side
// (cudaLaunchKernel, shuffles, shared memory) is in emulation.cc.
//
// This checks the kernels' logic (indexing, walks, masks, team reductions, which elements get
// written) against a float64 reference on machines without a GPU. It says nothing about
// timing or the GPU memory model.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <math.h>  // nvcc makes the C math functions available without an include

#include <cstring>

#define __launch_bounds__(...)

extern thread_local uint3 threadIdx;
extern thread_local uint3 blockIdx;
extern thread_local dim3 blockDim;
extern thread_local dim3 gridDim;

template <typename T>
inline T __ldg(const T* p) {
  return *p;
}

inline float __uint_as_float(unsigned int bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Both block until every lane named in `mask` has called a shuffle with the same mask (they
// abort on a deadlock or when the caller or its source lane is not in `mask`, which CUDA
// leaves undefined).
float __shfl_xor_sync(unsigned mask, float value, int lane_mask, int width = 32);
float __shfl_sync(unsigned mask, float value, int src_lane, int width = 32);
