// CPU handlers of the neighbourhood-attention targets on regular grids (contract: cuda/README.md):
// the three walks of the plan's arc tables, and the backward's delta.
//
// Work is split into (batch, walking row) items taken in row_order (longest rows first) by the
// calling thread and XLA's intra-op thread pool (attn_bodies.h). 16-bit activations are widened
// to float32 once per call; all arithmetic is float32.
#include "cpu/nbhd_attn.h"

#include <cstdint>
#include <new>
#include <vector>

#include "common/arc_walk.h"
#include "common/delta_binding.h"
#include "common/ffi_check.h"
#include "common/nbhd_binding.h"
#include "common/nbhd_params.h"
#include "cpu/attn_bodies.h"
#include "cpu/cpu_common.h"

namespace s2attn {
namespace cpu {
namespace {

using F32Result = ffi::ResultBuffer<ffi::F32>;
using AnyResult = ffi::Result<ffi::AnyBuffer>;

// ------------------------------------------------------------------ the walk

// Geometry of one walk direction: walking grid (whose points own the results) and the
// other grid (whose points are visited), with the arc table of the direction.
struct Walk {
  GridWindow walk_window, other_window;
  int64_t other_cols = 0;  // local columns of the other grid's arrays
  int32_t nlon_other = 0, residues = 1, shift = 1;
  const int32_t* row_order = nullptr;
  const int32_t* offsets = nullptr;
  const int32_t* arcs = nullptr;

  int64_t units = 0;      // local rows of the walking grid
  int64_t walk_cols = 0;  // local columns of the walking grid's arrays

  bool IsReal(int64_t i, int64_t j) const { return i < walk_window.nlat && j < walk_window.nlon; }

  int64_t UnitAt(int64_t rank) const { return row_order[rank]; }

  // The walk contract of attn_bodies.h: the points of local row i, their weight index the global row.
  template <typename Point>
  void ForEachPoint(int64_t i, const Point& point) const {
    const int32_t weight_index = walk_window.lat0 + static_cast<int32_t>(i);
    for (int64_t j = 0; j < walk_cols; ++j) {
      point(i * walk_cols + j, IsReal(i, j), weight_index, [&](const auto& run) { ForEachRun(i, j, run); });
    }
  }

