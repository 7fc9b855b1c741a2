// Stencil dq: dq of the plan's stencil rows (stencil_attn_device.cuh describes the walk), walking the same
// staged K and V as the forward: p = w exp(s - lse), dq = scale sum p (dout.v - delta) k, with delta given or
// formed from the forward's float32 out at entry (and then written for dk/dv), as the scheduled dq does.
#include "gpu/stencil_attn_device.cuh"

namespace s2attn {
namespace gpu {
namespace stencil {
namespace {

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 2) StencilDqKernel(const NbhdAttnGpuParams p) {
  using S = Shape<D>;
  Staged<T, D>& s = *reinterpret_cast<Staged<T, D>*>(DynamicShared());
  const WalkPoint at = StartBlock<T, D, false>(p, s);
  const int64_t row_at = at.point * D + at.lane * kLaneChannels;
  float q[kLaneChannels], dout[kLaneChannels];
  LoadLane<T>(q, static_cast<const T*>(p.q) + row_at, p.scale * kLog2e);
  LoadLane<T>(dout, static_cast<const T*>(p.dout) + row_at, 1.f);
  // A query without neighbours (lse = -inf): p = exp2(x - inf) = 0.
  const float lse2 = Log2Lse(__ldg(p.lse + at.point));
  float delta;
  if (p.forward_out != nullptr) {
    // delta = sum(dout * out) - dlse: each lane its channels in order, then the lanes
    float sum = 0.f;
#pragma unroll
    for (int c = 0; c < kLaneChannels; c += 4) {
      const float4 o = __ldg(reinterpret_cast<const float4*>(p.forward_out + row_at + c));
      sum = fmaf(dout[c], o.x, sum);
      sum = fmaf(dout[c + 1], o.y, sum);
      sum = fmaf(dout[c + 2], o.z, sum);
      sum = fmaf(dout[c + 3], o.w, sum);
    }
    delta = LaneSum<S::kLanes>(sum) - __ldg(p.dlse + at.point);
    if (at.lane == 0 && at.real) p.delta_out[at.point] = delta;
  } else {
    delta = __ldg(p.delta + at.point);
  }
  MbarrierWait(&s.landed, 0);

  float acc[kLaneChannels] = {};
#pragma unroll 1
  for (int i = 0; i < kMaxOtherRows; ++i) {
    const StagedArc arc = ArcOfRow(at, i);
    const T* k_row = &s.a[arc.row][at.column0 + arc.column][at.lane * kLaneChannels];
    const T* v_row = &s.b[arc.row][at.column0 + arc.column][at.lane * kLaneChannels];
    for (int32_t j = 0; j < arc.len; ++j) {
      float k[kLaneChannels], v[kLaneChannels];
      LoadLane<T>(k, k_row + j * S::kStride, 1.f);
      const float probability = Exp2(LaneDot<S::kLanes>(q, k) + arc.log2_weight - lse2);
      LoadLane<T>(v, v_row + j * S::kStride, 1.f);
      const float ds = probability * (LaneDot<S::kLanes>(dout, v) - delta);
#pragma unroll
      for (int c = 0; c < kLaneChannels; ++c) acc[c] = fmaf(ds, k[c], acc[c]);
    }
  }
  if (!at.real) return;
#pragma unroll
  for (int c = 0; c < kLaneChannels; ++c) acc[c] *= p.scale;
  StoreResult<T>(p.dq, p.gradient_dtype != ActivationType::kF32, row_at, acc);
}

}  // namespace

template <typename T, int D>
cudaError_t LaunchStencilDq(cudaStream_t stream, const NbhdAttnGpuParams& p) {
  return LaunchPairs<T, D>(StencilDqKernel<T, D>, stream, p);
}

S2ATTN_INSTANTIATE_STENCIL_LAUNCHER(LaunchStencilDq);

}  // namespace stencil
}  // namespace gpu

cudaError_t LaunchStencilAttnBwdDq(cudaStream_t stream, const NbhdAttnGpuParams& p) {
  // delta given, or formed from the forward's out and dlse and written to delta_out.
  const bool forming = p.forward_out != nullptr;
  if (p.dq == nullptr || (forming ? p.dlse == nullptr || p.delta_out == nullptr : p.delta == nullptr)) {
    return cudaErrorInvalidValue;
  }
  return gpu::stencil::DispatchStencil(p, [&](auto variant) {
    using V = decltype(variant);
    return gpu::stencil::LaunchStencilDq<typename V::Element, V::kDim>(stream, p);
  });
}

}  // namespace s2attn
