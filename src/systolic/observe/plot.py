"""End-of-run pictures: loss curves from `metrics.jsonl`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from systolic.observe.metrics import read_metrics


def plot_losses(run_dir: Path, out_name: str = "loss.png", key: str = "loss") -> Path | None:
    """Train and eval `key` against step; returns the PNG path, or None when there is nothing to plot."""
    records = read_metrics(run_dir)
    series: dict[str, tuple[list[int], list[float]]] = {}
    for r in records:
        value = r.get(key)
        if isinstance(value, (int, float)):
            steps, values = series.setdefault(r["split"], ([], []))
            steps.append(r["step"])
            values.append(value)
    if not series:
        return None
    try:
        import matplotlib
    except ImportError:  # a machine without it (the lent TPU's image) still finishes the run
        print(f"observe.plot: matplotlib is not installed, so {out_name} was not drawn (metrics.jsonl holds the "
              "numbers; pip install matplotlib to draw it, or set observe.plot=false)", file=sys.stderr)
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for split, (steps, values) in sorted(series.items()):
        ax.plot(steps, values, marker="o" if split != "train" else None, markersize=3, label=split)
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return save_figure(fig, Path(run_dir) / out_name)


def save_figure(fig, out: Path) -> Path:
    """Writes a matplotlib figure atomically (a reader never sees half a PNG) and closes it."""
    import matplotlib.pyplot as plt

    tmp = out.with_name(out.stem + ".tmp" + out.suffix)
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, out)
    return out
