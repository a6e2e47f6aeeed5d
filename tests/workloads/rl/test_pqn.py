"""PQN: its Q(lambda) targets against purejaxql's recursion and a loop written from the definition, truncation
bootstrapped and termination not, the Q-network's LayerNorms, and a run through the engine (sharded == single
device, stop + resume bit-exact, config errors)."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import TINY_PQN, run_steps

from systolic import config as config_lib
from systolic.engine import loop
from systolic.errors import ConfigError
from systolic.runtime.sharding import activate
from systolic.workloads.rl import pqn, qnetwork
from systolic.workloads.rl.config import RLConfig
from systolic.workloads.rl.envs import make_env
from systolic.workloads.rl.train import build_task

def tiny_pqn(*extra: str) -> RLConfig:
    return config_lib.from_dict(RLConfig, config_lib.apply_overrides({}, [*TINY_PQN, *extra]))


# TARGETS ----------------------------------------------------------------------------------------------------


def purejaxql_targets(rewards, q_next_obs, last_q, dones, gamma, lam):
    """purejaxql's `_get_target` recursion (pqn_gymnax.py), in NumPy: q_next_obs[t] = max Q(obs_{t+1}), which
    for the last step is last_q; `done` stops the recursion and bootstraps nothing."""
    T = len(rewards)
    targets = np.zeros_like(rewards)
    last_q = last_q * (1 - dones[-1])
    lambda_return = rewards[-1] + gamma * last_q
    targets[-1] = lambda_return
    next_q = last_q
    for t in range(T - 2, -1, -1):
        next_q = q_next_obs[t]  # max_a Q(s_{t+1}): purejaxql takes it from transition t+1's q_val
        bootstrap = rewards[t] + gamma * (1 - dones[t]) * next_q
        lambda_return = bootstrap + gamma * lam * (lambda_return - next_q)
        lambda_return = (1 - dones[t]) * lambda_return + dones[t] * rewards[t]
        targets[t] = lambda_return
    return targets


def test_targets_match_purejaxql_when_every_end_is_terminal():
    """With terminations only (no time limits), PQN's targets here and purejaxql's recursion agree."""
    rng = np.random.default_rng(0)
    T, N, gamma, lam = 12, 5, 0.99, 0.9
    rewards = rng.normal(size=(T, N)).astype(np.float32)
    next_q = rng.normal(size=(T, N)).astype(np.float32)
    terminated = rng.random((T, N)) < 0.2
    got = pqn.lambda_returns(jnp.asarray(rewards), jnp.asarray(next_q), jnp.asarray(terminated),
                             jnp.asarray(terminated), gamma=gamma, lam=lam)
    want = purejaxql_targets(rewards, next_q, next_q[-1], terminated.astype(np.float32), gamma, lam)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_targets_match_the_definition_with_truncations():
    """G_t = r_t + gamma (1 - term_t) [next_q_t if the episode or the rollout ends at t, else
    (1 - lam) next_q_t + lam G_{t+1}], by a plain loop."""
    rng = np.random.default_rng(1)
    T, N, gamma, lam = 16, 4, 0.95, 0.8
    rewards, next_q = rng.normal(size=(2, T, N)).astype(np.float32)
    terminated = rng.random((T, N)) < 0.15
    truncated = (rng.random((T, N)) < 0.15) & ~terminated
    done = terminated | truncated
    want = np.zeros((T, N))
    for t in reversed(range(T)):
        blend = np.where(done[t] | (t == T - 1), next_q[t], (1 - lam) * next_q[t] + lam * want[min(t + 1, T - 1)])
        want[t] = rewards[t] + gamma * (1 - terminated[t]) * blend
    got = pqn.lambda_returns(*map(jnp.asarray, (rewards, next_q, terminated, done)), gamma=gamma, lam=lam)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ending, expected_last_target", [
    ("truncated", 1.0 + 0.9 * 10.0),  # the time limit cut it: bootstrap from max Q of the pre-reset observation
    ("terminated", 1.0),  # a terminal state: no future
])
def test_truncation_bootstraps_and_termination_does_not(ending, expected_last_target):
    """An episode ends at step 1 of 3, then a new one runs on; the ended step's target must not see the new
    episode's returns (100) and bootstraps only on truncation. Values: next_q = 10 at the end."""
    rewards = jnp.asarray([[1.0], [1.0], [100.0]])
    next_q = jnp.asarray([[5.0], [10.0], [100.0]])
    terminated = jnp.asarray([[False], [ending == "terminated"], [False]])
    done = jnp.asarray([[False], [True], [False]])
    targets = pqn.lambda_returns(rewards, next_q, terminated, done, gamma=0.9, lam=0.5)
    assert float(targets[1, 0]) == pytest.approx(expected_last_target)
    # The step before blends its one-step bootstrap (5) with the ended step's target.
    assert float(targets[0, 0]) == pytest.approx(1.0 + 0.9 * (0.5 * 5.0 + 0.5 * expected_last_target))


