// Stencil prototype (benchmarks/stencil_attention.sh builds and runs it): forward, dq and dk/dv of the
// rows whose arcs are all short, on CUDA cores, to measure what a stencil path would cost before it is
// built into the module (NOTES, session 13: at 721x1440 with the default cutoff, rows whose arcs have at
// most 8 columns are 84 % of the points and take 78 % of the tiled kernels' staged chunks, where a
// 64-point unit multiplies 2 x 16 columns per warp and segment to use ~5).
//
// A block owns kRows consecutive walking rows x kLons longitudes (query rows for the forward and dq,
// key rows for dk/dv). It stages the rows of the other grid its points see (at most kMaxOtherRows, each
// kLons + 2 kMaxHalf columns around the block's longitudes: K and V, or Q and dout with their lse and
// delta) into shared memory once, all copies in flight together (cp.async), then kLanes lanes per point (kD / kLanes channels each) walk the
// point's columns there: dot products over the lanes (two shuffles each), in float32 throughout:
//   forward: online softmax in log2 units with the quadrature weight as a bias, out = P V / l, lse;
//   dq:      p = w exp(s - lse), dq = scale sum p (dout.v - delta) k;
//   dk/dv:   dv = sum p dout, dk = scale sum p (dout.v - delta) q over the queries that see the key.
//
// out is float32 (the residual delta is formed from); dq, dk and dv are bf16, each the float32 sum rounded
// to nearest, as the module writes the op's gradients.
//
// Self-attention on an equiangular grid, bf16, one head of 64 channels, neighbourhoods and stand-in
// weights from bench_reference.h (the half-width table is symmetric: a key row's queries are the rows it
// sees). Rows qualify when every arc has at most kMaxHalf columns each side and their block's other rows
// fit kMaxOtherRows. Every result of those rows is poisoned (NaN) before the run and must be written;
// sampled points are checked against the float64 truth (dq from the true delta, dk and dv from the
// kernels' lse and the delta of their out, as the op forms them). Standalone: not part of the package.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_common.h"
#include "bench/bench_reference.h"
#include "gpu/device_common.cuh"
#include "gpu/mbarrier_sm90.cuh"

