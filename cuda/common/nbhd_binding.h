// Operand, attribute and result bindings of the three targets, shared by the CPU and CUDA
// handlers so both platforms bind exactly the contract of cuda/README.md. Each Bind*
// function takes a binding that already holds the platform's context (thread pool, stream).
#pragma once

#include <cstdint>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace s2attn {

namespace ffi = xla::ffi;

using F32Buffer = ffi::Buffer<ffi::F32>;
using I32Buffer = ffi::Buffer<ffi::S32>;

// Attributes common to every target.
template <typename Binding>
auto BindAttrs(Binding&& binding) {
  return std::move(binding)
      .template Attr<float>("scale")
      .template Attr<int64_t>("residues")
      .template Attr<int64_t>("shift")
      .template Attr<int64_t>("nlat_q")
      .template Attr<int64_t>("nlon_q")
      .template Attr<int64_t>("nlat_k")
      .template Attr<int64_t>("nlon_k");
}

// Extra operands after the documented ones are ignored (RemainingArgs): tests alias
// NaN-filled buffers to the results through them to check that every element is written.

// The tables every target takes after its activations (window, row_order, arc_offsets, arcs,
// quad_weights), with kStencilPairs the stencil pairs (the stencil targets), then the
// operands aliased to results.
template <bool kStencilPairs, typename Binding>
auto BindTables(Binding&& binding) {
  auto tables = std::move(binding)
                    .template Arg<I32Buffer>()   // window
                    .template Arg<I32Buffer>()   // row_order
                    .template Arg<I32Buffer>()   // arc_offsets
                    .template Arg<I32Buffer>()   // arcs
                    .template Arg<F32Buffer>();  // quad_weights
  if constexpr (kStencilPairs) {
    return std::move(tables).template Arg<I32Buffer>().RemainingArgs();  // stencil_pairs
  } else {
    return std::move(tables).RemainingArgs();
  }
}

// jax_s2attn_nbhd_fwd: (q, k, v, window, row_order, arc_offsets, arcs, quad_weights) -> (out, lse);
// kStencilPairs (jax_s2attn_stencil_fwd): the stencil pairs after them.
template <bool kStencilPairs = false, typename Binding>
auto BindForward(Binding&& binding) {
  return BindAttrs(BindTables<kStencilPairs>(std::move(binding)
                                                 .template Arg<ffi::AnyBuffer>()   // q
                                                 .template Arg<ffi::AnyBuffer>()   // k
                                                 .template Arg<ffi::AnyBuffer>())  // v
                       .template Ret<ffi::AnyBuffer>()  // out (type checked by the handler)
                       .template Ret<F32Buffer>());     // lse
}

// Operands of the backward targets: q, k, v, dout, lse, delta (jax_s2attn_stencil_bwd_dq_delta: dlse), then the
// tables.
template <bool kStencilPairs = false, typename Binding>
auto BindBackwardArgs(Binding&& binding) {
  return BindTables<kStencilPairs>(std::move(binding)
                                       .template Arg<ffi::AnyBuffer>()  // q
                                       .template Arg<ffi::AnyBuffer>()  // k
                                       .template Arg<ffi::AnyBuffer>()  // v
                                       .template Arg<ffi::AnyBuffer>()  // dout
                                       .template Arg<F32Buffer>()       // lse
                                       .template Arg<F32Buffer>());     // delta, or dlse
}

// Gradient results are float32, or on the stencil targets also the activations' dtype (CheckResultTypes in
// nbhd_params.h); the handlers check which.

// jax_s2attn_nbhd_bwd_dq: backward operands -> dq.
template <bool kStencilPairs = false, typename Binding>
auto BindBackwardDq(Binding&& binding) {
  return BindAttrs(BindBackwardArgs<kStencilPairs>(std::move(binding)).template Ret<ffi::AnyBuffer>());
}

