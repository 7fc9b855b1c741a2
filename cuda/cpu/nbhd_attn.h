// CPU handlers of the neighbourhood-attention FFI targets (contract: cuda/README.md).
#pragma once

#include "xla/ffi/api/ffi.h"

// jax_s2attn_nbhd_fwd: (q, k, v, window, row_order, arc_offsets, arcs, quad_weights) -> (out, lse)
XLA_FFI_DECLARE_HANDLER_SYMBOL(S2AttnNbhdForwardCpu);
// jax_s2attn_nbhd_bwd_dq: (q, k, v, dout, lse, delta, window, row_order, ...) -> dq
XLA_FFI_DECLARE_HANDLER_SYMBOL(S2AttnNbhdBackwardDqCpu);
// jax_s2attn_nbhd_bwd_dkv: (q, k, v, dout, lse, delta, window, row_order, ...) -> (dk, dv)
XLA_FFI_DECLARE_HANDLER_SYMBOL(S2AttnNbhdBackwardDkvCpu);
// jax_s2attn_delta: (dout, out, dlse) -> delta = sum(dout * out, -1) - dlse
XLA_FFI_DECLARE_HANDLER_SYMBOL(S2AttnDeltaCpu);
