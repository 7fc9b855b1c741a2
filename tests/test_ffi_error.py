"""jax's FFI error path with a handler that only fails (tests/ffi_error/): the error is raised, the process lives.

Tells a crash in jax's handling of handler errors from one in this package's handlers (cuda/README.md,
"Handler errors"): run on the CPU everywhere and on the GPU where there is one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import pytest

HERE = Path(__file__).parent / "ffi_error"


@pytest.fixture(scope="module")
def handler_library(tmp_path_factory) -> Path:
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        pytest.skip("needs a host C++17 compiler (CI has g++)")
    library = tmp_path_factory.mktemp("ffi_error") / "libffi_error.so"
    subprocess.run(
        [compiler, "-std=c++17", "-O1", "-shared", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}",
         str(HERE / "ffi_error_handler.cc"), "-o", str(library)],
        check=True,
    )  # fmt: skip
    return library


@pytest.mark.parametrize(
    "platform, xla_flags",
    [
        ("cpu", ""),
        pytest.param("cuda", "", marks=pytest.mark.gpu),
        pytest.param("cuda", "--xla_gpu_enable_command_buffer=", marks=pytest.mark.gpu),
    ],
    ids=["cpu", "cuda", "cuda-without-command-buffers"],
)
def test_a_failing_handler_raises_and_the_process_lives(handler_library, platform, xla_flags):
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {xla_flags}".strip())
    result = subprocess.run(
        [sys.executable, str(HERE / "ffi_error_reproducer.py"), str(handler_library), platform],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr[-2000:]}"
    assert "raised" in result.stdout
    assert "INVALID_ARGUMENT: ffi_error_handler: this handler always fails" in result.stdout
