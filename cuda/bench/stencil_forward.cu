// Stencil forward prototype (benchmarks/stencil_forward.sh builds and runs it): the forward of the query
// rows whose arcs are all short, on CUDA cores, to measure what a stencil path would cost before it is
// built into the module (NOTES, session 13: at 721x1440 with the default cutoff, rows whose arcs have at
// most 8 columns are 84 % of the points and take 78 % of the tiled kernels' staged chunks, where a
// 64-point unit multiplies 2 x 16 columns per warp and segment to use ~5).
//
// A block owns kRows consecutive query rows x kLons longitudes. It stages the key and value rows its
// queries see (at most kMaxKeyRows, each kLons + 2 kMaxHalf columns around the block's longitudes) into
// shared memory once, then kLanes lanes per query (kD / kLanes channels each) walk the query's columns
// there: dot product over the lanes (two shuffles), online softmax in log2 units with the quadrature
// weight as a bias, P (float32, unrounded) times V. out is float32, lse as the module writes it.
//
// Self-attention on an equiangular grid, bf16, one head of 64 channels, neighbourhoods and stand-in
// weights from bench_reference.h. Rows qualify when every arc has at most kMaxHalf columns each side and
// their block's key rows fit kMaxKeyRows; out and lse of every point of those rows are poisoned (NaN)
// before the run, must be written, and are checked on sampled queries against the float64 truth.
// Standalone: not part of the package.
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

namespace {

using namespace bench;  // T, kD, kScale, kRing and the float64 truth
using s2attn::gpu::Exp2;
using s2attn::gpu::kLn2;
using s2attn::gpu::kLog2e;

constexpr int kMaxHalf = 3;                 // longitudes each side: arcs of at most 7 columns
constexpr int kRows = 2;                    // query rows per block
constexpr int kLons = 32;                   // longitudes per block
constexpr int kLanes = 4;                   // lanes per query
constexpr int kLaneChannels = kD / kLanes;  // 16: two 16-byte loads
constexpr int kThreads = kRows * kLons * kLanes;
constexpr int kMaxKeyRows = 4;
constexpr int kWindow = kLons + 2 * kMaxHalf;  // staged columns per key row
// Staged rows padded by 16 bytes: the queries of a quarter-warp read rows 144 bytes apart, in different banks.
constexpr int kStride = kD + 8;
constexpr int kVectors = kD * 2 / 16;  // 16-byte vectors per row of one operand

struct Problem {
  int nlat, nlon;
  const T *q, *k, *v;
  const int* half;         // [nlat][nlat] longitudes each side (-1: none); no ring among the processed rows
  const float* log2w;      // [nlat]
  const int* block_rows;   // [blocks]: first query row and first key row of each block row
  float *out, *lse;
  float scale2;            // scale * log2(e)
};

// The block's shared memory (dynamic, under the default 48 KiB: no opt-in).
struct Staged {
  T k[kMaxKeyRows][kWindow][kStride];
  T v[kMaxKeyRows][kWindow][kStride];
};

static_assert(sizeof(Staged) <= 48 * 1024, "dynamic shared memory beyond 48 KiB needs an opt-in");

__global__ void __launch_bounds__(kThreads) StencilForward(const Problem p) {
  Staged& s = *reinterpret_cast<Staged*>(s2attn::gpu::DynamicShared());
  const int row0 = p.block_rows[2 * blockIdx.y], key_row0 = p.block_rows[2 * blockIdx.y + 1];
  const int lon0 = blockIdx.x * kLons;
  // Stage rows key_row0 .. key_row0 + kMaxKeyRows - 1 (those past the grid are never read), columns
  // lon0 - kMaxHalf .. lon0 + kLons + kMaxHalf - 1 taken modulo nlon.
  for (int e = threadIdx.x; e < kMaxKeyRows * kWindow * kVectors; e += kThreads) {
    const int vec = e % kVectors, col = (e / kVectors) % kWindow, r = e / (kVectors * kWindow);
    if (key_row0 + r >= p.nlat) continue;
    const int lon = ((lon0 - kMaxHalf + col) % p.nlon + p.nlon) % p.nlon;
    const size_t point = size_t(key_row0 + r) * p.nlon + lon;
    *reinterpret_cast<uint4*>(&s.k[r][col][8 * vec]) = __ldg(reinterpret_cast<const uint4*>(p.k + point * kD) + vec);
    *reinterpret_cast<uint4*>(&s.v[r][col][8 * vec]) = __ldg(reinterpret_cast<const uint4*>(p.v + point * kD) + vec);
  }
  __syncthreads();

  const int lane = threadIdx.x % kLanes, query = threadIdx.x / kLanes;
  const int row = row0 + query / kLons, lon_in_block = query % kLons, lon = lon0 + lon_in_block;
  // Every lane of a warp runs the same loop (one row per warp; longitudes past nlon compute on a clamped
  // column and write nothing), so the shuffles take the whole warp.
  const bool real = row < p.nlat && lon < p.nlon;
  const size_t point = size_t(min(row, p.nlat - 1)) * p.nlon + min(lon, p.nlon - 1);
  float q[kLaneChannels], acc[kLaneChannels];
  for (int c = 0; c < kLaneChannels; c += 2) {
    const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p.q + point * kD +
                                                                                 lane * kLaneChannels + c));
    q[c] = x.x * p.scale2, q[c + 1] = x.y * p.scale2;
    acc[c] = acc[c + 1] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  const int walk_row = min(row, p.nlat - 1);
  for (int r = 0; r < kMaxKeyRows && key_row0 + r < p.nlat; ++r) {
    const int h = __ldg(p.half + size_t(walk_row) * p.nlat + key_row0 + r);
    if (h < 0) continue;
    const float bias = __ldg(p.log2w + key_row0 + r);
    for (int c = kMaxHalf + lon_in_block - h; c <= kMaxHalf + lon_in_block + h; ++c) {
      const __nv_bfloat162* kc = reinterpret_cast<const __nv_bfloat162*>(&s.k[r][c][lane * kLaneChannels]);
      float dot = 0.f;
      for (int e = 0; e < kLaneChannels / 2; ++e) {
        const float2 x = __bfloat1622float2(kc[e]);
        dot = fmaf(q[2 * e], x.x, fmaf(q[2 * e + 1], x.y, dot));
      }
      dot += __shfl_xor_sync(0xffffffffu, dot, 1);
      dot += __shfl_xor_sync(0xffffffffu, dot, 2);
      const float x = dot + bias, m_new = fmaxf(m, x);
      const float decay = Exp2(m - m_new), pr = Exp2(x - m_new);
      m = m_new;
      l = fmaf(l, decay, pr);
      const __nv_bfloat162* vc = reinterpret_cast<const __nv_bfloat162*>(&s.v[r][c][lane * kLaneChannels]);
      for (int e = 0; e < kLaneChannels / 2; ++e) {
        const float2 y = __bfloat1622float2(vc[e]);
        acc[2 * e] = fmaf(acc[2 * e], decay, pr * y.x);
        acc[2 * e + 1] = fmaf(acc[2 * e + 1], decay, pr * y.y);
      }
    }
  }
  if (!real) return;
  const float inv = l == 0.f ? 0.f : 1.f / l;
  float4* out = reinterpret_cast<float4*>(p.out + point * kD + lane * kLaneChannels);
  for (int c = 0; c < kLaneChannels; c += 4) {
    out[c / 4] = make_float4(acc[c] * inv, acc[c + 1] * inv, acc[c + 2] * inv, acc[c + 3] * inv);
  }
  if (lane == 0) p.lse[point] = l == 0.f ? -INFINITY : (m + log2f(l)) * kLn2;
}

