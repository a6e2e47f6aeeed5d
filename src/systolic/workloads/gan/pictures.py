"""Sample grids (PNG and TensorBoard) and the loss/metric curves of a gan run."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from systolic.observe.metrics import read_metrics
from systolic.observe.plot import save_figure


def image_grid(images: np.ndarray, pad: int = 1) -> np.ndarray:
    """images (N, H, W, C) in [-1, 1] -> one (rows*(H+pad)+pad, cols*(W+pad)+pad, 3) uint8 picture."""
    n, h, w, c = images.shape
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    pixels = np.clip((np.asarray(images, np.float32) + 1) * 127.5, 0, 255).astype(np.uint8)
    if c == 1:
        pixels = np.repeat(pixels, 3, axis=-1)
    grid = np.full((rows * (h + pad) + pad, cols * (w + pad) + pad, 3), 64, np.uint8)
    for i in range(n):
        r, k = divmod(i, cols)
        grid[pad + r * (h + pad):pad + r * (h + pad) + h, pad + k * (w + pad):pad + k * (w + pad) + w] = pixels[i]
    return grid


def save_grid(images: np.ndarray, out: Path, min_side: int = 256) -> Path:
    """Writes the grid as a PNG, scaled up with nearest-neighbour so 8x8 digits stay visible."""
    from PIL import Image

    grid = image_grid(images)
    scale = max(1, -(-min_side // grid.shape[0]))
    picture = Image.fromarray(grid).resize((grid.shape[1] * scale, grid.shape[0] * scale), Image.NEAREST)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp.png")
    picture.save(tmp)
    os.replace(tmp, out)
    return out


def plot_curves(run_dir: Path, out_name: str = "curves.png") -> Path | None:
    """Generator and discriminator losses (train) and the Fréchet classifier distance with its floor and
    ceiling (eval, log scale) against step."""
    records = read_metrics(run_dir)
    train = [r for r in records if r["split"] == "train" and isinstance(r.get("d_loss"), (int, float))]
    evals = [r for r in records if r["split"] == "eval" and isinstance(r.get("frechet"), (int, float))]
    if not train:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_fd) = plt.subplots(1, 2, figsize=(11, 4), dpi=120)
    steps = [r["step"] for r in train]
    ax_loss.plot(steps, [r["g_loss"] for r in train], label="generator loss", lw=0.8)
    ax_loss.plot(steps, [r["d_loss"] for r in train], label="discriminator loss", lw=0.8)
    ax_loss.set_xlabel("step")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    if evals:
        steps = [r["step"] for r in evals]
        ax_fd.plot(steps, [r["frechet"] for r in evals], marker="o", label="generated (EMA generator)")
        ax_fd.plot(steps, [r["frechet_floor"] for r in evals], "--", label="floor: real vs held-out")
        ax_fd.plot(steps, [r["frechet_ceiling"] for r in evals], ":", label="ceiling: untrained generator")
        ax_fd.set_yscale("log")
        ax_fd.set_xlabel("step")
        ax_fd.set_ylabel("Fréchet classifier distance")
        conf = ax_fd.twinx()
        conf.plot(steps, [r["confident"] for r in evals], color="gray", alpha=0.6, label="confident fraction")
        conf.set_ylim(0, 1)
        conf.set_ylabel("fraction classified with p >= 0.9")
        ax_fd.legend(fontsize=8)
        ax_fd.grid(alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, Path(run_dir) / out_name)
