// Stencil forward: out and lse of the plan's stencil rows (stencil_attn_device.cuh describes the walk). The
// softmax is exact and online and P is never rounded, so out is float32-accurate (the backward forms delta
// from it).
#include "gpu/stencil_attn_device.cuh"

namespace s2attn {
namespace gpu {
namespace stencil {
namespace {

// Online softmax in log2 units with the quadrature weight as a bias: x = log2(e) * scale * q.k + log2(w),
// p = exp2(x - m), lse = ln(2) * (m + log2(l)). m moves only where a logit passes it by more than
// kRescaleSlackLog2, so most neighbours cost no rescaling of acc and l. Then p <= 2^8, and acc and l are
// sums of at most 2^8 times as much as with m the running maximum: the same softmax to float32 round-off
// wherever |v| stays below ~2^115 (a point has at most kMaxOtherRows (2 kMaxHalf + 1) = 28 neighbours).
template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 4) StencilFwdKernel(const NbhdAttnGpuParams p) {
  using S = Shape<D>;
  Staged<T, D>& s = *reinterpret_cast<Staged<T, D>*>(DynamicShared());
  const WalkPoint at = StartBlock<T, D, false>(p, s);
  float q[kLaneChannels];
  LoadLane<T>(q, static_cast<const T*>(p.q) + at.point * D + at.lane * kLaneChannels, p.scale * kLog2e);
  MbarrierWait(&s.landed, 0);

  float acc[kLaneChannels] = {};
  float m = kNegInf, l = 0.f;
#pragma unroll 1
  for (int i = 0; i < kMaxOtherRows; ++i) {
    const StagedArc arc = ArcOfRow(at, i);
    const T* k_row = &s.a[arc.row][at.column0 + arc.column][at.lane * kLaneChannels];
    const T* v_row = &s.b[arc.row][at.column0 + arc.column][at.lane * kLaneChannels];
    for (int32_t j = 0; j < arc.len; ++j) {
      float x[kLaneChannels];
      LoadLane<T>(x, k_row + j * S::kStride, 1.f);
      const float logit = LaneDot<S::kLanes>(q, x) + arc.log2_weight;
      if (logit > m + kRescaleSlackLog2) {  // the point's first finite (or +inf) logit, then rarely
        const float decay = Exp2(m - logit);  // 0 while m = -inf
        m = logit;
        l *= decay;
#pragma unroll
        for (int c = 0; c < kLaneChannels; ++c) acc[c] *= decay;
      }
      // Nothing seen yet (m = -inf, so logit = -inf or NaN): p = 0, or NaN from a NaN logit.
      const float weight = Exp2(logit - (m == kNegInf ? 0.f : m));
      l += weight;
      LoadLane<T>(x, v_row + j * S::kStride, 1.f);
#pragma unroll
      for (int c = 0; c < kLaneChannels; ++c) acc[c] = fmaf(weight, x[c], acc[c]);
    }
  }
  if (!at.real) return;
  // No neighbour: 0, -inf. A NaN sum stays NaN (not "no neighbour"); a discarded acc may hold NaN.
  const bool seen = !(l == 0.f);
  const float inverse = seen ? 1.f / l : 0.f;
#pragma unroll
  for (int c = 0; c < kLaneChannels; ++c) acc[c] = seen ? acc[c] * inverse : 0.f;
  if (at.lane == 0) p.lse_out[at.point] = seen ? (m + log2f(l)) * kLn2 : kNegInf;
  const bool narrow = p.out == nullptr;  // out in T: the same float32 values, rounded to nearest
  const int64_t at_channel = at.point * D + at.lane * kLaneChannels;
  StoreResult<T>(narrow ? p.out_narrow : p.out, narrow, at_channel, acc);
}

}  // namespace

template <typename T, int D>
cudaError_t LaunchStencilFwd(cudaStream_t stream, const NbhdAttnGpuParams& p) {
  return LaunchPairs<T, D>(StencilFwdKernel<T, D>, stream, p);
}

S2ATTN_INSTANTIATE_STENCIL_LAUNCHER(LaunchStencilFwd);

}  // namespace stencil
}  // namespace gpu

bool StencilAttnSupported(const NbhdAttnGpuParams& p) {
  return gpu::SixteenBitTypes(p, kStencilHeadDims) && p.num_stencil_pairs > 0 && p.stencil_pairs != nullptr &&
         gpu::Aligned16({p.q, p.k, p.v, p.dout, p.out_narrow});
}

cudaError_t LaunchStencilAttnFwd(cudaStream_t stream, const NbhdAttnGpuParams& p) {
  // Exactly one out: float32 or in the activations' type.
  if ((p.out == nullptr) == (p.out_narrow == nullptr) || p.lse_out == nullptr) return cudaErrorInvalidValue;
  return gpu::stencil::DispatchStencil(p, [&](auto variant) {
    using V = decltype(variant);
    return gpu::stencil::LaunchStencilFwd<typename V::Element, V::kDim>(stream, p);
  });
}

}  // namespace s2attn
