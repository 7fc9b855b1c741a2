// CUDA handlers of the scheduled FFI targets (contract: cuda/README.md, "Scheduled targets").
#pragma once

#include "xla/ffi/api/ffi.h"

// jax_s2attn_sched_fwd: (q, k, v, tiles, tile_offsets, chunks, records, quad_weights) -> (out, lse)
XLA_FFI_DECLARE_HANDLER_SYMBOL(S2AttnScheduledForwardCuda);
// jax_s2attn_sched_bwd_dq: (q, k, v, dout, lse, delta, tiles, tile_offsets, chunks, records, quad_weights) -> dq
XLA_FFI_DECLARE_HANDLER_SYMBOL(S2AttnScheduledBackwardDqCuda);
// jax_s2attn_sched_bwd_dkv: the same operands on the backward schedule -> (dk, dv)
XLA_FFI_DECLARE_HANDLER_SYMBOL(S2AttnScheduledBackwardDkvCuda);
// jax_s2attn_sched_bwd_dq_delta: dq's operands with out (float32) and dlse in place of delta -> (dq, delta)
XLA_FFI_DECLARE_HANDLER_SYMBOL(S2AttnScheduledBackwardDqDeltaCuda);
