"""The examples run: the training script's and the HEALPix autoencoder's smoke modes and the gradient-check
notebook (headless)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

pytestmark = pytest.mark.slow

pytest.importorskip("flax")
pytest.importorskip("optax")
pytest.importorskip("matplotlib")


def test_train_sphere_quick_learns_and_saves_the_map(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("train_sphere", EXAMPLES / "train_sphere.py")
    train_sphere = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, train_sphere)  # dataclasses look their module up there
    spec.loader.exec_module(train_sphere)
    png = tmp_path / "map.png"
    metrics = train_sphere.main(["--quick", "--out", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The decoder starts at zero, i.e. at persistence; a few dozen steps must already beat it.
    assert metrics["validation_loss"] < 0.9 * metrics["validation_persistence"]
    assert metrics["train_loss"] < metrics["train_persistence"]


def test_healpix_autoencoder_quick_learns_and_saves_the_picture(tmp_path):
    spec = importlib.util.spec_from_file_location("healpix_autoencoder", EXAMPLES / "healpix_autoencoder.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    png = tmp_path / "healpix.png"
    metrics = example.main(["--quick", "--out", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Through a latent of a sixth of the input's points, a few dozen steps must already reconstruct most of it.
    assert metrics["validation_loss"] < 0.5 * metrics["baseline"]


def test_gradcheck_notebook_runs_headless():
    nbformat = pytest.importorskip("nbformat", reason="executing the notebook needs nbformat, nbclient and ipykernel")
    nbclient = pytest.importorskip("nbclient", reason="executing the notebook needs nbformat, nbclient and ipykernel")
    pytest.importorskip("ipykernel", reason="executing the notebook needs nbformat, nbclient and ipykernel")
    notebook = nbformat.read(EXAMPLES / "gradcheck.ipynb", as_version=4)
    # Every check in the notebook asserts, so a clean run is the test. Its kernel starts in examples/, so that it
    # imports the installed package (with its native modules), not the checkout.
    nbclient.NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(EXAMPLES)}}
    ).execute()
