// Pipeline shape of the tiled dq kernel and (with q parked, tiled_fwd_shape.cuh) the forward,
// included before tiled_attn_device.cuh: chunks
// of 32 columns, 4 stages, 4 blocks per SM. Chunks half as wide keep a warp's scores of one chunk in
// half the registers, so 128 per thread (16 warps per SM instead of 12) cost 24-32 bytes of spills;
// forward and dq are faster so than in the header's default shape on the H200 (measured:
// docs/performance.md). The dk/dv kernel has a shape of its own (tiled_dkv_shape.cuh).
// Each -DS2ATTN_TILED_* build flag overrides that part of every kernel's shape.
#pragma once

#ifdef S2ATTN_TILED_SHAPE_NAME
#error "include gpu/tiled_narrow_shape.cuh before gpu/tiled_attn_device.cuh: the header fixes the shape"
#endif

#ifndef S2ATTN_TILED_CHUNK
#define S2ATTN_TILED_CHUNK 32
#endif
#ifndef S2ATTN_TILED_STAGES
#define S2ATTN_TILED_STAGES 4
#endif
#ifndef S2ATTN_TILED_MIN_BLOCKS
#define S2ATTN_TILED_MIN_BLOCKS 4
#endif
