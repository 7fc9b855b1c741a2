// Own PTX wrappers or CuTe/CUTLASS primitives (experimental/mainloop_primitives.sh builds and runs it): the same
// streaming attention main loop, the scheduled forward's shape at head dim 64 (a producer warp staging K and V chunks
// of 32 keys by tensor-map boxes into a 4-stage mbarrier ring, a consumer warpgroup forming S = Q K^T by an SS wgmma,
// P = bf16(S scale) in registers and O += P V by an RS wgmma), written once on the project's wrappers
// (mainloop_own.cu) and once on CuTe and CUTLASS (mainloop_cute.cu), each its own translation unit. This driver
// checks both against a float64 host reference on a sample of blocks and against each other on every element, then
// times them alternately and prints one table: median time, chunks per microsecond, TFLOP/s of the two products,
// registers, local memory, shared memory and resident blocks per SM. Exit status 1 on a failed check or CUDA error,
// 3 when a checked launch is still running after kHangSeconds (a hung kernel).
//
// Block b (of sms * 4 * waves) multiplies Q rows [64 b, 64 b + 64) against chunks (b * stride + i) mod total_chunks,
// i < chunks, of K and V ([total_chunks * 32, 64] bf16 each); O is [blocks * 64, 64] float32. Standalone: not part of
// the Python package.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "check_cuda.h"
#include "mainloop_shape.h"

// The two versions' entry points (mainloop_own.cu, mainloop_cute.cu): set up the launches of a version over these
// arrays, or return an empty function after printing why not; `kernel`, `threads` and `shared_bytes` receive what
// the resource queries need.
std::function<cudaError_t(cudaStream_t)> PrepareOwnMainLoop(const __nv_bfloat16* q, const __nv_bfloat16* k,
                                                            const __nv_bfloat16* v, float* out, int blocks,
                                                            int chunks_per_block, int total_chunks, int stride,
                                                            float scale, const void** kernel, int* threads,
                                                            int* shared_bytes);
std::function<cudaError_t(cudaStream_t)> PrepareCuteMainLoop(const __nv_bfloat16* q, const __nv_bfloat16* k,
                                                             const __nv_bfloat16* v, float* out, int blocks,
                                                             int chunks_per_block, int total_chunks, int stride,
                                                             float scale, const void** kernel, int* threads,
                                                             int* shared_bytes);

namespace {

using namespace mainloop_shape;  // the shape both versions are written for; the grid is sms * kBlocksPerSm * waves
constexpr float kScale = 0.125f;  // 1 / sqrt(64): exact, so S scale is exact in float32
constexpr double kFlopsPerChunk = 2.0 * 2 * kQueryRows * kChunkRows * kHeadDim;  // S = Q K^T and O += P V
constexpr double kReferenceTolerance = 1e-2;  // max |O - reference| over max |reference| of a block (bf16's bar)
constexpr double kAgreementTolerance = 1e-5;  // the same on the whole O, own against CuTe (the same instructions)
constexpr double kHangSeconds = 30.0;         // a checked launch still running after this is reported as hung

struct Options {
  int waves = 8;            // blocks = sms * 4 * waves
  int chunks = 128;         // chunks a block walks
  int total_chunks = 4096;  // chunks of K and V (4 KiB each per tensor)
  int stride = 32;          // first chunk of block b: b * stride mod total_chunks
  int warmup = 3;           // untimed launches of each version
  int reps = 30;            // timed launches of each version, alternating
  int check_blocks = 12;    // blocks checked against the host reference
};

void PrintUsage() {
  std::printf(
      "usage: mainloop_primitives [--waves N (8)] [--chunks N (128)] [--total-chunks N (4096)] [--stride N (32)]\n"
      "                           [--warmup N (3)] [--reps N (30)] [--check-blocks N (12)]\n");
}

// False (after printing why) on an unknown option, a missing or non-numeric value, or a value out of range.
bool ParseOptions(int argc, char** argv, Options* o) {
  const struct {
    const char* name;
    int* value;
    int min;
  } fields[] = {{"--waves", &o->waves, 1},     {"--chunks", &o->chunks, 1}, {"--total-chunks", &o->total_chunks, 1},
                {"--stride", &o->stride, 0},   {"--warmup", &o->warmup, 0}, {"--reps", &o->reps, 1},
                {"--check-blocks", &o->check_blocks, 1}};
  for (int i = 1; i < argc; ++i) {
    bool known = false;
    for (const auto& field : fields) {
      if (std::strcmp(argv[i], field.name) != 0) continue;
      known = true;
      char* end = nullptr;
      const long value = i + 1 < argc ? std::strtol(argv[i + 1], &end, 10) : 0;
      if (i + 1 >= argc || *end != '\0' || value < field.min || value > (1 << 24)) {
        std::printf("%s needs an integer in [%d, %d]\n", field.name, field.min, 1 << 24);
        return false;
      }
      *field.value = static_cast<int>(value);
      ++i;
      break;
    }
    if (!known) {
      std::printf("unknown option %s\n", argv[i]);
      return false;
    }
  }
  return true;
}

// Uniform bf16 values in [-1, 1) from a fixed-seed generator (the same inputs every run), rounded to nearest even.
std::vector<__nv_bfloat16> RandomBf16(size_t count, uint64_t seed) {
  std::vector<__nv_bfloat16> values(count);
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  for (__nv_bfloat16& v : values) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    v = __float2bfloat16_rn(static_cast<float>(static_cast<int32_t>(state >> 40) - (1 << 23)) /
                            static_cast<float>(1 << 23));
  }
  return values;
}

