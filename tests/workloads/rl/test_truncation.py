"""Truncation vs termination, for every algorithm, through its real rollout and update.

A toy gymnax environment with one constant observation and reward 1 on every step: its episodes last exactly 5
steps, ended either by a terminal state or by the time limit alone. With gamma = 0.5 and one-step targets
(lambda = 0), the value the network converges to tells the two apart:
- the time limit only (truncation): the episode's future is cut, not ended, so every target bootstraps and the
  fixed point is V = Q = 1 + gamma V, that is 1 / (1 - gamma) = 2;
- a terminal state: 1 transition in 5 has the target 1 (nothing after it), the other 4 have 1 + gamma V, so the
  network's one value settles at V = 1 + gamma V 4/5, that is 5/3.
An algorithm that took a time limit for a terminal state would learn 5/3 in both cases; one that bootstrapped past
a terminal state would learn 2 in both.
"""

import gymnax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct
from gymnax.environments import environment, spaces
from tiny import TINY_DQN, TINY_PQN, TINY_RL, run_steps

from systolic import config as config_lib
from systolic.workloads.rl import policy, qnetwork
from systolic.workloads.rl.config import RLConfig
from systolic.workloads.rl.envs import make_env
from systolic.workloads.rl.train import build_task

EPISODE_STEPS = 5
GAMMA = 0.5
EXPECTED = {"truncated": 1 / (1 - GAMMA), "terminated": 1 / (1 - GAMMA * (EPISODE_STEPS - 1) / EPISODE_STEPS)}


@struct.dataclass
class ToyState(environment.EnvState):
    pass


class ConstantReward(environment.Environment):
    """Observation [1.0] and reward 1 at every step, 2 actions that change nothing; the episode ends after 5 steps,
    in a terminal state (`terminates`) or by the time limit alone."""

    def __init__(self, terminates: bool):
        super().__init__()
        self.terminates = terminates

    @property
    def default_params(self) -> environment.EnvParams:
        # A terminal episode never meets its (longer) time limit; a truncated one has no terminal state.
        return environment.EnvParams(max_steps_in_episode=10 * EPISODE_STEPS if self.terminates else EPISODE_STEPS)

    def step_env(self, key, state, action, params):
        state = ToyState(time=state.time + 1)
        terminated = jnp.logical_and(self.terminates, state.time >= EPISODE_STEPS)
        return jnp.ones((1,)), state, jnp.float32(1.0), terminated, {}

    def reset_env(self, key, params):
        return jnp.ones((1,)), ToyState(time=jnp.int32(0))

    def action_space(self, params=None):
        return spaces.Discrete(2)

    def observation_space(self, params):
        return spaces.Box(0.0, 1.0, (1,), jnp.float32)


for _ending in ("terminated", "truncated"):
    if f"ConstantReward-{_ending}" not in gymnax.registered_envs:
        gymnax.register(f"ConstantReward-{_ending}",
                        lambda terminates=_ending == "terminated": ConstantReward(terminates))

# Each algorithm's tiny config with one-step targets, gamma 0.5 and enough updates for the one value to settle
# (the learning rate decays to 0, so the end is not a noisy step).
RUN = ["rl.total_env_steps=8192", "rl.updates_per_chunk=128", "model.layers=1"]
CONFIGS = {
    "ppo": [*TINY_RL, *RUN, "ppo.gamma=0.5", "ppo.gae_lambda=0", "ppo.lr=3e-3", "ppo.anneal_lr=true",
            "ppo.clip_value=false"],
    "pqn": [*TINY_PQN, *RUN, "pqn.gamma=0.5", "pqn.q_lambda=0", "pqn.lr=3e-3", "pqn.anneal_lr=true"],
    "dqn": [*TINY_DQN, *RUN, "dqn.gamma=0.5", "dqn.lr=3e-3", "dqn.anneal_lr=true", "dqn.learning_starts=0",
            "dqn.target_update_every=64", "dqn.gradient_steps=4", "dqn.batch_size=64"],
}