def test_q_network_normalises_every_hidden_layer():
    cfg = tiny_pqn()
    spec = make_env(cfg.env).spec
    params = qnetwork.init_params(spec, cfg.model, key=jax.random.PRNGKey(0))
    assert set(params) == {"layers", "norms", "head"} and len(params["norms"]) == cfg.model.layers
    actor = pqn.make_act(cfg, make_env(cfg.env))
    actions, _ = actor.act(params, {}, jnp.ones((3, *spec.obs_shape)), actor.initial_carry((3,)))
    assert actions.shape == (3,) and actions.dtype == jnp.int32


def test_conv_q_network_matches_a_numpy_forward_pass():
    """MinAtar's Q-network (purejaxql's CNN): 3x3 VALID convolution, LayerNorm over channels, relu, flatten, then the
    LayerNorm MLP, against the same computation written out in NumPy from the parameters."""
    cfg = tiny_pqn("env.name=Breakout-MinAtar", "model.conv_channels=4", "model.layers=1", "model.activation=relu")
    spec = make_env(cfg.env).spec
    params = qnetwork.init_params(spec, cfg.model, key=jax.random.PRNGKey(0))
    kernel = np.asarray(params["conv"]["kernel"])
    assert kernel.shape == (3, 3, 4, 4)  # (kh, kw, C in, C out)
    obs = (np.random.default_rng(0).random((2, 5, 10, 10, 4)) < 0.2).astype(np.float32)  # (S, B, H, W, C)
    got = np.asarray(qnetwork.q_values(qnetwork.make_graphdef(spec, cfg.model), params, jnp.asarray(obs)))

    def layer_norm(x, p):
        mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + 1e-6) * np.asarray(p["scale"]) + np.asarray(p["bias"])

    x = obs.reshape(-1, 10, 10, 4)
    patches = np.stack([x[:, i:i + 8, j:j + 8] for i in range(3) for j in range(3)], axis=3)  # (B, 8, 8, 9, C)
    conv = np.einsum("bhwkc,kcd->bhwd", patches, kernel.reshape(9, 4, 4)) + np.asarray(params["conv"]["bias"])
    h = np.maximum(layer_norm(conv, params["conv_norm"]), 0).reshape(len(x), -1)  # (B, 8 * 8 * 4)
    dense = params["layers"][0]
    h = np.maximum(layer_norm(h @ np.asarray(dense["kernel"]) + np.asarray(dense["bias"]), params["norms"][0]), 0)
    want = h @ np.asarray(params["head"]["kernel"]) + np.asarray(params["head"]["bias"])
    np.testing.assert_allclose(got.reshape(-1, 3), want, rtol=1e-4, atol=1e-4)
    assert got.shape == (2, 5, 3)


def test_epsilon_decays_linearly_then_stays():
    cfg = tiny_pqn("pqn.eps_start=1.0", "pqn.eps_finish=0.1", "pqn.eps_decay=0.5", "rl.total_env_steps=1024")
    assert cfg.rl.num_updates == 16  # 1024 steps / (8 environments x 8 steps)
    epsilon = pqn.make_epsilon(cfg)  # over half the run: 8 updates
    assert [float(epsilon(jnp.int32(u))) for u in (0, 4, 8, 15)] == pytest.approx([1.0, 0.55, 0.1, 0.1])


