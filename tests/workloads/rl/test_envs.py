"""The gymnax adapter: termination vs truncation, the pre-reset observation, spaces, and agreement with Gymnasium."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from systolic.errors import ConfigError
from systolic.workloads.rl.config import EnvConfig
from systolic.workloads.rl.env_api import Env
from systolic.workloads.rl.envs import make_env


def run(env: Env, actions, key=0):
    """Steps one environment through `actions`, resetting with fresh states; returns the list of EnvSteps."""
    key = jax.random.PRNGKey(key)
    key, sub = jax.random.split(key)
    obs, state = env.reset(sub)
    step = jax.jit(env.step)
    out = []
    for action in actions:
        key, step_key, reset_key = jax.random.split(key, 3)
        result = step(step_key, state, action, env.reset(reset_key))
        out.append((obs, result))
        obs, state = result.obs, result.state
    return out


def test_truncation_keeps_the_pre_reset_observation():
    env = make_env(EnvConfig(name="CartPole-v1", max_episode_steps=3))
    steps = run(env, [jnp.int32(i % 2) for i in range(4)])
    flags = [(bool(s.terminated), bool(s.truncated)) for _, s in steps]
    assert flags == [(False, False), (False, False), (False, True), (False, False)]
    _, third = steps[2]
    # The episode ended: the next observation is a new episode's first, the final one is where it really went.
    assert not np.allclose(third.obs, third.final_obs)
    assert int(third.state["time"]) == 0 and float(third.reward) == 1.0
    # Not done: the final observation is simply the next observation.
    _, first = steps[0]
    np.testing.assert_array_equal(first.obs, first.final_obs)


def test_termination_is_not_truncation():
    env = make_env(EnvConfig(name="CartPole-v1"))
    steps = run(env, [jnp.int32(1)] * 40)  # always push right: the pole falls within a few dozen steps
    ends = [i for i, (_, s) in enumerate(steps) if bool(s.terminated)]
    assert ends, "pushing one way always topples the pole"
    _, end = steps[ends[0]]
    assert not bool(end.truncated)
    assert abs(float(end.final_obs[2])) > 0.2 or abs(float(end.final_obs[0])) > 2.4  # past the angle/position limit


def test_spaces_and_strong_types():
    pendulum = make_env(EnvConfig(name="Pendulum-v1"))
    spec = pendulum.spec
    assert (spec.discrete, spec.action_dim, spec.action_low, spec.action_high, spec.obs_shape,
            spec.max_episode_steps) == (False, 1, (-2.0,), (2.0,), (3,), 200)
    cartpole = make_env(EnvConfig(name="CartPole-v1")).spec
    assert (cartpole.discrete, cartpole.action_dim, cartpole.obs_shape, cartpole.max_episode_steps) == (True, 2, (4,), 500)
    _, state = pendulum.reset(jax.random.PRNGKey(0))
    # gymnax starts `time` as a weakly typed Python int; a weak type would recompile the step after a restore.
    assert not any(x.weak_type for x in jax.tree.leaves(state))


def test_unknown_environment_names_the_close_one():
    with pytest.raises(ConfigError, match="Did you mean 'CartPole-v1'"):
        make_env(EnvConfig(name="Cartpole-v1"))


def test_gymnax_cartpole_follows_gymnasium_dynamics():
    """Same start state, same actions: gymnax's CartPole-v1 and Gymnasium's reference agree step for step."""
    gymnasium = pytest.importorskip("gymnasium")
    env = make_env(EnvConfig(name="CartPole-v1"))
    reference = gymnasium.make("CartPole-v1", disable_env_checker=True).unwrapped
    actions = [0, 1, 1, 0, 1, 0, 0, 1, 1, 1, 0, 1]
    steps = run(env, [jnp.int32(a) for a in actions], key=3)
    reference.reset(seed=0)
    reference.state = np.asarray(steps[0][0], np.float64)  # gymnax's start state
    for t, (_, s) in enumerate(steps):
        ref_obs, ref_reward, ref_terminated, _, _ = reference.step(actions[t])
        np.testing.assert_allclose(np.asarray(s.final_obs), ref_obs, rtol=1e-4, atol=1e-5)
        assert float(s.reward) == ref_reward and bool(s.terminated) == ref_terminated


@pytest.mark.parametrize("name, channels, actions", [("Breakout-MinAtar", 4, 3), ("SpaceInvaders-MinAtar", 6, 4),
                                                     ("Asterix-MinAtar", 4, 5), ("Freeway-MinAtar", 7, 3)])
def test_minatar_games_build_and_step(name, channels, actions):
    """gymnax's MinAtar suite behind the adapter: 10 x 10 binary images, a few discrete actions."""
    env = make_env(EnvConfig(name=name))
    assert (env.spec.obs_shape, env.spec.discrete, env.spec.action_dim) == ((10, 10, channels), True, actions)
    (obs, first), = run(env, [jnp.int32(0)])
    assert set(np.unique(np.asarray(obs))) <= {0.0, 1.0} and first.obs.dtype == jnp.float32


def test_brax_names_without_brax_ask_for_the_extra(monkeypatch):
    """Brax is optional: without it a brax/ name says how to install it, and gymnax environments still build."""
    for module in ("brax", "brax.envs"):
        monkeypatch.setitem(sys.modules, module, None)  # `import brax` now raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'systolic\[control\]'") as info:
        make_env(EnvConfig(name="brax/inverted_pendulum"))
    assert "Brax, an optional dependency, is not installed" in str(info.value)
    with pytest.raises(ConfigError, match=r"brax/<name>, after pip install 'systolic\[control\]'"):
        make_env(EnvConfig(name="Cartpole-v1"))
    assert make_env(EnvConfig(name="CartPole-v1")).spec.discrete
