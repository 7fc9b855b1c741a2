// Pipeline shape of the tiled dk/dv kernel, included before tiled_attn_device.cuh: chunks of 32
// columns, 3 stages, 4 blocks per SM, and its own k and v fragments waiting in shared memory
// (OwnOperandsShared). Holding two accumulators and two own operands, it takes 168 registers and
// 62 KB per block in the header's default shape (12 warps per SM) and spills 348-428 bytes at 128;
// with k and v in shared memory it fits 128 registers (8 bytes of spills) and 51 KB: 16 warps per
// SM, the faster shape on the H200 (measured: docs/performance.md). Each -DS2ATTN_TILED_* build flag
// overrides that part of every kernel's shape.
#pragma once

#ifdef S2ATTN_TILED_SHAPE_NAME
#error "include gpu/tiled_dkv_shape.cuh before gpu/tiled_attn_device.cuh: the header fixes the shape"
#endif

#ifndef S2ATTN_TILED_CHUNK
#define S2ATTN_TILED_CHUNK 32
#endif
#ifndef S2ATTN_TILED_STAGES
#define S2ATTN_TILED_STAGES 3
#endif
#ifndef S2ATTN_TILED_MIN_BLOCKS
#define S2ATTN_TILED_MIN_BLOCKS 4
#endif
#ifndef S2ATTN_TILED_OWN_SHARED
#define S2ATTN_TILED_OWN_SHARED 2
#endif
