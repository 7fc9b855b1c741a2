// The streaming attention main loop on CuTe and CUTLASS primitives: one of the two versions
// experimental/mainloop_primitives.sh compares, the other on the project's own PTX wrappers (mainloop_own.cu, whose
// opening comment says what the loop does). Compiled as a translation unit of its own, so that the build times
// each version; mainloop_primitives.cu declares its entry point, PrepareCuteMainLoop.
//
// The same block, tiles, chunk walk and order of operations as the own version, each step by the library: tensor-map
// copies by cute::make_tma_copy (SM90_TMA_LOAD) and tma_partition, the ring by cutlass::PipelineTmaAsync (its
// producer_acquire / consumer_wait / consumer_release and PipelineState phases), the Q tile's barrier by
// cutlass::arch::ClusterTransactionBarrier, the shared layouts by GMMA's 128-byte swizzle atoms (what both the boxes
// and the descriptors read), the products by TiledMMAs of SM90_64x32x16_F32BF16BF16_SS and _64x64x16_..._RS with
// cute::gemm between warpgroup_arrive / warpgroup_commit_batch / warpgroup_wait, P rounded by CUTLASS's bf16x2
// converter, and O stored through the product's partition of the output tile.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <functional>

#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "mainloop_shape.h"

// A named namespace: nvcc's launch stub of a kernel in an anonymous one cannot tell it from CuTe's anonymous
// namespace once `using namespace cute` is in force.
namespace cute_mainloop {

using namespace cute;  // CuTe's shapes, layouts and tensors (Int, Shape, _, make_tensor, ...)
using Element = cutlass::bfloat16_t;
static_assert(sizeof(Element) == sizeof(__nv_bfloat16), "the driver's bf16 arrays are CUTLASS's");

using namespace mainloop_shape;
using HeadDim = Int<kHeadDim>;
using QueryRows = Int<kQueryRows>;
using ChunkRows = Int<kChunkRows>;

// Shared layouts: rows of 64 elements with the 128-byte swizzle. Q and K are K-major operands (rows x head dim); V
// is the MN-major B of O += P V, indexed (head dim, key) over rows laid out as K's (a key's 64 elements contiguous).
using QueryLayout = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, Shape<QueryRows, HeadDim>{}));
using KeyStageLayout = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, Shape<ChunkRows, HeadDim>{}));
using KeyLayout =
    decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, Shape<ChunkRows, HeadDim, Int<kStages>>{}));
using ValueStageLayout = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{}, Shape<HeadDim, ChunkRows>{}));
using ValueLayout =
    decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{}, Shape<HeadDim, ChunkRows, Int<kStages>>{}));

using ScoreOp = SM90_64x32x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>;
using ProductOp = SM90_64x64x16_F32BF16BF16_RS<GMMA::Major::K, GMMA::Major::MN>;
using ScoreMma = decltype(make_tiled_mma(ScoreOp{}));
using ProductMma = decltype(make_tiled_mma(ProductOp{}));

using Pipeline = cutlass::PipelineTmaAsync<kStages>;
using PipelineState = cutlass::PipelineState<kStages>;

constexpr uint32_t kQBytes = cosize_v<QueryLayout> * sizeof(Element);
constexpr uint32_t kChunkBytes = (cosize_v<KeyStageLayout> + cosize_v<ValueStageLayout>) * sizeof(Element);
static_assert(kQBytes == kQueryRows * kHeadDim * 2 && kChunkBytes == 2 * kChunkRows * kHeadDim * 2,
              "expect-tx bytes of one Q box and of a chunk's K and V boxes");
static_assert(cosize_v<KeyLayout> == kStages * cosize_v<KeyStageLayout> &&
                  cosize_v<ValueLayout> == kStages * cosize_v<ValueStageLayout>,
              "stages one tile apart");

struct SharedStorage {
  alignas(1024) Element q[cosize_v<QueryLayout>];
  alignas(1024) Element k[cosize_v<KeyLayout>];
  alignas(1024) Element v[cosize_v<ValueLayout>];
  Pipeline::SharedStorage pipeline;
  uint64_t q_full;
};

// Element i of the S accumulator and element i of P's register fragment (k16 step i / 8 of the product) are the same
// (row, key) for every thread: the accumulator's (thread, value) -> (m, n) layout and the register A operand's
// (thread, value) -> (m, k) one agree with k = n, so that P is S element by element.
constexpr bool ScoresAreTheProductOperand() {
  using Accumulator = typename MMA_Traits<ScoreOp>::CLayout;  // m + 64 n
  using Operand = typename MMA_Traits<ProductOp>::ALayout;    // m + 64 k
  for (int thread = 0; thread < kConsumerThreads; ++thread) {
    for (int value = 0; value < kChunkRows / 2; ++value) {
      const int s = Accumulator{}(thread, value), p = Operand{}(thread, value % 8) + 64 * 16 * (value / 8);
      if (s != p) return false;
    }
  }
  return true;
}
static_assert(ScoresAreTheProductOperand(), "P's fragment is S's accumulator, element by element");

