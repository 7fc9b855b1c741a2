// Tiled dk and dv without atomics: per unit of 64 keys, walking the transposed (backward)
// segments, recomputing p = w exp(s - lse) from the staged queries' lse and using their delta =
// sum(dout * out) (cuda/README.md).
#include "gpu/tiled_dkv_shape.cuh"  // before the device header: this kernel's pipeline shape
#include "gpu/tiled_attn_device.cuh"
#include "gpu/tiled_attn_dispatch.cuh"
#include "gpu/stencil_attn_kernels.h"

namespace s2attn {
namespace gpu {
namespace tiled {
namespace {

// dv_j = sum_o p_oj dout_o, dk_j = scale * sum_o p_oj (dout_o.v_j - delta_o) q_o over the
// queries o that have key j as a neighbour. Staged: Q (a), dout (b), lse, delta.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads, MinBlocksPerSm<D>()) TiledDkvKernel(const NbhdAttnGpuParams p) {
  const Windows win = ReadDeviceWindows(p);
  const Unit u = UnitOf(p, win.k, p.nk_lat, p.nk_lon);
  if (!u.live) return;
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  uint32_t ka[D / 16][4], va[D / 16][4];
  LoadOwnFragments<T, D>(ka, RealRow(k, D, u, 0), RealRow(k, D, u, 1));
  LoadOwnFragments<T, D>(va, RealRow(v, D, u, 0), RealRow(v, D, u, 1));
  OwnOperand<0, D>::Park(ka);
  OwnOperand<1, D>::Park(va);
  // The keys' own quadrature weight (one row per block).
  const float log2_weight = u.padding_row ? 0.f : log2f(__ldg(p.quad_weights + win.k.lat0 + u.local_row));
  const Walk walk = WalkOf(p, u, win.k, win.q, p.nlat_q, p.nlon_q);
  const StagedSource<T> src = SourceOf<T>(p.q, p.dout, p.lse, p.delta, u, p.nq_lat, p.nq_lon, p.heads, D);
  float dk[D / 8][4], dv[D / 8][4];
  ZeroAccumulator<D>(dk);
  ZeroAccumulator<D>(dv);
  const float scale2 = p.scale * kLog2e;
  const int t = threadIdx.x % 4;

  ForEachChunk<T, D>(walk, src, /*quad_weights=*/nullptr, u.row_lon, u.row_real,
                     [&](const Stage<T, D>& stage, const SegmentWindow& sw, int32_t chunk, const WarpBand& band) {
    const int32_t c0 = chunk * kChunk;
#pragma unroll
    for (int kb = 0; kb < kBlocksPerChunk; ++kb) {
      const int32_t cb = c0 + kBlock * kb;
      if (!band.Touches(cb, sw.width)) continue;
      const T* q_rows = stage.BlockA(kb);
      const T* dout_rows = stage.BlockB(kb);
      float s[2][4], dp[2][4];
      OwnOperand<0, D>::Products(s, ka, q_rows);
      OwnOperand<1, D>::Products(dp, va, dout_rows);
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[n][e] = fmaf(s[n][e], scale2, log2_weight + KeyWalkBias(stage.bias[ScoreColumn(kb, n, e, t)]));
        }
      }
      if (!band.Covers(cb)) MaskOffArc(s, cb, band, sw.wrap);
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[n][e] = Exp2(s[n][e]);
          dp[n][e] = s[n][e] * (dp[n][e] - stage.delta[ScoreColumn(kb, n, e, t)]);
        }
      }
      AccumulateRows<T, D>(dv, s, dout_rows);
      AccumulateRows<T, D>(dk, dp, q_rows);
    }
  });

  StoreGradient<T, D>(p.dk, p, u, dk, p.scale);
  StoreGradient<T, D>(p.dv, p, u, dv, 1.f);
}

}  // namespace
}  // namespace tiled
}  // namespace gpu

cudaError_t LaunchTiledAttnBwdDkv(cudaStream_t stream, const NbhdAttnGpuParams& p) {
  return gpu::tiled::DispatchTiled(p, [&](auto variant) {
    using V = decltype(variant);
    using T = typename V::Element;
    const auto stencil = [&](cudaStream_t s) { return gpu::stencil::LaunchStencilDkv<T, V::kDim>(s, p); };
    return gpu::tiled::LaunchUnitsAndStencilRows<V::kDim>(gpu::tiled::TiledDkvKernel<T, V::kDim>, stream, p,
                                                           /*walk_keys=*/true, stencil);
  });
}

}  // namespace s2attn
