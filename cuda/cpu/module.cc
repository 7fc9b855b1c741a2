// _s2attn_cpu: the CPU extension. Holds registrations only.
#include "common/module_info.h"

namespace nb = nanobind;

NB_MODULE(_s2attn_cpu, m) {
  m.def("registrations", []() { return nb::dict(); });
  m.def("build_info", []() { return s2attn::BuildInfo(); });
}
