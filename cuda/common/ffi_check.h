// Error idiom shared by every handler: a failed condition returns an ffi::Error with a
// message naming the operand and the values seen. Nothing throws across the XLA boundary.
#pragma once

#include <cstddef>
#include <cstdio>
#include <string>
#include <string_view>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace s2attn {

namespace ffi = xla::ffi;

// An error message built from text and numbers with std::string alone. No iostreams: inside jax's
// CUDA process, formatting a number through a std::ostringstream in this module read a null pointer
// inside the stream's number formatting and killed the process (cuda/README.md, "Handler errors").
// "a, b or c" of a list of kernel_limits.h, for messages.
template <typename T, size_t N>
std::string Alternatives(const T (&values)[N]) {
  std::string text;
  for (size_t i = 0; i < N; ++i) {
    text += (i == 0 ? "" : i + 1 == N ? " or " : ", ");
    if constexpr (std::is_arithmetic_v<T>) {
      text += std::to_string(values[i]);
    } else {
      text += values[i];
    }
  }
  return text;
}

class Message {
 public:
  Message& operator<<(std::string_view text) {
    text_.append(text);
    return *this;
  }
  template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, char>, int> = 0>
  Message& operator<<(T value) {
    text_ += std::is_same_v<T, bool> ? (value ? "true" : "false") : std::to_string(value);
    return *this;
  }
  Message& operator<<(double value) {
    char digits[32];
    std::snprintf(digits, sizeof digits, "%g", value);
    text_ += digits;
    return *this;
  }
  const std::string& str() const { return text_; }

 private:
  std::string text_;
};

// Builds the message lazily: S2ATTN_CHECK(cond, "q has rank " << rank).
#define S2ATTN_CHECK(cond, message)                                      \
  do {                                                                   \
    if (!(cond)) {                                                       \
      ::s2attn::Message s2attn_message_;                                 \
      s2attn_message_ << message;                                        \
      return ::xla::ffi::Error::InvalidArgument(s2attn_message_.str());  \
    }                                                                    \
  } while (0)

// Propagates an ffi::Error returned by a helper.
#define S2ATTN_RETURN_IF_ERROR(expr)               \
  do {                                             \
    ::xla::ffi::Error s2attn_error_ = (expr);      \
    if (s2attn_error_.failure()) return s2attn_error_; \
  } while (0)

}  // namespace s2attn
