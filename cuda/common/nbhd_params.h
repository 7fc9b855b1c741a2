// Sizes of one neighbourhood-attention call, decoded and validated from FFI buffers.
// Shared by the CPU and CUDA handlers (plain C++; never compiled by nvcc).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "common/ffi_check.h"

namespace s2attn {

// Target names, identical on CPU and CUDA (jax_s2attn/ops/_ffi.py holds the Python twins).
inline constexpr char kTargetForward[] = "jax_s2attn_nbhd_fwd";
inline constexpr char kTargetBackwardDq[] = "jax_s2attn_nbhd_bwd_dq";
inline constexpr char kTargetBackwardDkv[] = "jax_s2attn_nbhd_bwd_dkv";
// The scheduled tensor-core kernels (CUDA, sm_90a): the plan's block schedules instead of its tables.
inline constexpr char kTargetScheduledForward[] = "jax_s2attn_sched_fwd";
inline constexpr char kTargetScheduledBackwardDq[] = "jax_s2attn_sched_bwd_dq";
inline constexpr char kTargetScheduledBackwardDkv[] = "jax_s2attn_sched_bwd_dkv";
inline constexpr char kTargetScheduledBackwardDqDelta[] = "jax_s2attn_sched_bwd_dq_delta";
// The stencil kernels (CUDA only): the arc targets' operands with the walk's segment table in place of its arc
// table and the stencil pairs after them, writing only the stencil pairs' rows of results aliased to the scheduled
// targets' (the rows the scheduled kernels leave out). The dq_delta one takes dlse in place of delta: it forms
// delta from its own probabilities and returns it.
inline constexpr char kTargetStencilForward[] = "jax_s2attn_stencil_fwd";
inline constexpr char kTargetStencilBackwardDq[] = "jax_s2attn_stencil_bwd_dq";
inline constexpr char kTargetStencilBackwardDkv[] = "jax_s2attn_stencil_bwd_dkv";
inline constexpr char kTargetStencilBackwardDqDelta[] = "jax_s2attn_stencil_bwd_dq_delta";
// The arc walk between ring grids (CPU and CUDA): flat fields [..., npoints, H, D] and a RingPlan's patterns
// (common/ring_walk.h, common/ring_params.h).
inline constexpr char kTargetRingForward[] = "jax_s2attn_ring_fwd";
inline constexpr char kTargetRingBackwardDq[] = "jax_s2attn_ring_bwd_dq";
inline constexpr char kTargetRingBackwardDkv[] = "jax_s2attn_ring_bwd_dkv";
// The backward's delta = sum(dout * out, -1) - dlse, in a fixed summation order (common/delta_binding.h).
inline constexpr char kTargetDelta[] = "jax_s2attn_delta";

// What the `arc_offsets` / `arcs` operands hold: the arc table (offsets per pattern, rows of
// (row, lo, len)) or the segment table (offsets per walking row, rows of (row, lo[R], len[R])).
enum class TableForm { kArcs, kSegments };

// The element types activations may have. Accumulation is always float32.
enum class ElementType { kF32, kBF16, kF16 };

// Every size is in elements. "q grid" = query/output grid, "k grid" = key/input grid.
struct NbhdParams {
  int64_t batch = 0;        // product of all leading dims (vmap, user batch, shards)
  int64_t heads = 0;        // H
  int64_t dk = 0;           // query/key head dim
  int64_t dv = 0;           // value head dim
  int64_t nq_lat = 0;       // local rows of the query-grid arrays
  int64_t nq_lon = 0;       // local columns of the query-grid arrays
  int64_t nk_lat = 0;       // local rows of the key-grid arrays
  int64_t nk_lon = 0;       // local columns of the key-grid arrays
  int64_t nlat_q = 0;       // global query grid
  int64_t nlon_q = 0;
  int64_t nlat_k = 0;       // global key grid
  int64_t nlon_k = 0;
  int64_t residues = 1;     // R of the arc table being walked
  int64_t shift = 1;        // S of the arc table being walked
  int64_t num_patterns = 0; // rows of the walking grid * residues
  float scale = 1.0f;
  ElementType dtype = ElementType::kF32;

