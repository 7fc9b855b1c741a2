// _s2attn_cuda: the CUDA extension. Holds registrations only.
#include "common/module_info.h"
#include "gpu/device_info.h"

namespace nb = nanobind;

NB_MODULE(_s2attn_cuda, m) {
  m.def("registrations", []() { return nb::dict(); });
  m.def("build_info", []() {
    nb::dict info = s2attn::BuildInfo();
    info["cuda_runtime_version"] = s2attn::CudaRuntimeVersion();
    return info;
  });
}
