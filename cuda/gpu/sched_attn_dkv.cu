// Scheduled dk and dv on the backward schedule (sched_attn_device.cuh).
#include "gpu/sched_attn_device.cuh"

namespace s2attn {

cudaError_t LaunchSchedAttnDkv(cudaStream_t stream, const SchedAttnParams& params) {
  return gpu::sched::Launch<gpu::sched::Kind::kDkv>(stream, params);
}

}  // namespace s2attn
