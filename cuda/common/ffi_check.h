// Error idiom shared by every handler: a failed condition returns an ffi::Error with a
// message naming the operand and the values seen. Nothing throws across the XLA boundary.
#pragma once

#include <sstream>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace s2attn {

namespace ffi = xla::ffi;

// Builds the message lazily: S2ATTN_CHECK(cond, "q has rank " << rank).
#define S2ATTN_CHECK(cond, message)                                   \
  do {                                                                \
    if (!(cond)) {                                                    \
      std::ostringstream s2attn_message_;                             \
      s2attn_message_ << message;                                     \
      return ::xla::ffi::Error::InvalidArgument(s2attn_message_.str()); \
    }                                                                 \
  } while (0)

// Propagates an ffi::Error returned by a helper.
#define S2ATTN_RETURN_IF_ERROR(expr)               \
  do {                                             \
    ::xla::ffi::Error s2attn_error_ = (expr);      \
    if (s2attn_error_.failure()) return s2attn_error_; \
  } while (0)

}  // namespace s2attn
