// CUDA handlers of the neighbourhood-attention FFI targets (contract: cuda/README.md).
#pragma once

#include "xla/ffi/api/ffi.h"

// jax_s2attn_nbhd_fwd: (q, k, v, window, row_order, arc_offsets, arcs, quad_weights) -> (out, lse)
XLA_FFI_DECLARE_HANDLER_SYMBOL(S2AttnNbhdForwardCuda);
// jax_s2attn_nbhd_bwd_dq: (q, k, v, dout, lse, delta, window, row_order, ...) -> dq
XLA_FFI_DECLARE_HANDLER_SYMBOL(S2AttnNbhdBackwardDqCuda);
// jax_s2attn_nbhd_bwd_dkv: (q, k, v, dout, lse, delta, window, row_order, ...) -> (dk, dv)
XLA_FFI_DECLARE_HANDLER_SYMBOL(S2AttnNbhdBackwardDkvCuda);
// jax_s2attn_stencil_fwd / _bwd_dq / _bwd_dkv: the same operands with the walk's segment table in place of its arc
// table and the stencil pairs after them; bfloat16/float16, Dk == Dv in {32, 64, 128}; only the stencil pairs'
// rows of their results, which alias the scheduled targets' (stencil_attn_kernels.h).
XLA_FFI_DECLARE_HANDLER_SYMBOL(S2AttnStencilForwardCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(S2AttnStencilBackwardDqCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(S2AttnStencilBackwardDkvCuda);
// jax_s2attn_stencil_bwd_dq_delta: (q, k, v, dout, lse, dlse, window, row_order, ...) -> (dq, delta), the
// stencil pairs' rows of both, aliased to the scheduled dq_delta's.
XLA_FFI_DECLARE_HANDLER_SYMBOL(S2AttnStencilBackwardDqDeltaCuda);
// jax_s2attn_ring_fwd / _bwd_dq / _bwd_dkv: the arc kernels between ring grids on flat fields (the CPU ring
// targets' operands: cuda/README.md, "Ring targets").
XLA_FFI_DECLARE_HANDLER_SYMBOL(S2AttnRingForwardCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(S2AttnRingBackwardDqCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(S2AttnRingBackwardDkvCuda);
// jax_s2attn_delta: (dout, out, dlse) -> delta = sum(dout * out, -1) - dlse
XLA_FFI_DECLARE_HANDLER_SYMBOL(S2AttnDeltaCuda);