  // Calls run(global_row, first, len) for each run of consecutive neighbours of the
  // walking point at local (i, j): `first` is the local flat point index (row * cols +
  // col) in the other grid's arrays, `len` the run length.
  template <typename Run>
  void ForEachRun(int64_t i, int64_t j, const Run& run) const {
    const WalkStart start = WalkStartOf(walk_window.lat0 + static_cast<int32_t>(i),
                                        walk_window.lon0 + static_cast<int32_t>(j), residues, shift);
    for (int32_t a = offsets[start.pattern]; a < offsets[start.pattern + 1]; ++a) {
      const int32_t* arc = arcs + 3 * int64_t{a};
      const int32_t local_row = other_window.LocalRow(arc[0]);
      if (local_row < 0) continue;
      const ArcPieces pieces =
          ClipArc(arc[1], arc[2], start.offset, nlon_other, other_window.lon0, other_window.nlon);
      for (int32_t p = 0; p < pieces.count; ++p) run(arc[0], local_row * other_cols + pieces.col[p], pieces.len[p]);
    }
  }
};

// Validates the table operands (first copy) against the sizes and returns the walk.
// Table contents are checked here because a bad table must not crash the process; on
// the GPU the same contents are device memory and are trusted.
ffi::Error ReadWalk(const NbhdParams& p, bool walk_keys, const I32Buffer& window, const I32Buffer& row_order,
                    const I32Buffer& offsets, const I32Buffer& arcs, Walk* walk) {
  constexpr int64_t kMaxExtent = int64_t{1} << 29;  // keeps every int32 in arc_walk.h from overflowing
  S2ATTN_CHECK(p.nlat_q < kMaxExtent && p.nlon_q < kMaxExtent && p.nlat_k < kMaxExtent && p.nlon_k < kMaxExtent &&
                   p.num_patterns < kMaxExtent && p.residues < kMaxExtent && p.shift < kMaxExtent,
               "grid sizes, residues and shift must be below 2^29");
  const Windows win = ReadWindows(window.typed_data());
  S2ATTN_CHECK(win.q.Fits(p.nq_lat, p.nq_lon, p.nlat_q, p.nlon_q),
               "window: query block (lat0, lon0, nlat, nlon) = (" << win.q.lat0 << ", " << win.q.lon0 << ", "
                   << win.q.nlat << ", " << win.q.nlon << ") must be non-negative, fit the local query arrays "
                   << p.nq_lat << "x" << p.nq_lon << " and the global query grid " << p.nlat_q << "x" << p.nlon_q);
  S2ATTN_CHECK(win.k.Fits(p.nk_lat, p.nk_lon, p.nlat_k, p.nlon_k),
               "window: key block (lat0, lon0, nlat, nlon) = (" << win.k.lat0 << ", " << win.k.lon0 << ", "
                   << win.k.nlat << ", " << win.k.nlon << ") must be non-negative, fit the local key arrays "
                   << p.nk_lat << "x" << p.nk_lon << " and the global key grid " << p.nlat_k << "x" << p.nlon_k);
  walk->walk_window = walk_keys ? win.k : win.q;
  walk->other_window = walk_keys ? win.q : win.k;
  walk->other_cols = walk_keys ? p.nq_lon : p.nk_lon;
  walk->units = walk_keys ? p.nk_lat : p.nq_lat;
  walk->walk_cols = walk_keys ? p.nk_lon : p.nq_lon;
  walk->nlon_other = static_cast<int32_t>(walk_keys ? p.nlon_q : p.nlon_k);
  walk->residues = static_cast<int32_t>(p.residues);
  walk->shift = static_cast<int32_t>(p.shift);
  const int64_t nlat_other = walk_keys ? p.nlat_q : p.nlat_k;
  const int64_t nlon_walk = walk_keys ? p.nlon_k : p.nlon_q;
  S2ATTN_CHECK(p.shift * ((nlon_walk - 1) / p.residues) < walk->nlon_other,
               "shift " << p.shift << " and residues " << p.residues << " move arc starts past the other grid's "
                        << walk->nlon_other << " longitudes");

  const int64_t rows = walk_keys ? p.nk_lat : p.nq_lat;
  const int32_t* order = row_order.typed_data();
  std::vector<bool> seen(rows, false);
  for (int64_t r = 0; r < rows; ++r) {
    S2ATTN_CHECK(order[r] >= 0 && order[r] < rows && !seen[order[r]],
                 "row_order must be a permutation of 0.." << rows - 1 << "; entry " << r << " is " << order[r]);
    seen[order[r]] = true;
  }

  const int32_t* off = offsets.typed_data();
  S2ATTN_CHECK(off[0] == 0, "arc_offsets must start at 0, got " << off[0]);
  for (int64_t i = 0; i < p.num_patterns; ++i)
    S2ATTN_CHECK(off[i + 1] >= off[i], "arc_offsets must be non-decreasing (entry " << i + 1 << ")");
  const int64_t num_arcs = off[p.num_patterns];
  const int64_t arcs_count = static_cast<int64_t>(arcs.element_count());
  S2ATTN_CHECK(num_arcs == 0 ? arcs_count % 3 == 0 : arcs_count % (3 * num_arcs) == 0,
               "arcs has " << arcs_count << " elements; arc_offsets needs copies of " << num_arcs << " arcs");
  const int32_t* arc = arcs.typed_data();
  for (int64_t a = 0; a < num_arcs; ++a, arc += 3) {
    S2ATTN_CHECK(arc[0] >= 0 && arc[0] < nlat_other && arc[1] >= 0 && arc[1] < walk->nlon_other && arc[2] >= 1 &&
                     arc[2] <= walk->nlon_other,
                 "arc " << a << " = (" << arc[0] << ", " << arc[1] << ", " << arc[2] << ") is outside the "
                        << nlat_other << "x" << walk->nlon_other << " grid it runs on");
  }
  walk->row_order = order;
  walk->offsets = off;
  walk->arcs = arcs.typed_data();
  return ffi::Error::Success();
}

CallSizes SizesOf(const NbhdParams& p, bool walk_keys) {
  return CallSizes(p.batch, p.heads, p.dk, p.dv, p.q_points(), p.k_points(), p.scale, walk_keys);
}

NbhdAttrs MakeAttrs(float scale, int64_t residues, int64_t shift, int64_t nlat_q, int64_t nlon_q, int64_t nlat_k,
                    int64_t nlon_k) {
  return NbhdAttrs{scale, residues, shift, nlat_q, nlon_q, nlat_k, nlon_k};
}

// ------------------------------------------------------------------ forward

ffi::Error Forward(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, I32Buffer window,
                   I32Buffer row_order, I32Buffer arc_offsets, I32Buffer arcs, F32Buffer quad_weights,
                   ffi::RemainingArgs /*aliased_results*/, ffi::Result<ffi::AnyBuffer> out, F32Result lse,
                   float scale, int64_t residues, int64_t shift, int64_t nlat_q, int64_t nlon_q, int64_t nlat_k,
                   int64_t nlon_k) {
  NbhdParams p;
  S2ATTN_RETURN_IF_ERROR(DecodeParams(q, k, v, MakeAttrs(scale, residues, shift, nlat_q, nlon_q, nlat_k, nlon_k),
                                      /*walk_keys=*/false, window.element_count(), row_order.element_count(),
                                      arc_offsets.element_count(), arcs.element_count(),
                                      quad_weights.element_count(), &p));
  S2ATTN_RETURN_IF_ERROR(CheckGridArray("out", out->dimensions(), p.batch, p.nq_lat, p.nq_lon, p.heads, p.dv));
  S2ATTN_RETURN_IF_ERROR(CheckGridArray("lse", lse->dimensions(), p.batch, p.nq_lat, p.nq_lon, p.heads, -1));
  S2ATTN_RETURN_IF_ERROR(CheckResultTypes("out", {out->element_type()}, q.element_type(), false, nullptr));
  Walk walk;
  S2ATTN_RETURN_IF_ERROR(ReadWalk(p, /*walk_keys=*/false, window, row_order, arc_offsets, arcs, &walk));
  if (out->element_count() == 0 && lse->element_count() == 0) return ffi::Error::Success();
  return RunBody([&] {
    const FloatActivation qf(q, p.dtype, pool), kf(k, p.dtype, pool), vf(v, p.dtype, pool);
    return ForwardBody(pool, SizesOf(p, /*walk_keys=*/false), walk, qf.data(), kf.data(), vf.data(),
                                quad_weights.typed_data(), static_cast<float*>(out->untyped_data()),
                                lse->typed_data());
  });
}

// ------------------------------------------------------------------ backward

// Operands shared by both backward targets, decoded and validated.
struct Backward {
  NbhdParams p;
  Walk walk;
};

ffi::Error DecodeBackward(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                          const ffi::AnyBuffer& dout, const F32Buffer& lse, const F32Buffer& delta,
                          const I32Buffer& window, const I32Buffer& row_order, const I32Buffer& arc_offsets,
                          const I32Buffer& arcs, const F32Buffer& quad_weights, const NbhdAttrs& attrs, bool walk_keys,
                          Backward* bw) {
  NbhdParams& p = bw->p;
  S2ATTN_RETURN_IF_ERROR(DecodeParams(q, k, v, attrs, walk_keys, window.element_count(), row_order.element_count(),
                                      arc_offsets.element_count(), arcs.element_count(),
                                      quad_weights.element_count(), &p));
  S2ATTN_RETURN_IF_ERROR(CheckBackwardOperands(q, dout, lse.dimensions(), delta.dimensions(), p));
  return ReadWalk(p, walk_keys, window, row_order, arc_offsets, arcs, &bw->walk);
}

ffi::Error BackwardDq(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer dout,
                      F32Buffer lse, F32Buffer delta, I32Buffer window, I32Buffer row_order, I32Buffer arc_offsets,
                      I32Buffer arcs, F32Buffer quad_weights, ffi::RemainingArgs /*aliased_results*/, AnyResult dq,
                      float scale, int64_t residues, int64_t shift, int64_t nlat_q, int64_t nlon_q, int64_t nlat_k,
                      int64_t nlon_k) {
  Backward bw;
  S2ATTN_RETURN_IF_ERROR(DecodeBackward(q, k, v, dout, lse, delta, window, row_order, arc_offsets, arcs, quad_weights,
                                        MakeAttrs(scale, residues, shift, nlat_q, nlon_q, nlat_k, nlon_k),
                                        /*walk_keys=*/false, &bw));
  const NbhdParams& p = bw.p;
  const Walk& walk = bw.walk;
  S2ATTN_RETURN_IF_ERROR(CheckGridArray("dq", dq->dimensions(), p.batch, p.nq_lat, p.nq_lon, p.heads, p.dk));
  S2ATTN_RETURN_IF_ERROR(CheckResultTypes("dq", {dq->element_type()}, q.element_type(), false, nullptr));
  if (dq->element_count() == 0) return ffi::Error::Success();
  return RunBody([&] {
    const FloatActivation qf(q, p.dtype, pool), kf(k, p.dtype, pool), vf(v, p.dtype, pool);
    const FloatActivation doutf(dout, p.dtype, pool);
    return BackwardDqBody(pool, SizesOf(p, /*walk_keys=*/false), walk, qf.data(), kf.data(), vf.data(),
                                   doutf.data(), lse.typed_data(), delta.typed_data(), quad_weights.typed_data(),
                                   static_cast<float*>(dq->untyped_data()));
  });
}

ffi::Error BackwardDkv(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer dout,
                       F32Buffer lse, F32Buffer delta, I32Buffer window, I32Buffer row_order, I32Buffer arc_offsets,
                       I32Buffer arcs, F32Buffer quad_weights, ffi::RemainingArgs /*aliased_results*/, AnyResult dk,
                       AnyResult dv, float scale, int64_t residues, int64_t shift, int64_t nlat_q, int64_t nlon_q,
                       int64_t nlat_k, int64_t nlon_k) {
  Backward bw;
  S2ATTN_RETURN_IF_ERROR(DecodeBackward(q, k, v, dout, lse, delta, window, row_order, arc_offsets, arcs, quad_weights,
                                        MakeAttrs(scale, residues, shift, nlat_q, nlon_q, nlat_k, nlon_k),
                                        /*walk_keys=*/true, &bw));
  const NbhdParams& p = bw.p;
  const Walk& walk = bw.walk;
  S2ATTN_RETURN_IF_ERROR(CheckGridArray("dk", dk->dimensions(), p.batch, p.nk_lat, p.nk_lon, p.heads, p.dk));
  S2ATTN_RETURN_IF_ERROR(CheckGridArray("dv", dv->dimensions(), p.batch, p.nk_lat, p.nk_lon, p.heads, p.dv));
  S2ATTN_RETURN_IF_ERROR(
      CheckResultTypes("dk and dv", {dk->element_type(), dv->element_type()}, q.element_type(), false, nullptr));
  if (dk->element_count() == 0 && dv->element_count() == 0) return ffi::Error::Success();
  return RunBody([&] {
    const FloatActivation qf(q, p.dtype, pool), kf(k, p.dtype, pool), vf(v, p.dtype, pool);
    const FloatActivation doutf(dout, p.dtype, pool);
    return BackwardDkvBody(pool, SizesOf(p, /*walk_keys=*/true), walk, qf.data(), kf.data(), vf.data(),
                                    doutf.data(), lse.typed_data(), delta.typed_data(), quad_weights.typed_data(),
                                    static_cast<float*>(dk->untyped_data()), static_cast<float*>(dv->untyped_data()));
  });
}

// ------------------------------------------------------------------ delta

// delta[r] = sum_c widen(dout[r, c]) * out[r, c] - dlse[r] for `rows` contiguous rows, summed
// sequentially over c = 0..dv-1 in float32 (an order that depends on nothing but dv).
template <typename T, typename Widen>
bool DeltaRows(ffi::ThreadPool& pool, const T* dout, const float* out, const float* dlse, float* delta,
               int64_t rows, int64_t dv, Widen widen) {
  constexpr int64_t kRowsPerItem = 4096;
  return ParallelFor(pool, (rows + kRowsPerItem - 1) / kRowsPerItem, [&](int64_t item) {
    const int64_t end = std::min(rows, (item + 1) * kRowsPerItem);
    for (int64_t r = item * kRowsPerItem; r < end; ++r) {
      const T* dout_row = dout + r * dv;
      const float* out_row = out + r * dv;
      float sum = 0.f;
      for (int64_t c = 0; c < dv; ++c) sum += widen(dout_row[c]) * out_row[c];
      delta[r] = sum - dlse[r];
    }
  });
}

ffi::Error Delta(ffi::ThreadPool pool, ffi::AnyBuffer dout, F32Buffer out, F32Buffer dlse,
                 ffi::RemainingArgs /*aliased_results*/, F32Result delta) {
  DeltaParams p;
  S2ATTN_RETURN_IF_ERROR(DecodeDelta(dout, out.dimensions(), dlse.dimensions(), delta->dimensions(), &p));
  if (p.rows == 0) return ffi::Error::Success();
  const float* out_data = out.typed_data();
  const float* dlse_data = dlse.typed_data();
  float* delta_data = delta->typed_data();
  const auto* bits = static_cast<const uint16_t*>(dout.untyped_data());
  bool ok = false;
  try {
    switch (p.dtype) {
      case ElementType::kF32:
        ok = DeltaRows(pool, static_cast<const float*>(dout.untyped_data()), out_data, dlse_data, delta_data, p.rows,
                       p.dv, [](float x) { return x; });
        break;
      case ElementType::kBF16:
        ok = DeltaRows(pool, bits, out_data, dlse_data, delta_data, p.rows, p.dv, BFloat16ToFloat);
        break;
      case ElementType::kF16:
        ok = DeltaRows(pool, bits, out_data, dlse_data, delta_data, p.rows, p.dv, HalfToFloat);
        break;
    }
  } catch (const std::bad_alloc&) {
    ok = false;
  }
  return ok ? ffi::Error::Success() : OutOfMemory();
}

}  // namespace
}  // namespace cpu
}  // namespace s2attn

XLA_FFI_DEFINE_HANDLER_SYMBOL(S2AttnNbhdForwardCpu, s2attn::cpu::Forward,
                              s2attn::BindForward(xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(S2AttnNbhdBackwardDqCpu, s2attn::cpu::BackwardDq,
                              s2attn::BindBackwardDq(xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(S2AttnNbhdBackwardDkvCpu, s2attn::cpu::BackwardDkv,
                              s2attn::BindBackwardDkv(xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(S2AttnDeltaCpu, s2attn::cpu::Delta,
                              s2attn::BindDelta(xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()));
