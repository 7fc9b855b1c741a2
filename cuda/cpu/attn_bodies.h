// The arithmetic of the three CPU walks (forward, dq, dk/dv), for any walk: the regular grids'
// arc tables (nbhd_attn.cc) and the ring grids' patterns (ring_attn.cc).
//
// A walk W offers
//   int64_t units                       rows of work per batch entry (grid rows or rings)
//   int64_t UnitAt(int64_t rank)        the unit taken rank-th (longest first where known)
//   ForEachPoint(unit, point)           point(local, real, weight_index, for_each_run) for every walking point of
//                                       the unit: `local` its index in one batch entry's array, `real` false for
//                                       padding, `weight_index` its quadrature-weight index (used by dk/dv), and
//                                       for_each_run(run) calling run(weight_index, first, len) for each run of
//                                       consecutive visited points (local indices).
// Work is split into (batch, unit) items on the calling thread and XLA's pool. Every result element is
// computed by one thread in a fixed order, so results are bitwise identical for any number of threads.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <new>
#include <vector>

#include "cpu/cpu_common.h"

namespace s2attn {
namespace cpu {

// Sizes of one call as the bodies see it: per batch entry, the walking grid's and the visited grid's points
// (padding included). Activations are [batch, points, heads, dim] row-major.
struct CallSizes {
  int64_t batch = 0, heads = 0, dk = 0, dv = 0;
  int64_t walk_points = 0, other_points = 0;
  float scale = 1.0f;

