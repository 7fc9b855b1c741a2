// Warp-level tensor-core and async-copy primitives (sm_80+ PTX: mma.sync m16n8k16, ldmatrix,
// cp.async) used by the tiled kernels. One concern: the exact register fragments the PTX ISA
// defines; the kernels build everything else on these few functions.
//
// Fragments (lane = threadIdx.x % 32, g = lane / 4, t = lane % 4; two 16-bit values per uint32_t,
// the lower column in the low half):
//   A 16x16 (row-major):  a[0] = (g, 2t..2t+1)   a[1] = (g+8, 2t..)   a[2] = (g, 2t+8..)   a[3] = (g+8, 2t+8..)
//   B 16x8  (k x n):      b[0] = (k 2t..2t+1, n g)   b[1] = (k 2t+8.., n g)
//   C/D 16x8 (float):     c[0..1] = (g, 2t..2t+1)    c[2..3] = (g+8, 2t..2t+1)
// ldmatrix .x4: lanes 8i..8i+7 give the addresses of the 8 rows (16 bytes each) of matrix i;
// r[i] receives (row g, columns 2t..2t+1) of matrix i, or with .trans (rows 2t..2t+1, column g).
//
// Compiled for the host (tests/cuda_emulation, S2ATTN_HOST_EMULATION), the functions are
// declared here and implemented by the emulation runtime, which meets the lanes of a warp.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "gpu/packed_pair.cuh"

namespace s2attn {
namespace gpu {

#if defined(S2ATTN_HOST_EMULATION)

// d += a * b for one m16n8k16 tile, T = __nv_bfloat16 or __half, float accumulators.
template <typename T>
void MmaM16N8K16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);
void LdMatrixX4(uint32_t (&r)[4], const void* shared_row);
void LdMatrixX4Trans(uint32_t (&r)[4], const void* shared_row);
// Copies 16 bytes global -> shared (immediately, in the emulation).
void CopyAsync16(void* shared_dst, const void* global_src);
// The same if `copy`, else 16 zero bytes (the source is not read).
void CopyAsync16OrZero(void* shared_dst, const void* global_src, bool copy);
// Copies 4 bytes global -> shared (immediately, in the emulation).
void CopyAsync4(void* shared_dst, const void* global_src);

#else

template <typename T>
__device__ __forceinline__ void MmaM16N8K16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);

template <>
__device__ __forceinline__ void MmaM16N8K16<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                            const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <>
__device__ __forceinline__ void MmaM16N8K16<__half>(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], const void* shared_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SharedAddress(shared_row)));
}

__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], const void* shared_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SharedAddress(shared_row)));
}

// 16 bytes global -> shared, bypassing L1 (K/V windows are reused from shared memory, not L1).
__device__ __forceinline__ void CopyAsync16(void* shared_dst, const void* global_src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(SharedAddress(shared_dst)), "l"(global_src));
}

// CopyAsync16 if `copy`, else 16 zero bytes (source size 0: the copy fills the rest with zeros and
// reads nothing), so that a thread stages a real or an empty column without a branch.
__device__ __forceinline__ void CopyAsync16OrZero(void* shared_dst, const void* global_src, bool copy) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SharedAddress(shared_dst)), "l"(global_src),
               "r"(copy ? 16 : 0));
}

// 4 bytes global -> shared (cp.async takes sizes below 16 only through L1, .ca).
__device__ __forceinline__ void CopyAsync4(void* shared_dst, const void* global_src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(SharedAddress(shared_dst)), "l"(global_src));
}

#endif

}  // namespace gpu
}  // namespace s2attn
