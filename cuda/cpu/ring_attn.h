// CPU handlers of the ring-grid FFI targets (contract: cuda/README.md, "Ring targets").
#pragma once

#include "xla/ffi/api/ffi.h"

// jax_s2attn_ring_fwd: (q, k, v, walk_rings, pattern_offsets, pattern_arcs, quad_weights) -> (out, lse)
XLA_FFI_DECLARE_HANDLER_SYMBOL(S2AttnRingForwardCpu);
// jax_s2attn_ring_bwd_dq: (q, k, v, dout, lse, delta, tables of the queries' walk) -> dq
XLA_FFI_DECLARE_HANDLER_SYMBOL(S2AttnRingBackwardDqCpu);
// jax_s2attn_ring_bwd_dkv: (q, k, v, dout, lse, delta, tables of the keys' walk) -> (dk, dv)
XLA_FFI_DECLARE_HANDLER_SYMBOL(S2AttnRingBackwardDkvCpu);
