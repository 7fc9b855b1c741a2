// _s2attn_cpu: the CPU extension. Holds registrations only.
#include <type_traits>

#include "common/module_info.h"
#include "common/nbhd_params.h"
#include "cpu/nbhd_attn.h"

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule HandlerCapsule(Fn* handler) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, Fn, XLA_FFI_CallFrame*>, "not an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(handler));
}

}  // namespace

NB_MODULE(_s2attn_cpu, m) {
  m.def("registrations", []() {
    nb::dict targets;
    targets[s2attn::kTargetForward] = HandlerCapsule(S2AttnNbhdForwardCpu);
    targets[s2attn::kTargetBackwardDq] = HandlerCapsule(S2AttnNbhdBackwardDqCpu);
    targets[s2attn::kTargetBackwardDkv] = HandlerCapsule(S2AttnNbhdBackwardDkvCpu);
    return targets;
  });
  m.def("build_info", []() { return s2attn::BuildInfo(); });
}
