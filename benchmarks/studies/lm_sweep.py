"""What the learning-rate sweeps (`mup_transfer.py`, `muon_vs_adamw.py`, beside this file) share: train one lm config
in this process, evaluating on the held-out split as it goes, and keep finished runs in a JSON file so that an
interrupted sweep resumes where it stopped."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path


def start_jax() -> None:
    """The XLA:CPU settings that `systolic train` applies, before jax starts (import this module first)."""
    from systolic.runtime import cpu_tuning

    cpu_tuning.apply_at_start(workload="lm", stepping=True)


def train_curve(recipe: str, overrides: list[str], *, eval_every: int) -> dict:
    """Trains `recipe` with `overrides` on one device. Returns {"val": [[step, nats/token], ...], "train": the last
    train loss, "seconds": wall time}; a diverged run (non-finite loss) stops there with validation loss inf."""
    import jax

    from systolic import config as config_lib
    from systolic.config import MeshConfig
    from systolic.data.tokenizer import make_tokenizer
    from systolic.runtime import mesh as mesh_lib
    from systolic.runtime.sharding import activate
    from systolic.workloads.lm.config import LMConfig
    from systolic.workloads.lm.train import build_task

    cfg, _ = config_lib.load(LMConfig, recipe, overrides, "lm-tiny", "lm")
    mesh = mesh_lib.make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    prepared = build_task(cfg, mesh, make_tokenizer(cfg.data.tokenizer))
    task = prepared.task
    start = time.perf_counter()
    val, train = [], math.nan
    with activate(mesh, prepared.rules):
        state = task.init_state()
        for step in range(1, cfg.train.steps + 1):
            state, metrics = task.train_step(state, next(task.data))
            train = float(jax.device_get(metrics["loss"]))  # the step's guard kept the old state if not finite
            if not math.isfinite(train):
                val.append([step, math.inf])
                break
            if step % eval_every == 0 or step == cfg.train.steps:
                val.append([step, task.evaluate(state)["loss"]])
    return {"val": val, "train": train, "seconds": time.perf_counter() - start}


class Results:
    """Finished runs by name, in a JSON file written after each run."""

    def __init__(self, path: Path):
        self.path = path
        self.runs = json.loads(path.read_text()) if path.exists() else {}

    def get(self, name: str, run) -> dict:
        if name not in self.runs:
            self.runs[name] = run()
            self.path.write_text(json.dumps(self.runs, indent=1))
            print(f"{name}: final val {self.runs[name]['val'][-1][1]:.4f} ({self.runs[name]['seconds']:.0f} s)",
                  flush=True)
        return self.runs[name]


def final(run: dict) -> float:
    """A run's last validation loss (inf when it diverged)."""
    return run["val"][-1][1] if run["val"] else math.inf