namespace {

using namespace bench;  // T, kD, kScale, kRing and the float64 truth
using s2attn::gpu::Exp2;
using s2attn::gpu::kLn2;
using s2attn::gpu::kLog2e;

// Blocks per SM the launch bounds ask of dq and dk/dv (-DSTENCIL_MIN_BLOCKS=3 caps them at 80 registers);
// the forward asks for 4 (64 registers).
#ifndef STENCIL_MIN_BLOCKS
#define STENCIL_MIN_BLOCKS 2
#endif

constexpr int kMaxHalf = 3;                 // longitudes each side: arcs of at most 7 columns
constexpr int kRows = 2;                    // walking rows per block
constexpr int kLons = 32;                   // longitudes per block
constexpr int kLanes = 4;                   // lanes per point
constexpr int kLaneChannels = kD / kLanes;  // 16: two 16-byte loads
constexpr int kThreads = kRows * kLons * kLanes;
constexpr int kMaxOtherRows = 4;
constexpr int kWindow = kLons + 2 * kMaxHalf;  // staged columns per other row
// Staged rows padded by 16 bytes: the points of a quarter-warp read rows 144 bytes apart, in different banks.
constexpr int kStride = kD + 8;
constexpr int kVectors = kD * 2 / 16;  // 16-byte vectors per row of one operand

enum class Kind { kForward, kDq, kDkv };

struct Problem {
  int nlat, nlon;
  const T *q, *k, *v, *dout;
  const float *lse, *delta;  // the forward's lse and delta = sum(dout * out), for dq and dk/dv
  const int* half;           // [nlat][nlat] longitudes each side (-1: none); no ring among the walked rows
  const float* log2w;        // [nlat]
  const int* block_rows;     // [blocks]: first walking row and first other row of each block row
  float *out, *lse_out;
  T *dq, *dk, *dv;
  float scale;
};

// The block's shared memory (dynamic, under the default 48 KiB: no opt-in).
struct Staged {
  T a[kMaxOtherRows][kWindow][kStride];  // K (query walks) or Q (key walk)
  T b[kMaxOtherRows][kWindow][kStride];  // V or dout
  float lse[kMaxOtherRows][kWindow];     // key walk: lse of the staged queries
  float delta[kMaxOtherRows][kWindow];   // key walk: their delta
  uint64_t staged;                       // completes when every thread's copies landed
};
static_assert(sizeof(Staged) <= 48 * 1024, "dynamic shared memory beyond 48 KiB needs an opt-in");

// log2(e) * lse, with +inf for a point without neighbours (lse = -inf), so that exp2(x - it) = 0.
__device__ float Log2Lse(float lse) { return lse == -INFINITY ? INFINITY : kLog2e * lse; }

// Starts staging rows other_row0 .. other_row0 + kMaxOtherRows - 1 (those past the grid are never read),
// columns lon0 - kMaxHalf .. lon0 + kLons + kMaxHalf - 1 taken modulo nlon: every copy of the thread in
// flight at once (cp.async), landed when s.staged completes (each thread arrives for its copies and for
// itself), so that staging costs one trip to memory rather than one per copy.
template <Kind kKind>
__device__ void StartStaging(Staged& s, const Problem& p, int other_row0, int lon0) {
  const T* a = kKind == Kind::kDkv ? p.q : p.k;
  const T* b = kKind == Kind::kDkv ? p.dout : p.v;
  for (int e = threadIdx.x; e < kMaxOtherRows * kWindow * kVectors; e += kThreads) {
    const int vec = e % kVectors, col = (e / kVectors) % kWindow, r = e / (kVectors * kWindow);
    if (other_row0 + r >= p.nlat) continue;
    const int lon = ((lon0 - kMaxHalf + col) % p.nlon + p.nlon) % p.nlon;
    const size_t point = size_t(other_row0 + r) * p.nlon + lon;
    s2attn::gpu::CopyAsync16(&s.a[r][col][8 * vec], a + point * kD + 8 * vec);
    s2attn::gpu::CopyAsync16(&s.b[r][col][8 * vec], b + point * kD + 8 * vec);
    if (kKind == Kind::kDkv && vec == 0) {
      s2attn::gpu::CopyAsync4(&s.lse[r][col], p.lse + point);
      s2attn::gpu::CopyAsync4(&s.delta[r][col], p.delta + point);
    }
  }
  s2attn::gpu::CopyAsyncArriveOn(&s.staged);
  s2attn::gpu::MbarrierArrive(&s.staged);
}

// A lane's kLaneChannels channels of a row, widened: two 16-byte loads (in shared memory, a quarter-warp's
// loads then fall in distinct banks with the padded stride).
__device__ void LoadChannels(float (&x)[kLaneChannels], const T* row) {
  const uint4* vectors = reinterpret_cast<const uint4*>(row);
  for (int h = 0; h < kLaneChannels / 8; ++h) {
    const uint4 u = vectors[h];
    const uint32_t words[4] = {u.x, u.y, u.z, u.w};
    for (int w = 0; w < 4; ++w) {
      const float2 y = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[w]));
      x[8 * h + 2 * w] = y.x, x[8 * h + 2 * w + 1] = y.y;
    }
  }
}

// The lane's channels of a point's row of x, widened and multiplied by `scale`.
__device__ void LoadLane(float (&dst)[kLaneChannels], const T* x, size_t point, int lane, float scale) {
  LoadChannels(dst, x + point * kD + lane * kLaneChannels);
  for (float& e : dst) e *= scale;
}

