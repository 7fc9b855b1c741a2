"""Train a small spherical transformer to predict one step of advection + diffusion on the sphere.

Task: random band-limited fields f (spherical harmonics up to degree --lmax, drawn on the fly) are
carried by a solid-body rotation about an axis tilted 45 degrees from the pole and diffused; the model
sees f(t) and must predict f(t + dt). The rotation moves fields across the poles, so the model has to
learn where each point's information comes from: neighbourhood attention with positional inputs can
represent exactly that. The baseline is persistence (predict f(t + dt) = f(t)); losses are area-weighted
mean squared errors (quadrature weights of the grid).

Model: pointwise encoder of [f, x, y, z] -> --channels, --blocks pre-norm transformer blocks
(jax_s2attn.nnx.NeighborhoodAttentionS2 + MLP), pointwise decoder predicting the increment (zero-initialised,
so training starts exactly at persistence). Optimiser: optax AdamW with cosine decay.

Usage (CPU, about two minutes):   python examples/train_sphere.py
  (16x32 grid, 400 steps; the validation loss falls to about 1.5% of persistence's)
Smoke test (seconds):              python examples/train_sphere.py --quick
Finer:                             python examples/train_sphere.py --nlat 32 --nlon 64 --steps 1000
Options: --nlat/--nlon/--grid (resolution), --steps, --batch, --implementation {auto,reference,ffi,ffi-arc,ffi-tiled},
--out (PNG path); see --help.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jax_s2attn import precompute_latitudes
from jax_s2attn.nnx import NeighborhoodAttentionS2

# --- data: band-limited random fields, rotated and diffused exactly in closed form -------------------


def real_spherical_harmonics(lmax: int, theta: np.ndarray, lon: np.ndarray) -> np.ndarray:
    """Orthonormal real spherical harmonics up to degree ``lmax`` at points ``(theta, lon)``.

    Returns ``[points, (lmax + 1)**2]`` (float64), columns ordered by degree ``l``, then
    ``m = 0, 1, -1, 2, -2, ...`` (cosine for m > 0, sine for m < 0).
    """
    x, s = np.cos(theta), np.sin(theta)
    legendre = {(0, 0): np.full_like(x, 1.0 / math.sqrt(4.0 * math.pi))}
    for m in range(1, lmax + 1):  # diagonal: P_mm from P_(m-1)(m-1)
        legendre[m, m] = math.sqrt((2 * m + 1) / (2 * m)) * s * legendre[m - 1, m - 1]
    for m in range(lmax):
        legendre[m + 1, m] = math.sqrt(2 * m + 3) * x * legendre[m, m]
        for ell in range(m + 2, lmax + 1):
            a = math.sqrt((4 * ell * ell - 1) / (ell * ell - m * m))
            b = math.sqrt(((ell - 1) ** 2 - m * m) / (4 * (ell - 1) ** 2 - 1))
            legendre[ell, m] = a * (x * legendre[ell - 1, m] - b * legendre[ell - 2, m])
    columns = []
    for ell in range(lmax + 1):
        columns.append(legendre[ell, 0])
        for m in range(1, ell + 1):
            columns += [
                math.sqrt(2) * legendre[ell, m] * np.cos(m * lon),
                math.sqrt(2) * legendre[ell, m] * np.sin(m * lon),
            ]
    return np.stack(columns, axis=-1)


def degrees(lmax: int) -> np.ndarray:
    """Degree ``l`` of every column of :func:`real_spherical_harmonics`."""
    return np.concatenate([np.full(2 * ell + 1, ell) for ell in range(lmax + 1)])


def rotation_matrix(axis: np.ndarray, angle: float) -> np.ndarray:
    """Rotation by ``angle`` (right-handed) about the unit vector ``axis`` (Rodrigues)."""
    cross = np.array([[0, -axis[2], axis[1]], [axis[2], 0, -axis[0]], [-axis[1], axis[0], 0]])
    return np.eye(3) + math.sin(angle) * cross + (1 - math.cos(angle)) * cross @ cross


@dataclasses.dataclass(frozen=True)
class AdvectionDiffusion:
    """One time step of rotation + diffusion acting on random fields with a red spectrum.

    ``inputs = B a`` and ``targets = B_rot (decay * a)`` where ``B`` holds the harmonics at the grid points,
    ``B_rot`` at the points the rotation carries onto the grid points (their departure points), and
    ``decay = exp(-kappa dt l(l+1))``.
    """

    basis: jax.Array  # [nlat*nlon, K]
    departure_basis: jax.Array  # [nlat*nlon, K], already multiplied by the diffusion decay
    sigma: jax.Array  # [K] standard deviation of each coefficient
    positions: jax.Array  # [nlat, nlon, 3] unit vectors
    area: jax.Array  # [nlat, nlon] quadrature weights, summing to 1
    shape: tuple[int, int]

    @classmethod
    def build(cls, shape, grid, lmax, angle, diffusion_halving_degree):
        theta, w = precompute_latitudes(shape[0], grid)
        lon = 2 * np.pi * np.arange(shape[1]) / shape[1]
        theta_g, lon_g = np.meshgrid(theta, lon, indexing="ij")
        xyz = np.stack([np.sin(theta_g) * np.cos(lon_g), np.sin(theta_g) * np.sin(lon_g), np.cos(theta_g)], -1)
        axis = np.array([math.sin(math.pi / 4), 0.0, math.cos(math.pi / 4)])
        departure = xyz @ rotation_matrix(axis, angle)  # rows: R^T x, where the fluid came from
        theta_d = np.arccos(np.clip(departure[..., 2], -1, 1))
        lon_d = np.arctan2(departure[..., 1], departure[..., 0])
        degree = degrees(lmax)
        kappa_dt = math.log(2.0) / (diffusion_halving_degree * (diffusion_halving_degree + 1))
        decay = np.exp(-kappa_dt * degree * (degree + 1))
        sigma = 1.0 / (1.0 + degree)
        basis = real_spherical_harmonics(lmax, theta_g.ravel(), lon_g.ravel())
        sigma = sigma / math.sqrt(np.mean((basis * sigma) ** 2) * degree.size)  # unit field variance
        area = np.repeat(w[:, None], shape[1], axis=1)

        def f32(a):
            return jnp.asarray(a, jnp.float32)

        return cls(
            basis=f32(basis),
            departure_basis=f32(real_spherical_harmonics(lmax, theta_d.ravel(), lon_d.ravel()) * decay),
            sigma=f32(sigma),
            positions=f32(xyz),
            area=f32(area / area.sum()),
            shape=tuple(shape),
        )

    def sample(self, key, batch: int):
        """``(inputs [batch, nlat, nlon], targets [batch, nlat, nlon])``."""
        coefficients = jax.random.normal(key, (batch, self.sigma.size)) * self.sigma
        inputs = coefficients @ self.basis.T
        targets = coefficients @ self.departure_basis.T
        return inputs.reshape(batch, *self.shape), targets.reshape(batch, *self.shape)

    def loss(self, prediction, target):
        """Area-weighted mean squared error."""
        return jnp.mean(jnp.sum((prediction - target) ** 2 * self.area, axis=(-2, -1)))


# --- model -----------------------------------------------------------------------------------------


class Block(nnx.Module):
    """Pre-norm transformer block: spherical neighbourhood attention, then a pointwise MLP."""

    def __init__(self, channels, shape, *, heads, grid, theta_cutoff, implementation, rngs):
        self.attention_norm = nnx.LayerNorm(channels, rngs=rngs)
        self.attention = NeighborhoodAttentionS2(
            channels,
            shape,
            shape,
            num_heads=heads,
            grid_in=grid,
            grid_out=grid,
            theta_cutoff=theta_cutoff,
            normalize_qk=True,
            implementation=implementation,
            rngs=rngs,
        )
        self.mlp_norm = nnx.LayerNorm(channels, rngs=rngs)
        self.mlp_in = nnx.Linear(channels, 2 * channels, rngs=rngs)
        self.mlp_out = nnx.Linear(2 * channels, channels, rngs=rngs)

    def __call__(self, h):
        h = h + self.attention(self.attention_norm(h))
        return h + self.mlp_out(nnx.gelu(self.mlp_in(self.mlp_norm(h))))


class SphereTransformer(nnx.Module):
    """Predicts ``f(t + dt)`` from ``f(t)`` on one grid."""

    def __init__(self, shape, *, channels, blocks, heads, grid, theta_cutoff, implementation, rngs):
        self.encoder = nnx.Linear(4, channels, rngs=rngs)
        self.blocks = nnx.List(
            [
                Block(
                    channels,
                    shape,
                    heads=heads,
                    grid=grid,
                    theta_cutoff=theta_cutoff,
                    implementation=implementation,
                    rngs=rngs,
                )
                for _ in range(blocks)
            ]
        )
        self.decoder = nnx.Linear(channels, 1, kernel_init=nnx.initializers.zeros, rngs=rngs)

    def __call__(self, field, positions):
        features = jnp.concatenate([field[..., None], jnp.broadcast_to(positions, (*field.shape, 3))], axis=-1)
        h = self.encoder(features)
        for block in self.blocks:
            h = block(h)
        return field + self.decoder(h)[..., 0]


# --- training --------------------------------------------------------------------------------------


@functools.partial(nnx.jit, static_argnames="batch")
def train_step(model, optimizer, task, key, batch):
    inputs, targets = task.sample(key, batch)

    def loss_fn(model):
        return task.loss(model(inputs, task.positions), targets)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss, task.loss(inputs, targets)


@nnx.jit
def predict(model, task, inputs):
    return model(inputs, task.positions)


# The task's arrays travel as jit arguments; its shape is static.
jax.tree_util.register_dataclass(
    AdvectionDiffusion,
    data_fields=["basis", "departure_basis", "sigma", "positions", "area"],
    meta_fields=["shape"],
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nlat", type=int, default=16, help="latitudes (default 16)")
    parser.add_argument("--nlon", type=int, default=32, help="longitudes (default 32)")
    parser.add_argument("--grid", default="equiangular", help="latitude grid (default equiangular)")
    parser.add_argument("--lmax", type=int, default=None, help="band limit of the fields (default nlat // 3)")
    parser.add_argument("--steps", type=int, default=400, help="training steps (default 400)")
    parser.add_argument("--batch", type=int, default=8, help="fields per step (default 8)")
    parser.add_argument("--channels", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument(
        "--implementation", choices=["auto", "reference", "ffi", "ffi-arc", "ffi-tiled"], default="auto"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--out", type=Path, default=Path("train_sphere.png"), help="PNG comparing prediction and truth")
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (seconds): 12x24 grid, 1 block, 40 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.nlat, args.nlon, args.blocks, args.channels, args.steps, args.log_every = 12, 24, 1, 16, 40, 10
    args.lmax = args.nlat // 3 if args.lmax is None else args.lmax
    return args


def main(argv=None) -> dict:
    """Train, print progress and the final losses, save the PNG; returns the final metrics."""
    args = parse_args(argv)
    shape = (args.nlat, args.nlon)
    spacing = math.pi / (args.nlat - 1)
    # The rotation carries a point up to 1.5 grid spacings per step; attention reaches 2 spacings per block.
    task = AdvectionDiffusion.build(
        shape, args.grid, args.lmax, angle=1.5 * spacing, diffusion_halving_degree=args.lmax
    )
    implementation = None if args.implementation == "auto" else args.implementation
    model = SphereTransformer(
        shape,
        channels=args.channels,
        blocks=args.blocks,
        heads=args.heads,
        grid=args.grid,
        theta_cutoff=2 * spacing,
        implementation=implementation,
        rngs=nnx.Rngs(args.seed),
    )
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, max(1, args.steps // 20), args.steps, args.lr / 20)
    optimizer = nnx.Optimizer(model, optax.adamw(schedule, weight_decay=1e-4), wrt=nnx.Param)
    validation = task.sample(jax.random.key(args.seed + 1_000_003), 32)
    persistence = float(task.loss(*validation))
    num_params = sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(
        f"grid {shape[0]}x{shape[1]} {args.grid}, lmax {args.lmax}, model {num_params} parameters, "
        f"{args.steps} steps of {args.batch} fields on {jax.devices()[0].platform}"
    )
    print(f"validation persistence baseline (predict no change): {persistence:.4e}")

    key = jax.random.key(args.seed)
    start, recent = time.perf_counter(), []
    for step in range(1, args.steps + 1):
        key, sample_key = jax.random.split(key)
        loss, baseline = train_step(model, optimizer, task, sample_key, args.batch)
        recent.append((float(loss), float(baseline)))
        if step % args.log_every == 0 or step == args.steps:
            train_loss, train_baseline = np.mean(recent, axis=0)
            recent = []
            val_loss = float(task.loss(predict(model, task, validation[0]), validation[1]))
            rate = step / (time.perf_counter() - start)
            print(
                f"step {step:5d}/{args.steps}  train {train_loss:.4e} ({train_loss / train_baseline:6.1%} of "
                f"persistence)  validation {val_loss:.4e} ({val_loss / persistence:6.1%})  {rate:5.1f} steps/s",
                flush=True,
            )

    metrics = {
        "train_loss": float(train_loss),
        "train_persistence": float(train_baseline),
        "validation_loss": val_loss,
        "validation_persistence": persistence,
        "seconds": time.perf_counter() - start,
    }
    verdict = "below" if val_loss < persistence else "NOT below"
    print(
        f"final: validation loss {val_loss:.4e} is {verdict} persistence {persistence:.4e} "
        f"({val_loss / persistence:.1%}); {metrics['seconds']:.0f} s"
    )
    save_comparison(args.out, model, task, validation, metrics, args)
    print(f"saved {args.out}")
    return metrics


def save_comparison(path: Path, model, task, validation, metrics, args) -> None:
    """Input, truth, prediction and error of one validation field on Mollweide maps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    inputs, targets = validation
    prediction = np.asarray(predict(model, task, inputs))[0]
    theta, _ = precompute_latitudes(args.nlat, args.grid)
    lat = np.pi / 2 - theta
    lon = 2 * np.pi * np.arange(args.nlon + 1) / args.nlon - np.pi  # closed ring, centred on 0
    truth = np.asarray(targets[0])
    persistence_error = np.asarray(inputs[0]) - truth
    field_scale, error_scale = float(np.max(np.abs(truth))), float(np.max(np.abs(persistence_error)))
    panels = [  # (title, values, colour range)
        ("input f(t)", np.asarray(inputs[0]), field_scale),
        ("truth f(t + dt)", truth, field_scale),
        ("prediction", prediction, field_scale),
        ("prediction error", prediction - truth, error_scale),
        ("persistence error f(t) - f(t + dt)", persistence_error, error_scale),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(15, 6.5), subplot_kw={"projection": "mollweide"})
    for ax, (title, field, vmax) in zip(axes.ravel(), panels):
        values = np.roll(field, args.nlon // 2, axis=1)  # longitude 0 in the middle
        values = np.concatenate([values, values[:, :1]], axis=1)
        mesh = ax.pcolormesh(lon, lat, values, cmap="RdBu_r", vmin=-vmax, vmax=vmax, shading="gouraud")
        ax.set_title(title)
        ax.set_xticklabels([])
        ax.set_yticklabels([])
        fig.colorbar(mesh, ax=ax, orientation="horizontal", shrink=0.6, pad=0.05)
    axes.ravel()[-1].set_visible(False)
    fig.suptitle(
        f"Advection by a tilted solid-body rotation + diffusion, {args.nlat}x{args.nlon} {args.grid}: "
        f"validation MSE {metrics['validation_loss']:.3e} vs persistence {metrics['validation_persistence']:.3e}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    main()
