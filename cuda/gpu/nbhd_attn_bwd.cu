// Backward kernels: dq per query (forward arcs), dk and dv per key (backward arcs).
// Each result element is written once by the team that owns its point: no atomics, so the
// gradients are bitwise reproducible.
//
// With s = log2(e) * scale * q.k + log2(w_k) and lse2 = log2(e) * lse, the probability is
// p = exp2(s - lse2) = w_k exp(scale q.k - lse), and ds = p * (dout.v - delta).
#include "gpu/nbhd_attn_device.cuh"

namespace s2attn {
namespace gpu {
namespace {

// Per warp of the general kernels: dq needs q, dout and the dq accumulator; dkv needs k, v
// and both accumulators.
__host__ __device__ constexpr int64_t DqWarpWords(int64_t dk, int64_t dv) { return 2 * dk + dv; }
__host__ __device__ constexpr int64_t DkvWarpWords(int64_t dk, int64_t dv) { return 2 * (dk + dv); }

// One team per (batch, head, query): dq = scale * sum_k ds k over the key window.
template <typename T, typename Ch, typename G>
__global__ void __launch_bounds__(kVectorBlockThreads, kBlocksPerSm) NbhdAttnBwdDqKernel(const NbhdAttnGpuParams p) {
  const G geometry(p);
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const T* dout = static_cast<const T*>(p.dout);
  const int64_t heads = p.heads, dk = p.head_dim_k, dv = p.head_dim_v;
  float* warp_shared = DynamicShared() + (threadIdx.x / 32) * WarpSharedWords<Ch>(DqWarpWords(dk, dv));

  ForTeamPoint(
      p, geometry.Rows(), geometry.Cols(), threadIdx.x / Ch::kLanes, blockDim.x / Ch::kLanes,
      [&](int32_t i, int32_t j, int64_t b, int64_t head) {
        const WalkPoint point = geometry.At(i, j);
        if (!point.exists) return;
        const int64_t query = (b * geometry.WalkPoints() + point.local) * heads + head;  // (point, head) index
        float* dq = static_cast<float*>(p.dq) + query * dk;
        Ch ch(warp_shared);
        const float lse = point.real ? __ldg(p.lse + query) : kNegInf;
        if (lse == kNegInf) {  // padding, or no neighbour anywhere: every p is 0
          ch.StoreZero(dq, dk);
          return;
        }
        typename Ch::Vec qv = ch.NewVec(dk);
        ch.Load(qv, q + query * dk, p.scale * kLog2e);
        typename Ch::Vec gv = ch.NewVec(dv);
        ch.Load(gv, dout + query * dv, 1.f);
        typename Ch::Vec acc = ch.NewVec(dk);
        const float lse2 = lse * kLog2e;
        const float delta = __ldg(p.delta + query);

        geometry.ForEachRun(i, j, [&](int32_t weight_index, int64_t first_point, int32_t count) {
          const int64_t first = (b * geometry.OtherPoints() + first_point) * heads + head;
          const T* k_run = k + first * dk;
          const T* v_run = v + first * dv;
          const int64_t k_stride = heads * dk, v_stride = heads * dv;
          const float bias = log2f(__ldg(p.quad_weights + weight_index)) - lse2;
          ForEachGroup<kNeighbourGroup>(count, [&](auto group, int32_t t) {
            constexpr int kRows = decltype(group)::kRows;
            const auto kt = ch.template LoadRows<kRows>(k_run + t * k_stride, k_stride);
            const auto vt = ch.template LoadRows<kRows>(v_run + t * v_stride, v_stride);
            float s[kRows], dp[kRows];
            ch.Dots(qv, kt, s);
            ch.Dots(gv, vt, dp);
            ch.Sum(s);
            ch.Sum(dp);
#pragma unroll
            for (int u = 0; u < kRows; ++u) s[u] = Exp2(s[u] + bias) * (dp[u] - delta);
            ch.Accumulate(acc, s, kt);
          });
        });
        ch.Store(dq, acc, p.scale);
      });
}

// One team per (batch, head, key): dv = sum_q p dout and dk = scale * sum_q ds q over the
// queries in the query window that have this key as a neighbour (backward arcs). The key's
// log2 weight is one constant of the walk.
template <typename T, typename Ch, typename G>
__global__ void __launch_bounds__(kVectorBlockThreads, kBlocksPerSm) NbhdAttnBwdDkvKernel(const NbhdAttnGpuParams p) {
  const G geometry(p);
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const T* dout = static_cast<const T*>(p.dout);
  const int64_t heads = p.heads, dk = p.head_dim_k, dv = p.head_dim_v;
  float* warp_shared = DynamicShared() + (threadIdx.x / 32) * WarpSharedWords<Ch>(DkvWarpWords(dk, dv));

  ForTeamPoint(
      p, geometry.Rows(), geometry.Cols(), threadIdx.x / Ch::kLanes, blockDim.x / Ch::kLanes,
      [&](int32_t i, int32_t j, int64_t b, int64_t head) {
        const WalkPoint point = geometry.At(i, j);
        if (!point.exists) return;
        const int64_t key = (b * geometry.WalkPoints() + point.local) * heads + head;  // (point, head) index
        float* dk_out = static_cast<float*>(p.dk) + key * dk;
        float* dv_out = static_cast<float*>(p.dv) + key * dv;
        Ch ch(warp_shared);
        if (!point.real) {  // padding
          ch.StoreZero(dk_out, dk);
          ch.StoreZero(dv_out, dv);
          return;
        }
        typename Ch::Vec kv = ch.NewVec(dk);
        ch.Load(kv, k + key * dk, p.scale * kLog2e);
        typename Ch::Vec vv = ch.NewVec(dv);
        ch.Load(vv, v + key * dv, 1.f);
        typename Ch::Vec dk_acc = ch.NewVec(dk);
        typename Ch::Vec dv_acc = ch.NewVec(dv);
        const float log2w = log2f(__ldg(p.quad_weights + geometry.WalkWeightIndex(i)));

        geometry.ForEachRun(i, j, [&](int32_t /*query_weight_index*/, int64_t first_point, int32_t count) {
          const int64_t first = (b * geometry.OtherPoints() + first_point) * heads + head;
          const T* q_run = q + first * dk;
          const T* g_run = dout + first * dv;
          const float* lse_run = p.lse + first;
          const float* delta_run = p.delta + first;
          const int64_t q_stride = heads * dk, g_stride = heads * dv;
          ForEachGroup<kNeighbourGroup>(count, [&](auto group, int32_t t) {
            constexpr int kRows = decltype(group)::kRows;
            const auto qt = ch.template LoadRows<kRows>(q_run + t * q_stride, q_stride);
            const auto gt = ch.template LoadRows<kRows>(g_run + t * g_stride, g_stride);
            float lse[kRows], delta[kRows];
#pragma unroll
            for (int u = 0; u < kRows; ++u) {
              lse[u] = __ldg(lse_run + (t + u) * heads);
              delta[u] = __ldg(delta_run + (t + u) * heads);
            }
            float s[kRows], dp[kRows];
            ch.Dots(kv, qt, s);
            ch.Dots(vv, gt, dp);
            ch.Sum(s);
            ch.Sum(dp);
#pragma unroll
            for (int u = 0; u < kRows; ++u) {
              // lse = -inf: that query has no neighbour at all, so p = 0 (and never inf * 0).
              const bool live = lse[u] != kNegInf;
              s[u] = live ? Exp2(s[u] + log2w - lse[u] * kLog2e) : 0.f;
              dp[u] = live ? s[u] * (dp[u] - delta[u]) : 0.f;
            }
            ch.Accumulate(dv_acc, s, gt);
            ch.Accumulate(dk_acc, dp, qt);
          });
        });
        ch.Store(dk_out, dk_acc, p.scale);
        ch.Store(dv_out, dv_acc, 1.f);
      });
}

}  // namespace
}  // namespace gpu

namespace gpu {
namespace {

// dq over `rows` x `cols` walking points (queries) of geometry G.
template <typename G>
cudaError_t LaunchBwdDq(cudaStream_t stream, const NbhdAttnGpuParams& p, int32_t rows, int32_t cols) {
  if (p.gradient_dtype != ActivationType::kF32) return cudaErrorInvalidValue;  // float32 gradients only
  const bool aligned = Aligned16({p.q, p.k, p.v, p.dout, p.dq});
  return DispatchVariant(p, aligned, [&](auto variant) {
    using V = decltype(variant);
    using Ch = typename V::Channels;
    return LaunchTeams<Ch>(NbhdAttnBwdDqKernel<typename V::Element, Ch, G>, stream, p, rows, cols,
                           DqWarpWords(p.head_dim_k, p.head_dim_v));
  });
}

// dk, dv over `rows` x `cols` walking points (keys) of geometry G.
template <typename G>
cudaError_t LaunchBwdDkv(cudaStream_t stream, const NbhdAttnGpuParams& p, int32_t rows, int32_t cols) {
  if (p.gradient_dtype != ActivationType::kF32) return cudaErrorInvalidValue;  // float32 gradients only
  const bool aligned = Aligned16({p.q, p.k, p.v, p.dout, p.dk, p.dv});
  return DispatchVariant(p, aligned, [&](auto variant) {
    using V = decltype(variant);
    using Ch = typename V::Channels;
    return LaunchTeams<Ch>(NbhdAttnBwdDkvKernel<typename V::Element, Ch, G>, stream, p, rows, cols,
                           DkvWarpWords(p.head_dim_k, p.head_dim_v));
  });
}

}  // namespace
}  // namespace gpu

cudaError_t LaunchNbhdAttnBwdDq(cudaStream_t stream, const NbhdAttnGpuParams& p) {
  return gpu::LaunchBwdDq<gpu::GridGeometry<false>>(stream, p, p.nq_lat, p.nq_lon);
}

cudaError_t LaunchNbhdAttnBwdDkv(cudaStream_t stream, const NbhdAttnGpuParams& p) {
  return gpu::LaunchBwdDkv<gpu::GridGeometry<true>>(stream, p, p.nk_lat, p.nk_lon);
}

cudaError_t LaunchRingAttnBwdDq(cudaStream_t stream, const NbhdAttnGpuParams& p) {
  return gpu::LaunchBwdDq<gpu::RingGeometry<false>>(stream, p, p.num_walk_rings, p.max_ring_points);
}

cudaError_t LaunchRingAttnBwdDkv(cudaStream_t stream, const NbhdAttnGpuParams& p) {
  return gpu::LaunchBwdDkv<gpu::RingGeometry<true>>(stream, p, p.num_walk_rings, p.max_ring_points);
}

}  // namespace s2attn
