// CPU handlers of the neighbourhood-attention targets (contract: cuda/README.md): the three
// walks and the backward's delta.
//
// Work is split into (batch, walking row) items taken in row_order (longest rows first)
// by the calling thread and XLA's intra-op thread pool. Every result element is computed
// by exactly one thread in a fixed order, so results are bitwise identical for any number
// of threads. 16-bit activations are widened to float32 once per call; all arithmetic is
// float32.
#include "cpu/nbhd_attn.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <vector>

#include "common/arc_walk.h"
#include "common/delta_binding.h"
#include "common/ffi_check.h"
#include "common/nbhd_binding.h"
#include "common/nbhd_params.h"

namespace s2attn {
namespace {

using F32Result = ffi::ResultBuffer<ffi::F32>;
using AnyResult = ffi::Result<ffi::AnyBuffer>;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ------------------------------------------------------------------ 16-bit floats

float BFloat16ToFloat(uint16_t h) {
  const uint32_t bits = uint32_t{h} << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1f) {  // inf / nan
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {  // normal: rebias 15 -> 127
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {  // signed zero
    bits = sign;
  } else {  // subnormal: mantissa * 2^-24, normalised by shifting the leading one to bit 10
    exponent = 113;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// ------------------------------------------------------------------ threads

// Runs body(item) for every item in [0, count) on the calling thread and the pool, and
// returns once all items ran; false if any body threw (e.g. std::bad_alloc). The caller
// works too, so this never waits on a task that has not started (no deadlock when the
// caller is itself a pool thread); tasks that start late find no items left and touch
// only the shared state.
template <typename Body>
bool ParallelFor(ffi::ThreadPool& pool, int64_t count, const Body& body) {
  if (count <= 0) return true;
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<bool> failed{false};
    int64_t done = 0;
    std::mutex mutex;
    std::condition_variable all_done;
  };
  auto state = std::make_shared<State>();
  auto work = [state, count, &body]() {
    int64_t finished = 0;
    for (int64_t item; (item = state->next.fetch_add(1)) < count; ++finished) {
      try {
        body(item);
      } catch (...) {  // exceptions must not escape into XLA's threads
        state->failed = true;
      }
    }
    if (finished == 0) return;
    std::lock_guard<std::mutex> lock(state->mutex);
    state->done += finished;
    if (state->done == count) state->all_done.notify_all();
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), count - 1);
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule(decltype(work)(work));
  work();
  std::unique_lock<std::mutex> lock(state->mutex);
  state->all_done.wait(lock, [&] { return state->done == count; });
  return !state->failed;
}

// float32 data of an activation: the buffer itself, or a widened copy of a 16-bit one.
class FloatActivation {
 public:
  FloatActivation(const ffi::AnyBuffer& buffer, ElementType type, ffi::ThreadPool& pool) {
    if (type == ElementType::kF32) {
      data_ = static_cast<const float*>(buffer.untyped_data());
      return;
    }
    const int64_t n = static_cast<int64_t>(buffer.element_count());
    copy_.resize(n);
    const auto* bits = static_cast<const uint16_t*>(buffer.untyped_data());
    constexpr int64_t kChunk = 1 << 16;
    ParallelFor(pool, (n + kChunk - 1) / kChunk, [&](int64_t chunk) {  // cannot throw
      const int64_t end = std::min(n, (chunk + 1) * kChunk);
      for (int64_t i = chunk * kChunk; i < end; ++i)
        copy_[i] = type == ElementType::kBF16 ? BFloat16ToFloat(bits[i]) : HalfToFloat(bits[i]);
    });
    data_ = copy_.data();
  }
  const float* data() const { return data_; }

 private:
  std::vector<float> copy_;
  const float* data_ = nullptr;
};

// ------------------------------------------------------------------ vector helpers

// Fixed-order dot product (four interleaved partial sums, then the tail).
inline float Dot(const float* a, const float* b, int64_t n) {
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += a[i] * b[i];
    s1 += a[i + 1] * b[i + 1];
    s2 += a[i + 2] * b[i + 2];
    s3 += a[i + 3] * b[i + 3];
  }
  float s = (s0 + s1) + (s2 + s3);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void Axpy(float* y, float a, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

inline void Scale(float* y, float a, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] *= a;
}

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

  bool IsReal(int64_t i, int64_t j) const { return i < walk_window.nlat && j < walk_window.nlon; }

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

// Runs row_body(b, local_row) for every batch entry and walking row, longest rows first.
// Returns false if a row body threw.
template <typename RowBody>
bool ForEachWalkingRow(ffi::ThreadPool& pool, const NbhdParams& p, const Walk& walk, int64_t rows,
                       const RowBody& row_body) {
  return ParallelFor(pool, p.batch * rows,
              [&](int64_t item) { row_body(item % p.batch, int64_t{walk.row_order[item / p.batch]}); });
}

NbhdAttrs MakeAttrs(float scale, int64_t residues, int64_t shift, int64_t nlat_q, int64_t nlon_q, int64_t nlat_k,
                    int64_t nlon_k) {
  return NbhdAttrs{scale, residues, shift, nlat_q, nlon_q, nlat_k, nlon_k};
}

ffi::Error OutOfMemory() {
  return ffi::Error(ffi::ErrorCode::kResourceExhausted, "out of host memory");
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
  try {
    const FloatActivation qf(q, p.dtype, pool), kf(k, p.dtype, pool), vf(v, p.dtype, pool);
    const int64_t H = p.heads, dk = p.dk, dv = p.dv;
    const float* weights = quad_weights.typed_data();
    float* out_data = static_cast<float*>(out->untyped_data());
    float* lse_data = lse->typed_data();
    const bool ok = ForEachWalkingRow(pool, p, walk, p.nq_lat, [&](int64_t b, int64_t i) {
      // Online softmax per head: running max m, weighted sum A, accumulator acc.
      std::vector<float> m(H), total(H), acc(H * dv);
      for (int64_t j = 0; j < p.nq_lon; ++j) {
        const int64_t point = (b * p.nq_lat + i) * p.nq_lon + j;
        float* out_pt = out_data + point * H * dv;
        float* lse_pt = lse_data + point * H;
        std::fill(m.begin(), m.end(), kNegInf);
        std::fill(total.begin(), total.end(), 0.f);
        std::fill(acc.begin(), acc.end(), 0.f);
        if (walk.IsReal(i, j)) {
          const float* q_pt = qf.data() + point * H * dk;
          walk.ForEachRun(i, j, [&](int32_t row, int64_t first, int32_t len) {
            const float w = weights[row];
            const int64_t key = b * p.k_points() + first;
            for (int64_t n = 0; n < len; ++n) {
              const float* k_pt = kf.data() + (key + n) * H * dk;
              const float* v_pt = vf.data() + (key + n) * H * dv;
              for (int64_t h = 0; h < H; ++h) {
                const float s = p.scale * Dot(q_pt + h * dk, k_pt + h * dk, dk);
                float* acc_h = acc.data() + h * dv;
                if (s > m[h]) {
                  const float rescale = std::exp(m[h] - s);
                  total[h] *= rescale;
                  Scale(acc_h, rescale, dv);
                  m[h] = s;
                }
                const float a = w * std::exp(s - m[h]);
                total[h] += a;
                Axpy(acc_h, a, v_pt + h * dv, dv);
              }
            }
          });
        }
        for (int64_t h = 0; h < H; ++h) {
          const bool empty = total[h] == 0.f;  // no neighbour in the window (NaN is not empty)
          for (int64_t c = 0; c < dv; ++c) out_pt[h * dv + c] = empty ? 0.f : acc[h * dv + c] / total[h];
          lse_pt[h] = empty ? kNegInf : m[h] + std::log(total[h]);
        }
      }
    });
    if (!ok) return OutOfMemory();
  } catch (const std::bad_alloc&) {
    return OutOfMemory();
  }
  return ffi::Error::Success();
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
  try {
    const FloatActivation qf(q, p.dtype, pool), kf(k, p.dtype, pool), vf(v, p.dtype, pool);
    const FloatActivation doutf(dout, p.dtype, pool);
    const int64_t H = p.heads, dk = p.dk, dv = p.dv;
    const float* weights = quad_weights.typed_data();
    float* dq_data = static_cast<float*>(dq->untyped_data());
    const bool ok = ForEachWalkingRow(pool, p, walk, p.nq_lat, [&](int64_t b, int64_t i) {
      for (int64_t j = 0; j < p.nq_lon; ++j) {
        const int64_t point = (b * p.nq_lat + i) * p.nq_lon + j;
        float* dq_pt = dq_data + point * H * dk;
        std::fill(dq_pt, dq_pt + H * dk, 0.f);
        if (!walk.IsReal(i, j)) continue;
        const float* q_pt = qf.data() + point * H * dk;
        const float* dout_pt = doutf.data() + point * H * dv;
        const float* lse_pt = lse.typed_data() + point * H;
        const float* delta_pt = delta.typed_data() + point * H;
        walk.ForEachRun(i, j, [&](int32_t row, int64_t first, int32_t len) {
          const float w = weights[row];
          const int64_t key = b * p.k_points() + first;
          for (int64_t n = 0; n < len; ++n) {
            const float* k_pt = kf.data() + (key + n) * H * dk;
            const float* v_pt = vf.data() + (key + n) * H * dv;
            for (int64_t h = 0; h < H; ++h) {
              if (lse_pt[h] == kNegInf) continue;  // no neighbour anywhere: p = 0 (exp would give NaN)
              const float prob = w * std::exp(p.scale * Dot(q_pt + h * dk, k_pt + h * dk, dk) - lse_pt[h]);
              const float dscore = prob * (Dot(dout_pt + h * dv, v_pt + h * dv, dv) - delta_pt[h]);
              Axpy(dq_pt + h * dk, dscore, k_pt + h * dk, dk);
            }
          }
        });
        Scale(dq_pt, p.scale, H * dk);
      }
    });
    if (!ok) return OutOfMemory();
  } catch (const std::bad_alloc&) {
    return OutOfMemory();
  }
  return ffi::Error::Success();
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
  try {
    const FloatActivation qf(q, p.dtype, pool), kf(k, p.dtype, pool), vf(v, p.dtype, pool);
    const FloatActivation doutf(dout, p.dtype, pool);
    const int64_t H = p.heads, dkh = p.dk, dvh = p.dv;
    const float* weights = quad_weights.typed_data();
    const bool ok = ForEachWalkingRow(pool, p, walk, p.nk_lat, [&](int64_t b, int64_t i) {
      for (int64_t j = 0; j < p.nk_lon; ++j) {
        const int64_t point = (b * p.nk_lat + i) * p.nk_lon + j;
        float* dk_pt = static_cast<float*>(dk->untyped_data()) + point * H * dkh;
        float* dv_pt = static_cast<float*>(dv->untyped_data()) + point * H * dvh;
        std::fill(dk_pt, dk_pt + H * dkh, 0.f);
        std::fill(dv_pt, dv_pt + H * dvh, 0.f);
        if (!walk.IsReal(i, j)) continue;
        const float* k_pt = kf.data() + point * H * dkh;
        const float* v_pt = vf.data() + point * H * dvh;
        walk.ForEachRun(i, j, [&](int32_t /*query_row*/, int64_t first, int32_t len) {
          const int64_t query = b * p.q_points() + first;
          for (int64_t n = 0; n < len; ++n) {
            const float* q_pt = qf.data() + (query + n) * H * dkh;
            const float* dout_pt = doutf.data() + (query + n) * H * dvh;
            const float* lse_pt = lse.typed_data() + (query + n) * H;
            const float* delta_pt = delta.typed_data() + (query + n) * H;
            for (int64_t h = 0; h < H; ++h) {
              if (lse_pt[h] == kNegInf) continue;  // no neighbour anywhere: p = 0 (exp would give NaN)
              // The key's quadrature weight is applied once after the walk.
              const float prob = std::exp(p.scale * Dot(q_pt + h * dkh, k_pt + h * dkh, dkh) - lse_pt[h]);
              const float dscore = prob * (Dot(dout_pt + h * dvh, v_pt + h * dvh, dvh) - delta_pt[h]);
              Axpy(dv_pt + h * dvh, prob, dout_pt + h * dvh, dvh);
              Axpy(dk_pt + h * dkh, dscore, q_pt + h * dkh, dkh);
            }
          }
        });
        const float w = weights[walk.walk_window.lat0 + i];
        Scale(dv_pt, w, H * dvh);
        Scale(dk_pt, p.scale * w, H * dkh);
      }
    });
    if (!ok) return OutOfMemory();
  } catch (const std::bad_alloc&) {
    return OutOfMemory();
  }
  return ffi::Error::Success();
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
}  // namespace s2attn

XLA_FFI_DEFINE_HANDLER_SYMBOL(S2AttnNbhdForwardCpu, s2attn::Forward,
                              s2attn::BindForward(xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(S2AttnNbhdBackwardDqCpu, s2attn::BackwardDq,
                              s2attn::BindBackwardDq(xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(S2AttnNbhdBackwardDkvCpu, s2attn::BackwardDkv,
                              s2attn::BindBackwardDkv(xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(S2AttnDeltaCpu, s2attn::Delta,
                              s2attn::BindDelta(xla::ffi::Ffi::Bind().Ctx<xla::ffi::ThreadPool>()));
