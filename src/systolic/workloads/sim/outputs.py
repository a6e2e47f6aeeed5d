"""What a simulation leaves to look at: per-frame snapshots, the final field as a PNG, an animated GIF and a
plot of the diagnostics against simulated time.

Snapshots are written as they are computed (`frames/000042.npy`, subsampled to `output.image_pixels`), so a
run that stops and resumes still has every frame for the GIF. Every file is written to a temporary name and
renamed, so a crash never leaves a half-written picture.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from systolic.observe.metrics import read_metrics
from systolic.observe.plot import save_figure

FRAMES_DIR = "frames"
SPLIT = "sim"  # the `split` of the simulation's records in metrics.jsonl


def save_snapshot(run_dir: Path, frame: int, field: np.ndarray, max_pixels: int) -> Path:
    stride = max(1, math.ceil(field.shape[0] / max_pixels))
    out = Path(run_dir) / FRAMES_DIR / f"{frame:06d}.npy"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.stem + ".tmp.npy")
    np.save(tmp, np.asarray(field[::stride, ::stride], np.float16))  # plenty for a picture, half the disk
    os.replace(tmp, out)
    return out


def load_snapshots(run_dir: Path, last_frame: int) -> list[tuple[int, np.ndarray]]:
    """Snapshots 0..last_frame in order (later files belong to an abandoned run and are ignored)."""
    frames = []
    for path in sorted((Path(run_dir) / FRAMES_DIR).glob("[0-9]*.npy")):
        if path.stem.isdigit() and int(path.stem) <= last_frame:
            frames.append((int(path.stem), np.load(path).astype(np.float32)))
    return frames


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _limits(field: np.ndarray, symmetric: bool) -> tuple[float, float]:
    """Colour range: symmetric about 0 (vorticity) at the 99.5th percentile of |w| so a few extreme vortex
    cores do not wash out the rest; otherwise the field's min and max."""
    if symmetric:
        v = float(np.percentile(np.abs(field), 99.5)) or 1.0
        return -v, v
    lo, hi = float(field.min()), float(field.max())
    return lo, hi if hi > lo else lo + 1.0


def draw_field(field: np.ndarray, out: Path, *, title: str, cmap: str, symmetric: bool, length: float) -> Path:
    plt = _pyplot()
    lo, hi = _limits(field, symmetric)
    fig, ax = plt.subplots(figsize=(6, 5.2), dpi=120)
    # Rows are x, columns y: transpose so x runs left to right and y bottom to top.
    image = ax.imshow(field.T, origin="lower", cmap=cmap, vmin=lo, vmax=hi, extent=(0, length, 0, length),
                      interpolation="nearest")
    fig.colorbar(image, ax=ax, shrink=0.85)
    ax.set_xlabel("x")
    ax.set_ylabel("y")
    ax.set_title(title)
    fig.tight_layout()
    save_figure(fig, out)
    return out


def make_gif(frames: list[tuple[int, np.ndarray]], out: Path, *, cmap: str, symmetric: bool,
             frame_ms: int = 80) -> Path | None:
    """An animated GIF, one picture per snapshot. The colour range is fixed across frames (taken over all of
    them) so decay and growth show as fading and brightening."""
    if not frames:
        return None
    import matplotlib
    from PIL import Image

    stack = np.stack([f for _, f in frames])  # (frames, h, w)
    lo, hi = _limits(stack, symmetric)
    colour = matplotlib.colormaps[cmap]
    images = []
    for field in stack:
        rgba = colour(np.clip((field.T[::-1] - lo) / (hi - lo), 0, 1))  # y up, as in draw_field
        images.append(Image.fromarray((rgba[..., :3] * 255).astype(np.uint8)))
    tmp = out.with_name(out.stem + ".tmp.gif")
    images[0].save(tmp, save_all=True, append_images=images[1:], duration=frame_ms, loop=0)
    os.replace(tmp, out)
    return out


def plot_diagnostics(run_dir: Path, keys: tuple[str, ...], out: Path) -> Path | None:
    """Each diagnostic (energy, enstrophy, ...) against simulated time, one panel each."""
    records = [r for r in read_metrics(run_dir) if r.get("split") == SPLIT and "time" in r]
    keys = tuple(k for k in keys if any(isinstance(r.get(k), (int, float)) for r in records))
    if not keys:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.4 * len(keys)), dpi=120, sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        points = [(r["time"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
        if key == "error":  # spans many decades; the exact 0 at t = 0 has no place on a log axis
            points = [p for p in points if p[1] > 0]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=2)
        if key == "error":
            ax.set_yscale("log")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("simulated time")
    fig.tight_layout()
    save_figure(fig, out)
    return out
