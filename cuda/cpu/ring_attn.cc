// CPU handlers of the ring-grid targets (contract: cuda/README.md, "Ring targets"): the three
// walks of a RingPlan's patterns over flat fields [..., npoints, H, D]. The arithmetic is the
// regular grids' (attn_bodies.h); only the walk differs (common/ring_walk.h).
#include "cpu/ring_attn.h"

#include <algorithm>
#include <cstdint>
#include <new>
#include <vector>

#include "common/ffi_check.h"
#include "common/nbhd_binding.h"
#include "common/nbhd_params.h"
#include "common/ring_params.h"
#include "common/ring_walk.h"
#include "cpu/attn_bodies.h"
#include "cpu/cpu_common.h"

namespace s2attn {
namespace cpu {
namespace {

using AnyResult = ffi::Result<ffi::AnyBuffer>;

// The walk contract of attn_bodies.h over rings: a unit is a walking ring, taken most points first; a point's
// weight index is its ring, a run's the visited ring.
struct RingWalk {
  int64_t units = 0;
  const int32_t* order = nullptr;  // walking rings, most points first
  const int32_t* walk_rings = nullptr;
  const int32_t* offsets = nullptr;
  const int32_t* arcs = nullptr;

  int64_t UnitAt(int64_t rank) const { return order[rank]; }

