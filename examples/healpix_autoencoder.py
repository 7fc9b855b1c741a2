"""Encode a lat-lon field onto HEALPix by neighbourhood cross-attention, process it there and decode it back.

Task: smooth random fields on a 24x48 equiangular grid (sums of Gaussian bumps on the sphere, drawn on the fly)
pass through a HEALPix nside-4 latent (192 pixels, a sixth of the input's points) and must come back out. The
baseline is the fields' own area-weighted mean square (predicting zero); the loss is the area-weighted mean
squared error of the reconstruction.

Model (Flax NNX, every attention a jax_s2attn.nnx.NeighborhoodAttentionS2 between ring grids, on flat fields
[batch, points, channels]):
- encoder: [f, x, y, z] -> --channels on the lat-lon points; cross-attention from them to the HEALPix pixels,
  whose queries are their positions [x, y, z] projected;
- latent: a pre-norm block of HEALPix self-attention and an MLP;
- decoder: cross-attention from the HEALPix pixels back to the lat-lon points (queries from their positions),
  then a pointwise head.

Usage (CPU, about a minute):   python examples/healpix_autoencoder.py
Smoke test (seconds):          python examples/healpix_autoencoder.py --quick
Options: --steps, --batch, --channels, --nside, --out (PNG path: input, HEALPix latent, output); see --help.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jax_s2attn import RingGrid
from jax_s2attn.nnx import NeighborhoodAttentionS2


def unit_vectors(grid: RingGrid) -> np.ndarray:
    """``[points, 3]`` positions of a grid's points on the unit sphere (ring order)."""
    theta, phi = grid.point_colatitudes(), grid.point_longitudes()
    return np.stack([np.sin(theta) * np.cos(phi), np.sin(theta) * np.sin(phi), np.cos(theta)], axis=-1)


def random_fields(rng: np.random.Generator, points: np.ndarray, batch: int, bumps: int = 6) -> np.ndarray:
    """``[batch, points, 1]`` sums of ``bumps`` Gaussian bumps ``a exp(k (x . c - 1))`` with random centres c,
    amplitudes a in [-1, 1] and widths k in [4, 12]: smooth fields with a few features each."""
    centres = rng.standard_normal((batch, bumps, 3))
    centres /= np.linalg.norm(centres, axis=-1, keepdims=True)
    amplitude = rng.uniform(-1, 1, (batch, bumps, 1))
    width = rng.uniform(4, 12, (batch, bumps, 1))
    fields = (amplitude * np.exp(width * (centres @ points.T - 1))).sum(axis=1)
    return fields[..., None].astype(np.float32)


class Block(nnx.Module):
    """Pre-norm residual block: self-attention on one ring grid, then an MLP."""

    def __init__(self, grid: RingGrid, channels: int, theta_cutoff: float, *, rngs: nnx.Rngs):
        self.norm1, self.norm2 = nnx.LayerNorm(channels, rngs=rngs), nnx.LayerNorm(channels, rngs=rngs)
        self.attention = NeighborhoodAttentionS2(channels, grid_in=grid, grid_out=grid, theta_cutoff=theta_cutoff,
                                                 num_heads=4, rngs=rngs)  # fmt: skip
        self.mlp_in, self.mlp_out = nnx.Linear(channels, 2 * channels, rngs=rngs), nnx.Linear(2 * channels, channels, rngs=rngs)

    def __call__(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.norm2(x))))


class Autoencoder(nnx.Module):
    """Lat-lon -> HEALPix (cross-attention) -> HEALPix block -> lat-lon (cross-attention) -> field."""

    def __init__(self, latlon: RingGrid, healpix: RingGrid, channels: int, *, rngs: nnx.Rngs):
        self.latlon_xyz = unit_vectors(latlon).astype(np.float32)
        self.healpix_xyz = unit_vectors(healpix).astype(np.float32)
        self.embed = nnx.Linear(4, channels, rngs=rngs)
        self.healpix_query = nnx.Linear(3, channels, rngs=rngs)
        self.encode = NeighborhoodAttentionS2(channels, grid_in=latlon, grid_out=healpix, theta_cutoff=0.4,
                                              num_heads=4, rngs=rngs)  # fmt: skip
        self.latent = Block(healpix, channels, theta_cutoff=0.7, rngs=rngs)
        self.latlon_query = nnx.Linear(3, channels, rngs=rngs)
        self.decode = NeighborhoodAttentionS2(channels, grid_in=healpix, grid_out=latlon, theta_cutoff=0.6,
                                              num_heads=4, rngs=rngs)  # fmt: skip
        self.head = nnx.Linear(channels, 1, rngs=rngs)

    def latent_of(self, fields):
        """``[batch, healpix pixels, channels]`` of ``fields [batch, latlon points, 1]``."""
        xyz = jnp.broadcast_to(self.latlon_xyz, (*fields.shape[:-1], 3))
        features = self.embed(jnp.concatenate([fields, xyz], axis=-1))
        queries = self.healpix_query(jnp.broadcast_to(self.healpix_xyz, (fields.shape[0], *self.healpix_xyz.shape)))
        return self.latent(self.encode(queries, features))

    def __call__(self, fields):
        latent = self.latent_of(fields)
        queries = self.latlon_query(jnp.broadcast_to(self.latlon_xyz, (fields.shape[0], *self.latlon_xyz.shape)))
        return self.head(self.decode(queries, latent))


