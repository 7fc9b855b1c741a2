// Host-side queries of the CUDA runtime linked into _s2attn_cuda (no XLA, no nanobind).
#pragma once

namespace s2attn {

// CUDA runtime version this module was linked against, e.g. 13000.
int CudaRuntimeVersion();

}  // namespace s2attn
