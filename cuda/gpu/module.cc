// _s2attn_cuda: the CUDA extension. Holds registrations only.
#include "common/module_info.h"
#include "gpu/device_info.h"
#include "gpu/nbhd_attn_ffi.h"
#include "gpu/nbhd_attn_kernels.h"
#include "gpu/sched_attn_ffi.h"
#include "gpu/sched_attn_kernels.h"

NB_MODULE(_s2attn_cuda, m) {
  m.def("registrations", []() {
    nanobind::dict targets =
        s2attn::NbhdRegistrations(S2AttnNbhdForwardCuda, S2AttnNbhdBackwardDqCuda, S2AttnNbhdBackwardDkvCuda,
                                  S2AttnDeltaCuda);
    s2attn::AddScheduledRegistrations(targets, S2AttnScheduledForwardCuda, S2AttnScheduledBackwardDqCuda,
                                      S2AttnScheduledBackwardDkvCuda, S2AttnScheduledBackwardDqDeltaCuda);
    s2attn::AddStencilRegistrations(targets, S2AttnStencilForwardCuda, S2AttnStencilBackwardDqCuda,
                                    S2AttnStencilBackwardDkvCuda, S2AttnStencilBackwardDqDeltaCuda);
    s2attn::AddRingRegistrations(targets, S2AttnRingForwardCuda, S2AttnRingBackwardDqCuda, S2AttnRingBackwardDkvCuda);
    return targets;
  });
  m.def("build_info", []() {
    nanobind::dict limits = s2attn::KernelLimits();
    limits["cuda_arc_max_head_dims"] = s2attn::NbhdAttnMaxHeadDims();
    limits["scheduled_sm90a"] = s2attn::SchedAttnBuiltForSm90a();
    limits["cuda_architectures"] = S2ATTN_CUDA_ARCHITECTURES;  // CMAKE_CUDA_ARCHITECTURES, comma-separated
    nanobind::dict info = s2attn::BuildInfo(limits);
    info["cuda_runtime_version"] = s2attn::CudaRuntimeVersion();
    return info;
  });
}
