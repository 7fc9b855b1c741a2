// The smallest XLA FFI handlers that fail: each only returns InvalidArgument. Built by
// tests/test_ffi_error.py and called by ffi_error_reproducer.py: a crash there is one of jax's error path.
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static ffi::Error AlwaysInvalid(ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer>) {
  return ffi::Error::InvalidArgument("ffi_error_handler: this handler always fails");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(AlwaysInvalidCpu, AlwaysInvalid,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());

// The CUDA handler binds XLA's stream as every CUDA handler does, and never touches it.
static ffi::Error AlwaysInvalidOnStream(void*, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  return AlwaysInvalid(x, y);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(AlwaysInvalidCuda, AlwaysInvalidOnStream,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
