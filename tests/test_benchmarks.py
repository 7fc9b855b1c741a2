"""The benchmark scripts run end to end (tiny configurations, CPU) and write their CSVs."""

import csv
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_s2attn
from jax_s2attn import NeighborhoodPlan

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run(script: str, *args: str, cwd: pathlib.Path) -> str:
    result = subprocess.run(
        [sys.executable, "-P", str(ROOT / "benchmarks" / script), *args],  # -P: no script directory on sys.path
        cwd=cwd, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result.stdout


def _rows(directory: pathlib.Path, prefix: str) -> list[dict]:
    (path,) = directory.glob(f"{prefix}-*.csv")
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_attention_benchmark(tmp_path):
    # Three samples: their median stands one outlier on a busy CI machine (with two, one sample whose single call
    # is held up by a few ms can make the delta target, a few microseconds, read negative).
    _run("attention.py", "--configs", "1deg_tc0017", "--dtypes", "float32", "--reps", "3", "--input-sets", "1",
         "--out", str(tmp_path), cwd=tmp_path)
    (row,) = _rows(tmp_path, "attention")
    assert row["config"] == "1deg_tc0017" and int(row["pairs"]) == 696_240
    assert float(row["floor_fwdbwd_ms"]) > float(row["floor_fwd_ms"]) > 0
    assert float(row["reference_fwd_ms"]) > 0 and float(row["reference_fwdbwd_ms"]) > 0
    if "ffi_fwd_ms" in row:  # present when the native CPU module is built (as in CI)
        assert float(row["ffi_fwdbwd_ms"]) > 0 and float(row["speedup_fwdbwd_vs_reference"]) > 0
        # On the CPU "ffi" is the arc kernels, timed once; the scheduled kernels (and their schedules' statistics,
        # the arc/scheduled ratios) are sm_90 only.
        assert row["ffi_kernel"] == "arc" and row["ffi_fwd_ms"] == row["ffi_arc_fwd_ms"]
        assert float(row["ffi_arc_useful_tflops_fwdbwd"]) > 0
        targets = [float(row[f"ffi_arc_{t}_target_ms"]) for t in ("forward", "dq", "dkv", "delta")]
        assert min(targets) > 0 and sum(targets) < 2 * float(row["ffi_arc_fwdbwd_ms"])
        assert not any(column.startswith(("ffi_scheduled", "sched_util", "arc_over")) for column in row)
    # Per native family (ffi_<family>_*, besides the "ffi" choice's own columns) only the op's kernel families.
    own = ("ffi_fwd", "ffi_device_bytes", "ffi_kernel", "ffi_gpairs_per_s")
    families = {column.split("_")[1] for column in row if column.startswith("ffi_") and not column.startswith(own)}
    assert families <= set(jax_s2attn.ops._ffi.KERNELS), families


def _benchmark_module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_median_ms_times_bursts_of_calls(monkeypatch):
    import jax.numpy as jnp

    timing = _benchmark_module("timing")
    seen = []

    def fast(x):
        seen.append(x)
        return jnp.asarray(x)

    # Warm-up of every set, one call that sizes the burst (here max_burst), then per sample one
    # call alone and a burst, cycling through the input sets.
    timing.median_ms(fast, [(0,), (1,), (2,)], reps=2, sample_ms=1e4, max_burst=7)
    assert seen[:4] == [0, 1, 2, 0]
    assert seen[4:] == [0] + [(1 + j) % 3 for j in range(7)] + [1] + [(2 + j) % 3 for j in range(7)]

    # A call's own time is reported per call, whatever the burst, and a fixed cost per measurement
    # (dispatch of the first call, the final wait) cancels. On a fake clock: each call advances it
    # by `seconds`, each wait by 0.3 ms (real sleeps would fail on a loaded machine).
    clock = [0.0]

    def waiting(result):
        clock[0] += 3e-4
        return result

    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(timing, "jax", types.SimpleNamespace(block_until_ready=waiting))
    # Bursts last about 5 ms by the first call alone (0.8, 2.3, 20.3 ms with its wait), at least 2 calls.
    for seconds, burst in ((0.0005, 6), (0.002, 2), (0.02, 2)):
        calls = []

        def fn(x, seconds=seconds, calls=calls):
            calls.append(x)
            clock[0] += seconds
            return x

        assert timing.median_ms(fn, [(0,)], reps=3, sample_ms=5.0) == pytest.approx(1e3 * seconds)
        assert len(calls) == 1 + 1 + 3 * (1 + burst)  # warm-up, sizing, per sample one alone and a burst


@pytest.mark.slow
def test_distributed_benchmark_smoke(tmp_path):
    # --smoke: tiny grids on virtual CPU devices, table only (no CSV).
    table = _run("distributed.py", "--smoke", cwd=tmp_path).splitlines()
    modes = {line.split()[0] for line in table if line.split() and line.split()[0] in ("strong", "weak")}
    assert modes == {"strong", "weak"}
    assert not list(tmp_path.glob("*.csv"))


def test_torch_harmonics_build_imports_without_the_disco_extension(tmp_path, monkeypatch):
    # The build script's one edit of the copied package: names the convolution module imports from its
    # optimized module (present only with its own extension built) bound to None where absent.
    build = _benchmark_module("build_torch_harmonics")
    disco = tmp_path / "fake_th" / "disco"
    (disco / "optimized").mkdir(parents=True)
    (tmp_path / "fake_th" / "__init__.py").write_text("")
    (disco / "__init__.py").write_text("")
    (disco / "optimized" / "__init__.py").write_text("")
    (disco / "optimized" / "disco_optimized.py").write_text("def built():\n    return 1\n")
    (disco / "convolution.py").write_text(
        "import math\nfrom .optimized.disco_optimized import (\n    built,\n    missing,\n)\nafter = math.pi\n"
    )
    build._import_without_disco_kernels(tmp_path / "fake_th")
    monkeypatch.syspath_prepend(str(tmp_path))
    convolution = importlib.import_module("fake_th.disco.convolution")
    assert convolution.built() == 1 and convolution.missing is None
    assert convolution.after == pytest.approx(3.14159, 1e-5)  # the rest of the module untouched


def _expanded_rows(arcs, walk_shape, nlon_other):
    """Per walking row: its longest arc and its pairs, from each pattern's expanded neighbours (an arc is
    contiguous, so its length is the pattern's count of neighbours on that row of the other grid); a
    row's pairs: nlon / R points per pattern."""
    longest, row_pairs = np.zeros(walk_shape[0], int), np.zeros(walk_shape[0], int)
    for h in range(walk_shape[0]):
        for r in range(arcs.residues):
            neighbours = arcs.expand(h * arcs.residues + r)
            longest[h] = max(longest[h], np.bincount(neighbours // nlon_other, minlength=1).max())
            row_pairs[h] += neighbours.size * (walk_shape[1] // arcs.residues)
    return longest, row_pairs


@pytest.mark.parametrize(
    "shapes", [((17, 36), (17, 36)), ((34, 72), (17, 36)), ((17, 36), (33, 72))], ids=["self", "down", "up"]
)
def test_row_widths_split_the_plans_pairs(shapes):
    plan = NeighborhoodPlan(*shapes, theta_cutoff=0.3)
    row_widths = _benchmark_module("row_widths")
    walks = {"forward": (plan.forward_arcs, plan.out_shape, plan.in_shape[1]),
             "backward": (plan.backward_arcs, plan.in_shape, plan.out_shape[1])}  # fmt: skip
    for walk, (arcs, walk_shape, nlon_other) in walks.items():
        longest, row_pairs = _expanded_rows(arcs, walk_shape, nlon_other)
        for width in (0, 3, 8, nlon_other):
            split = row_widths.row_split(plan, walk, width)
            narrow = longest <= width
            assert (split.narrow_rows, split.narrow_pairs) == (narrow.sum(), row_pairs[narrow].sum()), walk
            assert split.pairs == plan.num_pairs


@pytest.mark.skipif(not jax_s2attn.native_backends().get("cpu"), reason="needs the native CPU module (CI has it)")
@pytest.mark.slow
def test_row_widths_times_a_kernel_on_each_band(tmp_path):
    lines = _run("row_widths.py", "--grid", "17", "36", "--theta-cutoff", "0.3", "--time", "arc", cwd=tmp_path)
    timed = [line for line in lines.splitlines() if "arc forward" in line or "arc dk/dv" in line]
    # every row, each of the forward walk's four splits (each has short-arc rows here), then the rows outside
    # the forward and the backward stencil pairs: rows 0..2 and 13..16 of this plan in both walks
    assert len(timed) == 7 and all(float(line.split()[-2]) > 0 for line in timed), lines
    assert [line.split("(")[1].split(")")[0] for line in timed[-2:]] == ["7 rows: 0..2, 13..16"] * 2, lines


def test_row_widths_bands_outside_the_stencil_pairs():
    bands_outside = _benchmark_module("row_widths").bands_outside
    assert bands_outside(10, np.array([[3, 4], [5, 6]])) == [(0, 3), (7, 3)]
    assert bands_outside(6, np.array([[0, 1], [4, 5]])) == [(2, 2)]
    assert bands_outside(4, np.zeros((0, 2), int)) == [(0, 4)]
    assert bands_outside(4, np.array([[0, 1], [2, 3]])) == []


@pytest.mark.skipif(not jax_s2attn.native_backends().get("cuda"), reason="needs the CUDA module (CI builds it)")
def test_stencil_gate_times_the_op_with_and_without_the_stencil_rows():
    # The op reads the gate when traced and jax reuses the traces of its inner functions: without clearing jax's
    # caches the second setting would lower to the first one's program and time it again.
    stencil_gate = _benchmark_module("stencil_gate")
    plan, gate = NeighborhoodPlan((17, 36), (17, 36)), jax_s2attn.ops.neighborhood.STENCIL_MIN_POINTS
    assert stencil_gate.gate_points(plan, 2, "forward") == 2 * stencil_gate.gate_points(plan, 1, "forward") > 0
    stencil = ["jax_s2attn_stencil_bwd_dkv", "jax_s2attn_stencil_bwd_dq_delta", "jax_s2attn_stencil_fwd"]
    for points, expected in ((stencil_gate.NEVER, []), (1, stencil), (stencil_gate.NEVER, [])):
        assert stencil_gate.stencil_targets(plan, 1, points) == expected, points
    assert jax_s2attn.ops.neighborhood.STENCIL_MIN_POINTS == gate  # restored


def test_torch_harmonics_build_leaves_a_wheels_prebuilt_extensions_behind(tmp_path):
    build = _benchmark_module("build_torch_harmonics")
    attention = tmp_path / "wheel" / "torch_harmonics" / "attention"
    attention.mkdir(parents=True)
    for name in ("__init__.py", "_C.cpython-312-x86_64-linux-gnu.so", "attention.py"):
        (attention / name).write_text("")
    # A DEST that an earlier run filled, with the wheel's extension in it.
    stale = tmp_path / "dest" / "torch_harmonics" / "attention"
    stale.mkdir(parents=True)
    (stale / "_C.cpython-312-x86_64-linux-gnu.so").write_text("")
    package = build._copy_sources(tmp_path / "wheel", tmp_path / "dest")
    assert sorted(p.name for p in (package / "attention").iterdir()) == ["__init__.py", "attention.py"]


@pytest.mark.slow
def test_profile_driver_runs_each_configuration(tmp_path):
    # The ncu driver of run_h200.sh, on the CPU with the reference: one line per configuration.
    out = _run("profile_kernels.py", "--grid", "9", "18", "--theta-cutoff", "0.8", "--grid", "12", "24",
               "--theta-cutoff", "0.5", "--implementation", "reference", "--dtype", "float32", cwd=tmp_path)
    assert [line.split(":")[0] for line in out.splitlines()] == [
        "(9, 18) theta_cutoff=0.8", "(12, 24) theta_cutoff=0.5"
    ]


def test_profile_driver_refuses_a_family_without_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    script = ROOT / "benchmarks" / "profile_kernels.py"
    result = subprocess.run([sys.executable, "-P", str(script), "--grid", "9", "18", "--family", "scheduled"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 2 and "--family runs the CUDA kernels" in result.stderr, result.stderr


@pytest.mark.slow
def test_soak_repeats_its_losses_bit_for_bit(tmp_path, monkeypatch):
    # Two CPU runs of a tiny configuration, the second compared with the first: the same losses, bit for bit.
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    tiny = ("--grid", "16", "32", "--channels", "16", "--heads", "2", "--theta-cutoff", "0.3", "--steps", "4")
    _run("soak.py", *tiny, "--out", str(tmp_path / "first.json"), cwd=tmp_path)
    lines = _run("soak.py", *tiny, "--out", str(tmp_path / "second.json"), "--compare", str(tmp_path / "first.json"),
                 cwd=tmp_path)  # exit status 0: identical losses, all finite
    first, second = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("first", "second"))
    assert first["losses_sha256"] == second["losses_sha256"] and second["compare"]["identical"], lines
    assert not first["any_nan"] and not second["any_nan"]
    assert len(first["losses"]) == first["steps"] == 4 and len(second["losses"]) == 4
    assert first["memory"]["step_100"] is None  # a run of fewer than 100 steps has no reading there


@pytest.mark.slow
def test_compare_builds_times_three_trees_in_turn(tmp_path):
    # Three exports of the working tree's package (CPU module only), one tiny config, two rounds each.
    script = ROOT / "benchmarks" / "compare_builds.sh"
    for name in ("a", "b", "c"):
        shutil.copytree(ROOT, tmp_path / name, ignore=shutil.ignore_patterns(".git", ".venv", ".carry", "build", "out",
                                                                            "*.so"))
    env = {**os.environ, "OUT": str(tmp_path / "out"), "TMPDIR": str(tmp_path), "JAX_S2ATTN_CUDA": "OFF",
           "PYTHON": sys.executable}
    result = subprocess.run(
        ["bash", str(script), str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "c"), "--configs",
         "1deg_tc0017", "--dtypes", "float32", "--reps", "3", "--input-sets", "1", "--reference-max-pairs", "0"],
        capture_output=True, text=True, timeout=1200, env=env,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rounds = sorted(p.name for p in (tmp_path / "out" / "ab").glob("[ABC]-[12]"))
    assert rounds == ["A-1", "A-2", "B-1", "B-2", "C-1", "C-2"]
    header = next(line.split() for line in result.stdout.splitlines() if line.startswith("config"))
    assert header[3:] == ["A", "ms", "B", "ms", "C", "ms", "B/A", "C/A"]
    table = [line.split() for line in result.stdout.splitlines() if line.startswith("1deg_tc0017")]
    assert {row[2] for row in table} >= {"ffi_fwd_ms", "ffi_fwdbwd_ms"}
    for row in table:
        a, b, c, b_over_a, c_over_a = map(float, row[3:])
        assert min(a, b, c) > 0
        assert b_over_a == pytest.approx(b / a, abs=1e-3) and c_over_a == pytest.approx(c / a, abs=1e-3)


def test_detach_runs_a_command_past_its_caller_and_collects_its_files(tmp_path):
    # A command that writes into its OUT, then ends: collect waits for it and copies its files and its status;
    # a second start while one runs is refused; collect without a start says so. The command reads the working
    # directory as it was at its start, whatever changes there after.
    script, env = ROOT / "benchmarks" / "detach.sh", {**os.environ, "DETACHED_DIR": str(tmp_path / "detached")}
    work = tmp_path / "work"
    work.mkdir()
    (work / "input.txt").write_text("written\n")

    def detach(*args, out):
        return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, timeout=60, cwd=work,
                              env={**env, "OUT": str(out)})  # fmt: skip

    assert detach("collect", out=tmp_path / "none").returncode == 2
    command = 'sleep 2; cat input.txt > "$OUT/result.txt"; exit 5'
    started = detach("start", "bash", "-c", command, out=tmp_path / "x")
    assert started.returncode == 0, started.stderr
    (work / "input.txt").unlink()  # a refresh of the working directory under the running command
    assert detach("start", "true", out=tmp_path / "x").returncode == 2  # the first still runs
    early = detach("collect", out=tmp_path / "early")
    assert early.returncode == 3 and not (tmp_path / "early" / "result.txt").exists()
    done = detach("collect", "30", out=tmp_path / "done")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "done" / "result.txt").read_text() == "written\n"
    assert (tmp_path / "done" / "detached-status").read_text().strip() == "5"


def test_schedule_shapes_reports_every_shape(tmp_path):
    lines = _run("schedule_shapes.py", "--configs", "hdeg_tc003", cwd=tmp_path).splitlines()
    rows = [line.split() for line in lines[1:]]
    schedule_shapes = _benchmark_module("schedule_shapes")
    assert [row[1:3] for row in rows] == [[f"{r}x{c}", f"W{w}"] for r, c, w in schedule_shapes.SHAPES]
    plan = NeighborhoodPlan((360, 720), (360, 720), theta_cutoff=0.03)
    for row, (r, c, w) in zip(rows, schedule_shapes.SHAPES):
        chunks, useful = int(row[3]), float(row[5])
        assert useful == pytest.approx(plan.num_pairs / (chunks * r * c * w), abs=5e-4)
        assert 0 < useful <= 1


# A cuobjdump -sass listing in its layout: an outer loop (0x0050-0x00d0) around an inner one (0x0070-0x00c0) that
# has a forward branch (0x0090) and two branches back to its head (a `continue` at 0x00a0), predicated branches,
# padding that never executes, the branch to itself after EXIT that ends every kernel, and a second architecture's
# section that repeats a name.
SASS_LISTING = """
\tcode for sm_90a
\t\tFunction : _Z6NestedPKfPfii
\t.headerflags\t@"EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                 /* 0x00000a00ff017b82 */
        /*0010*/                   S2R R0, SR_TID.X ;                     /* 0x0000000000007919 */
        /*0020*/                   ISETP.GE.AND P0, PT, R0, 0x1, PT ;     /* 0x000000010000780c */
        /*0030*/              @!P0 EXIT ;                                 /* 0x000000000000894d */
        /*0040*/                   MOV R4, RZ ;                           /* 0x000000ff00047202 */
        /*0050*/                   IADD3 R2, R2, 0x1, RZ ;                /* 0x0000000102027810 */
        /*0060*/                   MOV R3, RZ ;                           /* 0x000000ff00037202 */
        /*0070*/                   LDG.E R5, desc[UR4][R6.64] ;           /* 0x0000000406057981 */
        /*0080*/                @P2 BRA 0xb0 ;                            /* 0x0000000000082947 */
        /*0090*/              @!PT LDS RZ, [RZ] ;                         /* 0x00000000fffff984 */
        /*00a0*/                @P3 BRA 0x70 ;                            /* 0xfffffffc0000b947 */
        /*00b0*/                   FFMA R4, R4, R5, 1 ;                   /* 0x3f80000004047423 */
        /*00c0*/              @!P1 BRA 0x70 ;                             /* 0xfffffffc0000a947 */
        /*00d0*/                   @P0 BRA.U 0x50 ;                       /* 0xfffffffc0000a947 */
        /*00e0*/                   STG.E desc[UR4][R8.64], R4 ;           /* 0x0000000408007986 */
        /*00f0*/                   EXIT ;                                 /* 0x000000000000794d */
        /*0100*/                   BRA 0x100;                             /* 0xfffffffc00fc7947 */
\t\t..........
\t\tFunction : _Z5Otherv
        /*0000*/                   EXIT ;                                 /* 0x000000000000794d */
\tcode for sm_80
\t\tFunction : _Z5Otherv
        /*0000*/              @!UPT UMOV UR4, 0x1 ;                       /* 0x0000000100047882 */
        /*0010*/                   EXIT ;                                 /* 0x000000000000794d */
"""


def test_sass_loops_finds_each_loop_and_its_opcodes():
    sass_loops = _benchmark_module("sass_loops")
    functions = sass_loops.functions(SASS_LISTING)
    assert list(functions) == ["_Z6NestedPKfPfii", "_Z5Otherv", "_Z5Otherv [sm_80]"]
    assert len(functions["_Z6NestedPKfPfii"]) == 17 and functions["_Z5Otherv"] == [(0, "EXIT")]
    assert functions["_Z5Otherv [sm_80]"] == [(0, "@!UPT UMOV UR4, 0x1"), (0x10, "EXIT")]
    outer, inner = sass_loops.loops(functions["_Z6NestedPKfPfii"])
    # The inner loop runs from its head to the last branch back to it; the forward branch opens none.
    assert (inner.start, inner.end, inner.instructions, inner.innermost) == (0x70, 0xC0, 6, True)
    assert inner.opcodes == {"BRA": 3, "LDG": 1, "@!PT": 1, "FFMA": 1}
    assert (outer.start, outer.end, outer.instructions, outer.innermost) == (0x50, 0xD0, 9, False)
    assert outer.opcodes["BRA"] == 4 and "STG" not in outer.opcodes
    assert sass_loops.opcode("@!P1 BRA 0x70") == "BRA" and sass_loops.opcode("LDG.E.128 R4, [R2]") == "LDG"
    assert sass_loops.opcode("@!UPT UMOV UR4, 0x1") == "@!UPT"
    assert sass_loops.loops(functions["_Z5Otherv"]) == []
    assert "_Z5Otherv" not in sass_loops.report(SASS_LISTING, "Nested")
    with pytest.raises(ValueError, match="--kernel"):
        sass_loops.report(SASS_LISTING, "NoSuchKernel")


def test_sass_loops_names_the_fix_without_cuobjdump(monkeypatch):
    sass_loops = _benchmark_module("sass_loops")
    assert sass_loops.find_cuobjdump("/opt/cuda/bin/cuobjdump") == "/opt/cuda/bin/cuobjdump"
    monkeypatch.setattr(sass_loops.shutil, "which", lambda name: None)
    monkeypatch.setitem(sys.modules, "nvidia", None)  # no wheel: importing it raises ImportError
    with pytest.raises(ValueError, match="nvidia-cuda-cuobjdump"):
        sass_loops.find_cuobjdump()


NESTED_KERNEL = """
#include "gpu/nested_steps.cuh"

__global__ void Nested(const float* x, float* y, int n) {
  float acc = 0.f;
#pragma unroll 1
  for (int i = 0; i < n; ++i) {
#pragma unroll 1
    for (int j = 0; j < kSteps; ++j) acc = fmaf(acc, x[kSteps * i + j], 1.f);
    y[i] = acc;
  }
}
"""


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CI has it)")
def test_sass_loops_reads_a_compiled_kernel(tmp_path):
    # cuobjdump comes from the toolkit or the nvidia-cuda-cuobjdump wheel that `make test` installs. The kernel
    # lies in another tree's cuda/gpu and includes a header only that tree has (as an A/B's base tree does).
    (tmp_path / "cuda" / "gpu").mkdir(parents=True)
    (tmp_path / "cuda" / "gpu" / "nested_steps.cuh").write_text("constexpr int kSteps = 8;\n")
    source = tmp_path / "cuda" / "gpu" / "nested.cu"
    source.write_text(NESTED_KERNEL)
    lines = _run("sass_loops.py", str(source), "--kernel", "Nested", cwd=tmp_path).splitlines()
    assert re.match(r"_Z6NestedPKfPfi: \d+ instructions", lines[0])
    loops = [line for line in lines[1:] if line.startswith("  loop ")]
    inner = [line for line in loops if "innermost" in line]
    outer = [line for line in loops if "outer" in line]
    assert len(inner) == 1 and len(outer) == 1, lines
    # The inner loop loads and multiplies; the outer one also stores y[i].
    assert "LDG" in inner[0] and "FFMA" in inner[0] and "STG" not in inner[0]
    assert "STG" in outer[0]


# The FlexAttention peer (benchmarks/flex_attention.py), checked on the CPU with FlexAttention's eager path: its
# block lists against the dense neighbourhoods, its results against the float64 oracle.
FLEX_CASES = {
    "self-padded": ((13, 36), (13, 36), 0.35),  # neither grid whole patches
    "self-default": ((19, 40), (19, 40), None),
    "down-full-blocks": ((40, 80), (20, 40), 1.0),  # some key blocks read whole by every query of a block
    "up": ((20, 40), (40, 80), 1.0),
}


def _flex_blocks(lists, num_q, num_k):
    partial, full = np.zeros((num_q, num_k), bool), np.zeros((num_q, num_k), bool)
    for b in range(num_q):
        partial[b, lists.partial_indices[b, : lists.partial_counts[b]]] = True
        full[b, lists.full_indices[b, : lists.full_counts[b]]] = True
    return partial, full


@pytest.mark.parametrize("case", FLEX_CASES)
def test_flex_attention_block_mask_is_the_plans_neighbourhoods(case, dense_membership):
    torch = pytest.importorskip("torch")  # a test extra: CI has it
    flex = _benchmark_module("flex_attention")
    in_shape, out_shape, cutoff = FLEX_CASES[case]
    plan = NeighborhoodPlan(in_shape, out_shape, theta_cutoff=cutoff)
    attention = flex.FlexNeighborhoodAttention(plan, "cpu", compile=False)
    q_layout, k_layout = attention.q_layout, attention.k_layout
    truth = np.zeros((q_layout.tokens, k_layout.tokens), bool)
    q_real, k_real = np.flatnonzero(q_layout.valid), np.flatnonzero(k_layout.valid)
    truth[np.ix_(q_real, k_real)] = dense_membership(plan)[
        np.ix_(q_layout.gather_index()[q_real], k_layout.gather_index()[k_real])
    ]
    q_idx, kv_idx = torch.arange(q_layout.tokens)[:, None], torch.arange(k_layout.tokens)[None, :]
    np.testing.assert_array_equal(attention.mask_mod(0, 0, q_idx, kv_idx).numpy(), truth)

    num_q, num_k = q_layout.tokens // flex.BLOCK, k_layout.tokens // flex.BLOCK
    partial, full = _flex_blocks(flex.block_lists(plan, q_layout, k_layout), num_q, num_k)
    blocks = truth.reshape(num_q, flex.BLOCK, num_k, flex.BLOCK)
    touched = blocks.any(axis=(1, 3))
    q_rows = q_layout.valid.reshape(num_q, flex.BLOCK)
    k_whole = k_layout.valid.reshape(num_k, flex.BLOCK).all(axis=1)
    whole = np.array([[blocks[i][q_rows[i]][:, j].all() for j in range(num_k)] for i in range(num_q)]) & k_whole
    assert not (partial & full).any()
    np.testing.assert_array_equal(partial | full, touched)  # every block with a pair, and no other
    np.testing.assert_array_equal(full, whole)  # full exactly where every real query reads the whole block
    assert full.any() == (case == "down-full-blocks")


def _flex_check(case, rng, dense_attention, rel_error, device, gradients):
    """FlexAttention's out (and, where asked, q/k/v gradients of a vdot loss) against the float64 oracle."""
    torch = pytest.importorskip("torch")  # a test extra: CI has it
    flex = _benchmark_module("flex_attention")
    in_shape, out_shape, cutoff = FLEX_CASES[case]
    plan = NeighborhoodPlan(in_shape, out_shape, theta_cutoff=cutoff)
    attention = flex.FlexNeighborhoodAttention(plan, device, compile=device != "cpu")
    heads, dim = 2, 16
    q = rng.standard_normal((1, *out_shape, heads, dim))
    k, v = (rng.standard_normal((1, *in_shape, heads, dim)) for _ in range(2))
    g = rng.standard_normal((1, *out_shape, heads, dim))
    scale = dim**-0.5
    layouts = (attention.q_layout, attention.k_layout, attention.k_layout)
    tokens = [
        attention.to_tokens(torch.tensor(x, dtype=torch.float32, device=device), layout).requires_grad_(gradients)
        for x, layout in zip((q, k, v), layouts)
    ]
    out = attention.from_tokens(attention(*tokens, scale=scale), attention.q_layout)
    assert rel_error(out.detach().cpu().numpy(), np.asarray(dense_attention(q, k, v, plan, scale)[0])) <= 1e-5
    if gradients:
        loss = lambda q, k, v: jnp.vdot(dense_attention(q, k, v, plan, scale)[0], g)  # noqa: E731
        expected = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
        grads = torch.autograd.grad((out * torch.tensor(g, dtype=torch.float32, device=device)).sum(), tokens)
        for name, grad, layout, want in zip("qkv", grads, layouts, expected, strict=True):
            assert rel_error(attention.from_tokens(grad, layout).cpu().numpy(), np.asarray(want)) <= 1e-5, name


@pytest.mark.parametrize("case", FLEX_CASES)
def test_flex_attention_matches_float64(case, rng, dense_attention, rel_error):
    # FlexAttention has no backward on the CPU: the gradients are the GPU test's.
    _flex_check(case, rng, dense_attention, rel_error, "cpu", gradients=False)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["self-padded", "down-full-blocks"])  # each compiles for a minute or so
def test_flex_attention_and_its_gradients_match_float64_on_cuda(case, rng, dense_attention, rel_error):
    _flex_check(case, rng, dense_attention, rel_error, "cuda", gradients=True)


def test_scheduled_eta_is_computed_tflops_over_the_peak():
    """η of a scheduled target: its computed FLOPs (4d, 6d, 8d per computed pair of its walk) per second over
    790 TFLOP/s, here for times chosen to make it 0.5, 0.25 and 0.125."""
    attention = _benchmark_module("attention")
    cfg = attention.Config("small", (33, 64), (33, 64), 0.3, channels=128, heads=2, batch=3)
    plan = NeighborhoodPlan(cfg.in_shape, cfg.out_shape, theta_cutoff=cfg.theta_cutoff)
    shape = dict(zip(("tile_rows", "tile_cols", "chunk_cols"), jax_s2attn.ops._ffi.kernel_limits().scheduled_shape))
    computed = {walk: plan.block_schedule(walk, **shape).computed_pairs for walk in ("forward", "backward")}
    row = {}
    for target, per_pair, walk, eta in (("forward", 4, "forward", 0.5), ("dq", 6, "forward", 0.25),
                                        ("dkv", 8, "backward", 0.125)):  # fmt: skip
        flops = per_pair * 64 * computed[walk] * cfg.batch * cfg.heads
        row[f"ffi_scheduled_{target}_target_ms"] = 1e3 * flops / (eta * 790e12)
    metrics = attention._kernel_metrics(cfg, plan, row)
    assert metrics["ffi_scheduled_eta_forward"] == pytest.approx(0.5, rel=1e-12)
    assert metrics["ffi_scheduled_eta_dq"] == pytest.approx(0.25, rel=1e-12)
    assert metrics["ffi_scheduled_eta_dkv"] == pytest.approx(0.125, rel=1e-12)


def test_kernel_metrics_set_the_families_side_by_side():
    """Useful TFLOP/s of each timed native family (14d per pair forward+backward) and arc / scheduled time ratios;
    without the scheduled targets timed, no schedule statistics."""
    attention = _benchmark_module("attention")
    cfg = attention.Config("small", (33, 64), (33, 64), 0.3, channels=128, heads=2, batch=3)
    plan = NeighborhoodPlan(cfg.in_shape, cfg.out_shape, theta_cutoff=cfg.theta_cutoff)
    useful = 14 * 64 * plan.num_pairs * cfg.batch * cfg.heads
    row = {"ffi_arc_fwd_ms": 3.0, "ffi_arc_fwdbwd_ms": 8.0, "ffi_scheduled_fwd_ms": 1.0,
           "ffi_scheduled_fwdbwd_ms": 1e3 * useful / 100e12}  # fmt: skip
    metrics = attention._kernel_metrics(cfg, plan, row)
    assert metrics["ffi_scheduled_useful_tflops_fwdbwd"] == pytest.approx(100, rel=1e-12)
    assert metrics["ffi_arc_useful_tflops_fwdbwd"] == pytest.approx(100 * row["ffi_scheduled_fwdbwd_ms"] / 8.0)
    assert metrics["arc_over_scheduled_fwd"] == 3.0
    assert metrics["arc_over_scheduled_fwdbwd"] == pytest.approx(8.0 / row["ffi_scheduled_fwdbwd_ms"])
    assert not any(name.startswith(("sched_util", "ffi_scheduled_eta")) for name in metrics)
    del row["ffi_scheduled_fwd_ms"], row["ffi_scheduled_fwdbwd_ms"]
    arc_only = attention._kernel_metrics(cfg, plan, row)
    assert set(arc_only) == {"ffi_arc_useful_tflops_fwd", "ffi_arc_useful_tflops_fwdbwd"}
