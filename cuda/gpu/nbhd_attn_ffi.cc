// CUDA handlers of the three neighbourhood-attention targets (contract: cuda/README.md).
//
// A handler decodes and validates everything visible on the host (shapes, dtypes, attributes,
// table sizes), fills one NbhdAttnGpuParams and launches on XLA's stream. Table *contents*
// (window, row order, arcs) are device memory: the kernels read them and clamp every index
// they derive from them. Handlers never synchronise and allocate nothing.
#include "gpu/nbhd_attn_ffi.h"

#include <cuda_runtime_api.h>

#include <climits>
#include <cstdint>
#include <string>

#include "common/ffi_check.h"
#include "common/nbhd_binding.h"
#include "common/nbhd_params.h"
#include "gpu/nbhd_attn_kernels.h"

namespace s2attn {
namespace {

using F32Result = ffi::ResultBuffer<ffi::F32>;
using CudaStream = ffi::PlatformStream<cudaStream_t>;

ActivationType ToActivationType(ElementType type) {
  switch (type) {
    case ElementType::kF32: return ActivationType::kF32;
    case ElementType::kBF16: return ActivationType::kBF16;
    case ElementType::kF16: return ActivationType::kF16;
  }
  return ActivationType::kF32;  // unreachable: DecodeParams accepts only these three
}

// Limits of the kernels' index arithmetic (32-bit grid coordinates in arc_walk.h, 32-bit
// batch x head block indices, the shared-memory bound of the general path), checked on the
// host where they can be reported.
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
  S2ATTN_CHECK(p.batch * p.heads <= INT32_MAX,
               "batch x heads = " << p.batch * p.heads << " exceeds the CUDA kernels' limit of 2^31 - 1");
  S2ATTN_CHECK(NbhdAttnHeadDimsSupported(p.dk, p.dv),
               "head dims Dk = " << p.dk << ", Dv = " << p.dv
                                 << " are too large for the CUDA kernels (Dk + Dv must be at most 6144)");
  return ffi::Error::Success();
}

// Everything but the backward inputs and the results.
NbhdAttnGpuParams GpuParams(const NbhdParams& p, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                            const ffi::AnyBuffer& v, const I32Buffer& window, const I32Buffer& row_order,
                            const I32Buffer& arc_offsets, const I32Buffer& arcs, const F32Buffer& quad_weights) {
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
  g.num_arcs = static_cast<int64_t>(arcs.element_count()) / 3;
  g.scale = p.scale;
  return g;
}

ffi::Error LaunchStatus(cudaError_t status, const char* target) {
  if (status == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(target) + ": CUDA kernel launch failed: " + cudaGetErrorName(status) +
                              " (" + cudaGetErrorString(status) + ")");
}

NbhdAttrs MakeAttrs(float scale, int64_t residues, int64_t shift, int64_t nlat_q, int64_t nlon_q, int64_t nlat_k,
                    int64_t nlon_k) {
  return NbhdAttrs{scale, residues, shift, nlat_q, nlon_q, nlat_k, nlon_k};
}

ffi::Error Forward(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, I32Buffer window,
                   I32Buffer row_order, I32Buffer arc_offsets, I32Buffer arcs, F32Buffer quad_weights,
                   ffi::RemainingArgs /*aliased_results*/, F32Result out, F32Result lse, float scale,
                   int64_t residues, int64_t shift, int64_t nlat_q, int64_t nlon_q, int64_t nlat_k, int64_t nlon_k) {
  NbhdParams p;
  S2ATTN_RETURN_IF_ERROR(DecodeParams(q, k, v, MakeAttrs(scale, residues, shift, nlat_q, nlon_q, nlat_k, nlon_k),
                                      /*walk_keys=*/false, window.element_count(), row_order.element_count(),
                                      arc_offsets.element_count(), arcs.element_count(),
                                      quad_weights.element_count(), &p));
  S2ATTN_RETURN_IF_ERROR(CheckGridArray("out", out->dimensions(), p.batch, p.nq_lat, p.nq_lon, p.heads, p.dv));
  S2ATTN_RETURN_IF_ERROR(CheckGridArray("lse", lse->dimensions(), p.batch, p.nq_lat, p.nq_lon, p.heads, -1));
  S2ATTN_RETURN_IF_ERROR(CheckGpuLimits(p, /*walk_keys=*/false));
  if (out->element_count() == 0 && lse->element_count() == 0) return ffi::Error::Success();
  NbhdAttnGpuParams g = GpuParams(p, q, k, v, window, row_order, arc_offsets, arcs, quad_weights);
  g.out = out->typed_data();
  g.lse_out = lse->typed_data();
  return LaunchStatus(LaunchNbhdAttnFwd(stream, g), kTargetForward);
}

// Decodes the operands shared by both backward targets.
ffi::Error DecodeBackward(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                          const ffi::AnyBuffer& dout, const F32Buffer& lse, const F32Buffer& delta,
                          const I32Buffer& window, const I32Buffer& row_order, const I32Buffer& arc_offsets,
                          const I32Buffer& arcs, const F32Buffer& quad_weights, const NbhdAttrs& attrs, bool walk_keys,
                          NbhdAttnGpuParams* g) {
  NbhdParams p;
  S2ATTN_RETURN_IF_ERROR(DecodeParams(q, k, v, attrs, walk_keys, window.element_count(), row_order.element_count(),
                                      arc_offsets.element_count(), arcs.element_count(),
                                      quad_weights.element_count(), &p));
  S2ATTN_RETURN_IF_ERROR(CheckBackwardOperands(q, dout, lse.dimensions(), delta.dimensions(), p));
  S2ATTN_RETURN_IF_ERROR(CheckGpuLimits(p, walk_keys));
  *g = GpuParams(p, q, k, v, window, row_order, arc_offsets, arcs, quad_weights);
  g->dout = dout.untyped_data();
  g->lse = lse.typed_data();
  g->delta = delta.typed_data();
  return ffi::Error::Success();
}

ffi::Error BackwardDq(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer dout,
                      F32Buffer lse, F32Buffer delta, I32Buffer window, I32Buffer row_order, I32Buffer arc_offsets,
                      I32Buffer arcs, F32Buffer quad_weights, ffi::RemainingArgs /*aliased_results*/, F32Result dq,
                      float scale, int64_t residues, int64_t shift, int64_t nlat_q, int64_t nlon_q, int64_t nlat_k,
                      int64_t nlon_k) {
  NbhdAttnGpuParams g;
  S2ATTN_RETURN_IF_ERROR(DecodeBackward(q, k, v, dout, lse, delta, window, row_order, arc_offsets, arcs, quad_weights,
                                        MakeAttrs(scale, residues, shift, nlat_q, nlon_q, nlat_k, nlon_k),
                                        /*walk_keys=*/false, &g));
  S2ATTN_RETURN_IF_ERROR(
      CheckGridArray("dq", dq->dimensions(), g.batch, g.nq_lat, g.nq_lon, g.heads, g.head_dim_k));
  if (dq->element_count() == 0) return ffi::Error::Success();
  g.dq = dq->typed_data();
  return LaunchStatus(LaunchNbhdAttnBwdDq(stream, g), kTargetBackwardDq);
}

ffi::Error BackwardDkv(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       ffi::AnyBuffer dout, F32Buffer lse, F32Buffer delta, I32Buffer window, I32Buffer row_order,
                       I32Buffer arc_offsets, I32Buffer arcs, F32Buffer quad_weights,
                       ffi::RemainingArgs /*aliased_results*/, F32Result dk, F32Result dv, float scale,
                       int64_t residues, int64_t shift, int64_t nlat_q, int64_t nlon_q, int64_t nlat_k,
                       int64_t nlon_k) {
  NbhdAttnGpuParams g;
  S2ATTN_RETURN_IF_ERROR(DecodeBackward(q, k, v, dout, lse, delta, window, row_order, arc_offsets, arcs, quad_weights,
                                        MakeAttrs(scale, residues, shift, nlat_q, nlon_q, nlat_k, nlon_k),
                                        /*walk_keys=*/true, &g));
  S2ATTN_RETURN_IF_ERROR(
      CheckGridArray("dk", dk->dimensions(), g.batch, g.nk_lat, g.nk_lon, g.heads, g.head_dim_k));
  S2ATTN_RETURN_IF_ERROR(
      CheckGridArray("dv", dv->dimensions(), g.batch, g.nk_lat, g.nk_lon, g.heads, g.head_dim_v));
  if (dk->element_count() == 0 && dv->element_count() == 0) return ffi::Error::Success();
  g.dk = dk->typed_data();
  g.dv = dv->typed_data();
  return LaunchStatus(LaunchNbhdAttnBwdDkv(stream, g), kTargetBackwardDkv);
}

}  // namespace
}  // namespace s2attn

XLA_FFI_DEFINE_HANDLER_SYMBOL(S2AttnNbhdForwardCuda, s2attn::Forward,
                              s2attn::BindForward(xla::ffi::Ffi::Bind().Ctx<s2attn::CudaStream>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(S2AttnNbhdBackwardDqCuda, s2attn::BackwardDq,
                              s2attn::BindBackwardDq(xla::ffi::Ffi::Bind().Ctx<s2attn::CudaStream>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(S2AttnNbhdBackwardDkvCuda, s2attn::BackwardDkv,
                              s2attn::BindBackwardDkv(xla::ffi::Ffi::Bind().Ctx<s2attn::CudaStream>()));
