// Stencil dq: dq of the plan's stencil rows (stencil_attn_device.cuh describes the walk), walking the same
// staged K and V as the forward: p = w exp(s - lse), dq = scale sum p (dout.v - delta) k, with delta given, or
// formed from the walk's own probabilities (kFormsDelta) and then written for dk/dv.
#include "gpu/stencil_attn_device.cuh"

namespace s2attn {
namespace gpu {
namespace stencil {
namespace {

// kFormsDelta: delta = sum p (dout.v) / sum p - dlse from the walk's own p (the forward's, float32, never rounded),
// so the kernel needs no forward out, and dq = scale (sum p (dout.v) k - delta sum p k), the sums accumulated in
// one walk in a fixed order. Divided by the p's own sum, as a delta from an out divided by its own sums is, delta
// stays consistent with those p where lse carries float32 round-off: a key channel common to every key then
// cancels from dq to float32 round-off (sum p (dout.v) over sum p against delta, both times sum p k).
template <typename T, int D, bool kFormsDelta>
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
  // delta given, or dlse to form it with: read before the walk, so that no load waits after it.
  const float given_delta = kFormsDelta ? 0.f : __ldg(p.delta + at.point);
  const float dlse = kFormsDelta ? __ldg(p.dlse + at.point) : 0.f;
  MbarrierWait(&s.landed, 0);

  // acc: sum p (dout.v - delta) k given delta; forming it, sum p (dout.v) k beside weighted = sum p k.
  float acc[kLaneChannels] = {}, weighted[kFormsDelta ? kLaneChannels : 1] = {};
  float formed = 0.f, mass = 0.f;  // sum p (dout.v), sum p
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
      const float dp = LaneDot<S::kLanes>(dout, v);
      if constexpr (kFormsDelta) {
        const float pdp = probability * dp;
        formed = fmaf(probability, dp, formed);
        mass += probability;
#pragma unroll
        for (int c = 0; c < kLaneChannels; ++c) {
          acc[c] = fmaf(pdp, k[c], acc[c]);
          weighted[c] = fmaf(probability, k[c], weighted[c]);
        }
      } else {
        const float ds = probability * (dp - given_delta);
#pragma unroll
        for (int c = 0; c < kLaneChannels; ++c) acc[c] = fmaf(ds, k[c], acc[c]);
      }
    }
  }
  if constexpr (kFormsDelta) {
    // No neighbour (or every p underflowed): delta = -dlse, dq = 0; a NaN sum stays NaN.
    const float mean = mass == 0.f ? 0.f : formed / mass;
    const float delta = mean - dlse;
#pragma unroll
    for (int c = 0; c < kLaneChannels; ++c) acc[c] = fmaf(-delta, weighted[c], acc[c]);
    if (at.lane == 0 && at.real) p.delta_out[at.point] = delta;
  }
  if (!at.real) return;
#pragma unroll
  for (int c = 0; c < kLaneChannels; ++c) acc[c] *= p.scale;
  StoreResult<T>(p.dq, p.gradient_dtype != ActivationType::kF32, row_at, acc);
}

}  // namespace

template <typename T, int D>
cudaError_t LaunchStencilDq(cudaStream_t stream, const NbhdAttnGpuParams& p) {
  return p.dlse != nullptr ? LaunchPairs<T, D>(StencilDqKernel<T, D, true>, stream, p)
                           : LaunchPairs<T, D>(StencilDqKernel<T, D, false>, stream, p);
}

S2ATTN_INSTANTIATE_STENCIL_LAUNCHER(LaunchStencilDq);

}  // namespace stencil
}  // namespace gpu

cudaError_t LaunchStencilAttnBwdDq(cudaStream_t stream, const NbhdAttnGpuParams& p) {
  // delta given, or formed from the walk's probabilities and dlse and written to delta_out.
  const bool forming = p.dlse != nullptr;
  if (p.dq == nullptr || (forming ? p.delta_out == nullptr : p.delta == nullptr)) {
    return cudaErrorInvalidValue;
  }
  return gpu::stencil::DispatchStencil(p, [&](auto variant) {
    using V = decltype(variant);
    return gpu::stencil::LaunchStencilDq<typename V::Element, V::kDim>(stream, p);
  });
}

}  // namespace s2attn