  int64_t q_points() const { return nq_lat * nq_lon; }
  int64_t k_points() const { return nk_lat * nk_lon; }
};

// Attributes common to all targets, in binding order.
struct NbhdAttrs {
  float scale;
  int64_t residues, shift, nlat_q, nlon_q, nlat_k, nlon_k;
};

inline ffi::Error ToElementType(ffi::DataType t, ElementType* out) {
  switch (t) {
    case ffi::DataType::F32: *out = ElementType::kF32; return ffi::Error::Success();
    case ffi::DataType::BF16: *out = ElementType::kBF16; return ffi::Error::Success();
    case ffi::DataType::F16: *out = ElementType::kF16; return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("activations must be float32, bfloat16 or float16");
  }
}

// The product of all but the last `trailing` dims (the flattened batch); 1 for none.
inline int64_t LeadingProduct(ffi::Span<const int64_t> dims, int64_t trailing) {
  int64_t product = 1;
  for (int64_t i = 0; i + trailing < static_cast<int64_t>(dims.size()); ++i) product *= dims[i];
  return product;
}

// Splits dims [..., nlat, nlon, H, D] into (batch, nlat, nlon, H, D).
inline ffi::Error SplitActivation(const char* name, ffi::Span<const int64_t> dims, int64_t* batch,
                                  int64_t* nlat, int64_t* nlon, int64_t* heads, int64_t* d) {
  const int64_t rank = static_cast<int64_t>(dims.size());
  S2ATTN_CHECK(rank >= 4, name << " must have rank >= 4 ([..., nlat, nlon, H, D]), got rank " << rank);
  *batch = LeadingProduct(dims, 4);
  *nlat = dims[rank - 4];
  *nlon = dims[rank - 3];
  *heads = dims[rank - 2];
  *d = dims[rank - 1];
  return ffi::Error::Success();
}

// Checks that `dims` is [leading..., nlat, nlon, heads, d] with the leading dims
// flattening to `batch` (those of the operand `batch_of`); d < 0 means there is no trailing
// head-dim axis (lse, delta).
inline ffi::Error CheckGridArray(const char* name, ffi::Span<const int64_t> dims, int64_t batch, int64_t nlat,
                                 int64_t nlon, int64_t heads, int64_t d, const char* batch_of = "q") {
  const int64_t trailing = d < 0 ? 3 : 4;
  const int64_t rank = static_cast<int64_t>(dims.size());
  S2ATTN_CHECK(rank >= trailing, name << " has rank " << rank << "; expected at least " << trailing);
  const int64_t* tail = dims.begin() + (rank - trailing);
  const bool ok = LeadingProduct(dims, trailing) == batch && tail[0] == nlat && tail[1] == nlon &&
                  tail[2] == heads && (d < 0 || tail[3] == d);
  S2ATTN_CHECK(ok, name << " has the wrong shape: expected [batch..., " << nlat << ", " << nlon << ", " << heads
                        << (d < 0 ? std::string() : ", " + std::to_string(d)) << "] with the batch dims of " << batch_of
                        << " (" << batch << " in all)");
  return ffi::Error::Success();
}

// A table operand holding `copies >= 1` identical copies of `expected` elements.
inline ffi::Error CheckTable(const char* name, int64_t count, int64_t expected) {
  S2ATTN_CHECK(expected > 0 && count > 0 && count % expected == 0,
               name << " has " << count << " elements; expected a multiple of " << expected);
  return ffi::Error::Success();
}

// Decodes q [..., nq_lat, nq_lon, H, Dk], k [..., nk_lat, nk_lon, H, Dk],
// v [..., nk_lat, nk_lon, H, Dv] and checks them against each other and the attributes.
// `walk_rows` is the row count of the walking grid (query rows for the forward table,
// key rows for the backward table); `num_offsets` the element count of arc_offsets.
inline ffi::Error DecodeParams(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                               const NbhdAttrs& attrs, bool walk_keys, int64_t window_count,
                               int64_t order_count, int64_t offsets_count, int64_t arcs_count,
                               int64_t weights_count, NbhdParams* p, TableForm form = TableForm::kArcs) {
  int64_t bq, bk, bv, hk, hv, dk2, nv_lat, nv_lon;
  S2ATTN_RETURN_IF_ERROR(SplitActivation("q", q.dimensions(), &bq, &p->nq_lat, &p->nq_lon, &p->heads, &p->dk));
  S2ATTN_RETURN_IF_ERROR(SplitActivation("k", k.dimensions(), &bk, &p->nk_lat, &p->nk_lon, &hk, &dk2));
  S2ATTN_RETURN_IF_ERROR(SplitActivation("v", v.dimensions(), &bv, &nv_lat, &nv_lon, &hv, &p->dv));
  S2ATTN_CHECK(bq == bk && bq == bv, "q, k, v must have the same leading (batch) dims; flattened sizes "
                                         << bq << ", " << bk << ", " << bv);
  S2ATTN_CHECK(hk == p->heads && hv == p->heads,
               "q, k, v must have the same number of heads, got " << p->heads << ", " << hk << ", " << hv);
  S2ATTN_CHECK(dk2 == p->dk, "q and k must have the same head dim, got " << p->dk << " and " << dk2);
  S2ATTN_CHECK(nv_lat == p->nk_lat && nv_lon == p->nk_lon,
               "k and v must cover the same grid block, got " << p->nk_lat << "x" << p->nk_lon << " and " << nv_lat
                                                              << "x" << nv_lon);
  S2ATTN_CHECK(k.element_type() == q.element_type() && v.element_type() == q.element_type(),
               "q, k, v must share one dtype");
  S2ATTN_RETURN_IF_ERROR(ToElementType(q.element_type(), &p->dtype));
  p->batch = bq;
  p->scale = attrs.scale;
  p->residues = attrs.residues;
  p->shift = attrs.shift;
  p->nlat_q = attrs.nlat_q;
  p->nlon_q = attrs.nlon_q;
  p->nlat_k = attrs.nlat_k;
  p->nlon_k = attrs.nlon_k;
  S2ATTN_CHECK(p->residues >= 1 && p->shift >= 1, "residues and shift must be >= 1");
  S2ATTN_CHECK(p->nq_lat <= p->nlat_q && p->nq_lon <= p->nlon_q && p->nk_lat <= p->nlat_k && p->nk_lon <= p->nlon_k,
               "local blocks exceed the global grids");
  const int64_t walk_rows = walk_keys ? p->nlat_k : p->nlat_q;
  const int64_t walk_lon = walk_keys ? p->nlon_k : p->nlon_q;
  S2ATTN_CHECK(walk_lon % p->residues == 0, "residues must divide the walking grid's longitudes");
  p->num_patterns = walk_rows * p->residues;
  S2ATTN_RETURN_IF_ERROR(CheckTable("window", window_count, 8));
  S2ATTN_RETURN_IF_ERROR(CheckTable("row_order", order_count, walk_keys ? p->nk_lat : p->nq_lat));
  if (form == TableForm::kArcs) {
    S2ATTN_RETURN_IF_ERROR(CheckTable("arc_offsets", offsets_count, p->num_patterns + 1));
    S2ATTN_CHECK(arcs_count % 3 == 0, "arcs must hold (row, lo, len) triples, got " << arcs_count << " elements");
  } else {
    S2ATTN_RETURN_IF_ERROR(CheckTable("segment_offsets", offsets_count, walk_rows + 1));
    S2ATTN_CHECK(arcs_count % (1 + 2 * p->residues) == 0,
                 "segments must hold rows of 1 + 2 * residues = " << 1 + 2 * p->residues << " values, got "
                                                                  << arcs_count << " elements");
  }
  S2ATTN_RETURN_IF_ERROR(CheckTable("quad_weights", weights_count, p->nlat_k));
  return ffi::Error::Success();
}

// Checks the extra operands of the backward targets against decoded params:
// dout [..., nq_lat, nq_lon, H, Dv] in the dtype of q, lse and delta [..., nq_lat, nq_lon, H]
// (their float32 dtype is enforced by the handler binding).
// `row_name` is the per-row operand after lse: delta, or dlse on the target that forms delta itself.
inline ffi::Error CheckBackwardOperands(const ffi::AnyBuffer& q, const ffi::AnyBuffer& dout,
                                        ffi::Span<const int64_t> lse_dims, ffi::Span<const int64_t> row_dims,
                                        const NbhdParams& p, const char* row_name = "delta") {
  S2ATTN_CHECK(dout.element_type() == q.element_type(), "dout must have the dtype of q");
  S2ATTN_RETURN_IF_ERROR(CheckGridArray("dout", dout.dimensions(), p.batch, p.nq_lat, p.nq_lon, p.heads, p.dv));
  S2ATTN_RETURN_IF_ERROR(CheckGridArray("lse", lse_dims, p.batch, p.nq_lat, p.nq_lon, p.heads, -1));
  return CheckGridArray(row_name, row_dims, p.batch, p.nq_lat, p.nq_lon, p.heads, -1);
}

inline const char* DataTypeName(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F64: return "float64";
    default: return "a non-float dtype";
  }
}

// The element type of the results `names` (out, dq, or dk and dv) of `types`: all float32, or, where
// `narrow_allowed` (the stencil targets), all of q's dtype `activations`; their type goes to
// `*result_type` unless that is null.
inline ffi::Error CheckResultTypes(const char* names, std::initializer_list<ffi::DataType> types,
                                   ffi::DataType activations, bool narrow_allowed, ElementType* result_type) {
  const ffi::DataType first = *types.begin();
  bool ok = first == ffi::DataType::F32 || (narrow_allowed && first == activations);
  std::string got;
  for (const ffi::DataType type : types) {
    ok = ok && type == first;
    got += (got.empty() ? "" : " and ") + std::string(DataTypeName(type));
  }
  const char* all = types.size() > 1 ? "all " : "";
  if (narrow_allowed) {
    S2ATTN_CHECK(ok, names << " must be " << all << "float32 or " << all << DataTypeName(activations)
                           << " (the dtype of q), got " << got);
  } else {
    S2ATTN_CHECK(ok, names << " must be float32 (16-bit results come from the scheduled and stencil targets), got "
                           << got);
  }
  return result_type ? ToElementType(first, result_type) : ffi::Error::Success();
}

}  // namespace s2attn
