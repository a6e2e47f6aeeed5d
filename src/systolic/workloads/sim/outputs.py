"""What a simulation leaves to look at: per-frame snapshots, the final field as a PNG, an animated GIF and a
plot of the diagnostics against simulated time; in 3-D also the energy spectrum E(k) of every frame.

Snapshots are written as they are computed (`frames/000042.npy`, subsampled to `output.image_pixels`; spectra
`spectra/000042.npy`), so a run that stops and resumes still has every frame for the GIF. Every file is written to
a temporary name and renamed, so a crash never leaves a half-written picture.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from systolic.observe.metrics import read_metrics
from systolic.observe.plot import save_figure

FRAMES_DIR = "frames"
SPECTRA_DIR = "spectra"
SPLIT = "sim"  # the `split` of the simulation's records in metrics.jsonl


def save_snapshot(run_dir: Path, frame: int, field: np.ndarray, max_pixels: int) -> Path:
    stride = max(1, math.ceil(field.shape[0] / max_pixels))
    out = Path(run_dir) / FRAMES_DIR / f"{frame:06d}.npy"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.stem + ".tmp.npy")
    np.save(tmp, np.asarray(field[::stride, ::stride], np.float16))  # plenty for a picture, half the disk
    os.replace(tmp, out)
    return out


def save_spectrum(run_dir: Path, frame: int, spectrum: np.ndarray) -> Path:
    out = Path(run_dir) / SPECTRA_DIR / f"{frame:06d}.npy"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.stem + ".tmp.npy")
    np.save(tmp, np.asarray(spectrum, np.float64))
    os.replace(tmp, out)
    return out


def load_snapshots(run_dir: Path, last_frame: int, folder: str = FRAMES_DIR) -> list[tuple[int, np.ndarray]]:
    """Snapshots (or spectra) 0..last_frame in order (later files belong to an abandoned run and are ignored)."""
    frames = []
    for path in sorted((Path(run_dir) / folder).glob("[0-9]*.npy")):
        if path.stem.isdigit() and int(path.stem) <= last_frame:
            frames.append((int(path.stem), np.load(path).astype(np.float32 if folder == FRAMES_DIR else np.float64)))
    return frames


def pyplot():
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


def draw_field(field: np.ndarray, out: Path, *, title: str, cmap: str, symmetric: bool, length: float,
               axes: tuple[str, str] = ("x", "y")) -> Path:
    plt = pyplot()
    lo, hi = _limits(field, symmetric)
    fig, ax = plt.subplots(figsize=(6, 5.2), dpi=120)
    # Rows run along axes[0] (x), columns along axes[1] (y): transpose so x runs left to right and y bottom to top.
    image = ax.imshow(field.T, origin="lower", cmap=cmap, vmin=lo, vmax=hi, extent=(0, length, 0, length),
                      interpolation="nearest")
    fig.colorbar(image, ax=ax, shrink=0.85)
    ax.set_xlabel(axes[0])
    ax.set_ylabel(axes[1])
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


def frame_records(run_dir: Path) -> list[dict]:
    """The frames' rows of metrics.jsonl, as written (a resumed run may repeat a frame)."""
    return [r for r in read_metrics(run_dir) if r.get("split") == SPLIT and "time" in r]


def series(run_dir: Path, *keys: str) -> list[np.ndarray]:
    """Each key's values over the frames, in frame order (the last row of a frame counts, after a resume)."""
    by_step = {r["step"]: r for r in frame_records(run_dir)}
    return [np.array([by_step[s][k] for s in sorted(by_step)]) for k in keys]


def plot_diagnostics(run_dir: Path, keys: tuple[str, ...], out: Path) -> Path | None:
    """Each diagnostic (energy, enstrophy, ...) against simulated time, one panel each."""
    records = frame_records(run_dir)
    keys = tuple(k for k in keys if any(isinstance(r.get(k), (int, float)) for r in records))
    if not keys:
        return None
    plt = pyplot()
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


def plot_spectra(spectra: list[tuple[int, np.ndarray]], times: dict[int, float], out: Path, *,
                 curves: int = 6) -> Path | None:
    """E(k) on log-log axes at up to `curves` frames spread over the run, with a k^(-5/3) line for reference."""
    if not spectra:
        return None
    plt = pyplot()
    chosen = [spectra[round(i * (len(spectra) - 1) / max(1, curves - 1))] for i in range(min(curves, len(spectra)))]
    fig, ax = plt.subplots(figsize=(6.5, 4.8), dpi=110)
    colours = plt.get_cmap("viridis")
    for j, (frame, e) in enumerate(dict(chosen).items()):
        k = np.arange(len(e))
        keep = (k > 0) & (e > 1e-30)
        ax.loglog(k[keep], e[keep], color=colours(j / max(1, len(chosen) - 1)),
                  label=f"t = {times.get(frame, float('nan')):.3g}")
    frame, e = chosen[-1]
    k_mid = max(2, len(e) // 6)
    slope = e[k_mid] * (np.arange(1, len(e)) / k_mid) ** (-5 / 3)
    ax.loglog(np.arange(1, len(e)), slope, "k--", lw=0.8, label="k^(-5/3)")
    ax.set_ylim(max(1e-12, np.max([c[1][1:].max() for c in chosen]) * 1e-9), None)
    ax.set_xlabel("k (units of 2 pi / length)")
    ax.set_ylabel("E(k)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, out)
    return out