  // The sizes of a call walking one grid (`walk_keys`: the keys', for dk/dv) of q_points and k_points.
  CallSizes(int64_t batch, int64_t heads, int64_t dk, int64_t dv, int64_t q_points, int64_t k_points, float scale,
            bool walk_keys)
      : batch(batch), heads(heads), dk(dk), dv(dv), walk_points(walk_keys ? k_points : q_points),
        other_points(walk_keys ? q_points : k_points), scale(scale) {}
};

// Runs `body` (widening activations and running one of the bodies below; false if a body threw) and turns
// allocation failures into RESOURCE_EXHAUSTED.
template <typename Body>
ffi::Error RunBody(const Body& body) {
  try {
    if (!body()) return OutOfMemory();
  } catch (const std::bad_alloc&) {
    return OutOfMemory();
  }
  return ffi::Error::Success();
}

// Runs body(b, unit) for every batch entry and walking unit; false if a body threw.
template <typename W, typename Body>
bool ForEachUnit(ffi::ThreadPool& pool, const CallSizes& s, const W& walk, const Body& body) {
  return ParallelFor(pool, s.batch * walk.units,
                     [&](int64_t item) { body(item % s.batch, walk.UnitAt(item / s.batch)); });
}

// out [batch, walk_points, H, Dv] (float32) and lse [batch, walk_points, H] of queries q walking keys k, values v;
// weights[i] is the quadrature weight of visited points of weight index i. A query without neighbours gets
// out = 0, lse = -inf.
template <typename W>
bool ForwardBody(ffi::ThreadPool& pool, const CallSizes& s, const W& walk, const float* q, const float* k,
                 const float* v, const float* weights, float* out, float* lse) {
  const int64_t H = s.heads, dk = s.dk, dv = s.dv;
  return ForEachUnit(pool, s, walk, [&](int64_t b, int64_t unit) {
    // Online softmax per head: running max m, weighted sum total, accumulator acc.
    std::vector<float> m(H), total(H), acc(H * dv);
    walk.ForEachPoint(unit, [&](int64_t local, bool real, int32_t /*weight_index*/, const auto& for_each_run) {
      const int64_t point = b * s.walk_points + local;
      std::fill(m.begin(), m.end(), kNegInf);
      std::fill(total.begin(), total.end(), 0.f);
      std::fill(acc.begin(), acc.end(), 0.f);
      if (real) {
        const float* q_pt = q + point * H * dk;
        for_each_run([&](int32_t weight_index, int64_t first, int32_t len) {
          const float w = weights[weight_index];
          const int64_t key = b * s.other_points + first;
          for (int64_t n = 0; n < len; ++n) {
            const float* k_pt = k + (key + n) * H * dk;
            const float* v_pt = v + (key + n) * H * dv;
            for (int64_t h = 0; h < H; ++h) {
              const float score = s.scale * Dot(q_pt + h * dk, k_pt + h * dk, dk);
              float* acc_h = acc.data() + h * dv;
              if (score > m[h]) {
                const float rescale = std::exp(m[h] - score);
                total[h] *= rescale;
                Scale(acc_h, rescale, dv);
                m[h] = score;
              }
              const float a = w * std::exp(score - m[h]);
              total[h] += a;
              Axpy(acc_h, a, v_pt + h * dv, dv);
            }
          }
        });
      }
      float* out_pt = out + point * H * dv;
      float* lse_pt = lse + point * H;
      for (int64_t h = 0; h < H; ++h) {
        const bool empty = total[h] == 0.f;  // no neighbour in the window (NaN is not empty)
        for (int64_t c = 0; c < dv; ++c) out_pt[h * dv + c] = empty ? 0.f : acc[h * dv + c] / total[h];
        lse_pt[h] = empty ? kNegInf : m[h] + std::log(total[h]);
      }
    });
  });
}

// dq [batch, walk_points, H, Dk] (float32) of queries walking the keys.
template <typename W>
bool BackwardDqBody(ffi::ThreadPool& pool, const CallSizes& s, const W& walk, const float* q, const float* k,
                    const float* v, const float* dout, const float* lse, const float* delta, const float* weights,
                    float* dq) {
  const int64_t H = s.heads, dk = s.dk, dv = s.dv;
  return ForEachUnit(pool, s, walk, [&](int64_t b, int64_t unit) {
    walk.ForEachPoint(unit, [&](int64_t local, bool real, int32_t /*weight_index*/, const auto& for_each_run) {
      const int64_t point = b * s.walk_points + local;
      float* dq_pt = dq + point * H * dk;
      std::fill(dq_pt, dq_pt + H * dk, 0.f);
      if (!real) return;
      const float* q_pt = q + point * H * dk;
      const float* dout_pt = dout + point * H * dv;
      const float* lse_pt = lse + point * H;
      const float* delta_pt = delta + point * H;
      for_each_run([&](int32_t weight_index, int64_t first, int32_t len) {
        const float w = weights[weight_index];
        const int64_t key = b * s.other_points + first;
        for (int64_t n = 0; n < len; ++n) {
          const float* k_pt = k + (key + n) * H * dk;
          const float* v_pt = v + (key + n) * H * dv;
          for (int64_t h = 0; h < H; ++h) {
            if (lse_pt[h] == kNegInf) continue;  // no neighbour anywhere: p = 0 (exp would give NaN)
            const float prob = w * std::exp(s.scale * Dot(q_pt + h * dk, k_pt + h * dk, dk) - lse_pt[h]);
            const float dscore = prob * (Dot(dout_pt + h * dv, v_pt + h * dv, dv) - delta_pt[h]);
            Axpy(dq_pt + h * dk, dscore, k_pt + h * dk, dk);
          }
        }
      });
      Scale(dq_pt, s.scale, H * dk);
    });
  });
}

// dk [batch, walk_points, H, Dk] and dv [batch, walk_points, H, Dv] (float32) of keys walking the queries
// (other_points are the queries' points); weights are indexed by the walking key's weight index.
template <typename W>
bool BackwardDkvBody(ffi::ThreadPool& pool, const CallSizes& s, const W& walk, const float* q, const float* k,
                     const float* v, const float* dout, const float* lse, const float* delta, const float* weights,
                     float* dk, float* dv) {
  const int64_t H = s.heads, dkh = s.dk, dvh = s.dv;
  return ForEachUnit(pool, s, walk, [&](int64_t b, int64_t unit) {
    walk.ForEachPoint(unit, [&](int64_t local, bool real, int32_t weight_index, const auto& for_each_run) {
      const int64_t point = b * s.walk_points + local;
      float* dk_pt = dk + point * H * dkh;
      float* dv_pt = dv + point * H * dvh;
      std::fill(dk_pt, dk_pt + H * dkh, 0.f);
      std::fill(dv_pt, dv_pt + H * dvh, 0.f);
      if (!real) return;
      const float* k_pt = k + point * H * dkh;
      const float* v_pt = v + point * H * dvh;
      for_each_run([&](int32_t /*query_weight_index*/, int64_t first, int32_t len) {
        const int64_t query = b * s.other_points + first;
        for (int64_t n = 0; n < len; ++n) {
          const float* q_pt = q + (query + n) * H * dkh;
          const float* dout_pt = dout + (query + n) * H * dvh;
          const float* lse_pt = lse + (query + n) * H;
          const float* delta_pt = delta + (query + n) * H;
          for (int64_t h = 0; h < H; ++h) {
            if (lse_pt[h] == kNegInf) continue;  // no neighbour anywhere: p = 0 (exp would give NaN)
            // The key's quadrature weight is applied once after the walk.
            const float prob = std::exp(s.scale * Dot(q_pt + h * dkh, k_pt + h * dkh, dkh) - lse_pt[h]);
            const float dscore = prob * (Dot(dout_pt + h * dvh, v_pt + h * dvh, dvh) - delta_pt[h]);
            Axpy(dv_pt + h * dvh, prob, dout_pt + h * dvh, dvh);
            Axpy(dk_pt + h * dkh, dscore, q_pt + h * dkh, dkh);
          }
        }
      });
      const float w = weights[weight_index];
      Scale(dv_pt, w, H * dvh);
      Scale(dk_pt, s.scale * w, H * dkh);
    });
  });
}

}  // namespace cpu
}  // namespace s2attn
