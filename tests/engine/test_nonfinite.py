"""The engine's non-finite guard covers every workload's own step: with `loop.nonfinite=skip`, a poisoned step
(NaN parameters going in; for gan the first parameter leaves are the discriminator's) is discarded, and no
checkpoint ever holds a non-finite value. Every saved leaf of every checkpoint is read back."""

import json
import math
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp

from systolic.cli import main
from tiny import TINY_GAN, TINY_RL, TINY_SIM

SKIP = ["loop.nonfinite=skip", "loop.poison_step=2", "checkpoint.every_steps=1", "checkpoint.keep=10",
        "checkpoint.async_save=false", "observe.log_every=1", "observe.tensorboard=false", "observe.plot=false"]

def saved_leaves(run: Path) -> dict[str, np.ndarray]:
    """Every array of every checkpoint step, read from disk without a restore target."""
    leaves = {}
    for step_dir in sorted((run / "checkpoints").iterdir()):
        for item in ("params", "opt_state", "train"):
            if (step_dir / item).is_dir():
                tree = ocp.PyTreeCheckpointer().restore(step_dir / item)
                for path, leaf in _flatten(tree, f"{step_dir.name}/{item}"):
                    leaves[path] = np.asarray(leaf)
    return leaves


def _flatten(tree, prefix):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten(v, f"{prefix}/{k}")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _flatten(v, f"{prefix}/{i}")
    elif tree is not None:
        yield prefix, tree


def train_rows(run: Path, split: str = "train") -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if r["split"] == split}


def check_run(run: Path, steps: int, loss_key: str) -> None:
    rows = train_rows(run)
    assert rows[2].get("skipped_total") == 1 and str(rows[2][loss_key]) == "nan", rows[2]  # the guard did fire
    assert rows[1].get("skipped_total") is None and math.isfinite(rows[1][loss_key])
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir()) == list(range(1, steps + 1))
    leaves = saved_leaves(run)
    floats = {k: v for k, v in leaves.items() if np.issubdtype(v.dtype, np.floating)}
    assert any("/params/d/" in k for k in floats) or any("/params/" in k for k in floats)
    bad = [k for k, v in floats.items() if not np.isfinite(v).all()]
    assert not bad, bad


def test_gan_skip_never_checkpoints_a_nan_discriminator(tmp_path):
    run = tmp_path / "gan"
    assert main(["train", "gan", *TINY_GAN, *SKIP, "-q", "--run-dir", str(run)]) == 0
    check_run(run, 4, "d_loss")
    rows = train_rows(run)
    assert all(math.isfinite(rows[s]["d_loss"]) for s in (1, 3, 4))  # the steps after the skip train on


def test_gan_halt_names_the_step_and_keeps_the_checkpoints_finite(tmp_path, capsys):
    run = tmp_path / "gan"
    assert main(["train", "gan", *TINY_GAN, "loop.poison_step=2", "checkpoint.every_steps=1", "-q",
                 "--run-dir", str(run)]) == 3
    err = capsys.readouterr().err.replace("\n", " ")
    assert "Step 2 produced a non-finite value in" in err and "loop.nonfinite=skip" in err, err
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir()) == [1]
    assert all(np.isfinite(v).all() for v in saved_leaves(run).values() if np.issubdtype(v.dtype, np.floating))


def test_rl_skip_never_checkpoints_a_nan_policy(tmp_path):
    run = tmp_path / "rl"
    assert main(["train", "rl", *TINY_RL, *SKIP, "observe.plot=false", "-q", "--run-dir", str(run)]) == 0
    check_run(run, 4, "loss")


def test_simulate_halts_on_a_blow_up_naming_the_frame(tmp_path, capsys):
    run = tmp_path / "sim"
    assert main(["simulate", *TINY_SIM, "sim.t_end=0.4", "output.frames=4", "output.images=false",
                 "loop.poison_step=2", "--run-dir", str(run)]) == 3
    err = capsys.readouterr().err.replace("\n", " ")
    assert "Step 2 produced a non-finite value in" in err and "blew up" in err, err
