// Hopper (sm_90a) warpgroup MMA: wgmma.mma_async with B in shared memory and A in registers or shared
// memory, f32 accumulators. One concern: the instructions and the shared tiles' descriptor; the kernels
// choose tile shapes and pipelines. A warpgroup is four consecutive warps (the first a multiple of four);
// every wgmma function below is executed by all 128 threads together.
//
// Register layouts (thread `lane` of warp w of the warpgroup, g = lane / 4, t = lane % 4):
//   accumulator d[i] of an m64nN tile: row 16 w + g + 8 ((i >> 1) & 1), column 8 (i >> 2) + 2 t + (i & 1);
//   A fragment of an m64k16 slice: a[0] = row 16 w + g, k 2t..2t+1; a[1] = row + 8; a[2], a[3] = k + 8 —
//   mma.sync's m16n8k16 A fragment per warp, so columns 16 j..16 j + 15 of an accumulator are the A
//   fragment {pack(d[8j], d[8j+1]), pack(d[8j+2], d[8j+3]), pack(d[8j+4], d[8j+5]), pack(d[8j+6], d[8j+7])}.
//
// Shared tiles are rows of 64 16-bit elements (128 bytes) with the 128-byte swizzle, 1024-byte aligned:
// what a tensor-map box of 64 x rows with CU_TENSOR_MAP_SWIZZLE_128B writes (tma_sm90.cuh); or rows of 32
// (64 bytes) with the 64-byte swizzle, what a box of 32 x rows with CU_TENSOR_MAP_SWIZZLE_64B writes (the
// same, with 64 for 128 bytes and 512 for 1024 below: Swizzled64TileDescriptor). Such a tile
// of n rows is B "K-major" for a product against its transpose (S = Q K^T: rows are keys, advance 32
// bytes per k16 step; A = Q in shared memory the same way, rows are queries) and B "MN-major" for a
// product against itself (O = P V: rows are keys = k, advance 2048 bytes = 16 rows per k16 step,
// kTransB = 1).
// An MN-major B wider than 64 columns (m64n72, m64n128) takes its columns 64 j .. 64 j + 63 from the j-th tile of
// the same layout, j times the descriptor's leading byte offset past the first (SwizzledDescriptorAt's
// `next_block`).
//
// Compiled for the host (tests/cuda_emulation, S2ATTN_HOST_EMULATION), the functions are declared here
// and implemented by the emulation runtime: each warp takes its 16 rows of the product, which land in
// the accumulator registers at the WgmmaWait that completes their group (NaN until then).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "gpu/cp_async_sm80.cuh"

