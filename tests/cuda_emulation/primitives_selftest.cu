// Self-test kernels of the host emulation (tests/test_cuda_emulation_primitives.py): the
// cp.async copies of gpu/cp_async_sm80.cuh, the tensor-core products of gpu/wgmma_sm90.cuh, the
// tensor-map boxes of gpu/tma_sm90.cuh, the barriers of gpu/mbarrier_sm90.cuh,
// __syncthreads, __syncwarp, votes and shuffles,
// checked from Python against numpy. Compiled only for the emulation (emulation.h
// force-included).
//
// The emulated cudaLaunchKernel passes every kernel one NbhdAttnGpuParams, so these kernels
// read their inputs from q, k, v, dout (and int32 ones from arcs), write `out`, and take the
// fault to inject from `batch` and the byte offset of their staged data in shared memory from
// `num_arcs`.
#include <cstdint>

#include <cuda.h>

#include "gpu/cp_async_sm80.cuh"
#include "gpu/mbarrier_sm90.cuh"
#include "gpu/nbhd_attn_kernels.h"
#include "gpu/tma_sm90.cuh"
#include "gpu/wgmma_sm90.cuh"

namespace s2attn {
namespace gpu {

// The buffer the emulation provides (what DynamicShared() of cuda/gpu returns; outside the
// anonymous namespace, which would make the declaration name another array).
__device__ __forceinline__ char* SharedBytes() {
  extern __shared__ float s2attn_dynamic_shared[];
  return reinterpret_cast<char*>(s2attn_dynamic_shared);
}

namespace {

// Bugs the failure tests inject; the emulation must abort on each (values shared with Python).
enum Fault : int64_t {
  kNoFault = 0,
  kCopyAsyncToGlobal = 1,       // CopyAsync16 into global memory
  kThreadSkipsSyncthreads = 2,  // thread 70 returns before the first __syncthreads
  kThreadWaitsForItsWarp = 3,   // thread 70 waits at __syncwarp while its warp waits at __syncthreads
  kThreadSkipsArrival = 4,      // thread 70 does not arrive on the "written" barrier of round 1
  kUninitialisedBarrier = 5,    // the barriers are never initialised
  kCopyNotTracked = 6,          // the copies of StagedCopyKernel are not put on its barrier
  kThreadArrivesTwice = 7,      // thread 70 arrives twice on the "written" barrier of round 0
  kCopiesArriveTwice = 8,       // lane 7 puts its copies on StagedCopyKernel's barrier twice
  kBoxMisaligned = 9,           // WgmmaKernel's first box lands 512 bytes off its 1024-byte alignment
  kLaneOtherDescriptor = 10,    // lane 3 of WgmmaKernel gives another B descriptor
  kWarpSkipsWgmma = 11,         // warp 2 of WgmmaKernel skips its last wgmma
  kNoWgmmaWait = 12             // WgmmaKernel commits its wgmmas but never waits for them
};

constexpr int kStagedPieces = 64;  // of 16 bytes (CopyAsync16): two per lane
constexpr int kStagedWords = 32;   // of 4 bytes (CopyAsync4): one per lane

// Two 16-bit values as one fragment register, `lo` in the low half.
__device__ __forceinline__ uint32_t Pair(uint16_t lo, uint16_t hi) { return uint32_t{lo} | (uint32_t{hi} << 16); }

// One warp stages q (kStagedPieces x 16 bytes, by CopyAsync16) and dout (kStagedWords floats, by
// CopyAsync4) in shared memory, the way the stencil kernels stage their windows: every lane puts its copies
// on a barrier (CopyAsyncArriveOn, .noinc) and arrives itself, then waits. At p.num_arcs: the barrier
// (8 bytes, padded to 16), the pieces, the words. out gets them back (the pieces' bytes, then the words),
// each lane writing what lane 31 - lane copied, so that a barrier that did not wait for the copies would
// hand over NaN (shared memory starts as NaN).
__global__ void StagedCopyKernel(NbhdAttnGpuParams p) {
  const int lane = threadIdx.x % 32;
  auto* landed = reinterpret_cast<uint64_t*>(SharedBytes() + p.num_arcs);
  auto* pieces = reinterpret_cast<uint4*>(SharedBytes() + p.num_arcs + 16);
  auto* words = reinterpret_cast<float*>(pieces + kStagedPieces);
  if (lane == 0) MbarrierInit(landed, 64);  // every lane: its copies landed, then its own arrival
  __syncwarp();
  const auto* source = static_cast<const uint4*>(p.q);
  for (int piece = lane; piece < kStagedPieces; piece += 32) {
    void* destination = pieces + piece;
    if (p.batch == kCopyAsyncToGlobal) destination = p.out;
    CopyAsync16(destination, source + piece);
  }
  CopyAsync4(words + lane, static_cast<const float*>(p.dout) + lane);
  if (p.batch != kCopyNotTracked) CopyAsyncArriveOn(landed);
  if (p.batch == kCopiesArriveTwice && lane == 7) CopyAsyncArriveOn(landed);
  MbarrierArrive(landed);
  MbarrierWait(landed, 0);
  auto* out = reinterpret_cast<uint4*>(p.out);
  for (int piece = 31 - lane; piece < kStagedPieces; piece += 32) out[piece] = pieces[piece];
  reinterpret_cast<float*>(out + kStagedPieces)[31 - lane] = words[31 - lane];
}

// Blocks of 128 threads (4 warps); block b centres its 128 values of q (float): out = x - mean,
// the mean by a tree reduction in shared memory, with a __syncthreads after every step.
__global__ void BlockCentreKernel(NbhdAttnGpuParams p) {
  const unsigned tid = threadIdx.x;
  const int64_t index = int64_t{blockIdx.x} * blockDim.x + tid;
  auto* partial = reinterpret_cast<float*>(SharedBytes());
  const float x = static_cast<const float*>(p.q)[index];
  if (p.batch == kThreadSkipsSyncthreads && tid == 70) return;
  if (p.batch == kThreadWaitsForItsWarp && tid == 70) __syncwarp();
  partial[tid] = x;
  __syncthreads();
  for (unsigned stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (tid < stride) partial[tid] += partial[tid + stride];
    __syncthreads();
  }
  p.out[index] = x - partial[0] / blockDim.x;
}

// Blocks of 128 threads (4 warps) pass `rounds` (dout as an int) rows of 128 floats (q) through
// a ring of two shared-memory rows with mbarriers, the way the scheduled kernels' stage rings do:
// round r waits until every thread is done reading the row of round r - 2, writes its value,
// arrives on "written", waits for the row to be complete and writes the value of thread 127 - tid
// to out. Warps drift apart by up to a round; a barrier that did not wait would read NaN (shared
// memory starts as NaN) or the previous round's row.
__global__ void MbarrierRingKernel(NbhdAttnGpuParams p) {
  const unsigned tid = threadIdx.x;
  const int rounds = static_cast<int>(p.num_arcs);
  auto* rows = reinterpret_cast<float*>(SharedBytes());              // [2][128]
  auto* written = reinterpret_cast<uint64_t*>(SharedBytes() + 2 * 128 * sizeof(float));  // [2]
  uint64_t* read = written + 2;                                       // [2]
  if (tid == 0 && p.batch != kUninitialisedBarrier) {
    for (int s = 0; s < 2; ++s) {
      MbarrierInit(&written[s], blockDim.x);
      MbarrierInit(&read[s], blockDim.x);
    }
  }
  __syncthreads();
  const auto* x = static_cast<const float*>(p.q);
  for (int r = 0; r < rounds; ++r) {
    const int s = r % 2;
    if (r >= 2) MbarrierWait(&read[s], (r / 2 - 1) & 1);
    rows[s * 128 + tid] = x[r * 128 + tid];
    if (!(p.batch == kThreadSkipsArrival && tid == 70 && r == 1)) MbarrierArrive(&written[s]);
    if (p.batch == kThreadArrivesTwice && tid == 70 && r == 0) MbarrierArrive(&written[s]);
    MbarrierWait(&written[s], (r / 2) & 1);
    p.out[r * 128 + tid] = rows[s * 128 + 127 - tid];
    MbarrierArrive(&read[s]);
  }
}

// One warp; lane l writes 6 words at out[6 l]: ballot(x > 0), any(x > 2), all(x > -10), an int
// shuffle (lane ^ 3) * 7, a half-warp shuffle (lanes 0-15: x of lane ^ 1 under mask 0xffff;
// lanes 16-31: x of lane 16 under mask 0xffff0000), and x of lane 31 - l exchanged through
// shared memory and __syncwarp.
__global__ void WarpVotesKernel(NbhdAttnGpuParams p) {
  const int lane = threadIdx.x % 32;
  const float x = static_cast<const float*>(p.q)[lane];
  auto* words = reinterpret_cast<uint32_t*>(p.out) + 6 * lane;
  words[0] = __ballot_sync(0xffffffffu, x > 0.0f);
  words[1] = __any_sync(0xffffffffu, x > 2.0f);
  words[2] = __all_sync(0xffffffffu, x > -10.0f);
  words[3] = __shfl_xor_sync(0xffffffffu, lane * 7, 3);
  const float half = lane < 16 ? __shfl_xor_sync(0x0000ffffu, x, 1) : __shfl_sync(0xffff0000u, x, 16);
  words[4] = __float_as_uint(half);
  auto* exchange = reinterpret_cast<float*>(SharedBytes());
  exchange[lane] = x;
  __syncwarp();
  words[5] = __float_as_uint(exchange[31 - lane]);
}

// A [rows, 64] bf16 tensor as a 3-D tensor map ({64, rows, 1}), boxes of {64, box_rows, 1}, 128-byte
// swizzle or none (through the driver's encoder, as the kernels' hosts get it).
CUtensorMap RowsMap(const void* base, int rows, int box_rows, bool swizzle) {
  const sm90::EncodeTiled encode = sm90::FindEncodeTiled();
  if (encode == nullptr) __builtin_trap();
  CUtensorMap map;
  const cuuint64_t dims[3] = {64, cuuint64_t(rows), 1}, strides[2] = {128, cuuint64_t(rows) * 128};
  const cuuint32_t box[3] = {64, cuuint32_t(box_rows), 1}, element_strides[3] = {1, 1, 1};
  const CUresult status = encode(
      &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(base), dims, strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
      CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (status != CUDA_SUCCESS) __builtin_trap();
  return map;
}

constexpr int kWgmmaShared = 8192 + 4096 + 4096 + 1024;  // A, B, V, the barrier

// One warpgroup; wgmma_sm90.cuh's products on tiles staged by tensor-map boxes (128-byte swizzle):
// q = A [64, 64] (rows m), k = B [32, 64] (rows n), v = V [32, 64] (rows k), all bf16; out gets
// A B^T with A from shared memory, A B^T with A from registers (fragments per the documented layout,
// read from global memory), then A[:, :32] V (B MN-major), row-major [64, 32], [64, 32], [64, 64].
__global__ void WgmmaKernel(NbhdAttnGpuParams p) {
  char* shared = SharedBytes();
  using sm90::SwizzledTileDescriptor;
  void* tiles[3] = {shared + (p.batch == kBoxMisaligned ? 512 : 0), shared + 8192, shared + 12288};
  auto* full = reinterpret_cast<uint64_t*>(shared + 16384);
  if (threadIdx.x == 0) {
    MbarrierInit(full, 1);
    MbarrierInitFence();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const CUtensorMap maps[3] = {RowsMap(p.q, 64, 64, true), RowsMap(p.k, 32, 32, true), RowsMap(p.v, 32, 32, true)};
    sm90::MbarrierArriveExpectBytes(full, 8192 + 4096 + 4096);
    for (int i = 0; i < 3; ++i) sm90::LoadBox3d(tiles[i], &maps[i], 0, 0, 0, full);
  }
  MbarrierWait(full, 0);
  const int warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const auto* a = static_cast<const uint16_t*>(p.q);
  auto fragment = [&](int ks, uint32_t (&f)[4]) {
    const int row = 16 * warp + g, col = 16 * ks + 2 * t;
    auto at = [&](int r, int c) { return Pair(a[r * 64 + c], a[r * 64 + c + 1]); };
    f[0] = at(row, col), f[1] = at(row + 8, col), f[2] = at(row, col + 8), f[3] = at(row + 8, col + 8);
  };
  const uint64_t a_tile = SwizzledTileDescriptor(tiles[0]), b_tile = SwizzledTileDescriptor(tiles[1]);
  const uint64_t v_tile = SwizzledTileDescriptor(tiles[2]);
  float shared_a[16], register_a[16], values[32];
  sm90::WgmmaFence();
  for (int ks = 0; ks < 4; ++ks) {
    uint32_t f[4];
    fragment(ks, f);
    const uint64_t b = p.batch == kLaneOtherDescriptor && lane == 3 ? v_tile : b_tile;
    sm90::WgmmaM64N32K16SharedA<__nv_bfloat16>(shared_a, a_tile + 2 * ks, b + 2 * ks, ks > 0);
    sm90::WgmmaM64N32K16<__nv_bfloat16, 0>(register_a, f, b_tile + 2 * ks, ks > 0);
  }
  for (int ks = 0; ks < 2; ++ks) {
    if (p.batch == kWarpSkipsWgmma && warp == 2 && ks == 1) break;
    uint32_t f[4];
    fragment(ks, f);
    sm90::WgmmaM64N64K16<__nv_bfloat16, 1>(values, f, v_tile + 128 * ks, ks > 0);
  }
  sm90::WgmmaCommit();
  if (p.batch == kNoWgmmaWait) return;
  sm90::WgmmaWait<0>();
  float* out = p.out;
  for (int i = 0; i < 32; ++i) {  // d[i]: row 16 w + g + 8 ((i >> 1) & 1), column 8 (i >> 2) + 2 t + (i & 1)
    const int row = 16 * warp + g + 8 * ((i >> 1) & 1), col = 8 * (i >> 2) + 2 * t + (i & 1);
    if (i < 16) {
      out[row * 32 + col] = shared_a[i];
      out[64 * 32 + row * 32 + col] = register_a[i];
    }
    out[2 * 64 * 32 + row * 64 + col] = values[i];
  }
}

// One warp; two boxes of 16 rows of a [20, 64] bf16 tensor (q), at rows -3 and 10 (reaching past both
// ends), with the 128-byte swizzle (box 0, 1) or without (2); out gets the 3 x 2048 staged bytes raw.
__global__ void TensorMapBoxKernel(NbhdAttnGpuParams p) {
  char* shared = SharedBytes();
  auto* full = reinterpret_cast<uint64_t*>(shared + 3 * 2048 + 1024);
  if (threadIdx.x == 0) {
    MbarrierInit(full, 1);
    MbarrierInitFence();
    const CUtensorMap swizzled = RowsMap(p.q, 20, 16, true), plain = RowsMap(p.q, 20, 16, false);
    sm90::MbarrierArriveExpectBytes(full, 3 * 2048);
    sm90::LoadBox3d(shared, &swizzled, 0, -3, 0, full);
    sm90::LoadBox3d(shared + 2048, &swizzled, 0, 10, 0, full);
    sm90::LoadBox3d(shared + 2 * 2048 + 1024, &plain, 0, -3, 0, full);
  }
  __syncwarp();
  MbarrierWait(full, 0);
  const int lane = threadIdx.x % 32;
  auto* out = reinterpret_cast<char*>(p.out);
  for (int i = lane; i < 3 * 2048; i += 32) out[i] = shared[i < 2 * 2048 ? i : i + 1024];
}

}  // namespace
}  // namespace gpu
}  // namespace s2attn

namespace {

cudaError_t Launch(void (*kernel)(s2attn::NbhdAttnGpuParams), const s2attn::NbhdAttnGpuParams& p, unsigned blocks,
                   unsigned threads, size_t shared_bytes) {
  s2attn::NbhdAttnGpuParams params = p;
  void* args[] = {&params};
  const cudaError_t status =
      cudaLaunchKernel(reinterpret_cast<const void*>(kernel), dim3(blocks), dim3(threads), args, shared_bytes, nullptr);
  const cudaError_t last = cudaGetLastError();  // also clears a failed launch's error for the next test
  return status != cudaSuccess ? status : last;
}

}  // namespace

// tile: kStagedPieces x 16 bytes; words: kStagedWords floats; out: the same, one after the other. Sets
// the kernel's dynamic shared memory limit to `shared_limit`, then launches with `shared_bytes`, the
// staged data `shared_offset` bytes in.
extern "C" int RunStagedCopy(const void* tile, const float* words, void* out, int64_t shared_offset,
                             int64_t shared_bytes, int shared_limit, int64_t fault) {
  s2attn::NbhdAttnGpuParams p;
  p.q = tile;
  p.dout = words;
  p.out = static_cast<float*>(out);
  p.batch = fault;
  p.num_arcs = shared_offset;
  auto* kernel = s2attn::gpu::StagedCopyKernel;
  const cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_limit);
  if (status != cudaSuccess) {
    cudaGetLastError();  // clears it for the next test
    return status;
  }
  return Launch(kernel, p, 1, 32, static_cast<size_t>(shared_bytes));
}