// x . y over the point's kLanes lanes (every lane of the warp takes part).
__device__ float LaneDot(const float (&x)[kLaneChannels], const float (&y)[kLaneChannels]) {
  float dot = 0.f;
  for (int e = 0; e < kLaneChannels; ++e) dot = fmaf(x[e], y[e], dot);
  dot += __shfl_xor_sync(0xffffffffu, dot, 1);
  return dot + __shfl_xor_sync(0xffffffffu, dot, 2);
}

// acc = acc * decay + weight * y (the lane's channels).
__device__ void Accumulate(float (&acc)[kLaneChannels], float decay, float weight, const float (&y)[kLaneChannels]) {
  for (int e = 0; e < kLaneChannels; ++e) acc[e] = fmaf(acc[e], decay, weight * y[e]);
}

__device__ void StoreLane(float* x, size_t point, int lane, const float (&acc)[kLaneChannels], float scale) {
  float4* dst = reinterpret_cast<float4*>(x + point * kD + lane * kLaneChannels);
  for (int c = 0; c < kLaneChannels; c += 4) {
    dst[c / 4] = make_float4(acc[c] * scale, acc[c + 1] * scale, acc[c + 2] * scale, acc[c + 3] * scale);
  }
}

// The same rounded to nearest in T: 16-byte stores of eight channels.
__device__ void StoreLane(T* x, size_t point, int lane, const float (&acc)[kLaneChannels], float scale) {
  uint4* dst = reinterpret_cast<uint4*>(x + point * kD + lane * kLaneChannels);
  for (int c = 0; c < kLaneChannels; c += 8) {
    uint32_t words[4];
    for (int w = 0; w < 4; ++w) {
      const __nv_bfloat162 pair = __floats2bfloat162_rn(acc[c + 2 * w] * scale, acc[c + 2 * w + 1] * scale);
      words[w] = *reinterpret_cast<const uint32_t*>(&pair);
    }
    dst[c / 8] = make_uint4(words[0], words[1], words[2], words[3]);
  }
}

