"""The Brax adapter (brax_envs.py): spaces and types, Brax's own episode flags, exact resume, and `systolic eval rl`.

Skipped where Brax is not installed (`pip install 'systolic[control]'`; the `dev` extra includes it).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from systolic.cli import main
from systolic.runtime.sharding import activate
from systolic.workloads.rl.config import EnvConfig
from systolic.workloads.rl.envs import make_env
from systolic.workloads.rl.train import build_task

brax_envs = pytest.importorskip("brax.envs")

NAME = "brax/inverted_pendulum"
# The tiny rl config (tests/tiny.py) on Brax's inverted pendulum, whose episodes the time limit of 40 cuts.
BRAX = [f"env.name={NAME}", "observe.tensorboard=false", "observe.plot=false"]


@pytest.mark.slow  # 60-110 s on 2 cores (Brax's MJX pipeline compiles)
def test_spaces_and_strong_types():
    env = make_env(EnvConfig(name=NAME))
    spec = env.spec
    assert (spec.obs_shape, spec.discrete, spec.action_dim, spec.action_low, spec.action_high,
            spec.max_episode_steps) == ((4,), False, 1, (-1.0,), (1.0,), 1000)
    obs, state = jax.vmap(env.reset)(jax.random.split(jax.random.PRNGKey(0), 3))
    assert obs.shape == (3, 4) and obs.dtype == jnp.float32
    step = jax.vmap(env.step)(jax.random.split(jax.random.PRNGKey(1), 3), state, jnp.zeros((3, 1)), (obs, state))
    assert step.reward.shape == step.terminated.shape == step.truncated.shape == (3,)
    assert step.terminated.dtype == step.truncated.dtype == jnp.bool_ and step.reward.dtype == jnp.float32
    assert jax.tree.structure(step.state) == jax.tree.structure(state)
    # Plain names (no dots: Orbax joins nested keys with them) and no weak types (they would recompile after a restore).
    assert all("." not in k for k in state) and not any(x.weak_type for x in jax.tree.leaves(state))


@pytest.mark.slow  # 60-110 s on 2 cores (Brax's MJX pipeline compiles)
def test_flags_follow_brax_episode_wrapper():
    """Step by step against Brax's own time-limit wrapper from the same state: `terminated` is `done` without
    `info["truncation"]`, `truncated` is `truncation`, `final_obs` is Brax's observation. Pushing the cart one way
    topples the pole within a few steps; a limit of 3 steps cuts the other episodes."""
    env = make_env(EnvConfig(name=NAME, max_episode_steps=3))
    reference = brax_envs.training.EpisodeWrapper(brax_envs.get_environment("inverted_pendulum",
                                                                            backend="generalized"), 3, 1)
    step, ref_step = jax.jit(env.step), jax.jit(reference.step)
    obs, state = env.reset(jax.random.PRNGKey(0))
    seen = set()
    for t in range(24):
        action = jnp.full((1,), 1.0 if t % 8 < 4 else 0.0)
        out = step(jax.random.PRNGKey(t), state, action, env.reset(jax.random.PRNGKey(100 + t)))
        with jax.numpy_dtype_promotion("standard"):  # Brax mixes dtypes (brax_envs.py)
            ref = ref_step(env._from_dict(state), action)
        done, truncation = bool(ref.done), bool(ref.info["truncation"])
        assert (bool(out.terminated), bool(out.truncated)) == (done and not truncation, truncation), t
        np.testing.assert_array_equal(out.final_obs, ref.obs)
        if done:  # the next episode starts from the given reset state
            np.testing.assert_array_equal(out.obs, env.reset(jax.random.PRNGKey(100 + t))[0])
        seen.add((bool(out.terminated), bool(out.truncated)))
        state = out.state
    assert seen == {(False, False), (True, False), (False, True)}, seen


@pytest.mark.slow  # 60-110 s on 2 cores (Brax's MJX pipeline compiles)
def test_resume_is_exact(tiny_rl, tmp_path):
    """Brax's physics state goes through the checkpoint bit-exactly: stopped after 2 chunks and resumed, the run
    logs the same metrics as one straight run, without compiling again."""
    cfg, mesh = tiny_rl.config(*BRAX), tiny_rl.mesh(1)
    prepared = build_task(cfg, mesh)
    with activate(mesh):
        straight = tiny_rl.loop_run(prepared, cfg, tmp_path / "straight", steps=4)
        halfway = tiny_rl.loop_run(prepared, cfg, tmp_path / "resumed", steps=4, stop_at=2)
        assert int(halfway.state.step) == 2
        resumed = tiny_rl.loop_run(prepared, cfg, tmp_path / "resumed", steps=4)
    assert resumed.start_step == 2
    a, b = tiny_rl.train_records(tmp_path / "straight"), tiny_rl.train_records(tmp_path / "resumed")
    assert [r["step"] for r in b] == [1, 2, 3, 4] and a[3]["episode_return"] != a[0]["episode_return"]
    assert a == b
    for x, y in zip(jax.tree.leaves(straight.state.extra), jax.tree.leaves(resumed.state.extra)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert straight.eval_metrics == resumed.eval_metrics
    assert prepared.task.train_step._cache_size() == 1


@pytest.mark.slow  # compiles training and evaluation a second time, through the CLI: ~30 s of CPU
def test_eval_runs_brax_and_refuses_gymnasium_and_gif(tiny_rl, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "rl", *tiny_rl.overrides, *BRAX, "-q", "--run-dir", str(run)]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == [1, 2, 3, 4]
    capsys.readouterr()
    assert main(["eval", "rl", str(run), "--episodes", "2"]) == 0
    out = capsys.readouterr().out
    assert f"checkpoint step 4; 2 episodes per seed in Brax {NAME}" in out and "seed 1: mean return" in out
    for option, fragment in ((["--gymnasium"], "has no counterpart in Gymnasium"), (["--gif", str(tmp_path / "e.gif")],
                                                                                   "--gif: no renderer for")):
        assert main(["eval", "rl", str(run), "--episodes", "2", *option]) == 2
        err = capsys.readouterr().err
        assert fragment in err.replace("\n", " ") and "Traceback" not in err
