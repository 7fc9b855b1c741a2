// The jax_s2attn_delta target, shared by the CPU and CUDA handlers: its binding and the
// validation of its operands.
//
// delta = sum_c float(dout_c) * out_c - dlse per (point, head), the row term of the backward
// targets. It is a target of its own, and not left to XLA, because XLA fuses this reduction
// differently in differently compiled programs (changing its last bit); the kernels sum in an
// order that depends only on Dv.
#pragma once

#include <cstdint>
#include <utility>

#include "common/ffi_check.h"
#include "common/nbhd_params.h"
#include "xla/ffi/api/ffi.h"

namespace s2attn {

// jax_s2attn_delta: (dout, out, dlse) -> delta. dout [..., nlat, nlon, H, Dv] float32,
// bfloat16 or float16; out float32 of the same shape; dlse and delta float32 [..., nlat, nlon, H].
// Extra operands are ignored (the NaN-filled aliased results of the tests, as for every target).
template <typename Binding>
auto BindDelta(Binding&& binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()         // dout
      .template Arg<ffi::Buffer<ffi::F32>>()  // out
      .template Arg<ffi::Buffer<ffi::F32>>()  // dlse
      .RemainingArgs()
      .template Ret<ffi::Buffer<ffi::F32>>();  // delta
}

// The sizes of one delta call: `rows` (point, head) rows of `dv` channels, contiguous.
struct DeltaParams {
  int64_t rows = 0;
  int64_t dv = 0;
  ElementType dtype = ElementType::kF32;
};

// Checks dout, out, dlse and delta against each other and decodes their sizes.
inline ffi::Error DecodeDelta(const ffi::AnyBuffer& dout, ffi::Span<const int64_t> out_dims,
                              ffi::Span<const int64_t> dlse_dims, ffi::Span<const int64_t> delta_dims,
                              DeltaParams* p) {
  int64_t batch, nlat, nlon, heads;
  S2ATTN_RETURN_IF_ERROR(SplitActivation("dout", dout.dimensions(), &batch, &nlat, &nlon, &heads, &p->dv));
  S2ATTN_CHECK(ToElementType(dout.element_type(), &p->dtype).success(),
               "dout must be float32, bfloat16 or float16");
  S2ATTN_RETURN_IF_ERROR(CheckGridArray("out", out_dims, batch, nlat, nlon, heads, p->dv, "dout"));
  S2ATTN_RETURN_IF_ERROR(CheckGridArray("dlse", dlse_dims, batch, nlat, nlon, heads, -1, "dout"));
  S2ATTN_RETURN_IF_ERROR(CheckGridArray("delta", delta_dims, batch, nlat, nlon, heads, -1, "dout"));
  p->rows = batch * nlat * nlon * heads;
  return ffi::Error::Success();
}

}  // namespace s2attn
