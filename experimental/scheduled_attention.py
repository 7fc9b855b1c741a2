"""Runs the schedule-driven prototype (``experimental/cuda/scheduled_attention.cu``: forward, dq and dk/dv) on
plans and checks it.

For each configuration: builds the plan and both walks' block schedules (``plan.block_schedule``), writes
them, the key rows' log2 quadrature weights and random bf16 q, k, v, dout (one head of 64 channels; with
``--smooth`` v smooth in position) into a directory and runs the program's forward there (out in bf16, then
in float32 as the differentiated forward writes it), then its dq and dk/dv with the forward's lse and
delta = sum(dout * out) of the float32 out (as the op forms them); every result is poisoned with NaN first.
Checks out, lse and dq of sampled queries and dk, dv of sampled keys against the op's float64 results (out,
lse and delta in float64 too) from the plan's neighbourhoods (``forward_arcs`` and ``backward_arcs``), and
that every result was written. With ``--baseline`` (a GPU with the native module built) it also times the
package's ``neighborhood_attention`` forward on the same inputs in the same process, for the ratio.

Usage (on an H200, from the repository root): ``bash experimental/scheduled_attention.sh --baseline``, or
``python experimental/scheduled_attention.py --binary <program> ...``; ``--configs tiny`` runs the small
grids of the emulated test.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np

from jax_s2attn.plan import NeighborhoodPlan

D = 64
SCALE = D**-0.5
TILE_ROWS, TILE_COLS = 4, 16  # the kernel's kTileRows, kTileCols (its kChunk: --chunk-cols)

# name: (in_shape, out_shape, theta_cutoff)
CONFIGS = {
    "hdeg_tc003": ((360, 720), (360, 720), 0.03),
    "qdeg_default": ((721, 1440), (721, 1440), None),
    "qdeg_tc003": ((721, 1440), (721, 1440), 0.03),
    "h1deg_down_tc003": ((360, 720), (180, 360), 0.03),
    "1hdeg_up_tc003": ((180, 360), (360, 720), 0.03),
}
# Small grids: whole rings at the poles, windows across longitude 0, a longitude count that is not a
# multiple of the tile, downsampling by 3, upsampling by 2, and by 128 (a tile mostly past the grid, its
# windows with gaps wider than a chunk).
TINY = {
    "tiny_wide": ((11, 32), (11, 32), 0.7),
    "tiny_rows": ((33, 64), (33, 64), 0.12),
    "tiny_odd": ((13, 40), (13, 40), 0.5),
    "tiny_down3": ((16, 48), (8, 16), 0.5),
    "tiny_up2": ((8, 16), (16, 32), 0.4),
    "tiny_gaps": ((9, 512), (9, 4), 0.05),
}


def float64_rows(plan: NeighborhoodPlan, q, k, v, points) -> tuple[np.ndarray, np.ndarray]:
    """out and lse of query points (flat indices) in float64, from the plan's arcs."""
    table, nlon_q = plan.forward_arcs, plan.nlon_out
    log_w = np.log(plan.quad_weights.astype(np.float64))
    kf, vf = k.reshape(-1, D).astype(np.float64), v.reshape(-1, D).astype(np.float64)
    qf = q.reshape(-1, D).astype(np.float64)
    out, lse = np.empty((len(points), D)), np.empty(len(points))
    for i, point in enumerate(points):
        h, w = divmod(int(point), nlon_q)
        keys = table.expand(h * table.residues + w % table.residues, w // table.residues)
        logits = SCALE * kf[keys] @ qf[point] + log_w[keys // plan.nlon_in]
        top = logits.max()
        p = np.exp(logits - top)
        out[i] = p @ vf[keys] / p.sum()
        lse[i] = top + np.log(p.sum())
    return out, lse


def float64_truth(plan: NeighborhoodPlan, q, k, v, dout, points) -> tuple[np.ndarray, ...]:
    """out, lse and dq of query points (flat indices) in float64: the op's results for a cotangent dout
    (delta = dout . out of the float64 out), from the plan's arcs."""
    table, nlon_q = plan.forward_arcs, plan.nlon_out
    kf, vf = k.reshape(-1, D).astype(np.float64), v.reshape(-1, D).astype(np.float64)
    df = dout.reshape(-1, D).astype(np.float64)
    log_w = np.log(plan.quad_weights.astype(np.float64))
    out, lse = float64_rows(plan, q, k, v, points)
    dq = np.empty((len(points), D))
    qf = q.reshape(-1, D).astype(np.float64)
    for i, point in enumerate(points):
        h, w = divmod(int(point), nlon_q)
        keys = table.expand(h * table.residues + w % table.residues, w // table.residues)
        p = np.exp(SCALE * kf[keys] @ qf[point] + log_w[keys // plan.nlon_in] - lse[i])
        dq[i] = SCALE * (p * (vf[keys] @ df[point] - df[point] @ out[i])) @ kf[keys]
    return out, lse, dq


def float64_key_truth(plan: NeighborhoodPlan, q, k, v, dout, keys) -> tuple[np.ndarray, np.ndarray]:
    """dk and dv of key points (flat indices) in float64 (the op's, as float64_truth), from the plan's
    transposed arcs and the float64 out and lse of the queries that see them."""
    table, nlon_k = plan.backward_arcs, plan.nlon_in
    log_w = np.log(plan.quad_weights.astype(np.float64))
    qf, df = q.reshape(-1, D).astype(np.float64), dout.reshape(-1, D).astype(np.float64)
    kf, vf = k.reshape(-1, D).astype(np.float64), v.reshape(-1, D).astype(np.float64)
    seen = [table.expand(h * table.residues + w % table.residues, w // table.residues)
            for h, w in (divmod(int(key), nlon_k) for key in keys)]  # fmt: skip
    queries = np.unique(np.concatenate(seen)) if seen else np.zeros(0, np.int64)
    out, lse = float64_rows(plan, q, k, v, queries)
    delta = np.zeros(qf.shape[0])
    delta[queries] = (df[queries] * out).sum(axis=-1)
    lse_of = np.zeros(qf.shape[0])
    lse_of[queries] = lse
    dk, dv = np.empty((len(keys), D)), np.empty((len(keys), D))
    for i, (key, sees) in enumerate(zip(keys, seen)):
        p = np.exp(SCALE * qf[sees] @ kf[key] + log_w[int(key) // nlon_k] - lse_of[sees])
        dv[i] = p @ df[sees]
        dk[i] = SCALE * (p * (df[sees] @ vf[key] - delta[sees])) @ qf[sees]
    return dk, dv


def write_schedule(directory: Path, s, walk_shape, other_shape) -> None:
    """A walk's schedule and its meta (walking grid, other grid, classes, shift, shape, scale)."""
    directory.mkdir(parents=True, exist_ok=True)
    meta = [*walk_shape, *other_shape, s.classes, s.shift, s.tile_rows, s.tile_cols, s.chunk_cols, SCALE]
    np.asarray(meta, np.float32).tofile(directory / "meta.f32")
    for name in ("tiles", "tile_offsets", "chunks", "records"):
        np.ascontiguousarray(getattr(s, name), np.int32).tofile(directory / f"{name}.i32")


def write_inputs(directory: Path, plan: NeighborhoodPlan, chunk_cols: int, q, k, v, dout) -> None:
    """Both walks' schedules (the backward one under backward/), the key rows' log2 weights and q, k, v, dout."""
    shape = dict(tile_rows=TILE_ROWS, tile_cols=TILE_COLS, chunk_cols=chunk_cols)
    write_schedule(directory, plan.block_schedule("forward", **shape), plan.out_shape, plan.in_shape)
    write_schedule(directory / "backward", plan.block_schedule("backward", **shape), plan.in_shape, plan.out_shape)
    np.log2(plan.quad_weights).astype(np.float32).tofile(directory / "bias.f32")
    for name, x in (("q", q), ("k", k), ("v", v), ("dout", dout)):
        np.ascontiguousarray(x).tofile(directory / f"{name}.bf16")


def baseline_ms(plan: NeighborhoodPlan, q, k, v, reps: int) -> tuple[float, np.ndarray]:
    """The package's forward (implementation "ffi") on the same inputs: device ms and its out."""
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from timing import median_ms

    from jax_s2attn import neighborhood_attention

    fn = jax.jit(lambda q, k, v: neighborhood_attention(q, k, v, plan, scale=SCALE, implementation="ffi"))
    args = [tuple(jnp.asarray(x)[:, :, None, :] for x in (q, k, v))]
    out = np.asarray(fn(*args[0]).astype(jnp.float32))[:, :, 0, :]
    return median_ms(fn, args, reps), out


def relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def smooth_values(plan: NeighborhoodPlan, rng) -> np.ndarray:
    """Values smooth in position plus 1 % noise (the GPU suite's smooth-field case: dP - delta nearly cancels)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from kernel_cases import smooth_field

    field = smooth_field(*plan.in_shape, D, plan.grid_in)
    return (field + 0.01 * rng.standard_normal(field.shape)).astype(ml_dtypes.bfloat16)


def run(name: str, args, binary: Path, launcher: list[str], chunk_cols: int, reps: int, baseline: bool,
        samples: int, keep: Path | None = None, smooth: bool = False) -> bool:  # fmt: skip
    in_shape, out_shape, cutoff = args
    plan = NeighborhoodPlan(in_shape, out_shape, theta_cutoff=cutoff)
    rng = np.random.default_rng(1234)
    q, k, v, dout = (rng.standard_normal((*shape, D)).astype(ml_dtypes.bfloat16)
                     for shape in (out_shape, in_shape, in_shape, out_shape))  # fmt: skip
    if smooth:
        v = smooth_values(plan, rng)
    s = plan.block_schedule("forward", tile_rows=TILE_ROWS, tile_cols=TILE_COLS, chunk_cols=chunk_cols)
    with tempfile.TemporaryDirectory() if keep is None else contextlib.nullcontext(keep / name) as where:
        directory = Path(where)
        directory.mkdir(parents=True, exist_ok=True)
        write_inputs(directory, plan, chunk_cols, q, k, v, dout)
        ms = {}
        for mode in ("forward", "dq", "dkv"):
            result = subprocess.run([*launcher, str(binary), mode, str(directory), str(reps)], capture_output=True,
                                    text=True)  # fmt: skip
            if result.returncode != 0:
                print(f"{name}: the program's {mode} failed\n{result.stdout}{result.stderr}")
                return False
            ms.update(line.split() for line in result.stdout.splitlines() if line.endswith(tuple("0123456789")))
            if mode == "forward":
                out = np.fromfile(directory / "out.bf16", ml_dtypes.bfloat16).astype(np.float32).reshape(*out_shape, D)
                out_f32 = np.fromfile(directory / "out.f32", np.float32).reshape(*out_shape, D)
                lse = np.fromfile(directory / "lse.f32", np.float32).reshape(out_shape)
                # delta as the op forms it, from the differentiated forward's float32 out.
                delta = (dout.astype(np.float64) * out_f32).sum(axis=-1).astype(np.float32)
                delta.tofile(directory / "delta.f32")
        dq = np.fromfile(directory / "dq.f32", np.float32).reshape(*out_shape, D)
        dk, dv = (np.fromfile(directory / f"{x}.f32", np.float32).reshape(*in_shape, D) for x in ("dk", "dv"))
    points = out_shape[0] * out_shape[1]
    unwritten = int(sum(np.isnan(x).sum() for x in (out, out_f32, lse, dq, dk, dv)))
    chosen = np.arange(points) if points <= 4096 else np.concatenate(
        [[0, points - 1], rng.choice(points, samples, replace=False)]
    )  # fmt: skip
    truth_out, truth_lse, truth_dq = float64_truth(plan, q, k, v, dout, chosen)
    rel_out = relative(out.reshape(-1, D)[chosen], truth_out)
    rel_out_f32 = relative(out_f32.reshape(-1, D)[chosen], truth_out)
    rel_dq = relative(dq.reshape(-1, D)[chosen], truth_dq)
    lse_error = float(np.abs(lse.reshape(-1)[chosen] - truth_lse).max())
    key_points = in_shape[0] * in_shape[1]
    keys = np.arange(key_points) if key_points <= 4096 else np.concatenate(
        [[0, key_points - 1], rng.choice(key_points, samples // 3, replace=False)]
    )  # fmt: skip
    truth_dk, truth_dv = float64_key_truth(plan, q, k, v, dout, keys)
    rel_dk = relative(dk.reshape(-1, D)[keys], truth_dk)
    rel_dv = relative(dv.reshape(-1, D)[keys], truth_dv)
    ok = unwritten == 0 and max(rel_out, rel_dq, rel_dk, rel_dv) <= 1e-2 and lse_error <= 1e-3
    useful = plan.num_pairs / s.computed_pairs
    line = (
        f"{name:16s} {out_shape[0]}x{out_shape[1]}<-{in_shape[0]}x{in_shape[1]} tc {plan.theta_cutoff:.5f}: "
        f"chunks {s.chunks.shape[0]} full {s.full_fraction:.2f} useful {useful:.3f} | unwritten {unwritten} "
        f"rel out {rel_out:.1e} (f32 {rel_out_f32:.1e}) dq {rel_dq:.1e} dk {rel_dk:.1e} dv {rel_dv:.1e} lse abs {lse_error:.1e} "
        f"{'ok' if ok else 'WRONG'}"
    )
    if reps:
        backward = plan.block_schedule("backward", tile_rows=TILE_ROWS, tile_cols=TILE_COLS, chunk_cols=chunk_cols)
        # Computed TFLOP/s: 2 D FLOPs per product and computed pair; the forward 2 products, dq 3, dk/dv 4.
        for kernel, products, walk in (("forward", 2, s), ("forward_f32", 2, s), ("dq", 3, s), ("dkv", 4, backward)):
            kernel_ms = float(ms[f"{kernel}_ms"])
            tflops = 2 * products * D * walk.computed_pairs / kernel_ms / 1e9
            line += f" | {kernel} {kernel_ms:.3f} ms ({tflops:.0f} TFLOP/s computed, eta {tflops / 790:.2f})"
        forward = float(ms["forward_ms"])
        if baseline:
            base, base_out = baseline_ms(plan, q, k, v, reps)
            line += f" | package forward {base:.3f} ms ({base / forward:.2f}x), rel diff {relative(out, base_out):.1e}"
    print(line, flush=True)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--binary", type=Path, required=True)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), help="names, or 'tiny'")
    parser.add_argument("--chunk-cols", type=int, default=32, help="the program's kChunk (SF_CHUNK)")
    parser.add_argument("--reps", type=int, default=20, help="timed samples (0: check only)")
    parser.add_argument("--samples", type=int, default=1000, help="queries checked against float64 on large grids")
    parser.add_argument("--baseline", action="store_true", help="time the package's forward too (GPU)")
    parser.add_argument("--keep", type=Path, help="write each configuration's files under KEEP/<name> and keep them")
    parser.add_argument("--launcher", default="", help="command to run the program under, e.g. compute-sanitizer")
    parser.add_argument("--smooth", action="store_true", help="values smooth in position (plus 1 %% noise)")
    a = parser.parse_args()

    configs = TINY if a.configs == ["tiny"] else {name: CONFIGS[name] for name in a.configs}
    ok = True
    for name, args in configs.items():
        ok = run(name, args, a.binary, a.launcher.split(), a.chunk_cols, a.reps, a.baseline, a.samples, a.keep,
                 a.smooth) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
