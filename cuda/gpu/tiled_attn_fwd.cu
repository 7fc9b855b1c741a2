// Tiled forward: out and lse of a unit of 64 queries, K/V windows staged once per block and
// multiplied on tensor cores (tiled_attn_device.cuh describes the walk).
#include <type_traits>

#include "gpu/tiled_fwd_shape.cuh"  // before the device header: this kernel's pipeline shape
#include "gpu/tiled_attn_device.cuh"
#include "gpu/tiled_attn_dispatch.cuh"
#include "gpu/stencil_attn_kernels.h"

namespace s2attn {
namespace gpu {
namespace tiled {
namespace {

// How far (log2 units) a score may exceed its row's running maximum before the maximum is moved:
// p is at most 2^8 (so values within a factor 2^8 of float32's largest could then overflow the sums).
constexpr float kRescaleSlack = 8.f;

// Online softmax per tile row in log2 units with the quadrature weight folded into the column
// bias: x = log2(e) * scale * q.k + log2(w), p = exp2(x - m), lse = ln(2) * (m + log2(l)), with m a
// running maximum moved lazily (kRescaleSlack). Each thread keeps partial row sums over its columns;
// the four lanes of a row add them at the end. P.V multiplies P in kParts parts (SplitFragments): two where
// the backward forms delta from out (a float32 out, or one in T with its remainder), one where out in T is
// all the caller gets (KernelFor).
template <typename T, int D, int kParts>
__global__ void __launch_bounds__(kThreads, MinBlocksPerSm<D>()) TiledFwdKernel(const NbhdAttnGpuParams p) {
  const Windows win = ReadDeviceWindows(p);
  const Unit u = UnitOf(p, win.q, p.nq_lat, p.nq_lon);
  if (!u.live) return;
  const T* q = static_cast<const T*>(p.q);
  uint32_t qa[D / 16][4];
  LoadOwnFragments<T, D>(qa, RealRow(q, D, u, 0), RealRow(q, D, u, 1));
  OwnOperand<0, D>::Park(qa);
  const Walk walk = WalkOf(p, u, win.q, win.k, p.nlat_k, p.nlon_k);
  const StagedSource<T> src = SourceOf<T>(p.k, p.v, nullptr, nullptr, u, p.nk_lat, p.nk_lon, p.heads, D);

  float acc[D / 8][4];
  ZeroAccumulator<D>(acc);
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.f, 0.f};
  const float scale2 = p.scale * kLog2e;
  const int t = threadIdx.x % 4;

