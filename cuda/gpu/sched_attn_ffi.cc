// CUDA handlers of the scheduled targets (contract: cuda/README.md, "Scheduled targets"): forward, dq and dk/dv
// on the plan's block schedules (sched_attn_kernels.h). A handler checks everything visible on the host (shapes,
// dtypes, attributes, the schedule's table sizes against its shape), fills one SchedAttnParams and launches on
// XLA's stream; the schedule's contents are device memory, which the kernels clamp. Whole grids, or the local
// blocks of a window's schedule.
#include "gpu/sched_attn_ffi.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "common/ffi_check.h"
#include "common/kernel_limits.h"
#include "common/nbhd_binding.h"
#include "common/nbhd_params.h"
#include "gpu/ffi_launch.h"
#include "gpu/sched_attn_kernels.h"

namespace s2attn {
namespace {

using AnyResult = ffi::Result<ffi::AnyBuffer>;
using F32Result = ffi::ResultBuffer<ffi::F32>;
using CudaStream = ffi::PlatformStream<cudaStream_t>;

// The attributes of every scheduled target: the softmax scale, the walk's classes and shift, the arrays' grids
// (whole grids, or a window's local blocks), the other grid's ring, the schedule's shape (which must be the
// kernels'), the walking grid's tiles it leaves to the stencil targets (stencil_tiles), and whether it is a ring
// grids' schedule (ring_grids: flat fields as grids of one row, tiles of runs).
struct SchedAttrs {
  float scale;
  int64_t classes, shift, nlat_q, nlon_q, nlat_k, nlon_k, ring_nlon, tile_rows, tile_cols, chunk_cols, stencil_tiles;
  bool ring_grids;
};

template <typename Binding>
auto BindSchedAttrs(Binding&& binding) {
  return std::move(binding)
      .template Attr<float>("scale")
      .template Attr<int64_t>("classes")
      .template Attr<int64_t>("shift")
      .template Attr<int64_t>("nlat_q")
      .template Attr<int64_t>("nlon_q")
      .template Attr<int64_t>("nlat_k")
      .template Attr<int64_t>("nlon_k")
      .template Attr<int64_t>("ring_nlon")
      .template Attr<int64_t>("tile_rows")
      .template Attr<int64_t>("tile_cols")
      .template Attr<int64_t>("chunk_cols")
      .template Attr<int64_t>("stencil_tiles")
      .template Attr<bool>("ring_grids");
}

// The walk's schedule (tiles, tile_offsets, chunks, records) and the quadrature weights, then the operands
// aliased to results (ignored).
template <typename Binding>
auto BindSchedule(Binding&& binding) {
  return std::move(binding)
      .template Arg<I32Buffer>()  // tiles
      .template Arg<I32Buffer>()  // tile_offsets
      .template Arg<I32Buffer>()  // chunks
      .template Arg<I32Buffer>()  // records
      .template Arg<F32Buffer>()  // quad_weights
      .RemainingArgs();
}

// The backward targets' leading operands: the stream, q, k, v, dout, lse, then delta, or with kDeltaFromOut (the dq
// that forms delta) the forward's float32 out and dlse.
template <bool kDeltaFromOut, typename Binding>
auto BindBackwardOperands(Binding&& binding) {
  auto through_lse = std::move(binding)
                         .template Ctx<CudaStream>()
                         .template Arg<ffi::AnyBuffer>()  // q
                         .template Arg<ffi::AnyBuffer>()  // k
                         .template Arg<ffi::AnyBuffer>()  // v
                         .template Arg<ffi::AnyBuffer>()  // dout
                         .template Arg<F32Buffer>();      // lse
  if constexpr (kDeltaFromOut) {
    return std::move(through_lse).template Arg<F32Buffer>().template Arg<F32Buffer>();  // out, dlse
  } else {
    return std::move(through_lse).template Arg<F32Buffer>();  // delta
  }
}

struct Schedule {
  const I32Buffer& tiles;
  const I32Buffer& tile_offsets;
  const I32Buffer& chunks;
  const I32Buffer& records;
  const F32Buffer& quad_weights;
};

ActivationType ToActivationType(ffi::DataType type) {
  return type == ffi::DataType::F32 ? ActivationType::kF32
         : type == ffi::DataType::F16 ? ActivationType::kF16
                                      : ActivationType::kBF16;
}

// Whether the scheduled kernels are built for head dim `d` (kSchedHeadDims).
bool IsSchedHeadDim(int64_t d) {
  for (const int dim : kSchedHeadDims) {
    if (d == dim) return true;
  }
  return false;
}

// Decodes q, k, v (of the attributes' grids: whole grids or a window's local blocks; 16-bit, Dk == Dv, one of the
// kernels' head dims), the schedule's table sizes and the attributes into `g`; `walk_keys` for dk/dv's backward
// schedule.
ffi::Error Decode(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v, const Schedule& s,
                  const SchedAttrs& a, bool walk_keys, SchedAttnParams* g) {
  S2ATTN_CHECK(SchedAttnAvailable(), "the scheduled kernels need an sm_90 GPU (H100, H200) and a build for sm_90a");
  int64_t batch, nq_lat, nq_lon, heads, dk, bk, nk_lat, nk_lon, hk, dk2, bv, nv_lat, nv_lon, hv, dv;
  S2ATTN_RETURN_IF_ERROR(SplitActivation("q", q.dimensions(), &batch, &nq_lat, &nq_lon, &heads, &dk));
  S2ATTN_RETURN_IF_ERROR(SplitActivation("k", k.dimensions(), &bk, &nk_lat, &nk_lon, &hk, &dk2));
  S2ATTN_RETURN_IF_ERROR(SplitActivation("v", v.dimensions(), &bv, &nv_lat, &nv_lon, &hv, &dv));
  S2ATTN_CHECK(q.element_type() == k.element_type() && q.element_type() == v.element_type() &&
                   (q.element_type() == ffi::DataType::BF16 || q.element_type() == ffi::DataType::F16),
               "q, k, v must share one dtype, bfloat16 or float16 (the scheduled kernels'), got "
                   << DataTypeName(q.element_type()) << ", " << DataTypeName(k.element_type()) << ", "
                   << DataTypeName(v.element_type()));
  S2ATTN_CHECK(dk == dk2 && dk == dv && IsSchedHeadDim(dk),
               "the scheduled kernels take head dims Dk == Dv, one of " << Alternatives(kSchedHeadDims) << ", got "
                                                                        << dk << ", " << dk2 << ", " << dv);
  S2ATTN_CHECK(bk == batch && bv == batch && hk == heads && hv == heads,
               "q, k, v must have the same batch dims and heads");
  S2ATTN_CHECK(nq_lat == a.nlat_q && nq_lon == a.nlon_q && nk_lat == a.nlat_k && nk_lon == a.nlon_k &&
                   nv_lat == a.nlat_k && nv_lon == a.nlon_k,
               "q " << nq_lat << "x" << nq_lon << " and k, v " << nk_lat << "x" << nk_lon
                    << " must have the attributes' grids " << a.nlat_q << "x" << a.nlon_q << " and " << a.nlat_k
                    << "x" << a.nlon_k);
  S2ATTN_CHECK(a.tile_rows == kSchedTileRows && a.tile_cols == kSchedTileCols && a.chunk_cols == kSchedChunkCols,
               "the schedule's shape " << a.tile_rows << "x" << a.tile_cols << ", " << a.chunk_cols
                                       << " columns is not the kernels' " << kSchedTileRows << "x" << kSchedTileCols
                                       << ", " << kSchedChunkCols);
  S2ATTN_CHECK(a.classes >= 1 && a.classes <= kSchedTileCols && a.shift >= 1,
               "classes must be in [1, " << kSchedTileCols << "] and shift >= 1, got " << a.classes << ", " << a.shift);
  constexpr int64_t kMaxExtent = int64_t{1} << 29;
  S2ATTN_CHECK(a.nlat_q < kMaxExtent && a.nlon_q < kMaxExtent && a.nlat_k < kMaxExtent && a.nlon_k < kMaxExtent,
               "grid sizes must be below 2^29");
  S2ATTN_CHECK(a.ring_nlon >= 1 && a.ring_nlon < kMaxExtent,
               "ring_nlon (the other grid's longitudes) must be in [1, 2^29), got " << a.ring_nlon);
  // vmap (broadcast_all) prepends identical copies of the tables to their dims: a table is its trailing dims, and
  // the kernels read its first copy.
  const auto tile_dims = s.tiles.dimensions(), chunk_dims = s.chunks.dimensions();
  const auto offset_dims = s.tile_offsets.dimensions(), record_dims = s.records.dimensions();
  const size_t tile_rank = a.ring_grids ? 3 : 2;
  S2ATTN_CHECK(tile_dims.size() >= tile_rank && tile_dims.back() == 2 &&
                   (!a.ring_grids || tile_dims[tile_dims.size() - 2] == kSchedTileRuns),
               "tiles must be int32 " << (a.ring_grids ? "[tiles, 8, 2] (a ring grids' runs)" : "[tiles, 2]"));
  S2ATTN_CHECK(!a.ring_grids || (a.nlat_q == 1 && a.nlat_k == 1 && a.classes == kSchedTileCols),
               "a ring grids' schedule (tiles of runs) takes grids of one row (nlat_q = nlat_k = 1, got "
                   << a.nlat_q << ", " << a.nlat_k << ") and a record per point (classes = " << kSchedTileCols
                   << ", got " << a.classes << ")");
  S2ATTN_CHECK(chunk_dims.size() >= 2 && chunk_dims.back() == kSchedChunkFields,
               "chunks must be int32 [chunks, " << kSchedChunkFields << "]");
  const int64_t num_tiles = tile_dims[tile_dims.size() - tile_rank], num_chunks = chunk_dims[chunk_dims.size() - 2];
  S2ATTN_CHECK(offset_dims.size() > 0 && offset_dims.back() == num_tiles + 1,
               "tile_offsets must be int32 [tiles + 1] = [" << num_tiles + 1 << "]");
  const size_t records_rank = record_dims.size();
  const int64_t num_stagings = records_rank >= 4 ? record_dims[records_rank - 4] : 0;
  S2ATTN_CHECK(records_rank >= 4 && record_dims[records_rank - 3] == kSchedTileRows &&
                   record_dims[records_rank - 2] == a.classes && record_dims[records_rank - 1] == 2 &&
                   (num_chunks == 0 || num_stagings > 0),
               "records must be int32 [stagings, " << kSchedTileRows << ", classes = " << a.classes
                                                   << ", 2], non-empty where there are chunks");
  S2ATTN_CHECK(num_tiles < (int64_t{1} << 31) && num_chunks < (int64_t{1} << 31) && num_stagings < (int64_t{1} << 31),
               "the schedule exceeds the kernels' 32-bit indices");
  const int64_t key_weights = a.ring_grids ? a.nlon_k : a.nlat_k;
  S2ATTN_CHECK(static_cast<int64_t>(s.quad_weights.element_count()) >= key_weights,
               "quad_weights must hold the " << key_weights << (a.ring_grids ? " key points'" : " key rows'")
                                             << " weights");
  S2ATTN_CHECK(batch * heads <= INT32_MAX, "batch x heads must be below 2^31");
  g->dtype = ToActivationType(q.element_type());
  g->head_dim = static_cast<int32_t>(dk);
  g->q = q.untyped_data(), g->k = k.untyped_data(), g->v = v.untyped_data();
  g->tiles = s.tiles.typed_data(), g->tile_offsets = s.tile_offsets.typed_data();
  g->chunks = s.chunks.typed_data(), g->records = s.records.typed_data();
  g->quad_weights = s.quad_weights.typed_data();
  g->num_tiles = num_tiles, g->num_chunks = num_chunks, g->num_stagings = num_stagings;
  g->classes = static_cast<int32_t>(a.classes), g->shift = static_cast<int32_t>(a.shift);
  g->batch = batch, g->heads = heads;
  g->nlat_q = static_cast<int32_t>(a.nlat_q), g->nlon_q = static_cast<int32_t>(a.nlon_q);
  g->nlat_k = static_cast<int32_t>(a.nlat_k), g->nlon_k = static_cast<int32_t>(a.nlon_k);
  g->ring_nlon = static_cast<int32_t>(a.ring_nlon);
  g->ring_grids = a.ring_grids;
  g->scale = a.scale;
  if (a.ring_grids) {  // the runs are the schedule's own cut of the walking points: enough of them for every point
    const int64_t walk_points = walk_keys ? a.nlon_k : a.nlon_q;
    const int64_t tile_points = kSchedTileRuns * kSchedRunPoints;
    S2ATTN_CHECK(a.stencil_tiles >= 0 && a.stencil_tiles < kMaxExtent &&
                     (num_tiles + a.stencil_tiles) * tile_points >= walk_points,
                 "the schedule's " << num_tiles << " tiles and the " << a.stencil_tiles
                                   << " it leaves to the stencil targets cannot hold the " << walk_points
                                   << " walking points (pass the plan's " << (walk_keys ? "backward" : "forward")
                                   << " schedule)");
    return ffi::Error::Success();
  }
  const int64_t walk_tiles = ((walk_keys ? a.nlat_k : a.nlat_q) + kSchedTileRows - 1) / kSchedTileRows *
                             (((walk_keys ? a.nlon_k : a.nlon_q) + kSchedTileCols - 1) / kSchedTileCols);
  S2ATTN_CHECK(a.stencil_tiles >= 0 && num_tiles + a.stencil_tiles == walk_tiles,
               "the schedule lists " << num_tiles << " tiles and leaves " << a.stencil_tiles
                                     << " to the stencil targets; the walking grid has " << walk_tiles
                                     << " (pass the plan's, or the window's, " << (walk_keys ? "backward" : "forward")
                                     << " schedule)");
  return ffi::Error::Success();
}

// The results' element type (float32 or q's) into `g`.
ffi::Error SetResultType(const char* names, std::initializer_list<ffi::DataType> types, ffi::DataType activations,
                         SchedAttnParams* g) {
  ElementType type;
  S2ATTN_RETURN_IF_ERROR(CheckResultTypes(names, types, activations, /*narrow_allowed=*/true, &type));
  g->result_dtype = type == ElementType::kF32 ? ActivationType::kF32 : g->dtype;
  return ffi::Error::Success();
}

// jax_s2attn_sched_fwd: (out, lse), or with a third result (out, lse, out_f32): out in the activations' type and
// the same out in float32, what the backward forms delta from (the differentiated op's primal and residual).
ffi::Error Forward(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, I32Buffer tiles,
                   I32Buffer tile_offsets, I32Buffer chunks, I32Buffer records, F32Buffer quad_weights,
                   ffi::RemainingArgs /*aliased_results*/, AnyResult out, F32Result lse, ffi::RemainingRets more,
                   float scale, int64_t classes,
                   int64_t shift, int64_t nlat_q, int64_t nlon_q, int64_t nlat_k, int64_t nlon_k, int64_t ring_nlon,
                   int64_t tile_rows, int64_t tile_cols, int64_t chunk_cols, int64_t stencil_tiles, bool ring_grids) {
  SchedAttnParams g;
  const SchedAttrs a{scale,  classes,   shift,     nlat_q,    nlon_q,     nlat_k,
                     nlon_k, ring_nlon, tile_rows, tile_cols, chunk_cols, stencil_tiles, ring_grids};
  S2ATTN_RETURN_IF_ERROR(
      Decode(q, k, v, {tiles, tile_offsets, chunks, records, quad_weights}, a, /*walk_keys=*/false, &g));
  S2ATTN_RETURN_IF_ERROR(CheckGridArray("out", out->dimensions(), g.batch, nlat_q, nlon_q, g.heads, g.head_dim));
  S2ATTN_RETURN_IF_ERROR(CheckGridArray("lse", lse->dimensions(), g.batch, nlat_q, nlon_q, g.heads, -1));
  S2ATTN_RETURN_IF_ERROR(SetResultType("out", {out->element_type()}, q.element_type(), &g));
  g.out = out->untyped_data(), g.lse_out = lse->typed_data();
  S2ATTN_CHECK(more.size() <= 1, "the forward has two or three results (out, lse[, out_f32]), got " << 2 + more.size());
  if (more.size() == 1) {
    const auto out_f32 = more.get<ffi::AnyBuffer>(0);
    if (!out_f32.has_value()) return out_f32.error();
    S2ATTN_CHECK(g.result_dtype != ActivationType::kF32 && (*out_f32)->element_type() == ffi::DataType::F32,
                 "out_f32 (the third result) is float32 beside an out in the dtype of q");
    S2ATTN_RETURN_IF_ERROR(
        CheckGridArray("out_f32", (*out_f32)->dimensions(), g.batch, nlat_q, nlon_q, g.heads, g.head_dim));
    g.out_f32 = (*out_f32)->typed_data<float>();
  }
  return LaunchOnStreamDevice(stream, kTargetScheduledForward, [&] { return LaunchSchedAttnFwd(stream, g); });
}

// The backward targets' dout, lse and the per-point operand after it (`row_name`: delta, or dlse for the dq that
// forms delta; left to the caller).
ffi::Error DecodeBackward(const ffi::AnyBuffer& q, const ffi::AnyBuffer& dout, const F32Buffer& lse,
                          const F32Buffer& per_point, const char* row_name, SchedAttnParams* g) {
  S2ATTN_CHECK(dout.element_type() == q.element_type(), "dout must have the dtype of q");
  S2ATTN_RETURN_IF_ERROR(
      CheckGridArray("dout", dout.dimensions(), g->batch, g->nlat_q, g->nlon_q, g->heads, g->head_dim));
  S2ATTN_RETURN_IF_ERROR(CheckGridArray("lse", lse.dimensions(), g->batch, g->nlat_q, g->nlon_q, g->heads, -1));
  S2ATTN_RETURN_IF_ERROR(
      CheckGridArray(row_name, per_point.dimensions(), g->batch, g->nlat_q, g->nlon_q, g->heads, -1));
  g->dout = dout.untyped_data(), g->lse = lse.typed_data();
  return ffi::Error::Success();
}

ffi::Error BackwardDq(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer dout,
                      F32Buffer lse, F32Buffer delta, I32Buffer tiles, I32Buffer tile_offsets, I32Buffer chunks,
                      I32Buffer records, F32Buffer quad_weights, ffi::RemainingArgs /*aliased_results*/, AnyResult dq,
                      float scale, int64_t classes, int64_t shift, int64_t nlat_q, int64_t nlon_q, int64_t nlat_k,
                      int64_t nlon_k, int64_t ring_nlon, int64_t tile_rows, int64_t tile_cols,
                      int64_t chunk_cols, int64_t stencil_tiles, bool ring_grids) {
  SchedAttnParams g;
  const SchedAttrs a{scale,  classes,   shift,     nlat_q,    nlon_q,     nlat_k,
                     nlon_k, ring_nlon, tile_rows, tile_cols, chunk_cols, stencil_tiles, ring_grids};
  S2ATTN_RETURN_IF_ERROR(
      Decode(q, k, v, {tiles, tile_offsets, chunks, records, quad_weights}, a, /*walk_keys=*/false, &g));
  S2ATTN_RETURN_IF_ERROR(DecodeBackward(q, dout, lse, delta, "delta", &g));
  g.delta = delta.typed_data();
  S2ATTN_RETURN_IF_ERROR(CheckGridArray("dq", dq->dimensions(), g.batch, nlat_q, nlon_q, g.heads, g.head_dim));
  S2ATTN_RETURN_IF_ERROR(SetResultType("dq", {dq->element_type()}, q.element_type(), &g));
  g.dq = dq->untyped_data();
  return LaunchOnStreamDevice(stream, kTargetScheduledBackwardDq, [&] { return LaunchSchedAttnDq(stream, g); });
}

// jax_s2attn_sched_bwd_dq_delta: the scheduled dq forming delta = sum(dout * out, -1) - dlse of its points from
// the forward's float32 out at each block's entry, and returning it for the dk/dv target, so that the op needs no
// delta target between the passes (beside the stencil targets, jax_s2attn_stencil_bwd_dq_delta forms the stencil
// rows' delta into the same result).
ffi::Error BackwardDqDelta(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::AnyBuffer dout, F32Buffer lse, F32Buffer out, F32Buffer dlse, I32Buffer tiles,
                           I32Buffer tile_offsets, I32Buffer chunks, I32Buffer records, F32Buffer quad_weights,
                           ffi::RemainingArgs /*aliased_results*/, AnyResult dq, F32Result delta, float scale,
                           int64_t classes, int64_t shift, int64_t nlat_q, int64_t nlon_q, int64_t nlat_k,
                           int64_t nlon_k, int64_t ring_nlon, int64_t tile_rows, int64_t tile_cols,
                           int64_t chunk_cols, int64_t stencil_tiles, bool ring_grids) {
  SchedAttnParams g;
  const SchedAttrs a{scale,  classes,   shift,     nlat_q,    nlon_q,     nlat_k,
                     nlon_k, ring_nlon, tile_rows, tile_cols, chunk_cols, stencil_tiles, ring_grids};
  S2ATTN_RETURN_IF_ERROR(
      Decode(q, k, v, {tiles, tile_offsets, chunks, records, quad_weights}, a, /*walk_keys=*/false, &g));
  S2ATTN_RETURN_IF_ERROR(DecodeBackward(q, dout, lse, dlse, "dlse", &g));
  S2ATTN_RETURN_IF_ERROR(CheckGridArray("out", out.dimensions(), g.batch, nlat_q, nlon_q, g.heads, g.head_dim));
  S2ATTN_RETURN_IF_ERROR(CheckGridArray("dq", dq->dimensions(), g.batch, nlat_q, nlon_q, g.heads, g.head_dim));
  S2ATTN_RETURN_IF_ERROR(CheckGridArray("delta", delta->dimensions(), g.batch, nlat_q, nlon_q, g.heads, -1));
  S2ATTN_RETURN_IF_ERROR(SetResultType("dq", {dq->element_type()}, q.element_type(), &g));
  g.forward_out = out.typed_data(), g.dlse = dlse.typed_data();
  g.dq = dq->untyped_data(), g.delta_out = delta->typed_data();
  return LaunchOnStreamDevice(stream, kTargetScheduledBackwardDqDelta,
                              [&] { return LaunchSchedAttnDq(stream, g); });
}

ffi::Error BackwardDkv(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer dout,
                       F32Buffer lse, F32Buffer delta, I32Buffer tiles, I32Buffer tile_offsets, I32Buffer chunks,
                       I32Buffer records, F32Buffer quad_weights, ffi::RemainingArgs /*aliased_results*/,
                       AnyResult dk, AnyResult dv, float scale, int64_t classes, int64_t shift, int64_t nlat_q,
                       int64_t nlon_q, int64_t nlat_k, int64_t nlon_k, int64_t ring_nlon, int64_t tile_rows,
                       int64_t tile_cols, int64_t chunk_cols, int64_t stencil_tiles, bool ring_grids) {
  SchedAttnParams g;
  const SchedAttrs a{scale,  classes,   shift,     nlat_q,    nlon_q,     nlat_k,
                     nlon_k, ring_nlon, tile_rows, tile_cols, chunk_cols, stencil_tiles, ring_grids};
  S2ATTN_RETURN_IF_ERROR(
      Decode(q, k, v, {tiles, tile_offsets, chunks, records, quad_weights}, a, /*walk_keys=*/true, &g));
  S2ATTN_RETURN_IF_ERROR(DecodeBackward(q, dout, lse, delta, "delta", &g));
  g.delta = delta.typed_data();
  S2ATTN_RETURN_IF_ERROR(CheckGridArray("dk", dk->dimensions(), g.batch, nlat_k, nlon_k, g.heads, g.head_dim));
  S2ATTN_RETURN_IF_ERROR(CheckGridArray("dv", dv->dimensions(), g.batch, nlat_k, nlon_k, g.heads, g.head_dim));
  S2ATTN_RETURN_IF_ERROR(SetResultType("dk and dv", {dk->element_type(), dv->element_type()}, q.element_type(), &g));
  g.dk = dk->untyped_data(), g.dv = dv->untyped_data();
  return LaunchOnStreamDevice(stream, kTargetScheduledBackwardDkv, [&] { return LaunchSchedAttnDkv(stream, g); });
}

}  // namespace
}  // namespace s2attn

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    S2AttnScheduledForwardCuda, s2attn::Forward,
    s2attn::BindSchedAttrs(s2attn::BindSchedule(xla::ffi::Ffi::Bind()
                                                    .Ctx<s2attn::CudaStream>()
                                                    .Arg<xla::ffi::AnyBuffer>()   // q
                                                    .Arg<xla::ffi::AnyBuffer>()   // k
                                                    .Arg<xla::ffi::AnyBuffer>())  // v
                               .Ret<xla::ffi::AnyBuffer>()                        // out
                               .Ret<s2attn::F32Buffer>()                          // lse
                               .RemainingRets()));                                // [out_f32]

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    S2AttnScheduledBackwardDqCuda, s2attn::BackwardDq,
    s2attn::BindSchedAttrs(s2attn::BindSchedule(s2attn::BindBackwardOperands<false>(xla::ffi::Ffi::Bind()))
                               .Ret<xla::ffi::AnyBuffer>()));  // dq

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    S2AttnScheduledBackwardDkvCuda, s2attn::BackwardDkv,
    s2attn::BindSchedAttrs(s2attn::BindSchedule(s2attn::BindBackwardOperands<false>(xla::ffi::Ffi::Bind()))
                               .Ret<xla::ffi::AnyBuffer>()    // dk
                               .Ret<xla::ffi::AnyBuffer>()));  // dv

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    S2AttnScheduledBackwardDqDeltaCuda, s2attn::BackwardDqDelta,
    s2attn::BindSchedAttrs(s2attn::BindSchedule(s2attn::BindBackwardOperands<true>(xla::ffi::Ffi::Bind()))
                               .Ret<xla::ffi::AnyBuffer>()  // dq
                               .Ret<s2attn::F32Buffer>()));  // delta