namespace s2attn {
namespace gpu {
namespace sm90 {

// Descriptor of a swizzled tile of `row_bytes`-byte rows (128: the 128-byte swizzle; 64: the 64-byte one) at
// shared address `address` (1024-byte aligned): start address, leading byte offset and stride of 8-row atoms
// (8 rows) in 16-byte units, swizzle mode (1: 128 bytes, 2: 64 bytes) in bits 62-63. The leading offset matters
// only to an MN-major B wider than a row: `next_block` (above `address`) is where its next row-wide block of
// columns starts; narrower shapes ignore it. Adding n to the descriptor advances the start of every block by
// 16 n bytes.
__host__ __device__ constexpr uint64_t SwizzledDescriptorAt(uint32_t address, uint32_t next_block = 0,
                                                            uint32_t row_bytes = 128) {
  const uint32_t leading = next_block > address ? (next_block - address) >> 4 : 1;
  const uint64_t mode = row_bytes == 128 ? 1 : 2;
  return uint64_t{(address >> 4) & 0x3FFF} | uint64_t{leading & 0x3FFF} << 16 | uint64_t{(8 * row_bytes) >> 4} << 32 |
         mode << 62;
}

// `descriptor` with its start advanced by `units` 16-byte units. The start field (14 bits of the
// address / 16) stays below 2^14 for addresses and advances inside the 228 KB shared window, so it
// never carries into the next field, let alone the high word: the addition is kept 32-bit (a 64-bit
// one costs the kernels' chunk loops two more instructions and register moves per wgmma).
__host__ __device__ constexpr uint64_t DescriptorPlus(uint64_t descriptor, uint32_t units) {
  return (descriptor & ~uint64_t{0xFFFFFFFF}) | uint32_t(uint32_t(descriptor) + units);
}

// The descriptor of a two-block MN-major B (SwizzledDescriptorAt's `next_block`) with its first block advanced by
// `units` 16-byte units and its second where it was: the start grows and the leading offset shrinks by `units`
// (which it exceeds), in one 32-bit addition without carries between the fields.
__host__ __device__ constexpr uint64_t DescriptorFirstBlockPlus(uint64_t descriptor, uint32_t units) {
  return DescriptorPlus(descriptor, units - (units << 16));
}

#if defined(S2ATTN_HOST_EMULATION)

uint64_t SwizzledTileDescriptor(const void* tile);
uint64_t SwizzledTileDescriptor(const void* tile, const void* next_block);
uint64_t Swizzled64TileDescriptor(const void* tile);
inline void WgmmaFence() {}
void WgmmaCommit();
void WgmmaWaitFor(int pending);
template <int kPending>
void WgmmaWait() {
  WgmmaWaitFor(kPending);
}
template <int N>
void FenceRegisters(float (&)[N]) {}
template <int N>
void FenceRegisters(uint32_t (&)[N]) {}
inline void FenceSharedForWgmma() {}
template <typename T, int kTransB>
void WgmmaM64N32K16(float (&d)[16], const uint32_t (&a)[4], uint64_t b, uint32_t accumulate);
template <typename T>
void WgmmaM64N32K16SharedA(float (&d)[16], uint64_t a, uint64_t b, uint32_t accumulate);
template <typename T, int kTransB>
void WgmmaM64N64K16(float (&d)[32], const uint32_t (&a)[4], uint64_t b, uint32_t accumulate);
template <typename T>
void WgmmaM64N64K16SharedA(float (&d)[32], uint64_t a, uint64_t b, uint32_t accumulate);
template <typename T>
void WgmmaM64N72K16(float (&d)[36], const uint32_t (&a)[4], uint64_t b, uint32_t accumulate);
template <typename T, int kTransB>
void WgmmaM64N128K16(float (&d)[64], const uint32_t (&a)[4], uint64_t b, uint32_t accumulate);
template <typename T, int kTransB>
void WgmmaM64N8K16(float (&d)[4], const uint32_t (&a)[4], uint64_t b, uint32_t accumulate);

#else

// The descriptor of the swizzled tile at `tile` (SwizzledDescriptorAt).
__device__ __forceinline__ uint64_t SwizzledTileDescriptor(const void* tile) {
  return SwizzledDescriptorAt(SharedAddress(tile));
}
// The descriptor of an MN-major B whose columns 0..63 are the tile at `tile` and 64..127 the one at `next_block`
// (a higher address).
__device__ __forceinline__ uint64_t SwizzledTileDescriptor(const void* tile, const void* next_block) {
  return SwizzledDescriptorAt(SharedAddress(tile), SharedAddress(next_block));
}
// The descriptor of the tile of 64-byte rows with the 64-byte swizzle at `tile`.
__device__ __forceinline__ uint64_t Swizzled64TileDescriptor(const void* tile) {
  return SwizzledDescriptorAt(SharedAddress(tile), 0, 64);
}

// Orders this thread's register writes (A fragments, accumulators) before the next wgmma reads them.
__device__ __forceinline__ void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void WgmmaCommit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most kPending committed groups are still running.
template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving reads or writes of accumulator registers across a wgmma's issue or wait.
template <int N>
__device__ __forceinline__ void FenceRegisters(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// The same for A fragments in registers: they are complete before the wgmma group that reads them starts.
template <int N>
__device__ __forceinline__ void FenceRegisters(uint32_t (&a)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

// Makes this thread's ordinary shared-memory stores visible to wgmma's operand reads (the async proxy);
// a barrier after it orders them for the whole block.
__device__ __forceinline__ void FenceSharedForWgmma() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// The instruction for operands of PTX type TYPE ("bf16" or "f16"); d has N / 2 registers.
#define S2ATTN_WGMMA_D4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define S2ATTN_WGMMA_D16(i) S2ATTN_WGMMA_D4(i), S2ATTN_WGMMA_D4(i + 4), S2ATTN_WGMMA_D4(i + 8), S2ATTN_WGMMA_D4(i + 12)
#define S2ATTN_WGMMA_M64N32K16(TYPE)                                                                                   \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %22, 0;\n"                                                          \
               "wgmma.mma_async.sync.aligned.m64n32k16.f32." TYPE "." TYPE " "                                         \
               "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, "                                             \
               "{%16,%17,%18,%19}, %20, p, 1, 1, %21;\n}\n"                                                            \
               : S2ATTN_WGMMA_D16(0)                                                                                   \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(kTransB), "r"(accumulate))
#define S2ATTN_WGMMA_M64N32K16_SHARED_A(TYPE)                                                                          \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %18, 0;\n"                                                          \
               "wgmma.mma_async.sync.aligned.m64n32k16.f32." TYPE "." TYPE " "                                         \
               "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, "                                             \
               "%16, %17, p, 1, 1, 0, 0;\n}\n"                                                                         \
               : S2ATTN_WGMMA_D16(0)                                                                                   \
               : "l"(a), "l"(b), "r"(accumulate))
#define S2ATTN_WGMMA_M64N64K16(TYPE)                                                                                   \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %38, 0;\n"                                                          \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " "                                         \
               "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"                                               \
               "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "                                    \
               "{%32,%33,%34,%35}, %36, p, 1, 1, %37;\n}\n"                                                            \
               : S2ATTN_WGMMA_D16(0), S2ATTN_WGMMA_D16(16)                                                             \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(kTransB), "r"(accumulate))
#define S2ATTN_WGMMA_M64N72K16(TYPE)                                                                                   \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %41, 0;\n"                                                          \
               "wgmma.mma_async.sync.aligned.m64n72k16.f32." TYPE "." TYPE " "                                         \
               "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"                                               \
               "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35}, "                    \
               "{%36,%37,%38,%39}, %40, p, 1, 1, 1;\n}\n"                                                             \
               : S2ATTN_WGMMA_D16(0), S2ATTN_WGMMA_D16(16), S2ATTN_WGMMA_D4(32)                                        \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate))