// jax_s2attn_stencil_bwd_dq_delta: backward operands with dlse in place of delta, and the stencil pairs -> (dq,
// delta).
template <typename Binding>
auto BindBackwardDqDelta(Binding&& binding) {
  return BindAttrs(
      BindBackwardArgs<true>(std::move(binding)).template Ret<ffi::AnyBuffer>().template Ret<F32Buffer>());
}

// jax_s2attn_nbhd_bwd_dkv: backward operands -> (dk, dv); with kStencilPairs (jax_s2attn_stencil_bwd_dkv) the
// stencil pairs after them.
template <bool kStencilPairs = false, typename Binding>
auto BindBackwardDkv(Binding&& binding) {
  return BindAttrs(BindBackwardArgs<kStencilPairs>(std::move(binding))
                       .template Ret<ffi::AnyBuffer>()
                       .template Ret<ffi::AnyBuffer>());
}

// ------------------------------------------------------------------ ring targets

// Attributes of the ring targets: the logit scale and the sizes of one copy of the tables.
template <typename Binding>
auto BindRingAttrs(Binding&& binding) {
  return std::move(binding)
      .template Attr<float>("scale")
      .template Attr<int64_t>("walk_ring_count")     // rings of the walking grid
      .template Attr<int64_t>("visited_ring_count")  // rings of the visited grid
      .template Attr<int64_t>("pattern_count")        // patterns of the walk
      .template Attr<int64_t>("max_ring_points");     // points of the walking grid's largest ring
}

// The ring targets' tables after their activations (common/ring_walk.h), then the operands aliased to results.
template <typename Binding>
auto BindRingTables(Binding&& binding) {
  return std::move(binding)
      .template Arg<I32Buffer>()  // walk_rings
      .template Arg<I32Buffer>()  // ring_order: walking rings, most points first
      .template Arg<I32Buffer>()  // pattern_offsets
      .template Arg<I32Buffer>()  // pattern_arcs
      .template Arg<F32Buffer>()  // quad_weights: per visited ring (forward, dq) or walking ring (dk/dv)
      .RemainingArgs();
}

// jax_s2attn_ring_fwd: (q, k, v, tables) -> (out, lse).
template <typename Binding>
auto BindRingForward(Binding&& binding) {
  return BindRingAttrs(BindRingTables(std::move(binding)
                                          .template Arg<ffi::AnyBuffer>()   // q
                                          .template Arg<ffi::AnyBuffer>()   // k
                                          .template Arg<ffi::AnyBuffer>())  // v
                           .template Ret<ffi::AnyBuffer>()                  // out (float32)
                           .template Ret<F32Buffer>());                     // lse
}

// Operands of the ring backward targets: q, k, v, dout, lse, delta, then the tables.
template <typename Binding>
auto BindRingBackwardArgs(Binding&& binding) {
  return BindRingTables(std::move(binding)
                            .template Arg<ffi::AnyBuffer>()  // q
                            .template Arg<ffi::AnyBuffer>()  // k
                            .template Arg<ffi::AnyBuffer>()  // v
                            .template Arg<ffi::AnyBuffer>()  // dout
                            .template Arg<F32Buffer>()       // lse
                            .template Arg<F32Buffer>());     // delta
}

// jax_s2attn_ring_bwd_dq: backward operands, the queries' walk -> dq (float32).
template <typename Binding>
auto BindRingBackwardDq(Binding&& binding) {
  return BindRingAttrs(BindRingBackwardArgs(std::move(binding)).template Ret<ffi::AnyBuffer>());
}

// jax_s2attn_ring_bwd_dkv: backward operands, the keys' walk -> (dk, dv) (float32).
template <typename Binding>
auto BindRingBackwardDkv(Binding&& binding) {
  return BindRingAttrs(
      BindRingBackwardArgs(std::move(binding)).template Ret<ffi::AnyBuffer>().template Ret<ffi::AnyBuffer>());
}

}  // namespace s2attn
