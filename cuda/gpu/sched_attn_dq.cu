// Scheduled dq on the forward schedule (sched_attn_device.cuh).
#include "gpu/sched_attn_device.cuh"

namespace s2attn {

cudaError_t LaunchSchedAttnDq(cudaStream_t stream, const SchedAttnParams& params) {
  return gpu::sched::Launch<gpu::sched::Kind::kDq>(stream, params);
}

}  // namespace s2attn