// Block `block`'s O in float64, with P rounded to bf16 from float32 S times the scale, as the kernels round it.
std::vector<double> ReferenceBlock(const Options& o, int block, const std::vector<__nv_bfloat16>& q,
                                   const std::vector<__nv_bfloat16>& k, const std::vector<__nv_bfloat16>& v) {
  std::vector<double> out(kQueryRows * kHeadDim, 0.0), query(kQueryRows * kHeadDim);
  const size_t first_row = static_cast<size_t>(block) * kQueryRows * kHeadDim;
  for (int e = 0; e < kQueryRows * kHeadDim; ++e) query[e] = __bfloat162float(q[first_row + e]);
  std::vector<double> key(kChunkRows * kHeadDim), value(kChunkRows * kHeadDim), p(kQueryRows * kChunkRows);
  for (int i = 0; i < o.chunks; ++i) {
    const size_t first = static_cast<size_t>(ChunkOf(block, i, o.stride, o.total_chunks)) * kChunkRows * kHeadDim;
    for (int e = 0; e < kChunkRows * kHeadDim; ++e) {
      key[e] = __bfloat162float(k[first + e]);
      value[e] = __bfloat162float(v[first + e]);
    }
    for (int r = 0; r < kQueryRows; ++r) {
      for (int c = 0; c < kChunkRows; ++c) {
        double s = 0.0;
        for (int d = 0; d < kHeadDim; ++d) s += query[r * kHeadDim + d] * key[c * kHeadDim + d];
        p[r * kChunkRows + c] = __bfloat162float(__float2bfloat16_rn(static_cast<float>(s) * kScale));
      }
    }
    for (int r = 0; r < kQueryRows; ++r) {
      for (int c = 0; c < kChunkRows; ++c) {
        const double pc = p[r * kChunkRows + c];
        for (int d = 0; d < kHeadDim; ++d) out[r * kHeadDim + d] += pc * value[c * kHeadDim + d];
      }
    }
  }
  return out;
}

// The blocks checked against the reference, at most `count` of them: the first and last two (the last ones' walks
// wrap around the chunks), the middle one, then others spread evenly.
std::vector<int> CheckedBlocks(int blocks, int count) {
  std::vector<int> candidates = {0, blocks - 1, 1, blocks - 2, blocks / 2};
  for (int i = 0; i < count; ++i) {
    candidates.push_back(static_cast<int>(static_cast<int64_t>(2 * i + 1) * blocks / (2 * count)));
  }
  std::vector<int> chosen;
  for (int b : candidates) {
    const bool fresh = std::find(chosen.begin(), chosen.end(), b) == chosen.end();
    if (b >= 0 && b < blocks && fresh && static_cast<int>(chosen.size()) < count) chosen.push_back(b);
  }
  return chosen;
}

struct Version {
  const char* name;
  std::function<cudaError_t(cudaStream_t)> launch;
  const void* kernel = nullptr;
  int threads = 0, dynamic_shared = 0;
  cudaFuncAttributes attributes{};
  int blocks_per_sm = 0;
  std::vector<float> out;  // O of the checked launch
  std::vector<float> milliseconds;
};