// x, out: [blocks, 128] floats.
extern "C" int RunBlockCentre(const float* x, float* out, int blocks, int64_t shared_bytes, int64_t fault) {
  s2attn::NbhdAttnGpuParams p;
  p.q = x;
  p.out = out;
  p.batch = fault;
  return Launch(s2attn::gpu::BlockCentreKernel, p, static_cast<unsigned>(blocks), 128,
                static_cast<size_t>(shared_bytes));
}

// x, out: [rounds, 128] floats.
extern "C" int RunMbarrierRing(const float* x, float* out, int64_t rounds, int64_t fault) {
  s2attn::NbhdAttnGpuParams p;
  p.q = x;
  p.out = out;
  p.num_arcs = rounds;
  p.batch = fault;
  return Launch(s2attn::gpu::MbarrierRingKernel, p, 1, 128, 2 * 128 * sizeof(float) + 4 * sizeof(uint64_t));
}

// x: 32 floats; out: 32 x 6 words.
extern "C" int RunWarpVotes(const float* x, uint32_t* out) {
  s2attn::NbhdAttnGpuParams p;
  p.q = x;
  p.out = reinterpret_cast<float*>(out);
  return Launch(s2attn::gpu::WarpVotesKernel, p, 1, 32, 32 * sizeof(float));
}

// a: [64, 64], b: [32, 64], v: [32, 64] bf16; out: 64 * 32 + 64 * 32 + 64 * 64 floats.
extern "C" int RunWgmma(const void* a, const void* b, const void* v, float* out, int64_t fault) {
  s2attn::NbhdAttnGpuParams p;
  p.q = a;
  p.k = b;
  p.v = v;
  p.out = out;
  p.batch = fault;
  return Launch(s2attn::gpu::WgmmaKernel, p, 1, 128, s2attn::gpu::kWgmmaShared);
}

// x: [20, 64] bf16; out: 3 * 2048 bytes.
extern "C" int RunTensorMapBoxes(const void* x, void* out) {
  s2attn::NbhdAttnGpuParams p;
  p.q = x;
  p.out = static_cast<float*>(out);
  return Launch(s2attn::gpu::TensorMapBoxKernel, p, 1, 32, 3 * 2048 + 1024 + 64);
}