#define S2ATTN_WGMMA_M64N128K16(TYPE)                                                                                  \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %70, 0;\n"                                                          \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " "                                        \
               "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"                                               \
               "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"                                      \
               "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"                                      \
               "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "                                    \
               "{%64,%65,%66,%67}, %68, p, 1, 1, %69;\n}\n"                                                            \
               : S2ATTN_WGMMA_D16(0), S2ATTN_WGMMA_D16(16), S2ATTN_WGMMA_D16(32), S2ATTN_WGMMA_D16(48)                 \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(kTransB), "r"(accumulate))
#define S2ATTN_WGMMA_M64N8K16(TYPE)                                                                                    \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %10, 0;\n"                                                          \
               "wgmma.mma_async.sync.aligned.m64n8k16.f32." TYPE "." TYPE " "                                          \
               "{%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1, %9;\n}\n"                                                   \
               : S2ATTN_WGMMA_D4(0)                                                                                    \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(kTransB), "r"(accumulate))
#define S2ATTN_WGMMA_M64N64K16_SHARED_A(TYPE)                                                                          \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n"                                                          \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " "                                         \
               "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"                                               \
               "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "                                    \
               "%32, %33, p, 1, 1, 0, 0;\n}\n"                                                                         \
               : S2ATTN_WGMMA_D16(0), S2ATTN_WGMMA_D16(16)                                                             \
               : "l"(a), "l"(b), "r"(accumulate))

// d (+)= A B for an m64n32k16 slice; `accumulate` 0 overwrites d.
template <typename T, int kTransB>
__device__ __forceinline__ void WgmmaM64N32K16(float (&d)[16], const uint32_t (&a)[4], uint64_t b,
                                               uint32_t accumulate) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "bfloat16 or float16 operands");
  if constexpr (std::is_same_v<T, __half>) {
    S2ATTN_WGMMA_M64N32K16("f16");
  } else {
    S2ATTN_WGMMA_M64N32K16("bf16");
  }
}