template <Kind kKind>
__global__ void __launch_bounds__(kThreads, kKind == Kind::kForward ? 4 : STENCIL_MIN_BLOCKS) Stencil(const Problem p) {
  Staged& s = *reinterpret_cast<Staged*>(s2attn::gpu::DynamicShared());
  const int row0 = p.block_rows[2 * blockIdx.y], other_row0 = p.block_rows[2 * blockIdx.y + 1];
  const int lon0 = blockIdx.x * kLons;
  if (threadIdx.x == 0) s2attn::gpu::MbarrierInit(&s.staged, 2 * kThreads);
  __syncthreads();
  StartStaging<kKind>(s, p, other_row0, lon0);

  const int lane = threadIdx.x % kLanes, point_in_block = threadIdx.x / kLanes;
  const int row = row0 + point_in_block / kLons, lon_in_block = point_in_block % kLons, lon = lon0 + lon_in_block;
  // Every lane of a warp runs the same walk (one row per warp; points past the grid walk a clamped
  // point and write nothing), so the shuffles take the whole warp.
  const bool real = row < p.nlat && lon < p.nlon;
  const int walk_row = min(row, p.nlat - 1);
  const size_t point = size_t(walk_row) * p.nlon + min(lon, p.nlon - 1);
  const float scale2 = p.scale * kLog2e;
  // Forward and dq: q (scaled to log2 units); dk/dv: k (likewise).
  float own[kLaneChannels], second[kLaneChannels], acc[kLaneChannels] = {}, acc2[kLaneChannels] = {};
  LoadLane(own, kKind == Kind::kDkv ? p.k : p.q, point, lane, scale2);
  if (kKind != Kind::kForward) LoadLane(second, kKind == Kind::kDkv ? p.v : p.dout, point, lane, 1.f);
  float m = -INFINITY, l = 0.f, own_lse2 = 0.f, own_delta = 0.f;
  if (kKind == Kind::kDq) {
    own_lse2 = Log2Lse(__ldg(p.lse + point));
    own_delta = __ldg(p.delta + point);
  }
  const float own_log2w = __ldg(p.log2w + walk_row);
  // The point's half-widths and the rows' weights, read while the copies are in flight.
  int half[kMaxOtherRows];
  float other_log2w[kMaxOtherRows];
#pragma unroll
  for (int r = 0; r < kMaxOtherRows; ++r) {
    const bool on_grid = other_row0 + r < p.nlat;
    half[r] = on_grid ? __ldg(p.half + size_t(walk_row) * p.nlat + other_row0 + r) : -1;
    other_log2w[r] = on_grid ? __ldg(p.log2w + other_row0 + r) : 0.f;
  }
  s2attn::gpu::MbarrierWait(&s.staged, 0);
#pragma unroll 1
  for (int r = 0; r < kMaxOtherRows; ++r) {
    const int h = half[r];
    for (int c = kMaxHalf + lon_in_block - h; c <= kMaxHalf + lon_in_block + h; ++c) {
      // The staged column's two rows, each read from shared memory once (b after the first dot product:
      // fewer registers live across it).
      float a[kLaneChannels], b[kLaneChannels];
      LoadChannels(a, &s.a[r][c][lane * kLaneChannels]);
      if constexpr (kKind == Kind::kForward) {
        const float x = LaneDot(own, a) + other_log2w[r], m_new = fmaxf(m, x);
        const float decay = Exp2(m - m_new), pr = Exp2(x - m_new);
        m = m_new;
        l = fmaf(l, decay, pr);
        LoadChannels(b, &s.b[r][c][lane * kLaneChannels]);
        Accumulate(acc, decay, pr, b);
      } else if constexpr (kKind == Kind::kDq) {
        const float pr = Exp2(LaneDot(own, a) + other_log2w[r] - own_lse2);
        LoadChannels(b, &s.b[r][c][lane * kLaneChannels]);
        const float ds = pr * (LaneDot(second, b) - own_delta);
        Accumulate(acc, 1.f, ds, a);
      } else {
        const float pr = Exp2(LaneDot(own, a) + own_log2w - Log2Lse(s.lse[r][c]));
        LoadChannels(b, &s.b[r][c][lane * kLaneChannels]);
        const float ds = pr * (LaneDot(second, b) - s.delta[r][c]);
        Accumulate(acc, 1.f, pr, b);  // dv
        Accumulate(acc2, 1.f, ds, a);  // dk
      }
    }
  }
  if (!real) return;
  if constexpr (kKind == Kind::kForward) {
    StoreLane(p.out, point, lane, acc, l == 0.f ? 0.f : 1.f / l);
    if (lane == 0) p.lse_out[point] = l == 0.f ? -INFINITY : (m + log2f(l)) * kLn2;
  } else if constexpr (kKind == Kind::kDq) {
    StoreLane(p.dq, point, lane, acc, p.scale);
  } else {
    StoreLane(p.dv, point, lane, acc, 1.f);
    StoreLane(p.dk, point, lane, acc2, p.scale);
  }
}

// The block rows of the rows that qualify: pairs (first walking row, first other row), in row order. The
// same for both walks: the half-width table is symmetric.
std::vector<int> BlockRows(const Inputs& in) {
  std::vector<int> blocks;
  for (int row0 = 0; row0 < in.nlat; row0 += kRows) {
    const RowSpan span = SpanOfRows(in, row0, kRows);
    if (span.last >= span.first && span.widest <= kMaxHalf && span.last - span.first < kMaxOtherRows) {
      blocks.insert(blocks.end(), {row0, span.first});
    }
  }
  return blocks;
}

// NaN elements of `x` ([points][per_point]) on the rows `rows`.
size_t UnwrittenOnRows(const std::vector<float>& x, const std::vector<int>& rows, int nlon, int per_point) {
  size_t count = 0;
  for (int i : rows) {
    const auto first = x.begin() + size_t(i) * nlon * per_point;
    count += std::count_if(first, first + size_t(nlon) * per_point, [](float v) { return std::isnan(v); });
  }
  return count;
}

