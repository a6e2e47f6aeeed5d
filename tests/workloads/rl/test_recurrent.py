"""Partially observed environments (`env.hide_obs`) and recurrent PPO (`model.gru_size`): the network against a
float64 NumPy reference, the update's sequence replay against the rollout, exact resume, evaluation with memory."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import TINY_GRU, TINY_PQN, TINY_RL, run_steps

from systolic import config as config_lib
from systolic.cli import main
from systolic.config import LoopConfig
from systolic.engine import loop
from systolic.errors import ConfigError
from systolic.runtime.sharding import activate
from systolic.workloads.rl import ppo, ppo_rnn, recurrent
from systolic.workloads.rl.config import EnvConfig, RLConfig
from systolic.workloads.rl.envs import make_env, obs_view
from systolic.workloads.rl.train import build_task


def config(*overrides: str) -> RLConfig:
    return config_lib.from_dict(RLConfig, config_lib.apply_overrides({}, list(overrides)))


# HIDDEN OBSERVATIONS --------------------------------------------------------------------------------------------


def test_hide_obs_parses_from_the_command_line():
    assert config(*TINY_RL, "env.hide_obs=[1,3]").env.hide_obs == (1, 3)
    assert config(*TINY_RL).env.hide_obs == ()


def test_hidden_components_are_zero_in_obs_and_final_obs():
    env = make_env(EnvConfig(name="CartPole-v1", max_episode_steps=3, hide_obs=(1, 3)))
    full = make_env(EnvConfig(name="CartPole-v1", max_episode_steps=3))
    obs, state = env.reset(jax.random.PRNGKey(0))
    full_obs, _ = full.reset(jax.random.PRNGKey(0))
    np.testing.assert_array_equal(obs, full_obs * jnp.array([1.0, 0.0, 1.0, 0.0]))
    step = jax.jit(env.step)
    for i in range(3):  # the third step truncates: final_obs is the pre-reset observation, obs a new episode's
        keys = jax.random.split(jax.random.PRNGKey(i), 2)
        out = step(keys[0], state, jnp.int32(i % 2), env.reset(keys[1]))
        for o in (out.obs, out.final_obs):
            assert o[1] == 0 and o[3] == 0 and o[0] != 0 and o[2] != 0
        state = out.state
    assert bool(out.truncated) and not np.allclose(out.obs, out.final_obs)
    assert state["x_dot"] != 0, "the environment itself still moves: only the agent's view is masked"
    # The same mask for observations from elsewhere (Gymnasium's, in `systolic eval rl --gymnasium`).
    np.testing.assert_array_equal(obs_view((1, 3), env.spec)(np.ones((2, 4))), [[1, 0, 1, 0]] * 2)


@pytest.mark.parametrize("hide, fragment", [
    ("[4]", "[4] is not a component of CartPole-v1's observation, which has 4"),
    ("[-1]", "[-1] is not a component"),
    ("[0,1,2,3]", "hides all 4 components"),
    ("[1,1]", "names a component twice"),
])
def test_bad_hide_obs_is_a_clear_error(hide, fragment):
    with pytest.raises(ConfigError, match="Fix") as info:
        make_env(config(*TINY_RL, f"env.hide_obs={hide}").env)
    assert fragment in str(info.value)


@pytest.mark.parametrize("overrides, fragment", [
    ([*TINY_PQN, "model.gru_size=8"], "model.gru_size=8 with algo=pqn"),
    # 8 x 9 steps split into 3 minibatches of steps, but not 8 environments into 3 groups
    ([*TINY_GRU, "ppo.num_minibatches=3", "rl.num_steps=9"],
     "rl.num_envs=8 cannot be split into ppo.num_minibatches=3"),
    ([*TINY_GRU, "model.gru_size=-1"], "model.gru_size=-1 must be >= 0"),
])
def test_recurrent_config_errors_say_what_to_fix(overrides, fragment):
    with pytest.raises(ConfigError, match="Fix") as info:
        config(*overrides)
    assert fragment in str(info.value)


# THE NETWORK ------------------------------------------------------------------------------------------------


def numpy_step(params, hidden, obs):
    """recurrent.RecurrentActorCritic in float64 NumPy, from the GRU equations (Cho et al. 2014, flax's layout):
    r = s(x Wir + bir + h Whr), z = s(x Wiz + biz + h Whz), n = tanh(x Win + bin + r (h Whn)), h' = (1 - z) n + z h."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    sigmoid = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    x = np.tanh(obs @ p["embed"]["kernel"] + p["embed"]["bias"])
    xi_r, xi_z, xi_n = np.split(x @ p["gru"]["dense_i"]["kernel"] + p["gru"]["dense_i"]["bias"], 3, axis=-1)
    hh_r, hh_z, hh_n = np.split(hidden @ p["gru"]["dense_h"]["kernel"], 3, axis=-1)
    r, z = sigmoid(xi_r + hh_r), sigmoid(xi_z + hh_z)
    new_h = (1 - z) * np.tanh(xi_n + r * hh_n) + z * hidden

    def mlp(layers, y):
        for i in range(len(layers) - 1):
            y = np.tanh(y @ layers[i]["kernel"] + layers[i]["bias"])
        return y @ layers[len(layers) - 1]["kernel"] + layers[len(layers) - 1]["bias"]

    return new_h, mlp(p["actor"]["layers"], new_h), mlp(p["critic"]["layers"], new_h)[..., 0]


def test_recurrent_step_matches_a_float64_numpy_reference():
    cfg = config(*TINY_GRU)
    spec = make_env(cfg.env).spec
    params = recurrent.init_params(spec, cfg.model, key=jax.random.PRNGKey(0))
    graphdef = recurrent.make_graphdef(spec, cfg.model)
    hidden = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (5, 8)))
    obs = np.asarray(jax.random.normal(jax.random.PRNGKey(2), (5, 4)))
    got_h, dist, value = recurrent.step(graphdef, params, jnp.asarray(hidden), jnp.asarray(obs), 1)
    want_h, want_logits, want_value = numpy_step(params, hidden.astype(np.float64), obs.astype(np.float64))
    np.testing.assert_allclose(got_h, want_h, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dist.logits, want_logits, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(value, want_value, rtol=1e-5, atol=1e-6)


def test_the_update_replays_the_hidden_states_the_rollout_acted_with():
    """Two rollouts with episodes of at most 5 steps in 8-step rollouts, so hidden states are reset mid-rollout and
    the second rollout starts from a non-zero stored state; the replay from that state reproduces every step."""
    cfg = config(*TINY_GRU, "env.max_episode_steps=5")
    env = make_env(cfg.env)
    graphdef = recurrent.make_graphdef(env.spec, cfg.model)
    state = ppo_rnn.make_init(cfg, env, ppo.make_optimizer(cfg))(jax.random.PRNGKey(0))
    rollout = jax.jit(ppo_rnn.make_rollout(cfg, env))
    replay = jax.jit(lambda params, hidden, traj: recurrent.unroll(graphdef, params, hidden, traj.obs, traj.done, 1))
    for i in range(2):
        first_hidden = state.hidden
        state, traj = rollout(state, jax.random.PRNGKey(10 + i))
        assert traj.done[:-1].any(), "an episode ended inside the rollout"
        dist, values, hiddens = replay(state.params, first_hidden, traj)
        np.testing.assert_allclose(hiddens, traj.next_hidden, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(values, traj.value, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(dist.log_prob(traj.action), traj.log_prob, rtol=1e-5, atol=1e-6)
        # The next rollout acts with the last step's memory, forgotten where that step ended an episode.
        done = np.asarray(traj.done[-1])[:, None]
        np.testing.assert_array_equal(state.hidden, np.where(done, 0.0, traj.next_hidden[-1]))
    assert np.abs(first_hidden).max() > 0


# THE RUN --------------------------------------------------------------------------------------------------------


def train_records(run_dir: Path) -> list[dict]:
    rows = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["split"] == "train"]
    return [{k: v for k, v in r.items() if k != "env_steps_per_s"} for r in rows]


def test_recurrent_run_resumes_exactly_without_recompiling(tiny_rl, tmp_path):
    cfg = config(*TINY_GRU, "observe.tensorboard=false", "observe.plot=false")
    mesh = tiny_rl.mesh(1)
    prepared = build_task(cfg, mesh)

    def loop_run(run_dir: Path, stop_at: int = 0) -> loop.RunResult:
        settings = loop.LoopSettings(steps=4, eval_every=4, loop=LoopConfig(stop_at_step=stop_at),
                                     checkpoint=cfg.checkpoint, observe=cfg.observe, quiet=True)
        return loop.train(prepared.task, settings, run_dir)

    with activate(mesh):
        straight = loop_run(tmp_path / "straight")
        halfway = loop_run(tmp_path / "resumed", stop_at=2)
        hidden = np.asarray(halfway.state.extra["envs"]["hidden"])
        assert hidden.shape == (2, 8, 8) and np.abs(hidden).max() > 0, "the checkpoint holds real memories"
        resumed = loop_run(tmp_path / "resumed")
    assert resumed.start_step == 2
    a, b = train_records(tmp_path / "straight"), train_records(tmp_path / "resumed")
    assert a == b, "hidden states, environments, optimizer and RNG all resume exactly"
    assert straight.eval_metrics == resumed.eval_metrics
    for x, y in zip(jax.tree.leaves(straight.state), jax.tree.leaves(resumed.state)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert prepared.task.train_step._cache_size() == 1, "a restored state has the same types and shardings"


def test_recurrent_run_split_over_environments_matches_one_device(tiny_rl):
    """2 seeds on 8 devices: every seed's 8 environments (and their hidden states) split 8 ways, so each
    minibatch of whole environments spans devices. It follows the single-device run."""
    cfg = config(*TINY_GRU)
    runs = []
    for devices in (1, 8):
        prepared = build_task(cfg, tiny_rl.mesh(devices))
        state, metrics = run_steps(prepared.task, 2, mesh=tiny_rl.mesh(devices))
        runs.append((prepared.layout, state, metrics))
    (_, state1, history1), (layout, state8, history8) = runs
    assert layout == "envs"
    assert len(state8.extra["envs"]["hidden"].sharding.device_set) == 8
    for got, want in zip(history8, history1):
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=2e-4, atol=1e-5, err_msg=key)
    for a, b in zip(jax.tree.leaves(state8.params), jax.tree.leaves(state1.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_eval_of_a_recurrent_run_in_gymnax_and_gymnasium(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "rl", *TINY_GRU, "checkpoint.async_save=false", "observe.plot=false",
                 "observe.tensorboard=false", "-q", "--run-dir", str(run)]) == 0
    capsys.readouterr()
    assert main(["eval", "rl", str(run), "--episodes", "2"]) == 0
    gymnax_out = capsys.readouterr().out
    assert "2 episodes per seed in gymnax CartPole-v1" in gymnax_out and "seed 1: mean return" in gymnax_out
    assert main(["eval", "rl", str(run), "--episodes", "2", "--gymnasium"]) == 0
    assert "in Gymnasium CartPole-v1" in capsys.readouterr().out