// d (+)= A B for an m64n32k16 slice with A in shared memory too (K-major, descriptor `a`).
template <typename T>
__device__ __forceinline__ void WgmmaM64N32K16SharedA(float (&d)[16], uint64_t a, uint64_t b, uint32_t accumulate) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "bfloat16 or float16 operands");
  if constexpr (std::is_same_v<T, __half>) {
    S2ATTN_WGMMA_M64N32K16_SHARED_A("f16");
  } else {
    S2ATTN_WGMMA_M64N32K16_SHARED_A("bf16");
  }
}

// d (+)= A B for an m64n64k16 slice; `accumulate` 0 overwrites d.
template <typename T, int kTransB>
__device__ __forceinline__ void WgmmaM64N64K16(float (&d)[32], const uint32_t (&a)[4], uint64_t b,
                                               uint32_t accumulate) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "bfloat16 or float16 operands");
  if constexpr (std::is_same_v<T, __half>) {
    S2ATTN_WGMMA_M64N64K16("f16");
  } else {
    S2ATTN_WGMMA_M64N64K16("bf16");
  }
}

// d (+)= A B for an m64n64k16 slice with A in shared memory too (K-major, descriptor `a`).
template <typename T>
__device__ __forceinline__ void WgmmaM64N64K16SharedA(float (&d)[32], uint64_t a, uint64_t b, uint32_t accumulate) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "bfloat16 or float16 operands");
  if constexpr (std::is_same_v<T, __half>) {
    S2ATTN_WGMMA_M64N64K16_SHARED_A("f16");
  } else {
    S2ATTN_WGMMA_M64N64K16_SHARED_A("bf16");
  }
}

// d (+)= A B for an m64n72k16 slice with an MN-major B of two blocks (SwizzledTileDescriptor(tile, next_block)):
// columns 0..63 from the first, 64..71 from the second.
template <typename T>
__device__ __forceinline__ void WgmmaM64N72K16(float (&d)[36], const uint32_t (&a)[4], uint64_t b,
                                               uint32_t accumulate) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "bfloat16 or float16 operands");
  if constexpr (std::is_same_v<T, __half>) {
    S2ATTN_WGMMA_M64N72K16("f16");
  } else {
    S2ATTN_WGMMA_M64N72K16("bf16");
  }
}

// d (+)= A B for an m64n128k16 slice (an MN-major B of two blocks: SwizzledTileDescriptor(tile, next_block)).
template <typename T, int kTransB>
__device__ __forceinline__ void WgmmaM64N128K16(float (&d)[64], const uint32_t (&a)[4], uint64_t b,
                                                uint32_t accumulate) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "bfloat16 or float16 operands");
  if constexpr (std::is_same_v<T, __half>) {
    S2ATTN_WGMMA_M64N128K16("f16");
  } else {
    S2ATTN_WGMMA_M64N128K16("bf16");
  }
}

// d (+)= A B for an m64n8k16 slice.
template <typename T, int kTransB>
__device__ __forceinline__ void WgmmaM64N8K16(float (&d)[4], const uint32_t (&a)[4], uint64_t b, uint32_t accumulate) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "bfloat16 or float16 operands");
  if constexpr (std::is_same_v<T, __half>) {
    S2ATTN_WGMMA_M64N8K16("f16");
  } else {
    S2ATTN_WGMMA_M64N8K16("bf16");
  }
}

#undef S2ATTN_WGMMA_M64N72K16
#undef S2ATTN_WGMMA_M64N128K16
#undef S2ATTN_WGMMA_M64N8K16
#undef S2ATTN_WGMMA_M64N32K16
#undef S2ATTN_WGMMA_M64N64K16_SHARED_A
#undef S2ATTN_WGMMA_M64N64K16
#undef S2ATTN_WGMMA_M64N32K16_SHARED_A
#undef S2ATTN_WGMMA_D16
#undef S2ATTN_WGMMA_D4

#endif

}  // namespace sm90
}  // namespace gpu
}  // namespace s2attn
