// Host emulation of the few CUDA device facilities the kernels in cuda/gpu use, so that the
// kernels and their launchers compile with a host C++ compiler and run on the CPU (one fiber
// per CUDA thread, see emulation.cc). Force-included (-include) before each .cu file; the
// runtime side (cudaLaunchKernel, cudaFuncSetAttribute, barriers, warp collectives, shared
// memory) is in emulation.cc.
//
// This checks the kernels' logic (indexing, walks, masks, team reductions, tensor-core
// fragment layouts, which elements get written) against a float64 reference on machines
// without a GPU. It says nothing about timing or the GPU memory model.
//
// The cp.async copies of cuda/gpu/cp_async_sm80.cuh (CopyAsync16, CopyAsync4) are only declared
// there under S2ATTN_HOST_EMULATION, which this header defines first; emulation.cc implements them:
// they happen at the call, so their arrival on an mbarrier (CopyAsyncArriveOn) is immediate. The
// mbarrier functions of cuda/gpu/mbarrier_sm90.cuh are emulated the same way: a waiter yields until
// the phase completed. The Hopper primitives of gpu/wgmma_sm90.cuh and gpu/tma_sm90.cuh likewise: a
// wgmma is a collective of each warp (its 32 lanes meet and the warp takes its 16 rows of the
// warpgroup's product, per the register layouts documented in wgmma_sm90.cuh; operands in shared
// memory read through their 128- or 64-byte swizzle at the call; the result lands in the accumulator
// registers at the WgmmaWait that completes its group, which read NaN until then), a tensor-map box
// lands at the call (zeros outside the tensor, swizzled as its map says) and counts its bytes on the
// mbarrier, whose phase then needs both its arrivals and the bytes announced to it.
// cuTensorMapEncodeTiled, through cudaGetDriverEntryPointByVersion, writes maps only the emulation
// reads.
//
// Misuse aborts the run with a message naming the block and thread: a thread that returns
// while others wait for it at __syncthreads or a warp collective (stricter than the hardware,
// which lets exited threads off some barriers), lanes of one mask meeting at different kinds of
// collective, a deadlock (listing what each thread waits at), cp.async
// destinations not aligned to their size inside the launch's dynamic shared memory (swizzled tensor-map
// boxes: 8 rows, 1024 or 512 bytes; wgmma tiles: 1024 bytes), a wgmma not issued alike by all four warps of a
// whole warpgroup (or by all lanes), wgmma descriptors of other forms than the kernels use (see
// DecodeDescriptor), wgmma results never waited for, box bytes announced to an mbarrier but never
// landed by the end of a block,
// more arrivals on an mbarrier than it counts, a thread that
// synchronises with cp.async copies no mbarrier tracks, a second arrival of one kind (own, copies')
// of a thread in one phase.
#pragma once

#define S2ATTN_HOST_EMULATION 1

// The only shared memory here is the dynamic buffer of emulation.cc (DynamicShared() declares it
// `extern __shared__`). A static `__shared__` array would silently become one array per thread,
// so `weak` turns it into a compile error ("weak declaration of 'x' must be public") while
// keeping the extern declaration valid. Defined before the CUDA headers, which then keep it.
#define __shared__ __attribute__((weak))

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <math.h>  // nvcc makes the C math functions available without an include

#include <cstring>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

#define __launch_bounds__(...)

extern thread_local uint3 threadIdx;
extern thread_local uint3 blockIdx;
extern thread_local dim3 blockDim;
extern thread_local dim3 gridDim;

template <typename T>
inline T __ldg(const T* p) {
  return *p;
}

// The integer and floating-point min/max that nvcc declares at global scope. Same-type overloads
// only: a mixed signed/unsigned call, which nvcc resolves to unsigned, fails to compile here
// instead of silently picking a type.
#define S2ATTN_EMU_MIN_MAX(T)                      \
  inline T min(T a, T b) { return b < a ? b : a; } \
  inline T max(T a, T b) { return a < b ? b : a; }
