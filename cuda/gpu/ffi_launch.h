// A handler's launches on XLA's stream, with the stream's device current (gpu/stream_device.h), and their
// status as an ffi::Error naming the target.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "gpu/stream_device.h"
#include "xla/ffi/api/ffi.h"

namespace s2attn {

// Runs `launch()` (the kernel launches of one call of `target`) with the stream's device current.
template <typename Launch>
xla::ffi::Error LaunchOnStreamDevice(cudaStream_t stream, const char* target, Launch&& launch) {
  const ScopedStreamDevice device(stream);
  const cudaError_t status = device.status() == cudaSuccess ? launch() : device.status();
  if (status == cudaSuccess) return xla::ffi::Error::Success();
  return xla::ffi::Error::Internal(std::string(target) + ": CUDA kernel launch failed: " + cudaGetErrorName(status) +
                                   " (" + cudaGetErrorString(status) + ")");
}

}  // namespace s2attn
