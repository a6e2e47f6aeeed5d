"""The acceptance runs (slow: minutes on a 2-core CPU): the bundled recipes (PPO, PQN, DQN; gymnax and Brax) really
solve or learn their environments, and a CartPole policy trained by systolic also scores >= 475 in Gymnasium's own CartPole-v1."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest


def train(recipe: str, run_dir: Path, *overrides: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "systolic", "train", "rl", "--recipe", recipe, "--run-dir",
                           str(run_dir), *overrides], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert (run_dir / "returns.png").is_file()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["split"] == "eval"][-1]


@pytest.mark.slow
def test_default_recipe_solves_cartpole_in_gymnax_and_in_gymnasium(tmp_path):
    final = train("rl-cartpole", tmp_path / "cartpole")
    per_seed = [final[f"return/seed{i}"] for i in range(8)]
    assert min(per_seed) >= 475, per_seed

    pytest.importorskip("gymnasium")
    from systolic.workloads.rl import evaluate

    run = evaluate.restore_run(tmp_path / "cartpole")
    returns = evaluate.gymnasium_returns(run, episodes=100, seed=0)  # (seeds, episodes)
    assert returns.shape == (8, 100)
    assert np.all(returns.mean(axis=1) >= 475), returns.mean(axis=1)


@pytest.mark.slow
def test_pendulum_recipe_beats_minus_250(tmp_path):
    """The issue's bar is the mean return; every seed must also have learned to swing up (a seed that never
    does stays near -600 to -1200)."""
    final = train("rl-pendulum", tmp_path / "pendulum")
    per_seed = [final[f"return/seed{i}"] for i in range(4)]
    assert final["return"] > -250 and min(per_seed) > -300, per_seed


@pytest.mark.slow
def test_pqn_recipe_solves_cartpole_every_seed(tmp_path):
    """PQN (no replay buffer, no target network): every seed's greedy policy at >= 475 (measured: 500 for all 8)."""
    final = train("rl-cartpole-pqn", tmp_path / "pqn")
    per_seed = [final[f"return/seed{i}"] for i in range(8)]
    assert min(per_seed) >= 475, per_seed


@pytest.mark.slow
def test_dqn_recipe_learns_cartpole(tmp_path):
    """DQN with its replay buffer on the device: a mean over seeds of at least 400 and half the seeds at the 475
    target (measured: mean 480.1, 7 of 8 seeds at >= 475, the worst at 363.9); DQN's seeds spread more than PPO's
    or PQN's, so the bar is lower."""
    final = train("rl-cartpole-dqn", tmp_path / "dqn")
    per_seed = [final[f"return/seed{i}"] for i in range(8)]
    assert final["return"] >= 400 and sorted(per_seed)[4] >= 475, per_seed


@pytest.mark.slow
def test_brax_recipe_balances_the_inverted_pendulum_every_seed(tmp_path):
    """Continuous control on the device (Brax's MuJoCo InvertedPendulum): every seed's deterministic policy at >= 950
    of the 1000 an episode can score (measured: 1000 for all 8; uniformly random actions score 5.2)."""
    pytest.importorskip("brax")
    final = train("rl-inverted-pendulum-brax", tmp_path / "brax")
    per_seed = [final[f"return/seed{i}"] for i in range(8)]
    assert min(per_seed) >= 950, per_seed


@pytest.mark.slow
def test_gru_recipe_needs_its_memory_on_stateless_cartpole(tmp_path):
    """CartPole with its velocities hidden: the GRU policy learns it and the same run without memory does not.
    Measured 2026-12-07 over three sets of 8 seeds (rl.seed=0, 1, 2): means 489.9, 448.4, 489.9, and 23 of the 24
    seeds >= 419 (one at 150.6): a recurrent PPO seed now and then fails to learn in this budget, so the check
    allows one seed of 8; feed-forward: 42.4, every seed 40.7-44.1."""
    final = train("rl-cartpole-gru", tmp_path / "gru")
    per_seed = [final[f"return/seed{i}"] for i in range(8)]
    assert final["return"] >= 400 and sum(r >= 400 for r in per_seed) >= 7, per_seed
    feed_forward = train("rl-cartpole-gru", tmp_path / "ff", "model.gru_size=0")
    assert feed_forward["return"] < 100, feed_forward