# THROUGH THE ENGINE -----------------------------------------------------------------------------------------


def run_chunks(cfg, mesh, n):
    prepared = build_task(cfg, mesh)
    state, metrics = run_steps(prepared.task, n, mesh=mesh)
    return prepared, state, [{k: float(v) for k, v in m.items()} for m in metrics]


def test_sharded_run_matches_single_device_and_learning_moves(tiny_rl):
    _, state1, history1 = run_chunks(tiny_pqn(), tiny_rl.mesh(1), 2)
    prepared, state, history = run_chunks(tiny_pqn(), tiny_rl.mesh(2), 2)
    assert prepared.layout == "seeds"
    for got, want in zip(history, history1):
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=2e-4, atol=1e-5, err_msg=key)
    first = history1[0]
    assert {"loss", "q_value", "epsilon", "episode_return/seed0", "q_value/seed1"} <= first.keys()
    assert first["loss/seed0"] != first["loss/seed1"], "seeds are independent"
    assert history1[1]["epsilon"] < history1[0]["epsilon"] <= 1.0
    assert int(state1.extra["seeds"]["updates"][0]) == 4  # 2 chunks x 2 updates
    assert prepared.task.train_step._cache_size() == 1


def test_stop_and_resume_is_bit_exact(tiny_rl, tmp_path):
    cfg, mesh = tiny_pqn("observe.tensorboard=false", "observe.plot=false"), tiny_rl.mesh(1)
    prepared = build_task(cfg, mesh)

    def run(run_dir: Path, stop_at: int = 0) -> loop.RunResult:
        return tiny_rl.loop_run(prepared, cfg, run_dir, steps=4, stop_at=stop_at)

    with activate(mesh):
        straight = run(tmp_path / "straight")
        halfway = run(tmp_path / "resumed", stop_at=2)
        assert int(halfway.state.step) == 2
        fresh = prepared.task.init_state()
        assert not np.array_equal(np.asarray(jax.tree.leaves(halfway.state.params)[0]),
                                  np.asarray(jax.tree.leaves(fresh.params)[0]))
        resumed = run(tmp_path / "resumed")
    assert resumed.start_step == 2
    a, b = tiny_rl.train_records(tmp_path / "straight"), tiny_rl.train_records(tmp_path / "resumed")
    assert [r["step"] for r in b] == [1, 2, 3, 4] and a[3]["epsilon"] < a[0]["epsilon"]
    assert a == b, "Q-network, RAdam state, environments, exploration clock and RNG all resume exactly"
    for x, y in zip(jax.tree.leaves(straight.state), jax.tree.leaves(resumed.state)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert straight.eval_metrics == resumed.eval_metrics


@pytest.mark.parametrize("overrides, fragment", [
    (["pqn.num_minibatches=3"], "cannot be split into pqn.num_minibatches=3"),
    (["env.name=Pendulum-v1"], "needs discrete actions"),
    (["ppo.lr=0.1"], "has a 'ppo' section but algo=pqn"),
    (["pqn.q_lambda=1.5"], "pqn.q_lambda=1.5 is outside [0, 1]"),
    (["model.conv_channels=8"], "the convolution needs images (height, width, channels)"),  # CartPole's are flat
])
def test_config_errors_say_what_to_fix(tiny_rl, overrides, fragment):
    with pytest.raises(ConfigError, match="Fix") as info:
        build_task(tiny_pqn(*overrides), tiny_rl.mesh(1))
    assert fragment in str(info.value)


def test_a_ppo_config_has_no_pqn_keys_and_the_reverse(tiny_rl):
    ppo_tree = config_lib.to_dict(tiny_rl.config())
    pqn_tree = config_lib.to_dict(tiny_pqn())
    assert "ppo" in ppo_tree and "pqn" not in ppo_tree
    assert "pqn" in pqn_tree and "ppo" not in pqn_tree
    assert config_lib.from_dict(RLConfig, pqn_tree) == tiny_pqn()
    with pytest.raises(ConfigError, match="has a 'pqn' section but algo=ppo"):
        tiny_rl.config("pqn.lr=0.1")
