// CUDA handlers of the neighbourhood-attention targets (contract: cuda/README.md): the three
// arc-segment targets and the three stencil targets, one handler template each, the stencil dq that forms delta
// itself, the three ring targets (the arc kernels between ring grids), and the backward's delta.
//
// A handler decodes and validates everything visible on the host (shapes, dtypes, attributes,
// table sizes), fills one NbhdAttnGpuParams and launches on XLA's stream with its device current
// (gpu/stream_device.h). Table *contents* (window, row order, arcs) are device memory: the kernels
// read them and clamp every index they derive from them. Handlers never synchronise and allocate
// nothing.
#include "gpu/nbhd_attn_ffi.h"

#include <cuda_runtime_api.h>

#include <climits>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>

#include "common/delta_binding.h"
#include "common/ffi_check.h"
#include "common/kernel_limits.h"
#include "common/nbhd_binding.h"
#include "common/nbhd_params.h"
#include "common/ring_params.h"
#include "gpu/delta_kernel.h"
#include "gpu/nbhd_attn_kernels.h"
#include "gpu/ffi_launch.h"
#include "gpu/stencil_attn_kernels.h"

namespace s2attn {
namespace {

using F32Result = ffi::ResultBuffer<ffi::F32>;
using AnyResult = ffi::Result<ffi::AnyBuffer>;
using CudaStream = ffi::PlatformStream<cudaStream_t>;

ActivationType ToActivationType(ElementType type) {
  switch (type) {
    case ElementType::kF32: return ActivationType::kF32;
    case ElementType::kBF16: return ActivationType::kBF16;
    case ElementType::kF16: return ActivationType::kF16;
  }
  return ActivationType::kF32;  // unreachable: DecodeParams accepts only these three
}

// The arc kernels' limits on every call: 32-bit batch x head block indices and the shared-memory bound of the
// general path.
ffi::Error CheckTeamLimits(int64_t batch, int64_t heads, int64_t dk, int64_t dv) {
  S2ATTN_CHECK(batch * heads <= INT32_MAX,
               "batch x heads = " << batch * heads << " exceeds the CUDA kernels' limit of 2^31 - 1");
  S2ATTN_CHECK(NbhdAttnHeadDimsSupported(dk, dv), "head dims Dk = " << dk << ", Dv = " << dv
                                                                    << " are too large for the CUDA kernels (Dk + Dv "
                                                                       "must be at most "
                                                                    << NbhdAttnMaxHeadDims() << ")");
  return ffi::Error::Success();
}

// Limits of the kernels' index arithmetic (32-bit grid coordinates in arc_walk.h, and the team limits), checked on
// the host where they can be reported.
ffi::Error CheckGpuLimits(const NbhdParams& p, bool walk_keys) {
  constexpr int64_t kMaxExtent = int64_t{1} << 29;
  S2ATTN_CHECK(p.nlat_q < kMaxExtent && p.nlon_q < kMaxExtent && p.nlat_k < kMaxExtent && p.nlon_k < kMaxExtent &&
                   p.num_patterns < kMaxExtent,
               "grid sizes must be below 2^29");
  const int64_t nlon_walk = walk_keys ? p.nlon_k : p.nlon_q;
  const int64_t nlon_other = walk_keys ? p.nlon_q : p.nlon_k;
  S2ATTN_CHECK(p.shift * ((nlon_walk - 1) / p.residues) < nlon_other,
               "shift " << p.shift << " and residues " << p.residues << " move arc starts past the other grid's "
                        << nlon_other << " longitudes");
  return CheckTeamLimits(p.batch, p.heads, p.dk, p.dv);
}

// Everything but the backward inputs and the results.
NbhdAttnGpuParams GpuParams(const NbhdParams& p, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                            const ffi::AnyBuffer& v, const I32Buffer& window, const I32Buffer& row_order,
                            const I32Buffer& arc_offsets, const I32Buffer& arcs, const F32Buffer& quad_weights,
                            TableForm form) {
  NbhdAttnGpuParams g;
  g.dtype = ToActivationType(p.dtype);
  g.q = q.untyped_data();
  g.k = k.untyped_data();
  g.v = v.untyped_data();
  g.window = window.typed_data();
  g.row_order = row_order.typed_data();
  g.arc_offsets = arc_offsets.typed_data();
  g.arcs = arcs.typed_data();
  g.quad_weights = quad_weights.typed_data();
  g.batch = p.batch;
  g.heads = p.heads;
  g.head_dim_k = p.dk;
  g.head_dim_v = p.dv;
  g.nq_lat = static_cast<int32_t>(p.nq_lat);
  g.nq_lon = static_cast<int32_t>(p.nq_lon);
  g.nk_lat = static_cast<int32_t>(p.nk_lat);
  g.nk_lon = static_cast<int32_t>(p.nk_lon);
  g.nlat_q = static_cast<int32_t>(p.nlat_q);
  g.nlon_q = static_cast<int32_t>(p.nlon_q);
  g.nlat_k = static_cast<int32_t>(p.nlat_k);
  g.nlon_k = static_cast<int32_t>(p.nlon_k);
  g.residues = static_cast<int32_t>(p.residues);
  g.shift = static_cast<int32_t>(p.shift);
  g.num_arcs = static_cast<int64_t>(arcs.element_count()) / (form == TableForm::kArcs ? 3 : 1 + 2 * p.residues);
  g.scale = p.scale;
  return g;
}

// The kernel families behind one handler template: table form, target names, launchers, whether
// results may be written in the activations' type, and what a family cannot run (reported before
// launching).
struct ArcKernels {
  static constexpr TableForm kForm = TableForm::kArcs;
  static constexpr const char* kForward = kTargetForward;
  static constexpr const char* kBackwardDq = kTargetBackwardDq;
  static constexpr const char* kBackwardDkv = kTargetBackwardDkv;
  static constexpr bool kNarrowResults = false;
  static cudaError_t Forward(cudaStream_t s, const NbhdAttnGpuParams& g) { return LaunchNbhdAttnFwd(s, g); }
  static cudaError_t BackwardDq(cudaStream_t s, const NbhdAttnGpuParams& g) { return LaunchNbhdAttnBwdDq(s, g); }
  static cudaError_t BackwardDkv(cudaStream_t s, const NbhdAttnGpuParams& g) { return LaunchNbhdAttnBwdDkv(s, g); }
  static ffi::Error Check(const NbhdAttnGpuParams&) { return ffi::Error::Success(); }
};

// The stencil kernels: the arc targets' operands with segment tables and the stencil pairs; they write the stencil
// pairs' rows of results aliased to the scheduled targets' (which write every other row), and nothing else.
struct StencilKernels {
  static constexpr TableForm kForm = TableForm::kSegments;
  static constexpr const char* kForward = kTargetStencilForward;
  static constexpr const char* kBackwardDq = kTargetStencilBackwardDq;
  static constexpr const char* kBackwardDkv = kTargetStencilBackwardDkv;
  static constexpr const char* kBackwardDqDelta = kTargetStencilBackwardDqDelta;
  static constexpr bool kNarrowResults = true;
  static cudaError_t Forward(cudaStream_t s, const NbhdAttnGpuParams& g) { return LaunchStencilAttnFwd(s, g); }
  static cudaError_t BackwardDq(cudaStream_t s, const NbhdAttnGpuParams& g) { return LaunchStencilAttnBwdDq(s, g); }
  static cudaError_t BackwardDkv(cudaStream_t s, const NbhdAttnGpuParams& g) { return LaunchStencilAttnBwdDkv(s, g); }
  static ffi::Error Check(const NbhdAttnGpuParams& g) {
    S2ATTN_CHECK(StencilAttnSupported(g), "the stencil targets take " << Alternatives(kStencilDtypes)
                                                                      << " activations with Dk == Dv of "
                                                                      << Alternatives(kStencilHeadDims)
                                                                      << ", 16-byte aligned buffers and at least one "
                                                                         "stencil pair (got Dk = "
                                                                      << g.head_dim_k << ", Dv = " << g.head_dim_v
                                                                      << ", " << g.num_stencil_pairs << " pairs)");
    return ffi::Error::Success();
  }
};

NbhdAttrs MakeAttrs(float scale, int64_t residues, int64_t shift, int64_t nlat_q, int64_t nlon_q, int64_t nlat_k,
                    int64_t nlon_k) {
  return NbhdAttrs{scale, residues, shift, nlat_q, nlon_q, nlat_k, nlon_k};
}

// The walking row pairs of the stencil kernels (query rows for jax_s2attn_stencil_fwd, _bwd_dq and _bwd_dq_delta,
// key rows for _bwd_dkv), checked against the call `g` describes. Leading dims are
// copies (vmap_method="broadcast_all"); the first copy is read.
ffi::Error SetStencilPairs(const I32Buffer& stencil_pairs, bool walk_keys, NbhdAttnGpuParams* g) {
  const auto dims = stencil_pairs.dimensions();
  S2ATTN_CHECK(dims.size() >= 2 && dims.back() == 2, "stencil_pairs must be int32 [..., pairs, 2] (first walking "
                                                     "row, first row of the other grid of each pair; "
                                                     "jax_s2attn.plan), got rank "
                                                         << dims.size());
  const int64_t pairs = dims[dims.size() - 2];
  const int64_t walking_rows = walk_keys ? g->nk_lat : g->nq_lat;
  S2ATTN_CHECK(2 * pairs <= walking_rows && static_cast<int64_t>(stencil_pairs.element_count()) >= 2 * pairs,
               "stencil_pairs holds " << pairs << " row pairs, more than the " << walking_rows
                                      << " local walking rows (or than its copies hold)");
  if (pairs == 0) return ffi::Error::Success();
  S2ATTN_CHECK(g->residues == 1 && g->shift == 1 && g->nlon_q == g->nlon_k,
               "stencil rows need a walk of one residue and shift 1 between grids of equal longitudes (got residues "
                   << g->residues << ", shift " << g->shift << ", nlon_q " << g->nlon_q << ", nlon_k " << g->nlon_k
                   << "); pass no stencil pairs");
  // Both grids non-empty: a stencil block stages rows of the other grid, whichever walks.
  S2ATTN_CHECK(g->nq_lat == g->nlat_q && g->nq_lon == g->nlon_q && g->nk_lat == g->nlat_k && g->nk_lon == g->nlon_k &&
                   g->nlat_q > 0 && g->nlon_q > 0 && g->nlat_k > 0 && g->nlon_k > 0,
               "stencil rows need whole grids (local arrays of the global grids' shape, no padding); pass no "
               "stencil pairs for blocks of a sharded grid");
  g->stencil_pairs = stencil_pairs.typed_data();
  g->num_stencil_pairs = static_cast<int32_t>(pairs);
  return ffi::Error::Success();
}

// out is float32, or on the stencil kernels also the activations' type (`out_narrow`); `stencil_pairs` (stencil
// targets, else null) are the query row pairs of the stencil kernel.
template <typename Kernels>
ffi::Error ForwardOf(cudaStream_t stream, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                     const I32Buffer& window, const I32Buffer& row_order, const I32Buffer& arc_offsets,
                     const I32Buffer& arcs, const F32Buffer& quad_weights, const I32Buffer* stencil_pairs,
                     AnyResult& out, F32Result& lse, const NbhdAttrs& attrs) {
  NbhdParams p;
  S2ATTN_RETURN_IF_ERROR(DecodeParams(q, k, v, attrs, /*walk_keys=*/false, window.element_count(),
                                      row_order.element_count(), arc_offsets.element_count(), arcs.element_count(),
                                      quad_weights.element_count(), &p, Kernels::kForm));
  S2ATTN_RETURN_IF_ERROR(CheckGridArray("out", out->dimensions(), p.batch, p.nq_lat, p.nq_lon, p.heads, p.dv));
  S2ATTN_RETURN_IF_ERROR(CheckGridArray("lse", lse->dimensions(), p.batch, p.nq_lat, p.nq_lon, p.heads, -1));
  ElementType out_type;
  S2ATTN_RETURN_IF_ERROR(
      CheckResultTypes("out", {out->element_type()}, q.element_type(), Kernels::kNarrowResults, &out_type));
  S2ATTN_RETURN_IF_ERROR(CheckGpuLimits(p, /*walk_keys=*/false));
  if (out->element_count() == 0 && lse->element_count() == 0) return ffi::Error::Success();
  NbhdAttnGpuParams g = GpuParams(p, q, k, v, window, row_order, arc_offsets, arcs, quad_weights, Kernels::kForm);
  if (out_type == ElementType::kF32) {
    g.out = static_cast<float*>(out->untyped_data());
  } else {
    g.out_narrow = out->untyped_data();
  }
  g.lse_out = lse->typed_data();
  if (stencil_pairs != nullptr) S2ATTN_RETURN_IF_ERROR(SetStencilPairs(*stencil_pairs, /*walk_keys=*/false, &g));
  S2ATTN_RETURN_IF_ERROR(Kernels::Check(g));
  return LaunchOnStreamDevice(stream, Kernels::kForward, [&] { return Kernels::Forward(stream, g); });
}

// jax_s2attn_nbhd_fwd.
ffi::Error Forward(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, I32Buffer window,
                   I32Buffer row_order, I32Buffer arc_offsets, I32Buffer arcs, F32Buffer quad_weights,
                   ffi::RemainingArgs /*aliased_results*/, AnyResult out, F32Result lse, float scale,
                   int64_t residues, int64_t shift, int64_t nlat_q, int64_t nlon_q, int64_t nlat_k, int64_t nlon_k) {
  return ForwardOf<ArcKernels>(stream, q, k, v, window, row_order, arc_offsets, arcs, quad_weights, nullptr, out, lse,
                               MakeAttrs(scale, residues, shift, nlat_q, nlon_q, nlat_k, nlon_k));
}

// jax_s2attn_stencil_fwd: the arc forward's operands with segment tables and the stencil pairs; out (float32 or q's
// type) and lse of the stencil rows.
ffi::Error StencilForward(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, I32Buffer window,
                          I32Buffer row_order, I32Buffer arc_offsets, I32Buffer arcs, F32Buffer quad_weights,
                          I32Buffer stencil_pairs, ffi::RemainingArgs /*aliased_results*/, AnyResult out,
                          F32Result lse, float scale, int64_t residues, int64_t shift, int64_t nlat_q, int64_t nlon_q,
                          int64_t nlat_k, int64_t nlon_k) {
  return ForwardOf<StencilKernels>(stream, q, k, v, window, row_order, arc_offsets, arcs, quad_weights,
                                   &stencil_pairs, out, lse,
                                   MakeAttrs(scale, residues, shift, nlat_q, nlon_q, nlat_k, nlon_k));
}

// Decodes the operands shared by the backward targets; `per_row` is the operand after lse (delta,
// or dlse where the kernel forms delta), checked under `row_name` and left to the caller.
ffi::Error DecodeBackward(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                          const ffi::AnyBuffer& dout, const F32Buffer& lse, const F32Buffer& per_row,
                          const char* row_name, const I32Buffer& window, const I32Buffer& row_order,
                          const I32Buffer& arc_offsets, const I32Buffer& arcs, const F32Buffer& quad_weights,
                          const NbhdAttrs& attrs, bool walk_keys, TableForm form, NbhdAttnGpuParams* g) {
  NbhdParams p;
  S2ATTN_RETURN_IF_ERROR(DecodeParams(q, k, v, attrs, walk_keys, window.element_count(), row_order.element_count(),
                                      arc_offsets.element_count(), arcs.element_count(),
                                      quad_weights.element_count(), &p, form));
  S2ATTN_RETURN_IF_ERROR(CheckBackwardOperands(q, dout, lse.dimensions(), per_row.dimensions(), p, row_name));
  S2ATTN_RETURN_IF_ERROR(CheckGpuLimits(p, walk_keys));
  *g = GpuParams(p, q, k, v, window, row_order, arc_offsets, arcs, quad_weights, form);
  g->dout = dout.untyped_data();
  g->lse = lse.typed_data();
  return ffi::Error::Success();
}

// Checks the gradient results' element types and tells the kernels which one to write.
ffi::Error SetGradientType(const char* names, std::initializer_list<ffi::DataType> types, ffi::DataType activations,
                           bool narrow_allowed, NbhdAttnGpuParams* g) {
  ElementType gradient_type;
  S2ATTN_RETURN_IF_ERROR(CheckResultTypes(names, types, activations, narrow_allowed, &gradient_type));
  g->gradient_dtype = ToActivationType(gradient_type);
  return ffi::Error::Success();
}

// dq's shape and element type (float32, or the activations' type where `narrow_allowed`), and where the
// kernel writes it.
ffi::Error SetDqResult(AnyResult dq, ffi::DataType activations, bool narrow_allowed, NbhdAttnGpuParams* g) {
  S2ATTN_RETURN_IF_ERROR(
      CheckGridArray("dq", dq->dimensions(), g->batch, g->nq_lat, g->nq_lon, g->heads, g->head_dim_k));
  S2ATTN_RETURN_IF_ERROR(SetGradientType("dq", {dq->element_type()}, activations, narrow_allowed, g));
  g->dq = dq->untyped_data();
  return ffi::Error::Success();
}

// dq of any family; `stencil_pairs` as in ForwardOf.
template <typename Kernels>
ffi::Error BackwardDqOf(cudaStream_t stream, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                        const ffi::AnyBuffer& dout, const F32Buffer& lse, const F32Buffer& delta,
                        const I32Buffer& window, const I32Buffer& row_order, const I32Buffer& arc_offsets,
                        const I32Buffer& arcs, const F32Buffer& quad_weights, const I32Buffer* stencil_pairs,
                        AnyResult& dq, const NbhdAttrs& attrs) {
  NbhdAttnGpuParams g;
  S2ATTN_RETURN_IF_ERROR(DecodeBackward(q, k, v, dout, lse, delta, "delta", window, row_order, arc_offsets, arcs,
                                        quad_weights, attrs, /*walk_keys=*/false, Kernels::kForm, &g));
  g.delta = delta.typed_data();
  S2ATTN_RETURN_IF_ERROR(SetDqResult(dq, q.element_type(), Kernels::kNarrowResults, &g));
  if (stencil_pairs != nullptr) S2ATTN_RETURN_IF_ERROR(SetStencilPairs(*stencil_pairs, /*walk_keys=*/false, &g));
  if (dq->element_count() == 0) return ffi::Error::Success();
  S2ATTN_RETURN_IF_ERROR(Kernels::Check(g));
  return LaunchOnStreamDevice(stream, Kernels::kBackwardDq, [&] { return Kernels::BackwardDq(stream, g); });
}

// jax_s2attn_nbhd_bwd_dq.
ffi::Error BackwardDq(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer dout,
                      F32Buffer lse, F32Buffer delta, I32Buffer window, I32Buffer row_order, I32Buffer arc_offsets,
                      I32Buffer arcs, F32Buffer quad_weights, ffi::RemainingArgs /*aliased_results*/, AnyResult dq,
                      float scale, int64_t residues, int64_t shift, int64_t nlat_q, int64_t nlon_q, int64_t nlat_k,
                      int64_t nlon_k) {
  return BackwardDqOf<ArcKernels>(stream, q, k, v, dout, lse, delta, window, row_order, arc_offsets, arcs,
                                  quad_weights, nullptr, dq,
                                  MakeAttrs(scale, residues, shift, nlat_q, nlon_q, nlat_k, nlon_k));
}

// jax_s2attn_stencil_bwd_dq: the arc dq's operands with segment tables and the stencil pairs; dq of the stencil rows.
ffi::Error StencilBackwardDq(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                             ffi::AnyBuffer dout, F32Buffer lse, F32Buffer delta, I32Buffer window,
                             I32Buffer row_order, I32Buffer arc_offsets, I32Buffer arcs, F32Buffer quad_weights,
                             I32Buffer stencil_pairs, ffi::RemainingArgs /*aliased_results*/, AnyResult dq,
                             float scale, int64_t residues, int64_t shift, int64_t nlat_q, int64_t nlon_q,
                             int64_t nlat_k, int64_t nlon_k) {
  return BackwardDqOf<StencilKernels>(stream, q, k, v, dout, lse, delta, window, row_order, arc_offsets, arcs,
                                      quad_weights, &stencil_pairs, dq,
                                      MakeAttrs(scale, residues, shift, nlat_q, nlon_q, nlat_k, nlon_k));
}

// dk and dv of either family; `stencil_pairs` (stencil targets, else null) are the key row pairs of the
// stencil kernel.
template <typename Kernels>
ffi::Error BackwardDkvOf(cudaStream_t stream, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                         const ffi::AnyBuffer& v, const ffi::AnyBuffer& dout, const F32Buffer& lse,
                         const F32Buffer& delta, const I32Buffer& window, const I32Buffer& row_order,
                         const I32Buffer& arc_offsets, const I32Buffer& arcs, const F32Buffer& quad_weights,
                         const I32Buffer* stencil_pairs, AnyResult& dk, AnyResult& dv, const NbhdAttrs& attrs) {
  NbhdAttnGpuParams g;
  S2ATTN_RETURN_IF_ERROR(DecodeBackward(q, k, v, dout, lse, delta, "delta", window, row_order, arc_offsets, arcs,
                                        quad_weights, attrs, /*walk_keys=*/true, Kernels::kForm, &g));
  g.delta = delta.typed_data();
  S2ATTN_RETURN_IF_ERROR(
      CheckGridArray("dk", dk->dimensions(), g.batch, g.nk_lat, g.nk_lon, g.heads, g.head_dim_k));
  S2ATTN_RETURN_IF_ERROR(
      CheckGridArray("dv", dv->dimensions(), g.batch, g.nk_lat, g.nk_lon, g.heads, g.head_dim_v));
  S2ATTN_RETURN_IF_ERROR(SetGradientType("dk and dv", {dk->element_type(), dv->element_type()}, q.element_type(),
                                         Kernels::kNarrowResults, &g));
  if (stencil_pairs != nullptr) S2ATTN_RETURN_IF_ERROR(SetStencilPairs(*stencil_pairs, /*walk_keys=*/true, &g));
  if (dk->element_count() == 0 && dv->element_count() == 0) return ffi::Error::Success();
  g.dk = dk->untyped_data();
  g.dv = dv->untyped_data();
  S2ATTN_RETURN_IF_ERROR(Kernels::Check(g));
  return LaunchOnStreamDevice(stream, Kernels::kBackwardDkv, [&] { return Kernels::BackwardDkv(stream, g); });
}

// jax_s2attn_nbhd_bwd_dkv.
ffi::Error BackwardDkv(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer dout,
                       F32Buffer lse, F32Buffer delta, I32Buffer window, I32Buffer row_order, I32Buffer arc_offsets,
                       I32Buffer arcs, F32Buffer quad_weights, ffi::RemainingArgs /*aliased_results*/, AnyResult dk,
                       AnyResult dv, float scale, int64_t residues, int64_t shift, int64_t nlat_q, int64_t nlon_q,
                       int64_t nlat_k, int64_t nlon_k) {
  return BackwardDkvOf<ArcKernels>(stream, q, k, v, dout, lse, delta, window, row_order, arc_offsets, arcs,
                                   quad_weights, nullptr, dk, dv,
                                   MakeAttrs(scale, residues, shift, nlat_q, nlon_q, nlat_k, nlon_k));
}

// jax_s2attn_stencil_bwd_dkv: the arc dk/dv's operands with segment tables and the stencil pairs; dk and dv of the
// stencil key rows.
ffi::Error StencilBackwardDkv(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                              ffi::AnyBuffer dout, F32Buffer lse, F32Buffer delta, I32Buffer window,
                              I32Buffer row_order, I32Buffer arc_offsets, I32Buffer arcs, F32Buffer quad_weights,
                              I32Buffer stencil_pairs, ffi::RemainingArgs /*aliased_results*/, AnyResult dk,
                              AnyResult dv, float scale, int64_t residues, int64_t shift, int64_t nlat_q,
                              int64_t nlon_q, int64_t nlat_k, int64_t nlon_k) {
  return BackwardDkvOf<StencilKernels>(stream, q, k, v, dout, lse, delta, window, row_order, arc_offsets, arcs,
                                       quad_weights, &stencil_pairs, dk, dv,
                                       MakeAttrs(scale, residues, shift, nlat_q, nlon_q, nlat_k, nlon_k));
}

// jax_s2attn_stencil_bwd_dq_delta: dq of the stencil pairs' rows, forming delta = sum_j p_j (dout . v_j) / sum_j
// p_j - dlse from the walk's own probabilities (no forward out) and returning it for the dk/dv target (the other
// rows of both are aliased to the scheduled dq_delta's), so that the op needs no delta target between the passes.
ffi::Error StencilBackwardDqDelta(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                  ffi::AnyBuffer dout, F32Buffer lse, F32Buffer dlse, I32Buffer window,
                                  I32Buffer row_order, I32Buffer arc_offsets, I32Buffer arcs, F32Buffer quad_weights,
                                  I32Buffer stencil_pairs, ffi::RemainingArgs /*aliased_results*/, AnyResult dq,
                                  F32Result delta, float scale, int64_t residues, int64_t shift, int64_t nlat_q,
                                  int64_t nlon_q, int64_t nlat_k, int64_t nlon_k) {
  NbhdAttnGpuParams g;
  S2ATTN_RETURN_IF_ERROR(DecodeBackward(q, k, v, dout, lse, dlse, "dlse", window, row_order, arc_offsets, arcs,
                                        quad_weights, MakeAttrs(scale, residues, shift, nlat_q, nlon_q, nlat_k, nlon_k),
                                        /*walk_keys=*/false, StencilKernels::kForm, &g));
  S2ATTN_RETURN_IF_ERROR(SetDqResult(dq, q.element_type(), /*narrow_allowed=*/true, &g));
  S2ATTN_RETURN_IF_ERROR(CheckGridArray("delta", delta->dimensions(), g.batch, g.nq_lat, g.nq_lon, g.heads, -1));
  S2ATTN_RETURN_IF_ERROR(SetStencilPairs(stencil_pairs, /*walk_keys=*/false, &g));
  if (delta->element_count() == 0) return ffi::Error::Success();  // no query rows: dq is empty too
  g.dlse = dlse.typed_data();
  g.delta_out = delta->typed_data();
  S2ATTN_RETURN_IF_ERROR(StencilKernels::Check(g));
  return LaunchOnStreamDevice(stream, StencilKernels::kBackwardDqDelta,
                              [&] { return StencilKernels::BackwardDq(stream, g); });
}

ffi::Error Delta(cudaStream_t stream, ffi::AnyBuffer dout, F32Buffer out, F32Buffer dlse,
                 ffi::RemainingArgs /*aliased_results*/, F32Result delta) {
  DeltaParams p;
  S2ATTN_RETURN_IF_ERROR(DecodeDelta(dout, out.dimensions(), dlse.dimensions(), delta->dimensions(), &p));
  if (p.rows == 0) return ffi::Error::Success();
  DeltaGpuParams g;
  g.dtype = ToActivationType(p.dtype);
  g.dout = dout.untyped_data();
  g.out = out.typed_data();
  g.dlse = dlse.typed_data();
  g.delta = delta->typed_data();
  g.rows = p.rows;
  g.dv = p.dv;
  return LaunchOnStreamDevice(stream, kTargetDelta, [&] { return LaunchDelta(stream, g); });
}

// ------------------------------------------------------------------ ring targets

// A ring call's params: sizes, the walk's tables (device memory: the kernels clamp every index read from them)
// and the launch extent, after checking what the host sees.
ffi::Error RingGpuParams(const RingParams& p, const RingAttrs& attrs, bool walk_keys, const ffi::AnyBuffer& q,
                         const ffi::AnyBuffer& k, const ffi::AnyBuffer& v, const I32Buffer& walk_rings,
                         const I32Buffer& ring_order, const I32Buffer& offsets, const I32Buffer& arcs,
                         const F32Buffer& quad_weights, NbhdAttnGpuParams* g) {
  const int64_t walk_points = walk_keys ? p.nk : p.nq, visited_points = walk_keys ? p.nq : p.nk;
  const int64_t weighted_rings = walk_keys ? attrs.walk_rings : attrs.visited_rings;
  S2ATTN_RETURN_IF_ERROR(CheckRingTableSizes(attrs, walk_points, visited_points, walk_rings.element_count(),
                                             ring_order.element_count(), offsets.element_count(),
                                             arcs.element_count(), quad_weights.element_count(), weighted_rings));
  S2ATTN_RETURN_IF_ERROR(CheckTeamLimits(p.batch, p.heads, p.dk, p.dv));
  g->dtype = ToActivationType(p.dtype);
  g->q = q.untyped_data();
  g->k = k.untyped_data();
  g->v = v.untyped_data();
  g->row_order = ring_order.typed_data();
  g->arc_offsets = offsets.typed_data();
  g->arcs = arcs.typed_data();
  g->num_arcs = static_cast<int64_t>(arcs.element_count()) / kRingArcFields;
  g->quad_weights = quad_weights.typed_data();
  g->walk_rings = walk_rings.typed_data();
  g->num_walk_rings = static_cast<int32_t>(attrs.walk_rings);
  g->max_ring_points = static_cast<int32_t>(attrs.max_ring_points);
  g->num_patterns = attrs.patterns;
  g->num_weights = weighted_rings;
  g->walk_points = static_cast<int32_t>(walk_points);
  g->visited_points = static_cast<int32_t>(visited_points);
  g->batch = p.batch;
  g->heads = p.heads;
  g->head_dim_k = p.dk;
  g->head_dim_v = p.dv;
  g->scale = p.scale;
  return ffi::Error::Success();
}

// jax_s2attn_ring_fwd.
ffi::Error RingForward(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       I32Buffer walk_rings, I32Buffer ring_order, I32Buffer pattern_offsets, I32Buffer pattern_arcs,
                       F32Buffer quad_weights, ffi::RemainingArgs /*aliased_results*/, AnyResult out, F32Result lse,
                       float scale, int64_t walk_ring_count, int64_t visited_ring_count, int64_t pattern_count,
                       int64_t max_ring_points) {
  const RingAttrs attrs{scale, walk_ring_count, visited_ring_count, pattern_count, max_ring_points};
  RingParams p;
  S2ATTN_RETURN_IF_ERROR(DecodeRingParams(q, k, v, scale, &p));
  S2ATTN_RETURN_IF_ERROR(CheckRingForwardResults(q, out, lse->dimensions(), p));
  NbhdAttnGpuParams g;
  S2ATTN_RETURN_IF_ERROR(RingGpuParams(p, attrs, /*walk_keys=*/false, q, k, v, walk_rings, ring_order,
                                       pattern_offsets, pattern_arcs, quad_weights, &g));
  if (out->element_count() == 0 && lse->element_count() == 0) return ffi::Error::Success();
  g.out = static_cast<float*>(out->untyped_data());
  g.lse_out = lse->typed_data();
  return LaunchOnStreamDevice(stream, kTargetRingForward, [&] { return LaunchRingAttnFwd(stream, g); });
}

// The operands both ring backward targets share, checked, in `g`.
ffi::Error RingBackwardParams(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                              const ffi::AnyBuffer& dout, const F32Buffer& lse, const F32Buffer& delta,
                              const I32Buffer& walk_rings, const I32Buffer& ring_order, const I32Buffer& offsets,
                              const I32Buffer& arcs, const F32Buffer& quad_weights, const RingAttrs& attrs,
                              bool walk_keys, RingParams* p, NbhdAttnGpuParams* g) {
  S2ATTN_RETURN_IF_ERROR(DecodeRingParams(q, k, v, attrs.scale, p));
  S2ATTN_RETURN_IF_ERROR(CheckRingBackwardOperands(q, dout, lse.dimensions(), delta.dimensions(), *p));
  S2ATTN_RETURN_IF_ERROR(
      RingGpuParams(*p, attrs, walk_keys, q, k, v, walk_rings, ring_order, offsets, arcs, quad_weights, g));
  g->dout = dout.untyped_data();
  g->lse = lse.typed_data();
  g->delta = delta.typed_data();
  return ffi::Error::Success();
}

// jax_s2attn_ring_bwd_dq.
ffi::Error RingBackwardDq(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                          ffi::AnyBuffer dout, F32Buffer lse, F32Buffer delta, I32Buffer walk_rings,
                          I32Buffer ring_order, I32Buffer pattern_offsets, I32Buffer pattern_arcs,
                          F32Buffer quad_weights, ffi::RemainingArgs /*aliased_results*/, AnyResult dq, float scale,
                          int64_t walk_ring_count, int64_t visited_ring_count, int64_t pattern_count,
                          int64_t max_ring_points) {
  RingParams p;
  NbhdAttnGpuParams g;
  S2ATTN_RETURN_IF_ERROR(RingBackwardParams(
      q, k, v, dout, lse, delta, walk_rings, ring_order, pattern_offsets, pattern_arcs, quad_weights,
      {scale, walk_ring_count, visited_ring_count, pattern_count, max_ring_points}, /*walk_keys=*/false, &p, &g));
  S2ATTN_RETURN_IF_ERROR(CheckRingDqResult(q, dq, p));
  if (dq->element_count() == 0) return ffi::Error::Success();
  g.dq = dq->untyped_data();
  return LaunchOnStreamDevice(stream, kTargetRingBackwardDq, [&] { return LaunchRingAttnBwdDq(stream, g); });
}

// jax_s2attn_ring_bwd_dkv.
ffi::Error RingBackwardDkv(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::AnyBuffer dout, F32Buffer lse, F32Buffer delta, I32Buffer walk_rings,
                           I32Buffer ring_order, I32Buffer pattern_offsets, I32Buffer pattern_arcs,
                           F32Buffer quad_weights, ffi::RemainingArgs /*aliased_results*/, AnyResult dk,
                           AnyResult dv, float scale, int64_t walk_ring_count, int64_t visited_ring_count,
                           int64_t pattern_count, int64_t max_ring_points) {
  RingParams p;
  NbhdAttnGpuParams g;
  S2ATTN_RETURN_IF_ERROR(RingBackwardParams(
      q, k, v, dout, lse, delta, walk_rings, ring_order, pattern_offsets, pattern_arcs, quad_weights,
      {scale, walk_ring_count, visited_ring_count, pattern_count, max_ring_points}, /*walk_keys=*/true, &p, &g));
  S2ATTN_RETURN_IF_ERROR(CheckRingDkvResults(q, dk, dv, p));
  if (dk->element_count() == 0 && dv->element_count() == 0) return ffi::Error::Success();
  g.dk = dk->untyped_data();
  g.dv = dv->untyped_data();
  return LaunchOnStreamDevice(stream, kTargetRingBackwardDkv, [&] { return LaunchRingAttnBwdDkv(stream, g); });
}

}  // namespace
}  // namespace s2attn

