"""Muon against AdamW on lm-small's model: steps to reach AdamW's final validation loss, each tuned over a small
learning-rate grid.

lm-small's model (6 layers, 384 wide, 6 heads sharing 2 key/value heads, ~11M parameters) on its corpus (the
standard library), shortened to fit a 2-core CPU: sequences of 64 tokens, batch 16, `--steps` steps (warmup 10%,
cosine decay), the validation loss (4 batches) every `--eval-every` steps. AdamW sweeps `optim.lr`; Muon sweeps
`optim.muon_lr` for its matrices, with AdamW's best `optim.lr` for the embeddings, output layer and norms.

    nice -n 10 python benchmarks/studies/muon_vs_adamw.py                 # ~1 h on 2 busy cores
    python benchmarks/studies/muon_vs_adamw.py --steps 40 --adamw-lrs 2e-3 --muon-lrs 0.02   # a smoke run
    python benchmarks/studies/muon_vs_adamw.py --recipe lm-tiny --steps 2 --eval-every 1 --adamw-lrs 2e-3 \
        --muon-lrs 0.02 --out /tmp/muon.json                              # the wiring (tests/test_benchmarks.py)

Results go to --out (JSON; an interrupted sweep resumes) and a table on stdout.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import lm_sweep  # sys.path[0]: benchmarks/studies/


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="lm-small", help="the model and corpus (default lm-small)")
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--adamw-lrs", default="1e-3,2e-3,4e-3", help="optim.lr grid of the AdamW runs")
    p.add_argument("--muon-lrs", default="0.01,0.02,0.04", help="optim.muon_lr grid of the Muon runs")
    p.add_argument("--out", type=Path, default=Path("muon_vs_adamw.json"))
    return p.parse_args(argv)


def first_step_at(run: dict, target: float) -> int | None:
    """The first evaluated step whose validation loss is at or below target."""
    return next((step for step, loss in run["val"] if loss <= target), None)


def main(argv=None) -> None:
    a = _args(argv)
    lm_sweep.start_jax()
    common = [f"train.steps={a.steps}", "train.batch_size=16", "data.seq_len=64", "train.eval_batches=4",
              f"optim.warmup_steps={a.steps // 10}", "sample.max_new_tokens=0"]
    results = lm_sweep.Results(a.out)

    def run(name, overrides):
        return results.get(name, lambda: lm_sweep.train_curve(a.recipe, [*common, *overrides],
                                                              eval_every=a.eval_every))

    adamw = {lr: run(f"adamw lr={lr}", [f"optim.lr={lr}"]) for lr in filter(None, a.adamw_lrs.split(","))}
    best_lr = min(adamw, key=lambda lr: lm_sweep.final(adamw[lr]))
    muon = {lr: run(f"muon muon_lr={lr} lr={best_lr}", ["optim.name=muon", f"optim.lr={best_lr}",
                                                         f"optim.muon_lr={lr}"]) for lr in filter(None, a.muon_lrs.split(","))}
    target = lm_sweep.final(adamw[best_lr])
    print(f"\ntarget: AdamW's best final validation loss {target:.4f} nats/token (lr={best_lr}, {a.steps} steps)\n")
    print("| optimizer | learning rate | final val loss | steps to reach the target | wall time |")
    print("|---|---|---|---|---|")
    for label, grid in (("AdamW", adamw), ("Muon", muon)):
        for lr, r in grid.items():
            reached = first_step_at(r, target)
            lr_text = f"lr={lr}" if label == "AdamW" else f"muon_lr={lr} (lr={best_lr})"
            final = lm_sweep.final(r)
            print(f"| {label} | {lr_text} | {final:.4f} | {reached if reached else 'not reached'} | "
                  f"{r['seconds']:.0f} s |" if math.isfinite(final) else f"| {label} | {lr_text} | diverged | - | - |")


if __name__ == "__main__":
    main()
