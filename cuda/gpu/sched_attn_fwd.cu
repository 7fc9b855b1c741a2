// Scheduled forward: out and lse on the forward schedule (sched_attn_device.cuh).
#include "gpu/sched_attn_device.cuh"

namespace s2attn {

cudaError_t LaunchSchedAttnFwd(cudaStream_t stream, const SchedAttnParams& params) {
  return gpu::sched::Launch<gpu::sched::Kind::kForward>(stream, params);
}

}  // namespace s2attn