// STENCIL_PAIRS: the targets take the stencil pairs.
#define S2ATTN_DEFINE_CUDA_HANDLERS(PREFIX, FORWARD, BACKWARD_DQ, BACKWARD_DKV, STENCIL_PAIRS)                       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                                                     \
      PREFIX##ForwardCuda, FORWARD,                                                                                  \
      (s2attn::BindForward<STENCIL_PAIRS>(xla::ffi::Ffi::Bind().Ctx<s2attn::CudaStream>())));                        \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                                                     \
      PREFIX##BackwardDqCuda, BACKWARD_DQ,                                                                           \
      s2attn::BindBackwardDq<STENCIL_PAIRS>(xla::ffi::Ffi::Bind().Ctx<s2attn::CudaStream>()));                       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                                                     \
      PREFIX##BackwardDkvCuda, BACKWARD_DKV,                                                                         \
      s2attn::BindBackwardDkv<STENCIL_PAIRS>(xla::ffi::Ffi::Bind().Ctx<s2attn::CudaStream>()))

S2ATTN_DEFINE_CUDA_HANDLERS(S2AttnNbhd, s2attn::Forward, s2attn::BackwardDq, s2attn::BackwardDkv, false);
S2ATTN_DEFINE_CUDA_HANDLERS(S2AttnStencil, s2attn::StencilForward, s2attn::StencilBackwardDq,
                            s2attn::StencilBackwardDkv, true);
XLA_FFI_DEFINE_HANDLER_SYMBOL(S2AttnStencilBackwardDqDeltaCuda, s2attn::StencilBackwardDqDelta,
                              s2attn::BindBackwardDqDelta(xla::ffi::Ffi::Bind().Ctx<s2attn::CudaStream>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(S2AttnRingForwardCuda, s2attn::RingForward,
                              s2attn::BindRingForward(xla::ffi::Ffi::Bind().Ctx<s2attn::CudaStream>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(S2AttnRingBackwardDqCuda, s2attn::RingBackwardDq,
                              s2attn::BindRingBackwardDq(xla::ffi::Ffi::Bind().Ctx<s2attn::CudaStream>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(S2AttnRingBackwardDkvCuda, s2attn::RingBackwardDkv,
                              s2attn::BindRingBackwardDkv(xla::ffi::Ffi::Bind().Ctx<s2attn::CudaStream>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(S2AttnDeltaCuda, s2attn::Delta,
                              s2attn::BindDelta(xla::ffi::Ffi::Bind().Ctx<s2attn::CudaStream>()));