// What a launch takes: the three TMA copies (each holding its tensor map, so passed as a __grid_constant__ parameter)
// and the walk.
template <class QueryCopy, class KeyCopy, class ValueCopy>
struct Params {
  QueryCopy q;
  KeyCopy k;
  ValueCopy v;
  float* out;
  int blocks, chunks_per_block, total_chunks, stride;
  float scale;
};

// Lane 0 of the producer warp: the Q tile, then every chunk's K and V into the pipeline's stages.
template <class P>
__device__ __forceinline__ void Produce(const P& p, SharedStorage& s, Pipeline& pipeline) {
  Tensor sQ = make_tensor(make_smem_ptr(s.q), QueryLayout{});
  Tensor sK = make_tensor(make_smem_ptr(s.k), KeyLayout{});
  Tensor sV = make_tensor(make_smem_ptr(s.v), ValueLayout{});
  // Coordinate tensors of the whole arrays, tiled: (rows, 64, tile), (keys, 64, chunk), (64, keys, chunk).
  Tensor gQ = local_tile(p.q.get_tma_tensor(make_shape(p.blocks * kQueryRows, HeadDim{})), Shape<QueryRows, HeadDim>{},
                         make_coord(_, 0));
  Tensor gK = local_tile(p.k.get_tma_tensor(make_shape(p.total_chunks * kChunkRows, HeadDim{})),
                         Shape<ChunkRows, HeadDim>{}, make_coord(_, 0));
  Tensor gV = local_tile(p.v.get_tma_tensor(make_shape(HeadDim{}, p.total_chunks * kChunkRows)),
                         Shape<HeadDim, ChunkRows>{}, make_coord(0, _));
  auto [tQg, tQs] = tma_partition(p.q, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));  // (box, tile), (box)
  auto [tKg, tKs] = tma_partition(p.k, group_modes<0, 2>(sK), group_modes<0, 2>(gK));  // (box, chunk), (box, stage)
  auto [tVg, tVs] = tma_partition(p.v, group_modes<0, 2>(sV), group_modes<0, 2>(gV));

  cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&s.q_full, kQBytes);
  copy(p.q.with(s.q_full), tQg(_, static_cast<int>(blockIdx.x)), tQs);
  PipelineState state = cutlass::make_producer_start_state<Pipeline>();
  for (int i = 0; i < p.chunks_per_block; ++i) {
    pipeline.producer_acquire(state);  // the stage released; arrives on its full barrier expecting kChunkBytes
    uint64_t* full = pipeline.producer_get_barrier(state);
    const int chunk = ChunkOf(blockIdx.x, i, p.stride, p.total_chunks);
    copy(p.k.with(*full), tKg(_, chunk), tKs(_, state.index()));
    copy(p.v.with(*full), tVg(_, chunk), tVs(_, state.index()));
    ++state;
  }
}

