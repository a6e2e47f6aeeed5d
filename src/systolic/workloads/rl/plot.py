"""End-of-run picture: every seed's return curve (training episodes as lines, evaluations as dots)."""

from __future__ import annotations

from pathlib import Path

from systolic.observe.metrics import read_metrics
from systolic.observe.plot import save_figure

RETURNS_PNG = "returns.png"


def plot_returns(run_dir: Path, num_seeds: int, env_steps_per_step: int, *, title: str = "",
                 out_name: str = RETURNS_PNG) -> Path | None:
    """Reads `metrics.jsonl`; x is environment steps per seed. Returns the PNG path, or None with no data."""
    records = read_metrics(run_dir)
    train = {i: ([], []) for i in range(num_seeds)}
    evals = {i: ([], []) for i in range(num_seeds)}
    for r in records:
        series, key = (train, "episode_return/seed{}") if r["split"] == "train" else (evals, "return/seed{}")
        for i in range(num_seeds):
            value = r.get(key.format(i))
            if isinstance(value, (int, float)):
                series[i][0].append(r["step"] * env_steps_per_step)
                series[i][1].append(value)
    if not any(xs for xs, _ in train.values()):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    colors = plt.get_cmap("tab10" if num_seeds <= 10 else "viridis")
    for i in range(num_seeds):
        color = colors(i % 10) if num_seeds <= 10 else colors(i / max(num_seeds - 1, 1))
        ax.plot(*train[i], color=color, linewidth=1.2, alpha=0.85, label=f"seed {i}" if num_seeds <= 10 else None)
        if evals[i][0]:
            ax.plot(*evals[i], "o", color=color, markersize=4)
    ax.set_xlabel("environment steps per seed")
    ax.set_ylabel("episode return")
    ax.set_title((title + ": " if title else "") + "training episodes (lines), deterministic evaluation (dots)",
                 fontsize=9)
    ax.grid(alpha=0.3)
    if num_seeds <= 10:
        ax.legend(fontsize=7, ncol=2, loc="lower right")
    fig.tight_layout()
    return save_figure(fig, Path(run_dir) / out_name)
