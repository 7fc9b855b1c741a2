"""Calls the handler of ffi_error_handler.cc, which only returns InvalidArgument, in this process.

Usage: ``python ffi_error_reproducer.py LIBRARY cpu|cuda``. Prints ``raised <Type>: <message>`` and exits 0
when jax turns the handler's error into a Python exception; a crash of the process (e.g. SIGSEGV) would be
jax's error path failing, since the handler does nothing but return the error. With
``XLA_FLAGS=--xla_gpu_enable_command_buffer=`` the CUDA call runs without command buffers.
"""

import ctypes
import sys

import jax
import jax.numpy as jnp

library, platform = sys.argv[1], sys.argv[2]
handlers = ctypes.cdll.LoadLibrary(library)
handler = {"cpu": handlers.AlwaysInvalidCpu, "cuda": handlers.AlwaysInvalidCuda}[platform]
jax_platform = {"cpu": "cpu", "cuda": "CUDA"}[platform]
jax.ffi.register_ffi_target("ffi_error_always_invalid", jax.ffi.pycapsule(handler), platform=jax_platform)
device = jax.devices("gpu" if platform == "cuda" else "cpu")[0]
x = jax.device_put(jnp.arange(8, dtype=jnp.float32), device)
call = jax.ffi.ffi_call("ffi_error_always_invalid", jax.ShapeDtypeStruct(x.shape, x.dtype))
try:
    jax.block_until_ready(jax.jit(call)(x))
except Exception as e:  # the type jax raises for a failed handler is its own (JaxRuntimeError today)
    print(f"raised {type(e).__name__}: {e}".splitlines()[0], flush=True)
    sys.exit(0)
print("no error raised", flush=True)
sys.exit(1)
