"""The benchmark scripts run end to end (tiny configurations, CPU) and write their CSVs."""

import csv
import importlib.util
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run(script: str, *args: str, cwd: pathlib.Path) -> str:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        cwd=cwd, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result.stdout


def _rows(directory: pathlib.Path, prefix: str) -> list[dict]:
    (path,) = directory.glob(f"{prefix}-*.csv")
    with open(path) as f:
        return list(csv.DictReader(f))


def test_attention_benchmark(tmp_path):
    _run("attention.py", "--configs", "1deg_tc0017", "--dtypes", "float32", "--reps", "2", "--input-sets", "1",
         "--out", str(tmp_path), cwd=tmp_path)
    (row,) = _rows(tmp_path, "attention")
    assert row["config"] == "1deg_tc0017" and int(row["pairs"]) == 696_240
    assert float(row["floor_fwdbwd_ms"]) > float(row["floor_fwd_ms"]) > 0
    assert float(row["reference_fwd_ms"]) > 0 and float(row["reference_fwdbwd_ms"]) > 0
    if "ffi_fwd_ms" in row:  # present when the native CPU module is built (as in CI)
        assert float(row["ffi_fwdbwd_ms"]) > 0 and float(row["speedup_fwdbwd_vs_reference"]) > 0
        # On the CPU "ffi" is the arc kernels, timed once; the tiled kernels are CUDA only.
        assert row["ffi_kernel"] == "arc" and row["ffi_fwd_ms"] == row["ffi_arc_fwd_ms"]
        assert float(row["ffi_arc_useful_tflops_fwdbwd"]) > 0
        assert not any(column.startswith("ffi_tiled") for column in row)
    if importlib.util.find_spec("jax_s2attn.tile_walk") is not None:
        assert 0 < float(row["tile_util_fwd"]) <= 1 and 0 < float(row["tile_util_bwd"]) <= 1
        assert int(row["computed_pairs_fwd"]) >= int(row["pairs"])


def test_distributed_benchmark_smoke(tmp_path):
    # --smoke: tiny grids on virtual CPU devices, table only (no CSV).
    table = _run("distributed.py", "--smoke", cwd=tmp_path).splitlines()
    modes = {line.split()[0] for line in table if line.split() and line.split()[0] in ("strong", "weak")}
    assert modes == {"strong", "weak"}
    assert not list(tmp_path.glob("*.csv"))