// The block rows of the rows that qualify: pairs (first query row, first key row), in row order.
std::vector<int> BlockRows(const Inputs& in) {
  std::vector<int> blocks;
  for (int row0 = 0; row0 < in.nlat; row0 += kRows) {
    int first = in.nlat, last = -1;
    bool short_arcs = true;
    for (int i = row0; i < std::min(in.nlat, row0 + kRows); ++i) {
      for (int j = 0; j < in.nlat; ++j) {
        const int h = in.half[size_t(i) * in.nlat + j];
        if (h < 0) continue;
        short_arcs = short_arcs && h <= kMaxHalf;
        first = std::min(first, j), last = std::max(last, j);
      }
    }
    if (short_arcs && last >= 0 && last - first < kMaxKeyRows) blocks.insert(blocks.end(), {row0, first});
  }
  return blocks;
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
  std::vector<float> log2w(nlat);
  for (int j = 0; j < nlat; ++j) log2w[j] = std::log2(in.weight[j]);
  T *q, *k, *v;
  int *half, *dblock_rows;
  float *dlog2w, *out, *lse;
  CHECK_CUDA(Upload(in.q, &q));
  CHECK_CUDA(Upload(in.k, &k));
  CHECK_CUDA(Upload(in.v, &v));
  CHECK_CUDA(Upload(in.half, &half));
  CHECK_CUDA(Upload(block_rows, &dblock_rows));
  CHECK_CUDA(Upload(log2w, &dlog2w));
  CHECK_CUDA(cudaMalloc(&out, points * kD * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&lse, points * sizeof(float)));
  CHECK_CUDA(cudaMemset(out, 0xff, points * kD * sizeof(float)));
  CHECK_CUDA(cudaMemset(lse, 0xff, points * sizeof(float)));
  Problem problem{nlat, nlon, q, k, v, half, dlog2w, dblock_rows, out, lse, kScale * kLog2e};
  void* args[1] = {&problem};
  const dim3 grid((nlon + kLons - 1) / kLons, blocks_y);
  // Launched through cudaLaunchKernel (not <<< >>>), so that the program also builds for the host
  // emulation of tests/cuda_emulation.
  const auto forward = [&] {
    return cudaLaunchKernel(StencilForward, grid, dim3(kThreads), args, sizeof(Staged), 0);
  };
  CHECK_CUDA(forward());
  std::vector<float> got_out(points * kD), got_lse(points);
  CHECK_CUDA(cudaMemcpy(got_out.data(), out, got_out.size() * sizeof(float), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(got_lse.data(), lse, got_lse.size() * sizeof(float), cudaMemcpyDeviceToHost));

  // Every point of the processed rows written; sampled queries (the first and last processed row among
  // them) against the float64 truth.
  std::vector<int> rows;
  for (int b = 0; b < blocks_y; ++b) {
    for (int i = block_rows[2 * b]; i < std::min(nlat, block_rows[2 * b] + kRows); ++i) rows.push_back(i);
  }
  size_t unwritten = 0;
  long long pairs = 0;
  for (int i : rows) {
    const auto row_of = [&](const std::vector<float>& x, size_t per_point) {
      return std::vector<float>(x.begin() + size_t(i) * nlon * per_point, x.begin() + size_t(i + 1) * nlon * per_point);
    };
    unwritten += CountNaN(row_of(got_out, kD)) + CountNaN(row_of(got_lse, 1));
    for (int j = 0; j < nlat; ++j) {
      const int h = in.half[size_t(i) * nlat + j];
      pairs += h >= 0 ? 2 * h + 1 : 0;
    }
  }
  pairs *= nlon;
  Check out_check;
  double lse_error = 0;
  std::uniform_int_distribution<size_t> any_row(0, rows.size() - 1);
  std::uniform_int_distribution<int> any_lon(0, nlon - 1);
  for (int sample = 0; sample < 1000; ++sample) {
    const int i = sample == 0 ? rows.front() : sample == 1 ? rows.back() : rows[any_row(rng)], lon = any_lon(rng);
    const QueryTruth truth = Truth(in, i, lon);
    const size_t point = size_t(i) * nlon + lon;
    out_check.Add(i, lon, truth.out, &got_out[point * kD]);
    lse_error = std::max(lse_error, std::fabs(truth.lse - got_lse[point]));
  }
  const bool correct = unwritten == 0 && lse_error <= 1e-4 && out_check.Relative() <= 1e-5;

  double ms, fastest;
  if (!MedianMs(reps, forward, &ms, &fastest)) return false;
  // Bytes a perfect cache would move: q, k, v read and out, lse written once per processed point.
  const double bytes = double(rows.size()) * nlon * (3 * kD * sizeof(T) + kD * sizeof(float) + sizeof(float));
  std::printf("%-14s %4dx%-5d cutoff %.5f: %zu of %d rows (%d blocks of %dx%d): forward %.4f ms (min %.4f), "
              "%.0f GB/s of unique bytes, %.3g pairs | unwritten %zu, lse abs %.1e, rel out %.1e %s\n",
              config.name, nlat, nlon, config.cutoff, rows.size(), nlat, blocks_y * grid.x, kRows, kLons, ms, fastest,
              bytes / ms * 1e-6, double(pairs), unwritten, lse_error, out_check.Relative(), correct ? "ok" : "WRONG");
  if (!correct) {
    std::printf("  worst out: row %d lon %d channel %d: %.6f expected, %.6f written\n", out_check.row, out_check.lon,
                out_check.channel, out_check.expected, out_check.written);
  }
  for (T* x : {q, k, v}) CHECK_CUDA(cudaFree(x));
  for (float* x : {dlog2w, out, lse}) CHECK_CUDA(cudaFree(x));
  for (int* x : {half, dblock_rows}) CHECK_CUDA(cudaFree(x));
  return correct;
}

// Without arguments: the benchmark's grids, timed. `--tiny`: small grids with a longitude tail, an odd
// row count and several key rows per block, one launch each (for the host emulation,
// tests/test_bench_prototypes_emulated.py).
bool Main(const std::string& mode) {
  const double pi = 3.14159265358979323846, eps = 1 + 1e-3;  // the plan's rule: d <= (1 + 1e-3) cutoff
  const Config configs[] = {{"qdeg_default", 721, 1440, eps * pi / 720}, {"hdeg_default", 360, 720, eps * pi / 359},
                            {"qdeg_2steps", 721, 1440, eps * pi / 360}};
  const Config tiny[] = {{"tiny_tail", 17, 72, eps * pi / 16}, {"tiny_rows", 33, 40, 1.5 * pi / 32}};
  bool ok = true;
  if (mode == "--tiny") {
    for (const Config& config : tiny) ok = Run(config, 1) && ok;
    return ok;
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs; blocks of %d threads (%d x %d queries, %d lanes each)\n", prop.name,
              prop.multiProcessorCount, kThreads, kRows, kLons, kLanes);
  for (const Config& config : configs) ok = Run(config, 50) && ok;
  return ok;
}

}  // namespace

int main(int argc, char** argv) { return Main(argc > 1 ? argv[1] : "") ? 0 : 1; }