// One launch into `out` poisoned with NaN (all bits set), waited for on the host with a limit, so that a hung kernel
// is reported instead of waited for; O copied to the host.
bool RunChecked(Version& version, float* out, size_t out_elements, cudaStream_t stream) {
  CHECK_CUDA(cudaMemsetAsync(out, 0xFF, out_elements * sizeof(float), stream));
  cudaEvent_t done;
  CHECK_CUDA(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  CHECK_CUDA(version.launch(stream));
  CHECK_CUDA(cudaEventRecord(done, stream));
  const auto start = std::chrono::steady_clock::now();
  cudaError_t state;
  while ((state = cudaEventQuery(done)) == cudaErrorNotReady) {
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (waited > kHangSeconds) {
      std::printf("%s: the kernel is still running after %.0f s: hung (a barrier phase or an expected byte count)\n",
                  version.name, kHangSeconds);
      std::fflush(stdout);
      std::_Exit(3);  // a hung kernel blocks every orderly teardown
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  CHECK_CUDA(state);
  CHECK_CUDA(cudaEventDestroy(done));
  version.out.resize(out_elements);
  CHECK_CUDA(cudaMemcpy(version.out.data(), out, out_elements * sizeof(float), cudaMemcpyDeviceToHost));
  return true;
}

// Non-finite elements of `out` (unwritten ones are NaN).
size_t CountNonFinite(const std::vector<float>& out) {
  return static_cast<size_t>(std::count_if(out.begin(), out.end(), [](float x) { return !std::isfinite(x); }));
}

// max |a - b| over max |b| on `count` elements; infinity where an element of `a` is not finite.
double RelativeDifference(const float* a, const double* b, size_t count) {
  double diff = 0.0, scale = 0.0;
  for (size_t i = 0; i < count; ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    diff = std::max(diff, std::fabs(a[i] - b[i]));
    scale = std::max(scale, std::fabs(b[i]));
  }
  return scale > 0.0 ? diff / scale : diff;
}

double Median(std::vector<float> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

bool Main(int argc, char** argv) {
  Options o;
  if (!ParseOptions(argc, argv, &o)) {
    PrintUsage();
    return false;
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  if (prop.major != 9) {
    std::printf("%s is sm_%d%d: the kernels are built for sm_90a only\n", prop.name, prop.major, prop.minor);
    return false;
  }
  const int64_t blocks64 = static_cast<int64_t>(prop.multiProcessorCount) * kBlocksPerSm * o.waves;
  if (blocks64 * kQueryRows * kHeadDim >= (int64_t{1} << 31) ||
      static_cast<int64_t>(o.total_chunks) * kChunkRows * kHeadDim >= (int64_t{1} << 31)) {
    std::printf("too many blocks or chunks for 32-bit element offsets\n");
    return false;
  }
  const int blocks = static_cast<int>(blocks64);
  const size_t q_elements = static_cast<size_t>(blocks) * kQueryRows * kHeadDim;
  const size_t kv_elements = static_cast<size_t>(o.total_chunks) * kChunkRows * kHeadDim;
  std::printf("%s: %d SMs, %d MB of L2; %d blocks (%d waves of %d a SM) x %d chunks of %d keys; K and V %.1f MB "
              "each, stride %d\n",
              prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20, blocks, o.waves, kBlocksPerSm,
              o.chunks, kChunkRows, kv_elements * 2 / 1e6, o.stride);
  std::fflush(stdout);

  const std::vector<__nv_bfloat16> q = RandomBf16(q_elements, 1), k = RandomBf16(kv_elements, 2),
                                   v = RandomBf16(kv_elements, 3);
  __nv_bfloat16 *q_device = nullptr, *k_device = nullptr, *v_device = nullptr;
  float* out_device = nullptr;
  CHECK_CUDA(cudaMalloc(&q_device, q_elements * 2));
  CHECK_CUDA(cudaMalloc(&k_device, kv_elements * 2));
  CHECK_CUDA(cudaMalloc(&v_device, kv_elements * 2));
  CHECK_CUDA(cudaMalloc(&out_device, q_elements * sizeof(float)));
  CHECK_CUDA(cudaMemcpy(q_device, q.data(), q_elements * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(k_device, k.data(), kv_elements * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(v_device, v.data(), kv_elements * 2, cudaMemcpyHostToDevice));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  Version versions[2];
  versions[0].name = "own";
  versions[0].launch = PrepareOwnMainLoop(q_device, k_device, v_device, out_device, blocks, o.chunks, o.total_chunks,
                                          o.stride, kScale, &versions[0].kernel, &versions[0].threads,
                                          &versions[0].dynamic_shared);
  versions[1].name = "cute";
  versions[1].launch = PrepareCuteMainLoop(q_device, k_device, v_device, out_device, blocks, o.chunks, o.total_chunks,
                                           o.stride, kScale, &versions[1].kernel, &versions[1].threads,
                                           &versions[1].dynamic_shared);
  for (Version& version : versions) {
    if (!version.launch) return false;
    CHECK_CUDA(cudaFuncGetAttributes(&version.attributes, version.kernel));
    CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&version.blocks_per_sm, version.kernel, version.threads,
                                                             version.dynamic_shared));
  }

  // Checks: each version once into NaN-poisoned O, against the reference on the sampled blocks and against each
  // other on every element.
  bool ok = true;
  for (Version& version : versions) {
    std::printf("%s: checked launch ...\n", version.name);
    std::fflush(stdout);
    if (!RunChecked(version, out_device, q_elements, stream)) return false;
    const size_t non_finite = CountNonFinite(version.out);
    if (non_finite != 0) {
      std::printf("%s: FAIL, %zu of %zu elements of O not finite (unwritten or overflowed)\n", version.name, non_finite,
                  q_elements);
      ok = false;
    }
  }
  const std::vector<int> checked = CheckedBlocks(blocks, o.check_blocks);
  double worst[2] = {0.0, 0.0};
  for (int block : checked) {
    const std::vector<double> reference = ReferenceBlock(o, block, q, k, v);
    for (int i = 0; i < 2; ++i) {
      const float* got = versions[i].out.data() + static_cast<size_t>(block) * kQueryRows * kHeadDim;
      worst[i] = std::max(worst[i], RelativeDifference(got, reference.data(), reference.size()));
    }
  }
  for (int i = 0; i < 2; ++i) {
    const bool pass = worst[i] <= kReferenceTolerance;
    std::printf("%s: max relative error against the float64 reference on %zu blocks: %.3e (tolerance %.0e) %s\n",
                versions[i].name, checked.size(), worst[i], kReferenceTolerance, pass ? "ok" : "FAIL");
    ok = ok && pass;
  }
  {
    std::vector<double> own(versions[0].out.begin(), versions[0].out.end());
    const double agreement = RelativeDifference(versions[1].out.data(), own.data(), own.size());
    size_t bitwise_different = 0;
    for (size_t i = 0; i < q_elements; ++i) {
      bitwise_different += std::memcmp(&versions[0].out[i], &versions[1].out[i], sizeof(float)) != 0;
    }
    const bool pass = agreement <= kAgreementTolerance;
    std::printf("cute against own on all %zu elements: max relative difference %.3e (tolerance %.0e), %zu elements "
                "differ bitwise %s\n",
                q_elements, agreement, kAgreementTolerance, bitwise_different, pass ? "ok" : "FAIL");
    ok = ok && pass;
  }
  std::fflush(stdout);

  // Timing: warm-up launches, then the versions alternately (which goes first alternating too), so that clocks and
  // the L2's contents weigh on both alike. Every launch between its own pair of events, all queued before the one
  // wait at the end, so that the host's launch latency falls outside them (the stream never runs dry).
  for (Version& version : versions) {
    for (int i = 0; i < o.warmup; ++i) CHECK_CUDA(version.launch(stream));
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  std::vector<cudaEvent_t> starts(2 * o.reps), stops(2 * o.reps);
  for (int i = 0; i < 2 * o.reps; ++i) {
    CHECK_CUDA(cudaEventCreate(&starts[i]));
    CHECK_CUDA(cudaEventCreate(&stops[i]));
  }
  for (int i = 0; i < 2 * o.reps; ++i) {  // launch i: rep i / 2, version (i / 2 + i) % 2
    CHECK_CUDA(cudaEventRecord(starts[i], stream));
    CHECK_CUDA(versions[(i / 2 + i) % 2].launch(stream));
    CHECK_CUDA(cudaEventRecord(stops[i], stream));
  }
  CHECK_CUDA(cudaStreamSynchronize(stream));
  for (int i = 0; i < 2 * o.reps; ++i) {
    float ms = 0.f;
    CHECK_CUDA(cudaEventElapsedTime(&ms, starts[i], stops[i]));
    versions[(i / 2 + i) % 2].milliseconds.push_back(ms);
    CHECK_CUDA(cudaEventDestroy(starts[i]));
    CHECK_CUDA(cudaEventDestroy(stops[i]));
  }

  const double chunks_total = static_cast<double>(blocks) * o.chunks;
  std::printf("\nversion,median_ms,min_ms,chunks_per_us,tflops,registers,local_bytes,shared_bytes,blocks_per_sm\n");
  for (const Version& version : versions) {
    const double median = Median(version.milliseconds);
    const double fastest = *std::min_element(version.milliseconds.begin(), version.milliseconds.end());
    std::printf("%s,%.4f,%.4f,%.1f,%.1f,%d,%zu,%zu,%d\n", version.name, median, fastest, chunks_total / (median * 1e3),
                chunks_total * kFlopsPerChunk / (median * 1e-3) / 1e12, version.attributes.numRegs,
                version.attributes.localSizeBytes, version.attributes.sharedSizeBytes + version.dynamic_shared,
                version.blocks_per_sm);
  }
  std::printf("ratio cute/own of the median times: %.3f\n",
              Median(versions[1].milliseconds) / Median(versions[0].milliseconds));
  CHECK_CUDA(cudaStreamDestroy(stream));
  CHECK_CUDA(cudaFree(q_device));
  CHECK_CUDA(cudaFree(k_device));
  CHECK_CUDA(cudaFree(v_device));
  CHECK_CUDA(cudaFree(out_device));
  std::printf("%s\n", ok ? "checks passed" : "CHECKS FAILED");
  return ok;
}

}  // namespace

int main(int argc, char** argv) { return Main(argc, argv) ? 0 : 1; }