// The consumer warpgroup: the chunks' products into O, then O to the block's 64 rows of `out`.
template <class P>
__device__ __forceinline__ void Consume(const P& p, SharedStorage& s, Pipeline& pipeline) {
  Tensor sQ = make_tensor(make_smem_ptr(s.q), QueryLayout{});
  Tensor sK = make_tensor(make_smem_ptr(s.k), KeyLayout{});
  Tensor sV = make_tensor(make_smem_ptr(s.v), ValueLayout{});
  ScoreMma score_mma;
  ProductMma product_mma;
  auto score_thread = score_mma.get_thread_slice(threadIdx.x);
  auto product_thread = product_mma.get_thread_slice(threadIdx.x);
  Tensor tSrQ = score_thread.partition_fragment_A(sQ);      // (MMA, 1, k16 steps): descriptors
  Tensor tSrK = score_thread.partition_fragment_B(sK);      // (MMA, 1, k16 steps, stage)
  Tensor tOrV = product_thread.partition_fragment_B(sV);    // (MMA, 1, k16 steps, stage)
  Tensor tSrS = partition_fragment_C(score_mma, Shape<QueryRows, ChunkRows>{});  // S, float
  Tensor tOrP = make_tensor<Element>(partition_shape_A(product_mma, Shape<QueryRows, ChunkRows>{}));  // P, bf16
  Tensor tOrO = partition_fragment_C(product_mma, Shape<QueryRows, HeadDim>{});  // O, float
  CUTE_STATIC_ASSERT_V(size<2>(tSrQ) == Int<kHeadDim / 16>{} && size<3>(tSrK) == Int<kStages>{});  // 4 k16 steps
  CUTE_STATIC_ASSERT_V(size<2>(tOrV) == Int<kChunkRows / 16>{} && size<3>(tOrV) == Int<kStages>{});  // 2 k16 steps
  CUTE_STATIC_ASSERT_V(size(tSrS) == Int<kChunkRows / 2>{} && size(tOrP) == size(tSrS));  // a thread's 16 scores
  CUTE_STATIC_ASSERT_V(size(tOrO) == Int<kHeadDim / 2>{});                                 // and 32 outputs
  clear(tOrO);

  const auto issue_scores = [&](int stage) {  // S = Q K^T: 4 k16 steps, one group
    warpgroup_fence_operand(tSrS);
    warpgroup_arrive();
    score_mma.accumulate_ = GMMA::ScaleOut::Zero;
    CUTE_UNROLL
    for (int ks = 0; ks < size<2>(tSrQ); ++ks) {
      gemm(score_mma, tSrQ(_, _, ks), tSrK(_, _, ks, stage), tSrS);
      score_mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
  };
  const auto issue_products = [&](int stage) {  // O += P V: 2 k16 steps, one group
    warpgroup_fence_operand(tOrP);
    warpgroup_fence_operand(tOrO);
    warpgroup_arrive();  // P's registers were written since the last wgmma
    CUTE_UNROLL
    for (int kk = 0; kk < size<2>(tOrP); ++kk) gemm(product_mma, tOrP(_, _, kk), tOrV(_, _, kk, stage), tOrO);
    warpgroup_commit_batch();
  };
  const auto scale_scores = [&] {
    CUTE_UNROLL
    for (int i = 0; i < size(tSrS); ++i) tSrS(i) *= p.scale;
  };
  const auto round_scores = [&] {  // two a cvt.rn.bf16x2 (ScoresAreTheProductOperand: element i to element i)
    cutlass::NumericArrayConverter<Element, float, 2> to_bf16;
    CUTE_UNROLL
    for (int i = 0; i < size(tSrS); i += 2) {
      cutlass::Array<float, 2> pair;
      pair[0] = tSrS(i);
      pair[1] = tSrS(i + 1);
      const cutlass::Array<Element, 2> rounded = to_bf16(pair);
      tOrP(i) = rounded[0];
      tOrP(i + 1) = rounded[1];
    }
  };

  cutlass::arch::ClusterBarrier::wait(&s.q_full, 0);
  PipelineState current;  // stage 0, phase 0
  pipeline.consumer_wait(current);
  issue_scores(current.index());
  warpgroup_wait<0>();
  warpgroup_fence_operand(tSrS);
  scale_scores();
  round_scores();
  for (int j = 0; j + 1 < p.chunks_per_block; ++j) {
    PipelineState next = current;
    ++next;
    pipeline.consumer_wait(next);
    issue_scores(next.index());
    issue_products(current.index());
    warpgroup_wait<1>();  // S(j + 1) complete, P(j) V(j) may still run
    warpgroup_fence_operand(tSrS);
    scale_scores();
    warpgroup_wait<0>();  // P(j) V(j) complete: stage j and P's registers are free
    warpgroup_fence_operand(tOrO);
    pipeline.consumer_release(current);
    round_scores();
    current = next;
  }
  issue_products(current.index());
  warpgroup_wait<0>();
  warpgroup_fence_operand(tOrO);
  pipeline.consumer_release(current);

  Tensor mO = make_tensor(make_gmem_ptr(p.out), make_shape(p.blocks * kQueryRows, HeadDim{}),
                          make_stride(HeadDim{}, Int<1>{}));
  Tensor gO = local_tile(mO, Shape<QueryRows, HeadDim>{}, make_coord(static_cast<int>(blockIdx.x), 0));
  Tensor tOgO = product_thread.partition_C(gO);
  copy(tOrO, tOgO);
}

template <class P>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) CuteMainLoop(const __grid_constant__ P p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char cute_dynamic_shared[];
  const uint32_t misalignment = cast_smem_ptr_to_uint(cute_dynamic_shared) % 1024;
  SharedStorage& s = *reinterpret_cast<SharedStorage*>(cute_dynamic_shared + (1024 - misalignment) % 1024);
  const bool producer = threadIdx.x >= kConsumerThreads;
  Pipeline::Params pipeline_params;
  pipeline_params.role = producer ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pipeline_params.is_leader = threadIdx.x == kConsumerThreads;  // the thread that asks for the boxes
  pipeline_params.num_consumers = kConsumerThreads;             // every consumer thread releases a stage
  pipeline_params.num_producers = 1;
  pipeline_params.transaction_bytes = kChunkBytes;
  pipeline_params.initializing_warp = 0;
  if (threadIdx.x == 0) {
    cutlass::arch::ClusterTransactionBarrier::init(&s.q_full, 1);
    cutlass::arch::fence_barrier_init();
  }
  // Warp 0 initialises the stages' barriers; every thread takes its role (a cluster of one block: every consumer
  // thread arrives on the empty barriers, locally).
  Pipeline pipeline(s.pipeline, pipeline_params, Shape<_1, _1, _1>{});
  __syncthreads();
  if (producer) {
    if (threadIdx.x == kConsumerThreads) Produce(p, s, pipeline);
  } else {
    Consume(p, s, pipeline);
  }
#endif
}

