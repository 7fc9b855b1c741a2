// The device of XLA's stream made current for one handler's launches.
//
// A launch must go to a stream of the current device, and cudaFuncSetAttribute (the scheduled kernels'
// dynamic shared-memory limit) applies to the current device only. The handlers keep no other
// per-device state: no cached device properties, no static buffers, no attribute set once per process.
// So each launch runs with the stream's own device current, whatever device the calling thread had
// (several GPUs in one process, e.g. under shard_map), and the thread's device is restored after it.
#pragma once

#include <cuda_runtime_api.h>

namespace s2attn {

class ScopedStreamDevice {
 public:
  explicit ScopedStreamDevice(cudaStream_t stream) {
    int device = 0;
    status_ = cudaStreamGetDevice(stream, &device);
    if (status_ == cudaSuccess) status_ = cudaGetDevice(&previous_);
    if (status_ == cudaSuccess && device != previous_) {
      status_ = cudaSetDevice(device);
      switched_ = status_ == cudaSuccess;
    }
  }
  ~ScopedStreamDevice() {
    if (switched_) cudaSetDevice(previous_);
  }
  ScopedStreamDevice(const ScopedStreamDevice&) = delete;
  ScopedStreamDevice& operator=(const ScopedStreamDevice&) = delete;

  // cudaSuccess, or why the stream's device could not be made current.
  cudaError_t status() const { return status_; }

 private:
  cudaError_t status_ = cudaSuccess;
  int previous_ = 0;
  bool switched_ = false;
};

}  // namespace s2attn