  ForEachChunk<T, D>(walk, src, p.quad_weights, u.row_lon, u.row_real,
                     [&](const Stage<T, D>& stage, const SegmentWindow& sw, int32_t chunk, const WarpBand& band) {
    const int32_t c0 = chunk * kChunk;
    float s[kBlocksPerChunk][2][4];
    bool active[kBlocksPerChunk];
    bool any = false;
    float mx[2] = {kNegInf, kNegInf};
#pragma unroll
    for (int kb = 0; kb < kBlocksPerChunk; ++kb) {
      const int32_t cb = c0 + kBlock * kb;
      active[kb] = band.Touches(cb, sw.width);
      any = any || active[kb];
      if (!active[kb]) continue;
      OwnOperand<0, D>::Products(s[kb], qa, stage.BlockA(kb));
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[kb][n][e] = fmaf(s[kb][n][e], scale2, stage.bias[ScoreColumn(kb, n, e, t)]);
      }
      if (!band.Covers(cb)) MaskOffArc(s[kb], cb, band, sw.wrap);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float (&x)[2][4] = s[kb];
        mx[h] = fmaxf(mx[h], fmaxf(fmaxf(x[0][2 * h], x[0][2 * h + 1]), fmaxf(x[1][2 * h], x[1][2 * h + 1])));
      }
    }
    if (!any) return;  // warp-uniform: this chunk lies outside the warp's band
    // Lazy rescaling: the running maxima move (and l, acc are rescaled) only when some row of the warp
    // sees a score above its maximum by more than kRescaleSlack; otherwise p = exp2(x - m) is at most
    // 2^kRescaleSlack, harmless in float32 sums and in T. A lane's own partial maximum decides for its
    // row, so the common case skips the row reductions, the decay and the rescale.
    if (__any_sync(0xffffffffu, mx[0] > m[0] + kRescaleSlack || mx[1] > m[1] + kRescaleSlack)) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float m_new = fmaxf(m[h], RowMax(mx[h]));
        const float decay = m_new == kNegInf ? 1.f : Exp2(m[h] - m_new);
        m[h] = m_new;
        l[h] *= decay;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          acc[n][2 * h] *= decay;
          acc[n][2 * h + 1] *= decay;
        }
      }
    }
    float base[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) base[h] = m[h] == kNegInf ? 0.f : m[h];  // nothing seen yet: p = 0
#pragma unroll
    for (int kb = 0; kb < kBlocksPerChunk; ++kb) {
      if (!active[kb]) continue;
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[kb][n][e] = Exp2(s[kb][n][e] - base[e >> 1]);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        l[h] += (s[kb][0][2 * h] + s[kb][0][2 * h + 1]) + (s[kb][1][2 * h] + s[kb][1][2 * h + 1]);
      }
      AccumulateRows<T, D, kParts>(acc, s[kb], stage.BlockB(kb));
    }
  });

  float scale[2];
  bool seen[2];
  for (int h = 0; h < 2; ++h) {
    l[h] = RowSum(l[h]);
    // No neighbour inside the key window: 0, -inf. A NaN sum stays NaN (not "no neighbour").
    seen[h] = u.row_real[h] && !(l[h] == 0.f);
    scale[h] = seen[h] ? 1.f / l[h] : 0.f;
    if (t == 0 && u.row_exists[h]) p.lse_out[u.row_point[h]] = seen[h] ? (m[h] + log2f(l[h])) * kLn2 : kNegInf;
  }
  const auto store = [&](auto* out, auto remainder) {  // remainder: a std::bool_constant, StoreRows' kRemainder
    StoreRows<D, decltype(remainder)::value>(ExistingRow(out, D, u, 0), ExistingRow(out, D, u, 1), acc, scale[0],
                                             scale[1], seen[0], seen[1]);
  };
  if (p.out != nullptr) {
    store(p.out, std::false_type{});
  } else {  // out in T: acc rounded to nearest (P once without a remainder: KernelFor); maybe what that left, in T
    store(static_cast<T*>(p.out_narrow), std::false_type{});
    if (p.out_remainder != nullptr) store(static_cast<T*>(p.out_remainder), std::true_type{});
  }
}

// The forward for the results `p` asks for. P in two parts carries ~16 bits of P to out, not T's 8: the op
// forms delta = rowsum(dout * out) from a float32 out or from out in T plus its remainder, and for values
// smooth in position dP - delta cancels so far that P rounded once makes dq and dk miss the 1e-2 bar
// (measured: docs/performance.md). An out in T without a remainder (the op undifferentiated) is rounded to
// T's 8 bits anyway: P rounded once stays inside that rounding's error, and the second P.V product (8-12 %
// of the forward) is saved.
template <typename T, int D>
auto KernelFor(const NbhdAttnGpuParams& p) {
  const bool delta_from_out = p.out != nullptr || p.out_remainder != nullptr;
  return delta_from_out ? TiledFwdKernel<T, D, 2> : TiledFwdKernel<T, D, 1>;
}

}  // namespace
}  // namespace tiled
}  // namespace gpu

bool TiledAttnSupported(const NbhdAttnGpuParams& p) {
  return gpu::SixteenBitTypes(p, kTiledHeadDims) &&
         gpu::Aligned16({p.q, p.k, p.v, p.dout, p.forward_out, p.forward_out_narrow, p.forward_out_remainder,
                         p.out_narrow, p.out_remainder});
}

cudaError_t LaunchTiledAttnFwd(cudaStream_t stream, const NbhdAttnGpuParams& p) {
  // One out, of either type; a remainder only beside an out in T.
  if ((p.out == nullptr) == (p.out_narrow == nullptr) || (p.out_remainder != nullptr && p.out_narrow == nullptr)) {
    return cudaErrorInvalidValue;
  }
  return gpu::tiled::DispatchTiled(p, [&](auto variant) {
    using V = decltype(variant);
    using T = typename V::Element;
    const auto stencil = [&](cudaStream_t s) { return gpu::stencil::LaunchStencilFwd<T, V::kDim>(s, p); };
    return gpu::tiled::LaunchUnitsAndStencilRows<V::kDim>(gpu::tiled::KernelFor<T, V::kDim>(p), stream, p,
                                                           /*walk_keys=*/false, stencil);
  });
}

}  // namespace s2attn