def learned_value(algo: str, ending: str, mesh) -> jax.Array:
    """(S,) each seed's value of the one observation after training: V for PPO, max_a Q for PQN and DQN."""
    cfg = config_lib.from_dict(RLConfig, config_lib.apply_overrides(
        {}, [*CONFIGS[algo], f"env.name=ConstantReward-{ending}", "env.max_episode_steps=0"]))
    prepared = build_task(cfg, mesh)
    state, _ = run_steps(prepared.task, cfg.rl.num_chunks, mesh=mesh)
    spec, obs = prepared.env.spec, jnp.ones((1, 1))
    if algo == "ppo":
        graphdef = policy.make_graphdef(spec, cfg.model)
        return jax.vmap(lambda p: policy.value(graphdef, p, obs, 1)[0])(state.params)
    graphdef = qnetwork.make_graphdef(spec, cfg.model)
    return jax.vmap(lambda p: qnetwork.q_values(graphdef, p, obs)[0].max())(state.params)


def test_the_toy_environment_ends_as_declared():
    for ending in ("terminated", "truncated"):
        env = make_env(config_lib.from_dict(RLConfig, {"env": {"name": f"ConstantReward-{ending}"}}).env)
        obs, state = env.reset(jax.random.PRNGKey(0))
        flags = []
        for _ in range(EPISODE_STEPS):
            step = env.step(jax.random.PRNGKey(1), state, jnp.int32(0), env.reset(jax.random.PRNGKey(2)))
            flags.append((bool(step.terminated), bool(step.truncated)))
            obs, state = step.obs, step.state
        assert flags[:-1] == [(False, False)] * (EPISODE_STEPS - 1)
        assert flags[-1] == ((True, False) if ending == "terminated" else (False, True))
        assert int(state["time"]) == 0  # a new episode


@pytest.mark.parametrize("algo", ["ppo", "pqn", "dqn"])
def test_time_limits_bootstrap_and_terminal_states_do_not(algo, tiny_rl):
    mesh = tiny_rl.mesh(1)
    for ending in ("truncated", "terminated"):
        values = learned_value(algo, ending, mesh)
        assert jnp.allclose(values, EXPECTED[ending], atol=0.05), (algo, ending, values.tolist(), EXPECTED[ending])


def test_recurrent_ppo_bootstraps_a_truncated_step_with_the_episode_s_memory():
    """Recurrent PPO (ppo_rnn.py) on the truncated toy episodes: every episode sees the same constant observation,
    so only the GRU's memory tells its steps apart. A truncated step's bootstrap value must be the value of its
    final observation seen with the memory of the 5 steps before it, computed here by replaying the episode from
    zeros, not the next episode's first value (zero memory); and the next episode starts with zero memory."""
    from systolic.workloads.rl import ppo, ppo_rnn, recurrent

    cfg = config_lib.from_dict(RLConfig, config_lib.apply_overrides(
        {}, [*TINY_RL, "model.gru_size=8", "env.name=ConstantReward-truncated", "env.max_episode_steps=0"]))
    env = make_env(cfg.env)
    graphdef = recurrent.make_graphdef(env.spec, cfg.model)
    state = ppo_rnn.make_init(cfg, env, ppo.make_optimizer(cfg))(jax.random.PRNGKey(0))
    _, traj = jax.jit(ppo_rnn.make_rollout(cfg, env))(state, jax.random.PRNGKey(1))  # 8 steps: 5 + 3
    assert traj.done[:, 0].tolist() == [False] * 4 + [True] + [False] * 3 and not traj.terminated.any()
    next_values = ppo_rnn.bootstrap_values(graphdef, state.params, traj, 1)  # (T, N)

    obs = jnp.ones((cfg.rl.num_envs, 1))
    hidden = jnp.zeros((cfg.rl.num_envs, cfg.model.gru_size))
    for _ in range(EPISODE_STEPS):  # the episode, replayed step by step from zero memory
        hidden, _, _ = recurrent.step(graphdef, state.params, hidden, obs, 1)
    _, _, want = recurrent.step(graphdef, state.params, hidden, obs, 1)  # V(final observation | the episode's memory)
    np.testing.assert_allclose(next_values[EPISODE_STEPS - 1], want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(want, traj.value[EPISODE_STEPS], atol=1e-4), "memory changes the value here"
    # Elsewhere the bootstrap is the next step's own value; and the new episode forgot the old one.
    not_done = ~np.asarray(traj.done[:-1])
    np.testing.assert_allclose(np.asarray(next_values[:-1])[not_done], np.asarray(traj.value[1:])[not_done],
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(traj.next_hidden[EPISODE_STEPS:], traj.next_hidden[:8 - EPISODE_STEPS], atol=1e-6)
