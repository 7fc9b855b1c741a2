// Building blocks of the CPU handlers: 16-bit widening, the thread pool loop, float32 views of
// activations and the fixed-order vector helpers. Plain C++ and the XLA FFI API.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>

#include "common/nbhd_params.h"
#include "xla/ffi/api/ffi.h"

namespace s2attn {
namespace cpu {

inline constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ------------------------------------------------------------------ 16-bit floats

inline float BFloat16ToFloat(uint16_t h) {
  const uint32_t bits = uint32_t{h} << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float HalfToFloat(uint16_t h) {
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

inline ffi::Error OutOfMemory() {
  return ffi::Error(ffi::ErrorCode::kResourceExhausted, "out of host memory");
}

}  // namespace cpu
}  // namespace s2attn