S2ATTN_EMU_MIN_MAX(int)
S2ATTN_EMU_MIN_MAX(unsigned int)
S2ATTN_EMU_MIN_MAX(long)
S2ATTN_EMU_MIN_MAX(unsigned long)
S2ATTN_EMU_MIN_MAX(long long)
S2ATTN_EMU_MIN_MAX(unsigned long long)
#undef S2ATTN_EMU_MIN_MAX
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }

// Bit casts of the device intrinsics (memcpy: well defined on the host).
inline float __uint_as_float(unsigned int bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float __int_as_float(int bits) { return __uint_as_float(static_cast<unsigned int>(bits)); }
inline unsigned int __float_as_uint(float f) {
  unsigned int bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}
inline int __float_as_int(float f) { return static_cast<int>(__float_as_uint(f)); }

// Block-wide barrier: every thread of the block must reach it (a thread that exits while others
// wait, or waits after another exited, aborts the run).
void __syncthreads();
// Barrier of the lanes named in `mask` (the caller must be one of them).
void __syncwarp(unsigned mask = 0xffffffffu);

// Shuffles block until every lane named in `mask` has called a shuffle with the same mask (they
// abort on a deadlock or when the caller or its source lane is not in `mask`, which CUDA
// leaves undefined). Overloads per 32-bit type, so that an int is never converted to float.
float __shfl_xor_sync(unsigned mask, float value, int lane_mask, int width = 32);
int __shfl_xor_sync(unsigned mask, int value, int lane_mask, int width = 32);
unsigned __shfl_xor_sync(unsigned mask, unsigned value, int lane_mask, int width = 32);
float __shfl_sync(unsigned mask, float value, int src_lane, int width = 32);
int __shfl_sync(unsigned mask, int value, int src_lane, int width = 32);
unsigned __shfl_sync(unsigned mask, unsigned value, int src_lane, int width = 32);

// Votes over the lanes named in `mask`, with the same meeting rules as the shuffles.
unsigned __ballot_sync(unsigned mask, int predicate);
int __any_sync(unsigned mask, int predicate);
int __all_sync(unsigned mask, int predicate);

// A launch in the emulation: `kernel` runs once per thread of every block (the launch's parameters
// bound into it), as cudaLaunchKernel describes.
cudaError_t EmulatedLaunch(const void* func, dim3 grid, dim3 block, size_t shared_bytes, std::function<void()> kernel);

// Launches of kernels with any parameters (experimental/cuda programs): the parameters are copied at the launch,
// as on the device. (cudaLaunchKernel on a `const void*`, as cuda/gpu's launchers call it, passes one
// NbhdAttnGpuParams.)
template <typename... Params>
cudaError_t cudaLaunchKernel(void (*kernel)(Params...), dim3 grid, dim3 block, void** args, size_t shared_bytes,
                             cudaStream_t /*stream*/) {
  return [&]<size_t... I>(std::index_sequence<I...>) {
    std::tuple<std::decay_t<Params>...> copies{*static_cast<std::decay_t<Params>*>(args[I])...};
    return EmulatedLaunch(reinterpret_cast<const void*>(kernel), grid, block, shared_bytes,
                          [kernel, copies] { std::apply(kernel, copies); });
  }(std::index_sequence_for<Params...>{});
}

// cuda_runtime.h declares this convenience overload for nvcc only; launchers call it with the
// kernel itself. Emulated in emulation.cc: the MaxDynamicSharedMemorySize limit (up to the
// H200's 232448 bytes) is kept per kernel, and a launch past its kernel's limit (48 KiB unless
// raised) fails with cudaErrorInvalidValue, as on the device.
template <typename Kernel>
inline cudaError_t cudaFuncSetAttribute(Kernel* kernel, cudaFuncAttribute attribute, int value) {
  return cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), attribute, value);
}
