// _s2attn_cpu: the CPU extension. Holds registrations only.
#include "common/module_info.h"
#include "cpu/nbhd_attn.h"
#include "cpu/ring_attn.h"

NB_MODULE(_s2attn_cpu, m) {
  m.def("registrations", []() {
    nanobind::dict targets = s2attn::NbhdRegistrations(S2AttnNbhdForwardCpu, S2AttnNbhdBackwardDqCpu,
                                                       S2AttnNbhdBackwardDkvCpu, S2AttnDeltaCpu);
    s2attn::AddRingRegistrations(targets, S2AttnRingForwardCpu, S2AttnRingBackwardDqCpu, S2AttnRingBackwardDkvCpu);
    return targets;
  });
  m.def("build_info", []() { return s2attn::BuildInfo(); });
}
