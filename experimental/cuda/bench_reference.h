// The host side of the standalone attention prototype (ws_attention.cu): bf16
// self-attention at D 64 on an equiangular grid, neighbourhoods from per-(row, row) longitude
// half-widths (the plan's geodesic-disk rule without its epsilon; symmetric, so one table serves both
// walks), positive stand-in quadrature weights, random inputs, and the float64 truth of a query.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <utility>
#include <vector>

#include "bench_common.h"

namespace bench {

using T = __nv_bfloat16;
constexpr int kD = 64;            // channels: one 128-byte row per point
constexpr float kScale = 0.125f;  // softmax scale, 1 / sqrt(kD)
constexpr int kRing = 1 << 20;    // half-width of a key row every query of the row sees whole

// Half-widths of the geodesic disk: query row i sees key (j, c) iff the angular distance of the points
// is <= cutoff, i.e. |c - lon| <= half[i][j] around its own longitude.
inline std::vector<int> HalfWidths(int nlat, int nlon, double cutoff) {
  std::vector<int> half(size_t(nlat) * nlat, -1);
  const double pi = 3.14159265358979323846, step = 2 * pi / nlon;
  for (int i = 0; i < nlat; ++i) {
    for (int j = 0; j < nlat; ++j) {
      const double ti = pi * i / (nlat - 1), tj = pi * j / (nlat - 1);
      const double sines = std::sin(ti) * std::sin(tj);
      int& h = half[size_t(i) * nlat + j];
      if (sines < 1e-12) {
        h = std::fabs(ti - tj) <= cutoff ? kRing : -1;
        continue;
      }
      const double c = (std::cos(cutoff) - std::cos(ti) * std::cos(tj)) / sines;
      if (c > 1) continue;
      h = c <= -1 ? kRing : int(std::floor(std::acos(c) / step + 1e-9));
      if (2 * h + 1 >= nlon) h = kRing;
    }
  }
  return half;
}

struct Config {
  const char* name;
  int nlat, nlon;
  double cutoff;
};

// The float64 truth for one query: out, lse and dq (the latter for a given dout and the true delta).
struct QueryTruth {
  std::vector<double> out, dq;
  double lse;
};

struct Inputs {
  int nlat, nlon;
  std::vector<int> half;
  std::vector<float> weight;
  std::vector<T> q, k, v, dout;
};

// Element d of point `point` of a [points, kD] operand, widened.
inline double Element(const std::vector<T>& x, size_t point, int d) {
  return double(__bfloat162float(x[point * kD + d]));
}

inline double Dot(const std::vector<T>& x, size_t x_point, const std::vector<T>& y, size_t y_point) {
  double dot = 0;
  for (int d = 0; d < kD; ++d) dot += Element(x, x_point, d) * Element(y, y_point, d);
  return dot;
}

// visit(other_row, other_point) for every point of the other grid that the point (row, lon) sees (the
// half-width table is symmetric, so this serves queries and keys alike).
template <typename Visit>
void ForEachNeighbour(const Inputs& in, int row, int lon, Visit&& visit) {
  for (int other = 0; other < in.nlat; ++other) {
    const int h = in.half[size_t(row) * in.nlat + other];
    if (h < 0) continue;
    const int width = h >= kRing ? in.nlon : 2 * h + 1, first = h >= kRing ? 0 : lon - h;
    for (int c = 0; c < width; ++c) visit(other, size_t(other) * in.nlon + ((first + c) % in.nlon + in.nlon) % in.nlon);
  }
}

inline QueryTruth Truth(const Inputs& in, int i, int lon) {
  const size_t query = size_t(i) * in.nlon + lon;
  std::vector<std::pair<double, size_t>> logits;
  double top = -1e300;
  ForEachNeighbour(in, i, lon, [&](int j, size_t key) {
    logits.emplace_back(kScale * Dot(in.q, query, in.k, key) + std::log(double(in.weight[j])), key);
    top = std::max(top, logits.back().first);
  });
  QueryTruth truth{std::vector<double>(kD), std::vector<double>(kD), 0};
  double total = 0;
  for (const auto& [logit, key] : logits) total += std::exp(logit - top);
  truth.lse = top + std::log(total);
  for (const auto& [logit, key] : logits) {
    for (int d = 0; d < kD; ++d) truth.out[d] += std::exp(logit - truth.lse) * Element(in.v, key, d);
  }
  double delta = 0;
  for (int d = 0; d < kD; ++d) delta += Element(in.dout, query, d) * truth.out[d];
  for (const auto& [logit, key] : logits) {
    const double ds = std::exp(logit - truth.lse) * (Dot(in.dout, query, in.v, key) - delta);
    for (int d = 0; d < kD; ++d) truth.dq[d] += kScale * ds * Element(in.k, key, d);
  }
  return truth;
}

// The float64 truth of one key's gradients, given the queries' lse and delta (the kernels').
struct KeyTruth {
  std::vector<double> dk, dv;
};

inline KeyTruth TruthOfKey(const Inputs& in, const std::vector<float>& lse, const std::vector<float>& delta, int j,
                           int lon) {
  const size_t key = size_t(j) * in.nlon + lon;
  KeyTruth truth{std::vector<double>(kD), std::vector<double>(kD)};
  ForEachNeighbour(in, j, lon, [&](int, size_t query) {
    const double p = std::exp(kScale * Dot(in.q, query, in.k, key) + std::log(double(in.weight[j])) - lse[query]);
    const double dp = Dot(in.dout, query, in.v, key);
    for (int d = 0; d < kD; ++d) {
      truth.dv[d] += p * Element(in.dout, query, d);
      truth.dk[d] += kScale * p * (dp - delta[query]) * Element(in.q, query, d);
    }
  });
  return truth;
}

// What a block of walking rows row0 .. row0 + rows - 1 sees: the first and last row of the other grid
// (last < first: none) and the widest half-width there (kRing: a whole ring). The table is symmetric, so
// this serves query and key blocks alike.
struct RowSpan {
  int first, last, widest;
};

inline RowSpan SpanOfRows(const Inputs& in, int row0, int rows) {
  RowSpan span{in.nlat, -1, -1};
  for (int i = row0; i < std::min(in.nlat, row0 + rows); ++i) {
    for (int j = 0; j < in.nlat; ++j) {
      const int h = in.half[size_t(i) * in.nlat + j];
      if (h < 0) continue;
      span.first = std::min(span.first, j), span.last = std::max(span.last, j), span.widest = std::max(span.widest, h);
    }
  }
  return span;
}

// Half-widths for `config`, weights sin(theta) (the poles' raised to half the first row's) times the row
// spacing, and q, k, v, dout drawn from `rng` in that order.
inline Inputs MakeInputs(const Config& config, std::mt19937& rng) {
  const int nlat = config.nlat, nlon = config.nlon;
  Inputs in{nlat, nlon, HalfWidths(nlat, nlon, config.cutoff), std::vector<float>(nlat), {}, {}, {}, {}};
  const double pi = 3.14159265358979323846;
  for (int j = 0; j < nlat; ++j) {
    in.weight[j] = float(std::max(std::sin(pi * j / (nlat - 1)), 0.5 * std::sin(pi / (nlat - 1))) * pi / (nlat - 1));
  }
  std::normal_distribution<float> normal;
  for (std::vector<T>* operand : {&in.q, &in.k, &in.v, &in.dout}) {
    operand->resize(size_t(nlat) * nlon * kD);
    for (T& e : *operand) e = __float2bfloat16(normal(rng));
  }
  return in;
}

// Largest error of `got` against the truths of the sampled queries, relative to the truths' largest value.
struct Check {
  double error = 0, scale = 0;
  int row = 0, lon = 0, channel = 0;
  double expected = 0, written = 0;
  void Add(int i, int lon_, const std::vector<double>& truth, const float* got) {
    for (int d = 0; d < kD; ++d) {
      const double wrong = std::fabs(truth[d] - got[d]);
      if (!(wrong <= error)) row = i, lon = lon_, channel = d, expected = truth[d], written = got[d];
      error = std::max(error, wrong);
      scale = std::max(scale, std::fabs(truth[d]));
    }
  }
  double Relative() const { return error / scale; }
};

template <typename Launch>
bool MedianMs(int reps, Launch&& launch, double* ms, double* fastest) {
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<float> times;
  for (int rep = 0; rep < reps; ++rep) {
    CHECK_CUDA(cudaEventRecord(start));
    CHECK_CUDA(launch());
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float t;
    CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
    if (rep >= reps / 7) times.push_back(t);
  }
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  std::sort(times.begin(), times.end());
  *ms = times[times.size() / 2];
  *fastest = times.front();
  return true;
}

inline size_t CountNaN(const std::vector<float>& x) {
  return std::count_if(x.begin(), x.end(), [](float v) { return std::isnan(v); });
}

}  // namespace bench
