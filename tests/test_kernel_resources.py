"""The scheduled kernels' register budgets, from ptxas (``nvcc -Xptxas -v``; no GPU needed).

Their speed rests on every wgmma staying asynchronous, which ptxas gives up ("wgmma.mma_async instructions are
serialized due to insufficient register resources") when a kernel's register budget is too small, and on no
spills. dk/dv's three consumer warpgroups get their budget from ``setmaxnreg`` (``cuda/gpu/sched_attn_device.cuh``,
kConsumerRegisters), which ptxas honours only for code inside the branch that raised it: this holds every
instantiation of the three kinds to it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

CUDA = Path(__file__).resolve().parents[1] / "cuda"
_ENTRY = re.compile(r"Compiling entry function '(\S*ScheduledAttention\S*)'")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


@pytest.mark.parametrize("kind", ["fwd", "dq", "dkv"])
def test_scheduled_kernels_keep_wgmmas_asynchronous_without_spills(kind, tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("needs nvcc")
    run = subprocess.run(
        [nvcc, "-std=c++17", "-arch=sm_90a", "-Xptxas", "-v", f"-I{CUDA}", "-c", str(CUDA / f"gpu/sched_attn_{kind}.cu"),
         "-o", str(tmp_path / "kernels.o")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    log = run.stderr
    assert "serialized" not in log, [line for line in log.splitlines() if "serialized" in line]
    entries = _ENTRY.findall(log)
    assert len(entries) == 6, entries  # bfloat16 and float16 at head dims 32, 64 and 128
    for entry, section in zip(entries, re.split(_ENTRY, log)[2::2]):
        spills = _SPILLS.search(section)
        assert spills is not None and spills.groups() == ("0", "0"), (entry, spills and spills.group(0))
