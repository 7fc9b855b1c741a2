// Pipeline shape of the tiled forward, included before tiled_attn_device.cuh: dq's narrow shape
// (tiled_narrow_shape.cuh) with q's fragments waiting in shared memory (OwnOperandsShared). Multiplying
// P in two parts leaves the forward at D 64 at its cap of 128 registers with 40 bytes of spills; with q
// parked it has none and is faster on the H200, where dq and dk/dv are slower so (measured:
// docs/performance.md). The one-part forward (the op undifferentiated) shares the shape.
// Each -DS2ATTN_TILED_* build flag overrides that part of every kernel's shape.
#pragma once

#ifndef S2ATTN_TILED_OWN_SHARED
#define S2ATTN_TILED_OWN_SHARED 1
#endif
#include "gpu/tiled_narrow_shape.cuh"
