// What every extension module reports about its own build (read by jax_s2attn/ops/_ffi.py).
#pragma once

#include <string>

#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"
#include "xla/ffi/api/c_api.h"

namespace s2attn {

inline nanobind::dict BuildInfo() {
  nanobind::dict info;
  info["jaxlib_version"] = std::string(JAXLIB_BUILD_VERSION);
  info["ffi_api_version"] = nanobind::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
  return info;
}

}  // namespace s2attn
