// Stencil dk/dv: dk and dv of the plan's backward stencil rows (key rows; stencil_attn_device.cuh describes
// the walk), staging the rows of queries that see them with their lse and delta: p = w exp(s - lse),
// dv = sum p dout, dk = scale sum p (dout.v - delta) q, as the scheduled dk/dv sums them but float32 throughout.
#include "gpu/stencil_attn_device.cuh"

namespace s2attn {
namespace gpu {
namespace stencil {
namespace {

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 2) StencilDkvKernel(const NbhdAttnGpuParams p) {
  using S = Shape<D>;
  Staged<T, D, true>& s = *reinterpret_cast<Staged<T, D, true>*>(DynamicShared());
  const WalkPoint at = StartBlock<T, D, true>(p, s);
  const int64_t row_at = at.point * D + at.lane * kLaneChannels;
  float k[kLaneChannels], v[kLaneChannels];
  LoadLane<T>(k, static_cast<const T*>(p.k) + row_at, p.scale * kLog2e);
  LoadLane<T>(v, static_cast<const T*>(p.v) + row_at, 1.f);
  KeepWidened(k);
  KeepWidened(v);
  const float log2_weight = log2f(__ldg(p.quad_weights + at.row));  // the key's own row
  MbarrierWait(&s.landed, 0);

  float dk[kLaneChannels] = {}, dv[kLaneChannels] = {};
#pragma unroll 1
  for (int i = 0; i < kMaxOtherRows; ++i) {
    const StagedArc arc = ArcOfRow(at, i);
    const int32_t column = at.column0 + arc.column;
    const T* q_row = &s.a[arc.row][column][at.lane * kLaneChannels];
    const T* dout_row = &s.b[arc.row][column][at.lane * kLaneChannels];
    const float* lse_row = &s.lse[arc.row][column];
    const float* delta_row = &s.delta[arc.row][column];
    for (int32_t j = 0; j < arc.len; ++j) {
      // A query without neighbours (lse = -inf) never has this key as one; its p would be exp2(-inf) = 0.
      const float lse2 = Log2Lse(lse_row[j]);
      float x[kLaneChannels];
      LoadLane<T>(x, q_row + j * S::kStride, 1.f);
      const float probability = Exp2(LaneDot<S::kLanes>(k, x) + log2_weight - lse2);
      float dout[kLaneChannels];
      LoadLane<T>(dout, dout_row + j * S::kStride, 1.f);
      const float ds = probability * (LaneDot<S::kLanes>(v, dout) - delta_row[j]);
#pragma unroll
      for (int c = 0; c < kLaneChannels; ++c) {
        dv[c] = fmaf(probability, dout[c], dv[c]);
        dk[c] = fmaf(ds, x[c], dk[c]);
      }
    }
  }
  if (!at.real) return;
#pragma unroll
  for (int c = 0; c < kLaneChannels; ++c) dk[c] *= p.scale;
  const bool narrow = p.gradient_dtype != ActivationType::kF32;
  StoreResult<T>(p.dk, narrow, row_at, dk);
  StoreResult<T>(p.dv, narrow, row_at, dv);
}

}  // namespace

template <typename T, int D>
cudaError_t LaunchStencilDkv(cudaStream_t stream, const NbhdAttnGpuParams& p) {
  return LaunchPairs<T, D, /*kKeyWalk=*/true>(StencilDkvKernel<T, D>, stream, p);
}

S2ATTN_INSTANTIATE_STENCIL_LAUNCHER(LaunchStencilDkv);

}  // namespace stencil
}  // namespace gpu

cudaError_t LaunchStencilAttnBwdDkv(cudaStream_t stream, const NbhdAttnGpuParams& p) {
  if (p.dk == nullptr || p.dv == nullptr) return cudaErrorInvalidValue;
  return gpu::stencil::DispatchStencil</*kKeyWalk=*/true>(p, [&](auto variant) {
    using V = decltype(variant);
    return gpu::stencil::LaunchStencilDkv<typename V::Element, V::kDim>(stream, p);
  });
}

}  // namespace s2attn
