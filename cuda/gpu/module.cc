// _s2attn_cuda: the CUDA extension. Holds registrations only.
#include <type_traits>

#include "common/module_info.h"
#include "common/nbhd_params.h"
#include "gpu/device_info.h"
#include "gpu/nbhd_attn_ffi.h"

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule HandlerCapsule(Fn* handler) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, Fn, XLA_FFI_CallFrame*>, "not an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(handler));
}

}  // namespace

NB_MODULE(_s2attn_cuda, m) {
  m.def("registrations", []() {
    nb::dict targets;
    targets[s2attn::kTargetForward] = HandlerCapsule(S2AttnNbhdForwardCuda);
    targets[s2attn::kTargetBackwardDq] = HandlerCapsule(S2AttnNbhdBackwardDqCuda);
    targets[s2attn::kTargetBackwardDkv] = HandlerCapsule(S2AttnNbhdBackwardDkvCuda);
    return targets;
  });
  m.def("build_info", []() {
    nb::dict info = s2attn::BuildInfo();
    info["cuda_runtime_version"] = s2attn::CudaRuntimeVersion();
    return info;
  });
}