bool Run(const Config& config, int reps) {
  const int nlat = config.nlat, nlon = config.nlon;
  const size_t points = size_t(nlat) * nlon;
  std::mt19937 rng(1234);
  const Inputs in = MakeInputs(config, rng);
  const std::vector<int> block_rows = BlockRows(in);
  const int blocks_y = int(block_rows.size() / 2);
  if (blocks_y == 0) {
    std::printf("%s: no rows with arcs of at most %d columns each side\n", config.name, kMaxHalf);
    return false;
  }
  std::vector<int> rows;
  for (int b = 0; b < blocks_y; ++b) {
    for (int i = block_rows[2 * b]; i < std::min(nlat, block_rows[2 * b] + kRows); ++i) rows.push_back(i);
  }
  std::vector<float> log2w(nlat);
  for (int j = 0; j < nlat; ++j) log2w[j] = std::log2(in.weight[j]);
  T *q, *k, *v, *dout, *dq, *dk, *dv;
  int *half, *dblock_rows;
  float *dlog2w, *out, *lse, *delta;
  CHECK_CUDA(Upload(in.q, &q));
  CHECK_CUDA(Upload(in.k, &k));
  CHECK_CUDA(Upload(in.v, &v));
  CHECK_CUDA(Upload(in.dout, &dout));
  CHECK_CUDA(Upload(in.half, &half));
  CHECK_CUDA(Upload(block_rows, &dblock_rows));
  CHECK_CUDA(Upload(log2w, &dlog2w));
  CHECK_CUDA(cudaMalloc(&out, points * kD * sizeof(float)));
  CHECK_CUDA(cudaMemset(out, 0xff, points * kD * sizeof(float)));  // NaN
  for (T** x : {&dq, &dk, &dv}) {
    CHECK_CUDA(cudaMalloc(x, points * kD * sizeof(T)));
    CHECK_CUDA(cudaMemset(*x, 0xff, points * kD * sizeof(T)));  // NaN
  }
  for (float** x : {&lse, &delta}) {
    CHECK_CUDA(cudaMalloc(x, points * sizeof(float)));
    CHECK_CUDA(cudaMemset(*x, 0xff, points * sizeof(float)));
  }
  Problem problem{nlat, nlon, q, k, v, dout, lse, delta, half, dlog2w, dblock_rows, out, lse, dq, dk, dv, kScale};
  void* args[1] = {&problem};
  const dim3 grid((nlon + kLons - 1) / kLons, blocks_y);
  // Launched through cudaLaunchKernel (not <<< >>>), so that the program also builds for the host
  // emulation of tests/cuda_emulation.
  const auto launch = [&](auto kernel) {
    return cudaLaunchKernel(kernel, grid, dim3(kThreads), args, sizeof(Staged), 0);
  };
  const auto forward = [&] { return launch(Stencil<Kind::kForward>); };
  const auto backward_dq = [&] { return launch(Stencil<Kind::kDq>); };
  const auto backward_dkv = [&] { return launch(Stencil<Kind::kDkv>); };

  // The forward, then delta = sum(dout * out) from its out (float32, as the op forms it), then dq and
  // dk/dv. The key walk also stages query rows just outside the processed ones (the module's other path
  // would compute them): their lse and out come from the float64 truth.
  CHECK_CUDA(forward());
  std::vector<float> got_out(points * kD), got_lse(points), host_delta(points, NAN);
  CHECK_CUDA(cudaMemcpy(got_out.data(), out, got_out.size() * sizeof(float), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(got_lse.data(), lse, got_lse.size() * sizeof(float), cudaMemcpyDeviceToHost));
  std::vector<bool> staged_row(nlat, false);
  for (int b = 0; b < blocks_y; ++b) {
    for (int j = block_rows[2 * b + 1]; j < std::min(nlat, block_rows[2 * b + 1] + kMaxOtherRows); ++j) {
      staged_row[j] = true;
    }
  }
  for (int i : rows) staged_row[i] = false;
  for (int i = 0; i < nlat; ++i) {
    for (int lon = 0; lon < nlon && staged_row[i]; ++lon) {
      const QueryTruth truth = Truth(in, i, lon);
      const size_t point = size_t(i) * nlon + lon;
      got_lse[point] = float(truth.lse);
      for (int d = 0; d < kD; ++d) got_out[point * kD + d] = float(truth.out[d]);
    }
  }
  for (int i = 0; i < nlat; ++i) {
    for (size_t point = size_t(i) * nlon; point < size_t(i + 1) * nlon; ++point) {
      double sum = 0;
      for (int d = 0; d < kD; ++d) sum += Element(in.dout, point, d) * got_out[point * kD + d];
      host_delta[point] = float(sum);
    }
  }
  CHECK_CUDA(cudaMemcpy(lse, got_lse.data(), points * sizeof(float), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(delta, host_delta.data(), points * sizeof(float), cudaMemcpyHostToDevice));
  CHECK_CUDA(backward_dq());
  CHECK_CUDA(backward_dkv());
  std::vector<float> got_dq(points * kD), got_dk(points * kD), got_dv(points * kD);
  for (auto [dst, src] : {std::pair{&got_dq, dq}, std::pair{&got_dk, dk}, std::pair{&got_dv, dv}}) {
    std::vector<T> narrow(points * kD);
    CHECK_CUDA(cudaMemcpy(narrow.data(), src, narrow.size() * sizeof(T), cudaMemcpyDeviceToHost));
    std::transform(narrow.begin(), narrow.end(), dst->begin(), [](T x) { return __bfloat162float(x); });
  }
  size_t unwritten = UnwrittenOnRows(got_lse, rows, nlon, 1);
  for (const std::vector<float>* x : {&got_out, &got_dq, &got_dk, &got_dv}) {
    unwritten += UnwrittenOnRows(*x, rows, nlon, kD);
  }

  // Sampled points of the processed rows (the first and last processed row among them).
  Check out_check, dq_check, dk_check, dv_check;
  double lse_error = 0;
  std::uniform_int_distribution<size_t> any_row(0, rows.size() - 1);
  std::uniform_int_distribution<int> any_lon(0, nlon - 1);
  for (int sample = 0; sample < 1000; ++sample) {
    const int i = sample == 0 ? rows.front() : sample == 1 ? rows.back() : rows[any_row(rng)], lon = any_lon(rng);
    const QueryTruth truth = Truth(in, i, lon);
    const size_t point = size_t(i) * nlon + lon;
    out_check.Add(i, lon, truth.out, &got_out[point * kD]);
    dq_check.Add(i, lon, truth.dq, &got_dq[point * kD]);
    lse_error = std::max(lse_error, std::fabs(truth.lse - got_lse[point]));
    if (sample < 300) {
      const KeyTruth key = TruthOfKey(in, got_lse, host_delta, i, lon);
      dk_check.Add(i, lon, key.dk, &got_dk[point * kD]);
      dv_check.Add(i, lon, key.dv, &got_dv[point * kD]);
    }
  }
  const Check* checks[4] = {&out_check, &dq_check, &dk_check, &dv_check};
  const char* names[4] = {"out", "dq", "dk", "dv"};
  // Float32 throughout; the gradients then rounded once to bf16 (at most 2^-8 of the largest value).
  bool correct = unwritten == 0 && lse_error <= 1e-4 && out_check.Relative() <= 1e-4;
  for (const Check* c : {&dq_check, &dk_check, &dv_check}) correct = correct && c->Relative() <= 1.0 / 256 + 1e-4;

  double ms[3], fastest[3];
  if (!MedianMs(reps, forward, &ms[0], &fastest[0]) || !MedianMs(reps, backward_dq, &ms[1], &fastest[1]) ||
      !MedianMs(reps, backward_dkv, &ms[2], &fastest[2])) {
    return false;
  }
  long long pairs = 0;
  for (int i : rows) {
    for (int j = 0; j < nlat; ++j) pairs += std::max(0, 2 * in.half[size_t(i) * nlat + j] + 1);
  }
  // Bytes a perfect cache would move per point: operands read and results written once (forward: q, k, v,
  // out in float32, lse; dq: q, k, v, dout, lse, delta, dq; dk/dv: q, k, v, dout, lse, delta, dk, dv).
  const double row_points = double(rows.size()) * nlon, bf16_row = kD * sizeof(T), f32_row = kD * sizeof(float);
  const double bytes[3] = {row_points * (3 * bf16_row + f32_row + 4), row_points * (5 * bf16_row + 8),
                           row_points * (6 * bf16_row + 8)};
  std::printf("%-14s %4dx%-5d cutoff %.5f: %zu of %d rows, %.3g pairs | ms (GB/s of unique bytes): forward %.4f "
              "(%.0f), dq %.4f (%.0f), dk/dv %.4f (%.0f) | unwritten %zu, lse abs %.1e, rel out %.1e dq %.1e dk %.1e "
              "dv %.1e %s\n",
              config.name, nlat, nlon, config.cutoff, rows.size(), nlat, double(pairs) * nlon, ms[0],
              bytes[0] / ms[0] * 1e-6, ms[1], bytes[1] / ms[1] * 1e-6, ms[2], bytes[2] / ms[2] * 1e-6, unwritten,
              lse_error, out_check.Relative(), dq_check.Relative(), dk_check.Relative(), dv_check.Relative(),
              correct ? "ok" : "WRONG");
  for (int c = 0; c < 4 && !correct; ++c) {
    std::printf("  worst %s: row %d lon %d channel %d: %.6f expected, %.6f written\n", names[c], checks[c]->row,
                checks[c]->lon, checks[c]->channel, checks[c]->expected, checks[c]->written);
  }
  for (T* x : {q, k, v, dout, dq, dk, dv}) CHECK_CUDA(cudaFree(x));
  for (float* x : {dlog2w, out, lse, delta}) CHECK_CUDA(cudaFree(x));
  for (int* x : {half, dblock_rows}) CHECK_CUDA(cudaFree(x));
  return correct;
}

// Without arguments: 0.25 and 0.5 degree grids at the default cutoff (one grid step), timed. (At two grid
// steps a block of 2 rows sees 6 rows, more than kMaxOtherRows: no row qualifies.) `--tiny`: small grids
// with a longitude tail and arcs across longitude 0, one launch each (for the host emulation,
// tests/test_bench_prototypes_emulated.py).
bool Main(const std::string& mode) {
  const double pi = 3.14159265358979323846, eps = 1 + 1e-3;  // the plan's rule: d <= (1 + 1e-3) cutoff
  const Config configs[] = {{"qdeg_default", 721, 1440, eps * pi / 720}, {"hdeg_default", 360, 720, eps * pi / 359}};
  const Config tiny[] = {{"tiny_tail", 17, 72, eps * pi / 16}, {"tiny_rows", 33, 40, 1.5 * pi / 32}};
  bool ok = true;
  if (mode == "--tiny") {
    for (const Config& config : tiny) ok = Run(config, 1) && ok;
    return ok;
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs; blocks of %d threads (%d x %d points, %d lanes each)\n", prop.name,
              prop.multiProcessorCount, kThreads, kRows, kLons, kLanes);
  for (const Config& config : configs) ok = Run(config, 50) && ok;
  return ok;
}

}  // namespace

int main(int argc, char** argv) { return Main(argc > 1 ? argv[1] : "") ? 0 : 1; }
