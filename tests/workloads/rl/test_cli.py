"""The real entry points on the tiny config: `systolic train rl`, resume, `systolic eval rl` (gymnax, Gymnasium,
GIF), and bad input ending in one paragraph with exit code 2."""

import json
import subprocess
import sys

import pytest

from systolic.cli import main


def test_train_resume_and_eval(tiny_rl, tmp_path, capsys):
    run = tmp_path / "run"
    first = subprocess.run([sys.executable, "-m", "systolic", "train", "rl", *tiny_rl.overrides, "ppo.anneal_lr=false",
                            "--run-dir", str(run)], capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, f"stdout:\n{first.stdout}\nstderr:\n{first.stderr}"
    assert "Traceback" not in first.stderr
    assert "PPO on CartPole-v1 (discrete actions), 2 seeds x 8 environments" in first.stdout
    assert "envs split over the data axes" in first.stdout  # 2 seeds cannot be split over the 8 devices
    assert "evaluation (2 episodes per seed, deterministic policy)" in first.stdout
    assert "seeds reach the target mean return 475 on CartPole-v1" in first.stdout
    for name in ("config.yaml", "returns.png", "loss.png", "metrics.jsonl"):
        assert (run / name).is_file(), name
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == [1, 2, 3, 4]
    assert {"episode_return/seed0", "episode_return/seed1", "entropy/seed1", "loss"} <= records[0].keys()
    final_eval = [r for r in records if r["split"] == "eval"][-1]
    assert final_eval["step"] == 4 and {"return", "return_min", "return/seed0", "return/seed1"} <= final_eval.keys()

    # Twice the experience: the run resumes from its last checkpoint instead of starting over.
    assert main(["train", "rl", *tiny_rl.overrides, "rl.total_env_steps=1024", "-q",
                 "--run-dir", str(run)]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == list(range(1, 9))

    capsys.readouterr()
    gymnasium = pytest.importorskip("gymnasium")
    assert gymnasium is not None
    gif = tmp_path / "episode.gif"
    assert main(["eval", "rl", str(run), "--episodes", "3", "--gymnasium", "--gif", str(gif)]) == 0
    out = capsys.readouterr().out
    assert "checkpoint step 8; 3 episodes per seed in Gymnasium CartPole-v1" in out
    assert "seed 0: mean return" in out and "seed 1: mean return" in out and "worst seed" in out
    from PIL import Image

    with Image.open(gif) as image:
        assert image.n_frames > 1 and image.size == (300, 300)

    assert main(["eval", "rl", str(run), "--episodes", "2"]) == 0
    assert "in gymnax CartPole-v1" in capsys.readouterr().out


@pytest.mark.parametrize("argv, fragment", [
    (["train", "rl", "ppo.num_minibatches=7"], "cannot be split into ppo.num_minibatches=7"),
    (["train", "rl", "model.conv_channels=16"], "only the Q-networks (algo=pqn, algo=dqn) have a convolution"),
    (["train", "rl", "rl.num_sedes=8"], "Did you mean 'rl.num_seeds'"),
    (["train", "rl", "rl.unroll=0"], "rl.unroll=0 must be >= 1"),
    (["train", "rl", "algo=pqn"], "has a 'ppo' section but algo=pqn"),  # rl-cartpole is a PPO recipe
    (["train", "rl", "env.name=Pong"], "is not an environment the rl workload can build"),
    (["train", "rl", "--recipe", "lm-tiny"], "is for the 'lm' workload, not 'rl'"),
    (["eval", "rl", "/nonexistent/run"], "not a systolic run directory"),
    (["eval", "gan", "/nonexistent/run"], "has no `eval` command"),
    (["eval", "rl", "/nonexistent/run", "--data", "x.txt"], "has no option --data (it is an option of `systolic eval lm`)"),
])
def test_user_errors_exit_2_without_traceback(argv, fragment, capsys, tmp_path):
    assert main(argv + (["--run-dir", str(tmp_path / "r")] if argv[0] == "train" else [])) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and fragment in err.replace("\n", " ")
    assert "Traceback" not in err


def test_eval_of_a_run_without_checkpoint(tmp_path, capsys, tiny_rl):
    from systolic.engine import rundir

    rundir.prepare(tmp_path, tiny_rl.config())
    assert main(["eval", "rl", str(tmp_path)]) == 2
    assert "has no complete checkpoint" in capsys.readouterr().err.replace("\n", " ")


@pytest.mark.parametrize("recipe, algo, env, seeds", [("rl-cartpole", "ppo", "CartPole-v1", 8),
                                                      ("rl-pendulum", "ppo", "Pendulum-v1", 4),
                                                      ("rl-cartpole-pqn", "pqn", "CartPole-v1", 8),
                                                      ("rl-breakout-pqn", "pqn", "Breakout-MinAtar", 2),
                                                      ("rl-cartpole-dqn", "dqn", "CartPole-v1", 8),
                                                      ("rl-inverted-pendulum-brax", "ppo", "brax/inverted_pendulum", 8),
                                                      ("rl-cartpole-gru", "ppo", "CartPole-v1", 8)])
def test_bundled_recipes_load(recipe, algo, env, seeds):
    from systolic import config as config_lib
    from systolic.workloads import get

    rl = get("rl")
    cfg, name = config_lib.load(rl.config, recipe, [], rl.default_recipe)
    assert (name, cfg.algo, cfg.env.name, cfg.rl.num_seeds) == (recipe, algo, env, seeds)
    assert cfg.rl.num_updates * cfg.rl.env_steps_per_update >= cfg.rl.total_env_steps
    assert rl.default_recipe == "rl-cartpole"
