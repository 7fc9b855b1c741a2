// Work that may overlap the caller's stream: a second, low-priority stream per device, forked from and
// joined back into the caller's stream by events made per call (so that calls from several threads never
// share an event). Host code only; no synchronisation with the host.
#pragma once

#include <cuda_runtime_api.h>

#include <mutex>

namespace s2attn {
namespace gpu {

// The side stream of the current device (created on first use, never destroyed), or null if it cannot be.
inline cudaStream_t SideStream() {
  constexpr int kMaxDevices = 64;
  static cudaStream_t streams[kMaxDevices] = {};
  static std::once_flag created[kMaxDevices];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) return nullptr;
  std::call_once(created[device], [device] {
    int least = 0, greatest = 0;  // numerically, `least` is the lowest priority
    if (cudaDeviceGetStreamPriorityRange(&least, &greatest) != cudaSuccess ||
        cudaStreamCreateWithPriority(&streams[device], cudaStreamNonBlocking, least) != cudaSuccess) {
      streams[device] = nullptr;
    }
  });
  return streams[device];
}

// Enqueues `first(stream)`, then `alongside(side)` on the side stream after everything enqueued on `stream`
// so far, and makes `stream` wait for both: the two may run concurrently, the second (low priority) taking
// the SMs the first leaves idle. Without a side stream, both run on `stream`, one after the other.
template <typename First, typename Alongside>
cudaError_t RunAlongside(cudaStream_t stream, First&& first, Alongside&& alongside) {
  const cudaStream_t side = SideStream();
  cudaEvent_t fork = nullptr, join = nullptr;
  if (side == nullptr || cudaEventCreateWithFlags(&fork, cudaEventDisableTiming) != cudaSuccess) {
    const cudaError_t status = first(stream);
    return status != cudaSuccess ? status : alongside(stream);
  }
  cudaError_t status = cudaEventCreateWithFlags(&join, cudaEventDisableTiming);
  if (status == cudaSuccess) status = cudaEventRecord(fork, stream);
  if (status == cudaSuccess) status = first(stream);
  if (status == cudaSuccess) status = cudaStreamWaitEvent(side, fork, 0);
  if (status == cudaSuccess) status = alongside(side);
  if (status == cudaSuccess) status = cudaEventRecord(join, side);
  if (status == cudaSuccess) status = cudaStreamWaitEvent(stream, join, 0);
  // Destroying a recorded event is safe: its resources go once the work it waits for is done.
  cudaEventDestroy(fork);
  if (join != nullptr) cudaEventDestroy(join);
  return status;
}

}  // namespace gpu
}  // namespace s2attn
