// Tiled dq without atomics: per unit of 64 queries, walking the forward segments, recomputing
// p = w exp(s - lse) from the saved lse and using delta = sum(dout * out) - dlse in float32: given by
// the caller, or formed here from the forward's out (ForwardOut) at the unit's entry and written for the
// dk/dv kernel (cuda/README.md).
#include "gpu/tiled_narrow_shape.cuh"  // before the device header: this kernel's pipeline shape
#include "gpu/tiled_attn_device.cuh"
#include "gpu/tiled_attn_dispatch.cuh"
#include "gpu/stencil_attn_kernels.h"

namespace s2attn {
namespace gpu {
namespace tiled {
namespace {

// delta = sum(dout * out) - dlse of the thread's two tile rows (0 for rows outside the local arrays):
// each lane multiplies the elements of its dout fragments `da` (LoadOwnFragments' layout: row h's
// columns 16 ks + 2t and 16 ks + 8 + 2t, two each) with the same elements of `out`, in ks order; the
// four lanes of a row add their sums in a fixed butterfly. The same bits in every program.
template <typename T, int D>
__device__ __forceinline__ void FormDelta(float (&delta)[2], const uint32_t (&da)[D / 16][4], const ForwardOut<T>& out,
                                          const float* dlse, const Unit& u) {
  const int t = threadIdx.x % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = 0.f;
    if (u.row_exists[h]) {
      const int64_t row = u.row_point[h] * D;
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float2 o = out.Pair(row + 16 * ks + 8 * half + 2 * t);
          const float2 d = UnpackPair<T>(da[ks][2 * half + h]);
          sum = fmaf(d.y, o.y, fmaf(d.x, o.x, sum));
        }
      }
    }
    sum = RowSum(sum);
    delta[h] = u.row_exists[h] ? sum - __ldg(dlse + u.row_point[h]) : 0.f;
  }
}

// dq_o = scale * sum_j p_oj (dout_o.v_j - delta_o) k_j. Staged: K (a), V (b).
template <typename T, int D>
__global__ void __launch_bounds__(kThreads, MinBlocksPerSm<D>()) TiledDqKernel(const NbhdAttnGpuParams p) {
  const Windows win = ReadDeviceWindows(p);
  const Unit u = UnitOf(p, win.q, p.nq_lat, p.nq_lon);
  if (!u.live) return;
  const T* q = static_cast<const T*>(p.q);
  const T* dout = static_cast<const T*>(p.dout);
  // Forming delta takes every existing row's dout: rows outside the query window then multiply real
  // values too, but their p is 0 (lse below) and their results are written as zeros (StoreGradient).
  const ForwardOut<T> forward_out = ForwardOut<T>::Of(p);
  const bool form_delta = forward_out.Given();
  uint32_t qa[D / 16][4], da[D / 16][4];
  LoadOwnFragments<T, D>(qa, RealRow(q, D, u, 0), RealRow(q, D, u, 1));
  LoadOwnFragments<T, D>(da, form_delta ? ExistingRow(dout, D, u, 0) : RealRow(dout, D, u, 0),
                         form_delta ? ExistingRow(dout, D, u, 1) : RealRow(dout, D, u, 1));
  float lse2[2], delta[2];
  if (form_delta) {
    FormDelta<T, D>(delta, da, forward_out, p.dlse, u);
    if (threadIdx.x % 4 == 0) {
      for (int h = 0; h < 2; ++h) {
        if (u.row_exists[h]) p.delta_out[u.row_point[h]] = delta[h];
      }
    }
  }
  OwnOperand<0, D>::Park(qa);
  OwnOperand<1, D>::Park(da);
  for (int h = 0; h < 2; ++h) {
    // A row without neighbours anywhere (lse = -inf) or outside the window: p = exp2(x - inf) = 0.
    const float lse = u.row_real[h] ? __ldg(p.lse + u.row_point[h]) : kNegInf;
    lse2[h] = Log2Lse(lse);
    if (!form_delta) delta[h] = u.row_real[h] ? __ldg(p.delta + u.row_point[h]) : 0.f;
  }
  const Walk walk = WalkOf(p, u, win.q, win.k, p.nlat_k, p.nlon_k);
  const StagedSource<T> src = SourceOf<T>(p.k, p.v, nullptr, nullptr, u, p.nk_lat, p.nk_lon, p.heads, D);
  float acc[D / 8][4];
  ZeroAccumulator<D>(acc);
  const float scale2 = p.scale * kLog2e;
  const int t = threadIdx.x % 4;

  ForEachChunk<T, D>(walk, src, p.quad_weights, u.row_lon, u.row_real,
                     [&](const Stage<T, D>& stage, const SegmentWindow& sw, int32_t chunk, const WarpBand& band) {
    const int32_t c0 = chunk * kChunk;
#pragma unroll
    for (int kb = 0; kb < kBlocksPerChunk; ++kb) {
      const int32_t cb = c0 + kBlock * kb;
      if (!band.Touches(cb, sw.width)) continue;
      const T* k_rows = stage.BlockA(kb);
      float s[2][4], dp[2][4];
      OwnOperand<0, D>::Products(s, qa, k_rows);
      OwnOperand<1, D>::Products(dp, da, stage.BlockB(kb));
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[n][e] = fmaf(s[n][e], scale2, stage.bias[ScoreColumn(kb, n, e, t)]) - lse2[e >> 1];
        }
      }
      if (!band.Covers(cb)) MaskOffArc(s, cb, band, sw.wrap);
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = Exp2(s[n][e]) * (dp[n][e] - delta[e >> 1]);
      }
      AccumulateRows<T, D>(acc, s, k_rows);
    }
  });

  StoreGradient<T, D>(p.dq, p, u, acc, p.scale);
}

}  // namespace
}  // namespace tiled
}  // namespace gpu

cudaError_t LaunchTiledAttnBwdDq(cudaStream_t stream, const NbhdAttnGpuParams& p) {
  // The forward's out, if given, in one form: float32, or in T with its remainder.
  if (!gpu::ForwardOutInOneForm(p)) return cudaErrorInvalidValue;
  return gpu::tiled::DispatchTiled(p, [&](auto variant) {
    using V = decltype(variant);
    using T = typename V::Element;
    const auto stencil = [&](cudaStream_t s) { return gpu::stencil::LaunchStencilDq<T, V::kDim>(s, p); };
    return gpu::tiled::LaunchUnitsAndStencilRows<V::kDim>(gpu::tiled::TiledDqKernel<T, V::kDim>, stream, p,
                                                           /*walk_keys=*/false, stencil);
  });
}

}  // namespace s2attn