  template <typename Point>
  void ForEachPoint(int64_t ring, const Point& point) const {
    const int32_t* ring_row = walk_rings + kWalkRingFields * ring;
    const int32_t first = ring_row[0], count = ring_row[1];
    for (int32_t i = 0; i < count; ++i) {
      const RingPoint at = RingPointOf(ring_row, i);
      point(int64_t{first} + i, true, static_cast<int32_t>(ring), [&](const auto& run) {
        for (int32_t a = offsets[at.pattern]; a < offsets[at.pattern + 1]; ++a) {
          const int32_t* arc = arcs + kRingArcFields * int64_t{a};
          const RingRuns runs = RunsOfArc(arc, at.position);
          for (int32_t r = 0; r < runs.count; ++r) run(arc[0], runs.first[r], runs.len[r]);
        }
      });
    }
  }
};

// Validates the tables (first copy) against the grids' points and returns the walk. Contents are checked
// because a bad table must not crash the process: walking rings tile the walking grid's points in order, every
// pattern of a ring exists, and every arc and every position a ring's points take stay inside a visited ring.
ffi::Error ReadRingWalk(const RingAttrs& attrs, int64_t walk_points, int64_t visited_points,
                        const I32Buffer& walk_rings, const I32Buffer& ring_order, const I32Buffer& offsets,
                        const I32Buffer& arcs, int64_t weights_count, int64_t weighted_rings, RingWalk* walk) {
  S2ATTN_RETURN_IF_ERROR(CheckRingTableSizes(attrs, walk_points, visited_points, walk_rings.element_count(),
                                             ring_order.element_count(), offsets.element_count(),
                                             arcs.element_count(), weights_count, weighted_rings));
  const int32_t* off = offsets.typed_data();
  S2ATTN_CHECK(off[0] == 0, "pattern_offsets must start at 0, got " << off[0]);
  for (int64_t i = 0; i < attrs.patterns; ++i)
    S2ATTN_CHECK(off[i + 1] >= off[i], "pattern_offsets must be non-decreasing (entry " << i + 1 << ")");
  const int64_t num_arcs = off[attrs.patterns];
  const int64_t arcs_count = static_cast<int64_t>(arcs.element_count());
  S2ATTN_CHECK(arcs_count >= kRingArcFields * num_arcs &&
                   (num_arcs == 0 ? arcs_count % kRingArcFields == 0 : arcs_count % (kRingArcFields * num_arcs) == 0),
               "pattern_arcs has " << arcs_count << " elements; pattern_offsets needs copies of " << num_arcs
                                   << " arcs of " << kRingArcFields << " values");
  const int32_t* arc = arcs.typed_data();
  for (int64_t a = 0; a < num_arcs; ++a, arc += kRingArcFields) {
    const int64_t first = arc[1], start = arc[2], length = arc[3], nlon = arc[4];
    S2ATTN_CHECK(arc[0] >= 0 && arc[0] < attrs.visited_rings && first >= 0 && nlon >= 1 && nlon <= kMaxRingPoints &&
                     first + nlon <= visited_points && start >= 0 && start < nlon && length >= 1 && length <= nlon &&
                     arc[5] >= 0,
                 "pattern arc " << a << " = (" << arc[0] << ", " << first << ", " << start << ", " << length << ", "
                                << nlon << ", " << arc[5] << ") is outside the visited grid of " << attrs.visited_rings
                                << " rings and " << visited_points << " points");
  }
  const int32_t* rings = walk_rings.typed_data();
  int64_t next_point = 0;
  for (int64_t r = 0; r < attrs.walk_rings; ++r) {
    const int32_t* ring = rings + kWalkRingFields * r;
    const int64_t first = ring[0], count = ring[1], pattern = ring[2], period = ring[3];
    S2ATTN_CHECK(first == next_point && count >= 1 && count <= attrs.max_ring_points && period >= 1 &&
                     pattern >= 0 && pattern + period <= attrs.patterns && first + count <= walk_points,
                 "walk_rings row " << r << " = (" << first << ", " << count << ", " << pattern << ", " << period
                                   << ") must start at point " << next_point << ", hold 1 to max_ring_points = "
                                   << attrs.max_ring_points << " points of the " << walk_points
                                   << " and patterns inside the " << attrs.patterns);
    next_point = first + count;
    const int64_t last_position = (count - 1) / period;
    for (int64_t a = off[pattern]; a < off[pattern + period]; ++a) {
      const int32_t* pattern_arc = arcs.typed_data() + kRingArcFields * a;
      S2ATTN_CHECK(int64_t{pattern_arc[5]} * last_position < pattern_arc[4],
                   "pattern arc " << a << " of walking ring " << r << " moves on by shift " << pattern_arc[5]
                                  << " for " << last_position << " positions, past its ring's " << pattern_arc[4]
                                  << " points");
    }
  }
  S2ATTN_CHECK(next_point == walk_points,
               "walk_rings cover " << next_point << " points; the walking grid has " << walk_points);
  const int32_t* order = ring_order.typed_data();
  std::vector<bool> seen(attrs.walk_rings, false);
  for (int64_t r = 0; r < attrs.walk_rings; ++r) {
    S2ATTN_CHECK(order[r] >= 0 && order[r] < attrs.walk_rings && !seen[order[r]],
                 "ring_order must be a permutation of 0.." << attrs.walk_rings - 1 << "; entry " << r << " is "
                                                           << order[r]);
    seen[order[r]] = true;
  }
  walk->units = attrs.walk_rings;
  walk->order = order;
  walk->walk_rings = rings;
  walk->offsets = off;
  walk->arcs = arcs.typed_data();
  return ffi::Error::Success();
}

CallSizes SizesOf(const RingParams& p, bool walk_keys) {
  return CallSizes(p.batch, p.heads, p.dk, p.dv, p.nq, p.nk, p.scale, walk_keys);
}

// Decodes the operands shared by both backward targets and the walk of the queries (dq) or the keys (dk/dv).
ffi::Error DecodeRingBackward(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                              const ffi::AnyBuffer& dout, const F32Buffer& lse, const F32Buffer& delta,
                              const I32Buffer& walk_rings, const I32Buffer& ring_order, const I32Buffer& offsets,
                              const I32Buffer& arcs, const F32Buffer& quad_weights, const RingAttrs& attrs,
                              bool walk_keys, RingParams* p, RingWalk* walk) {
  S2ATTN_RETURN_IF_ERROR(DecodeRingParams(q, k, v, attrs.scale, p));
  S2ATTN_RETURN_IF_ERROR(CheckRingBackwardOperands(q, dout, lse.dimensions(), delta.dimensions(), *p));
  // The weights are the input rings': the visited rings of the queries' walk, the walking rings of the keys'.
  return ReadRingWalk(attrs, walk_keys ? p->nk : p->nq, walk_keys ? p->nq : p->nk, walk_rings, ring_order, offsets,
                      arcs, quad_weights.element_count(), walk_keys ? attrs.walk_rings : attrs.visited_rings, walk);
}

ffi::Error RingForward(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                       I32Buffer walk_rings, I32Buffer ring_order, I32Buffer pattern_offsets, I32Buffer pattern_arcs,
                       F32Buffer quad_weights, ffi::RemainingArgs /*aliased_results*/, AnyResult out,
                       ffi::ResultBuffer<ffi::F32> lse, float scale, int64_t walk_ring_count,
                       int64_t visited_ring_count, int64_t pattern_count, int64_t max_ring_points) {
  const RingAttrs attrs{scale, walk_ring_count, visited_ring_count, pattern_count, max_ring_points};
  RingParams p;
  S2ATTN_RETURN_IF_ERROR(DecodeRingParams(q, k, v, scale, &p));
  S2ATTN_RETURN_IF_ERROR(CheckRingForwardResults(q, out, lse->dimensions(), p));
  RingWalk walk;
  S2ATTN_RETURN_IF_ERROR(ReadRingWalk(attrs, p.nq, p.nk, walk_rings, ring_order, pattern_offsets, pattern_arcs,
                                      quad_weights.element_count(), visited_ring_count, &walk));
  if (out->element_count() == 0 && lse->element_count() == 0) return ffi::Error::Success();
  return RunBody([&] {
    const FloatActivation qf(q, p.dtype, pool), kf(k, p.dtype, pool), vf(v, p.dtype, pool);
    return ForwardBody(pool, SizesOf(p, /*walk_keys=*/false), walk, qf.data(), kf.data(), vf.data(),
                       quad_weights.typed_data(), static_cast<float*>(out->untyped_data()), lse->typed_data());
  });
}

ffi::Error RingBackwardDq(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                          ffi::AnyBuffer dout, F32Buffer lse, F32Buffer delta, I32Buffer walk_rings,
                          I32Buffer ring_order, I32Buffer pattern_offsets, I32Buffer pattern_arcs,
                          F32Buffer quad_weights, ffi::RemainingArgs /*aliased_results*/, AnyResult dq, float scale,
                          int64_t walk_ring_count, int64_t visited_ring_count, int64_t pattern_count,
                          int64_t max_ring_points) {
  RingParams p;
  RingWalk walk;
  S2ATTN_RETURN_IF_ERROR(DecodeRingBackward(
      q, k, v, dout, lse, delta, walk_rings, ring_order, pattern_offsets, pattern_arcs, quad_weights,
      {scale, walk_ring_count, visited_ring_count, pattern_count, max_ring_points}, /*walk_keys=*/false, &p, &walk));
  S2ATTN_RETURN_IF_ERROR(CheckRingDqResult(q, dq, p));
  if (dq->element_count() == 0) return ffi::Error::Success();
  return RunBody([&] {
    const FloatActivation qf(q, p.dtype, pool), kf(k, p.dtype, pool), vf(v, p.dtype, pool);
    const FloatActivation doutf(dout, p.dtype, pool);
    return BackwardDqBody(pool, SizesOf(p, /*walk_keys=*/false), walk, qf.data(), kf.data(), vf.data(),
                          doutf.data(), lse.typed_data(), delta.typed_data(), quad_weights.typed_data(),
                          static_cast<float*>(dq->untyped_data()));
  });
}

ffi::Error RingBackwardDkv(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::AnyBuffer dout, F32Buffer lse, F32Buffer delta, I32Buffer walk_rings,
                           I32Buffer ring_order, I32Buffer pattern_offsets, I32Buffer pattern_arcs,
                           F32Buffer quad_weights, ffi::RemainingArgs /*aliased_results*/, AnyResult dk,
                           AnyResult dv, float scale, int64_t walk_ring_count, int64_t visited_ring_count,
                           int64_t pattern_count, int64_t max_ring_points) {
  RingParams p;
  RingWalk walk;
  S2ATTN_RETURN_IF_ERROR(DecodeRingBackward(
      q, k, v, dout, lse, delta, walk_rings, ring_order, pattern_offsets, pattern_arcs, quad_weights,
      {scale, walk_ring_count, visited_ring_count, pattern_count, max_ring_points}, /*walk_keys=*/true, &p, &walk));
  S2ATTN_RETURN_IF_ERROR(CheckRingDkvResults(q, dk, dv, p));
  if (dk->element_count() == 0 && dv->element_count() == 0) return ffi::Error::Success();
  return RunBody([&] {
    const FloatActivation qf(q, p.dtype, pool), kf(k, p.dtype, pool), vf(v, p.dtype, pool);
    const FloatActivation doutf(dout, p.dtype, pool);
    return BackwardDkvBody(pool, SizesOf(p, /*walk_keys=*/true), walk, qf.data(), kf.data(), vf.data(),
                           doutf.data(), lse.typed_data(), delta.typed_data(), quad_weights.typed_data(),
                           static_cast<float*>(dk->untyped_data()), static_cast<float*>(dv->untyped_data()));
  });
}

}  // namespace
}  // namespace cpu
}  // namespace s2attn

XLA_FFI_DEFINE_HANDLER_SYMBOL(S2AttnRingForwardCpu, s2attn::cpu::RingForward,
                              s2attn::BindRingForward(xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(S2AttnRingBackwardDqCpu, s2attn::cpu::RingBackwardDq,
                              s2attn::BindRingBackwardDq(xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(S2AttnRingBackwardDkvCpu, s2attn::cpu::RingBackwardDkv,
                              s2attn::BindRingBackwardDkv(xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()));
