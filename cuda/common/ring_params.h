// Sizes of one call of a ring target (flat fields [..., npoints, H, D]), decoded and validated from
// FFI buffers. Plain C++; shared by the handlers of the ring targets.
#pragma once

#include <cstdint>
#include <string>

#include "common/ffi_check.h"
#include "common/nbhd_params.h"
#include "common/ring_walk.h"

namespace s2attn {

// "q grid" = query/output grid, "k grid" = key/input grid; points per batch entry.
struct RingParams {
  int64_t batch = 0;  // product of all leading dims
  int64_t heads = 0, dk = 0, dv = 0;
  int64_t nq = 0, nk = 0;
  float scale = 1.0f;
  ElementType dtype = ElementType::kF32;
};

// The attributes of a ring target: the scale and the sizes of one copy of its tables.
struct RingAttrs {
  float scale;
  int64_t walk_rings, visited_rings, patterns, max_ring_points;
};

// Splits dims [..., npoints, H, D] into (batch, npoints, H, D).
inline ffi::Error SplitFlatActivation(const char* name, ffi::Span<const int64_t> dims, int64_t* batch,
                                      int64_t* points, int64_t* heads, int64_t* d) {
  const int64_t rank = static_cast<int64_t>(dims.size());
  S2ATTN_CHECK(rank >= 3, name << " must have rank >= 3 ([..., npoints, H, D]), got rank " << rank);
  *batch = LeadingProduct(dims, 3);
  *points = dims[rank - 3];
  *heads = dims[rank - 2];
  *d = dims[rank - 1];
  return ffi::Error::Success();
}

// Checks that `dims` is [leading..., points, heads, d] with the leading dims flattening to `batch`; d < 0 means
// there is no head-dim axis (lse, delta).
inline ffi::Error CheckPointArray(const char* name, ffi::Span<const int64_t> dims, int64_t batch, int64_t points,
                                  int64_t heads, int64_t d) {
  const int64_t trailing = d < 0 ? 2 : 3;
  const int64_t rank = static_cast<int64_t>(dims.size());
  S2ATTN_CHECK(rank >= trailing, name << " has rank " << rank << "; expected at least " << trailing);
  const int64_t* tail = dims.begin() + (rank - trailing);
  const bool ok =
      LeadingProduct(dims, trailing) == batch && tail[0] == points && tail[1] == heads && (d < 0 || tail[2] == d);
  S2ATTN_CHECK(ok, name << " has the wrong shape: expected [batch..., " << points << ", " << heads
                        << (d < 0 ? std::string() : ", " + std::to_string(d)) << "] with the batch dims of q ("
                        << batch << " in all)");
  return ffi::Error::Success();
}

// Checks the attributes and the table operands' sizes (each a whole number of copies of the attributes' tables)
// against the grids' points; `weighted_rings` is how many rings quad_weights weighs (the input grid's: the
// visited rings of the queries' walk, the walking rings of the keys').
inline ffi::Error CheckRingTableSizes(const RingAttrs& attrs, int64_t walk_points, int64_t visited_points,
                                      int64_t walk_rings_count, int64_t ring_order_count, int64_t offsets_count,
                                      int64_t arcs_count, int64_t weights_count, int64_t weighted_rings) {
  S2ATTN_CHECK(attrs.walk_rings >= 1 && attrs.visited_rings >= 1 && attrs.patterns >= 1 &&
                   attrs.max_ring_points >= 1 && attrs.max_ring_points <= kMaxRingPoints,
               "walk_ring_count, visited_ring_count, pattern_count and max_ring_points must be >= 1 (and rings at "
               "most " << kMaxRingPoints << " points), got " << attrs.walk_rings << ", " << attrs.visited_rings
                       << ", " << attrs.patterns << ", " << attrs.max_ring_points);
  S2ATTN_CHECK(walk_points < (int64_t{1} << 31) && visited_points < (int64_t{1} << 31),
               "ring grids index points with int32: at most 2^31 - 1 points, got " << walk_points << " and "
                                                                                   << visited_points);
  S2ATTN_CHECK(attrs.walk_rings <= walk_points && attrs.visited_rings <= visited_points,
               "walk_ring_count " << attrs.walk_rings << " and visited_ring_count " << attrs.visited_rings
                                  << " must not exceed the grids' points " << walk_points << " and "
                                  << visited_points << " (a ring has at least one point)");
  S2ATTN_RETURN_IF_ERROR(CheckTable("walk_rings", walk_rings_count, kWalkRingFields * attrs.walk_rings));
  S2ATTN_RETURN_IF_ERROR(CheckTable("ring_order", ring_order_count, attrs.walk_rings));
  S2ATTN_RETURN_IF_ERROR(CheckTable("pattern_offsets", offsets_count, attrs.patterns + 1));
  S2ATTN_CHECK(arcs_count % kRingArcFields == 0,
               "pattern_arcs must hold rows of " << kRingArcFields << " values, got " << arcs_count << " elements");
  return CheckTable("quad_weights", weights_count, weighted_rings);
}

// Decodes q [..., nq, H, Dk], k [..., nk, H, Dk], v [..., nk, H, Dv] and checks them against each other.
inline ffi::Error DecodeRingParams(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                                   float scale, RingParams* p) {
  int64_t bk, bv, hk, hv, dk2, nv;
  S2ATTN_RETURN_IF_ERROR(SplitFlatActivation("q", q.dimensions(), &p->batch, &p->nq, &p->heads, &p->dk));
  S2ATTN_RETURN_IF_ERROR(SplitFlatActivation("k", k.dimensions(), &bk, &p->nk, &hk, &dk2));
  S2ATTN_RETURN_IF_ERROR(SplitFlatActivation("v", v.dimensions(), &bv, &nv, &hv, &p->dv));
  S2ATTN_CHECK(bk == p->batch && bv == p->batch, "q, k, v must have the same leading (batch) dims; flattened sizes "
                                                     << p->batch << ", " << bk << ", " << bv);
  S2ATTN_CHECK(hk == p->heads && hv == p->heads,
               "q, k, v must have the same number of heads, got " << p->heads << ", " << hk << ", " << hv);
  S2ATTN_CHECK(dk2 == p->dk, "q and k must have the same head dim, got " << p->dk << " and " << dk2);
  S2ATTN_CHECK(nv == p->nk, "k and v must have the same points, got " << p->nk << " and " << nv);
  S2ATTN_CHECK(k.element_type() == q.element_type() && v.element_type() == q.element_type(),
               "q, k, v must share one dtype");
  p->scale = scale;
  return ToElementType(q.element_type(), &p->dtype);
}

// Checks dout [..., nq, H, Dv] (the dtype of q), lse and delta [..., nq, H] against decoded params.
inline ffi::Error CheckRingBackwardOperands(const ffi::AnyBuffer& q, const ffi::AnyBuffer& dout,
                                            ffi::Span<const int64_t> lse_dims, ffi::Span<const int64_t> delta_dims,
                                            const RingParams& p) {
  S2ATTN_CHECK(dout.element_type() == q.element_type(), "dout must have the dtype of q");
  S2ATTN_RETURN_IF_ERROR(CheckPointArray("dout", dout.dimensions(), p.batch, p.nq, p.heads, p.dv));
  S2ATTN_RETURN_IF_ERROR(CheckPointArray("lse", lse_dims, p.batch, p.nq, p.heads, -1));
  return CheckPointArray("delta", delta_dims, p.batch, p.nq, p.heads, -1);
}

// Checks the results of a ring target, all float32: the forward's out [..., nq, H, Dv] and lse [..., nq, H].
inline ffi::Error CheckRingForwardResults(const ffi::AnyBuffer& q, const ffi::Result<ffi::AnyBuffer>& out,
                                          ffi::Span<const int64_t> lse_dims, const RingParams& p) {
  S2ATTN_RETURN_IF_ERROR(CheckPointArray("out", out->dimensions(), p.batch, p.nq, p.heads, p.dv));
  S2ATTN_RETURN_IF_ERROR(CheckPointArray("lse", lse_dims, p.batch, p.nq, p.heads, -1));
  return CheckResultTypes("out", {out->element_type()}, q.element_type(), false, nullptr);
}

// dq, the shape of q.
inline ffi::Error CheckRingDqResult(const ffi::AnyBuffer& q, const ffi::Result<ffi::AnyBuffer>& dq,
                                    const RingParams& p) {
  S2ATTN_RETURN_IF_ERROR(CheckPointArray("dq", dq->dimensions(), p.batch, p.nq, p.heads, p.dk));
  return CheckResultTypes("dq", {dq->element_type()}, q.element_type(), false, nullptr);
}

// dk and dv, the shapes of k and v.
inline ffi::Error CheckRingDkvResults(const ffi::AnyBuffer& q, const ffi::Result<ffi::AnyBuffer>& dk,
                                      const ffi::Result<ffi::AnyBuffer>& dv, const RingParams& p) {
  S2ATTN_RETURN_IF_ERROR(CheckPointArray("dk", dk->dimensions(), p.batch, p.nk, p.heads, p.dk));
  S2ATTN_RETURN_IF_ERROR(CheckPointArray("dv", dv->dimensions(), p.batch, p.nk, p.heads, p.dv));
  return CheckResultTypes("dk and dv", {dk->element_type(), dv->element_type()}, q.element_type(), false, nullptr);
}

}  // namespace s2attn