def main(argv=None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--channels", type=int, default=32)
    parser.add_argument("--nside", type=int, default=4, help="HEALPix resolution of the latent (12 nside^2 pixels)")
    parser.add_argument("--quick", action="store_true", help="a few dozen steps (smoke test)")
    parser.add_argument("--out", type=Path, default=Path("healpix_autoencoder.png"))
    args = parser.parse_args(argv)
    steps = 60 if args.quick else args.steps

    latlon, healpix = RingGrid.latlon(24, 48), RingGrid.healpix(args.nside)
    weights = jnp.asarray(latlon.point_weights() / latlon.point_weights().sum(), jnp.float32)[None, :, None]
    model = Autoencoder(latlon, healpix, args.channels, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(optax.cosine_decay_schedule(3e-3, steps), weight_decay=1e-4),
                              wrt=nnx.Param)  # fmt: skip

    def loss_fn(model, fields):
        return jnp.sum(weights * (model(fields) - fields) ** 2) / fields.shape[0]

    @nnx.jit
    def train_step(model, optimizer, fields):
        loss, grads = nnx.value_and_grad(loss_fn)(model, fields)
        optimizer.update(model, grads)
        return loss

    rng = np.random.default_rng(0)
    points = unit_vectors(latlon)
    validation = jnp.asarray(random_fields(np.random.default_rng(1), points, 32))
    baseline = float(jnp.sum(weights * validation**2) / validation.shape[0])
    start = time.perf_counter()
    for step in range(steps):
        loss = train_step(model, optimizer, jnp.asarray(random_fields(rng, points, args.batch)))
        if step % max(1, steps // 5) == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {float(loss):.5f}  ({time.perf_counter() - start:.0f} s)")
    validation_loss = float(nnx.jit(loss_fn)(model, validation))
    print(f"validation: loss {validation_loss:.5f} against {baseline:.5f} for predicting zero "
          f"({validation_loss / baseline:.1%})")  # fmt: skip
    _plot(args.out, latlon, healpix, validation[:1], model)
    print(f"wrote {args.out}")
    return {"validation_loss": validation_loss, "baseline": baseline}


def _plot(path: Path, latlon: RingGrid, healpix: RingGrid, fields, model: Autoencoder) -> None:
    """Input on the lat-lon grid, the first latent channel on the HEALPix pixels, the output."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shape = latlon.regular_shape
    latent = np.asarray(model.latent_of(fields))[0, :, 0]
    output = np.asarray(model(fields))[0, :, 0].reshape(shape)
    field = np.asarray(fields)[0, :, 0].reshape(shape)
    extent = (0, 360, -90, 90)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.2), constrained_layout=True)
    scale = np.abs(field).max()
    axes[0].imshow(field, extent=extent, cmap="RdBu_r", vmin=-scale, vmax=scale, aspect="auto")
    axes[0].set_title(f"input ({shape[0]}x{shape[1]} lat-lon)")
    lon, lat = np.degrees(healpix.point_longitudes()), 90 - np.degrees(healpix.point_colatitudes())
    axes[1].scatter(lon, lat, c=latent, cmap="viridis", s=40)
    axes[1].set(xlim=(0, 360), ylim=(-90, 90), title=f"latent channel 0 ({healpix.name}, {healpix.npoints} pixels)")
    axes[2].imshow(output, extent=extent, cmap="RdBu_r", vmin=-scale, vmax=scale, aspect="auto")
    axes[2].set_title("output")
    for ax in axes:
        ax.set_xlabel("longitude (deg)")
    axes[0].set_ylabel("latitude (deg)")
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
