// Forward kernel: out and lse per query, online softmax over the query's arcs.
#include "gpu/nbhd_attn_device.cuh"

namespace s2attn {
namespace gpu {
namespace {

// Per warp of the general kernel: the scaled query and the output accumulator.
__host__ __device__ constexpr int64_t FwdWarpWords(int64_t dk, int64_t dv) { return dk + dv; }

// One team per (batch, head, query). Scores are kept in log2 units with the quadrature
// weight folded in, s = log2(e) * scale * q.k + log2(w): then p = exp2(s - m) and
// lse = ln(2) * (m + log2(l)). The running max m and sum l are rescaled once per group.
template <typename T, typename Ch, typename G>
__global__ void __launch_bounds__(kVectorBlockThreads, Ch::kUsesShared ? kBlocksPerSm : kFwdVectorBlocksPerSm)
    NbhdAttnFwdKernel(const NbhdAttnGpuParams p) {
  const G geometry(p);
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const int64_t heads = p.heads, dk = p.head_dim_k, dv = p.head_dim_v;
  float* warp_shared = DynamicShared() + (threadIdx.x / 32) * WarpSharedWords<Ch>(FwdWarpWords(dk, dv));

  ForTeamPoint(
      p, geometry.Rows(), geometry.Cols(), threadIdx.x / Ch::kLanes, blockDim.x / Ch::kLanes,
      [&](int32_t i, int32_t j, int64_t b, int64_t head) {
        const WalkPoint point = geometry.At(i, j);
        if (!point.exists) return;
        const int64_t query = (b * geometry.WalkPoints() + point.local) * heads + head;  // (point, head) index
        float* out = p.out + query * dv;
        Ch ch(warp_shared);
        if (!point.real) {  // padding
          ch.StoreZero(out, dv);
          if (ch.Leader()) p.lse_out[query] = kNegInf;
          return;
        }
        typename Ch::Vec qv = ch.NewVec(dk);
        ch.Load(qv, q + query * dk, p.scale * kLog2e);
        typename Ch::Vec acc = ch.NewVec(dv);
        float m = kNegInf, l = 0.f;

        geometry.ForEachRun(i, j, [&](int32_t weight_index, int64_t first_point, int32_t count) {
          const int64_t first = (b * geometry.OtherPoints() + first_point) * heads + head;
          const T* k_run = k + first * dk;
          const T* v_run = v + first * dv;
          const int64_t k_stride = heads * dk, v_stride = heads * dv;
          const float log2w = log2f(__ldg(p.quad_weights + weight_index));
          ForEachGroup<kNeighbourGroup>(count, [&](auto group, int32_t t) {
            constexpr int kRows = decltype(group)::kRows;
            const auto kt = ch.template LoadRows<kRows>(k_run + t * k_stride, k_stride);
            const auto vt = ch.template LoadRows<kRows>(v_run + t * v_stride, v_stride);
            float s[kRows];
            ch.Dots(qv, kt, s);
            ch.Sum(s);
            float m_new = m;
#pragma unroll
            for (int u = 0; u < kRows; ++u) {
              s[u] += log2w;
              m_new = fmaxf(m_new, s[u]);
            }
            // All scores so far -inf (zero weights): keep everything at zero, never inf - inf.
            const float base = m_new == kNegInf ? 0.f : m_new;
            const float decay = Exp2(m - base);
            float group_sum = 0.f;
#pragma unroll
            for (int u = 0; u < kRows; ++u) {
              s[u] = Exp2(s[u] - base);
              group_sum += s[u];
            }
            l = l * decay + group_sum;
            m = m_new;
            ch.Scale(acc, decay);
            ch.Accumulate(acc, s, vt);
          });
        });

        if (l == 0.f) {  // no neighbour inside the key window
          ch.StoreZero(out, dv);
          if (ch.Leader()) p.lse_out[query] = kNegInf;
        } else {
          ch.Store(out, acc, 1.f / l);
          if (ch.Leader()) p.lse_out[query] = (m + log2f(l)) * kLn2;
        }
      });
}

}  // namespace
}  // namespace gpu

int64_t NbhdAttnMaxHeadDims() { return gpu::kGeneralSharedBytes / (2 * static_cast<int64_t>(sizeof(float))); }

bool NbhdAttnHeadDimsSupported(int64_t head_dim_k, int64_t head_dim_v) {
  return head_dim_k >= 0 && head_dim_v >= 0 && head_dim_k + head_dim_v <= NbhdAttnMaxHeadDims();
}

namespace gpu {
namespace {

// The forward over `rows` x `cols` walking points of geometry G.
template <typename G>
cudaError_t LaunchFwd(cudaStream_t stream, const NbhdAttnGpuParams& p, int32_t rows, int32_t cols) {
  const bool aligned = Aligned16({p.q, p.k, p.v, p.out});
  return DispatchVariant(p, aligned, [&](auto variant) {
    using V = decltype(variant);
    using Ch = typename V::Channels;
    return LaunchTeams<Ch>(NbhdAttnFwdKernel<typename V::Element, Ch, G>, stream, p, rows, cols,
                           FwdWarpWords(p.head_dim_k, p.head_dim_v));
  });
}

}  // namespace
}  // namespace gpu

cudaError_t LaunchNbhdAttnFwd(cudaStream_t stream, const NbhdAttnGpuParams& p) {
  return gpu::LaunchFwd<gpu::GridGeometry<false>>(stream, p, p.nq_lat, p.nq_lon);
}

cudaError_t LaunchRingAttnFwd(cudaStream_t stream, const NbhdAttnGpuParams& p) {
  return gpu::LaunchFwd<gpu::RingGeometry<false>>(stream, p, p.num_walk_rings, p.max_ring_points);
}

}  // namespace s2attn