// False (after printing why) where a TMA copy's tensor map stayed empty: make_tma_copy reports a failed encoding only
// by an assert, which NDEBUG removes.
template <class Copy>
bool Encoded(const Copy& copy_op, const char* what) {
  const auto* bytes = reinterpret_cast<const unsigned char*>(copy_op.get_tma_descriptor());
  for (size_t i = 0; i < sizeof(CUtensorMap); ++i) {
    if (bytes[i] != 0) return true;
  }
  std::printf("cute: the tensor map of %s is empty (cuTensorMapEncodeTiled failed)\n", what);
  return false;
}

}  // namespace cute_mainloop

// Sets up the CuTe/CUTLASS main loop over q [blocks * 64, 64], k and v [total_chunks * 32, 64] (bf16, rows
// contiguous) into out [blocks * 64, 64] (float32): its TMA copies and shared-memory limit, once. Returns its launch
// on a stream, or an empty function after printing why it cannot be set up; `kernel`, `threads` and `shared_bytes`
// receive what the resource queries need.
std::function<cudaError_t(cudaStream_t)> PrepareCuteMainLoop(const __nv_bfloat16* q, const __nv_bfloat16* k,
                                                             const __nv_bfloat16* v, float* out, int blocks,
                                                             int chunks_per_block, int total_chunks, int stride,
                                                             float scale, const void** kernel, int* threads,
                                                             int* shared_bytes) {
  using namespace cute_mainloop;
  const auto* q_rows = reinterpret_cast<const Element*>(q);
  const auto* k_rows = reinterpret_cast<const Element*>(k);
  const auto* v_rows = reinterpret_cast<const Element*>(v);
  const int keys = total_chunks * kChunkRows;
  Tensor mQ = make_tensor(make_gmem_ptr(q_rows), make_shape(blocks * kQueryRows, HeadDim{}),
                          make_stride(HeadDim{}, Int<1>{}));
  Tensor mK = make_tensor(make_gmem_ptr(k_rows), make_shape(keys, HeadDim{}), make_stride(HeadDim{}, Int<1>{}));
  Tensor mV = make_tensor(make_gmem_ptr(v_rows), make_shape(HeadDim{}, keys), make_stride(Int<1>{}, HeadDim{}));
  auto q_copy = make_tma_copy(SM90_TMA_LOAD{}, mQ, QueryLayout{});
  auto k_copy = make_tma_copy(SM90_TMA_LOAD{}, mK, KeyStageLayout{});
  auto v_copy = make_tma_copy(SM90_TMA_LOAD{}, mV, ValueStageLayout{});
  if (!Encoded(q_copy, "Q") || !Encoded(k_copy, "K") || !Encoded(v_copy, "V")) return {};
  using LaunchParams = Params<decltype(q_copy), decltype(k_copy), decltype(v_copy)>;
  const LaunchParams params{q_copy, k_copy, v_copy, out, blocks, chunks_per_block, total_chunks, stride, scale};
  const auto function = CuteMainLoop<LaunchParams>;
  const int shared = static_cast<int>(sizeof(SharedStorage)) + 1024;  // + the alignment
  const cudaError_t status = cudaFuncSetAttribute(function, cudaFuncAttributeMaxDynamicSharedMemorySize, shared);
  if (status != cudaSuccess) {
    std::printf("cute: cudaFuncSetAttribute: %s\n", cudaGetErrorString(status));
    return {};
  }
  *kernel = reinterpret_cast<const void*>(function);
  *threads = kThreads;
  *shared_bytes = shared;
  return [=](cudaStream_t stream) {
    function<<<blocks, kThreads, shared, stream>>>(params);
    return cudaGetLastError();
  };
}
