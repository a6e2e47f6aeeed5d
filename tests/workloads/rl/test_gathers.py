"""The rl programs gather as little as they can: on the TPU a gather's cost is per row, not per byte (PPO's shuffle,
six leaves gathered apart, took 63% of a 2,048-environment update there, and the action's log-probability, a
one-element gather, 17% in the loss and 4% in the rollout; benchmarks/rl_profile.py, 2026-12-07). So the shuffle
gathers every leaf in one pass and the chosen action's value is a select, exactly as before."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import TINY_GRU, TINY_PQN, TINY_RL

from systolic import config as config_lib
from systolic.workloads.rl.config import RLConfig
from systolic.workloads.rl.envs import make_env
from systolic.workloads.rl.optimization import take_examples
from systolic.workloads.rl.policy import pick
from systolic.workloads.rl.train import algorithm_for


def test_take_examples_equals_a_take_of_each_leaf():
    key = jax.random.PRNGKey(0)
    data = {"obs": jax.random.normal(key, (3, 12, 4)),  # examples on axis 1, as ppo_rnn's sequences
            "action": jnp.arange(12, dtype=jnp.int32),
            "done": jnp.arange(12) % 3 == 0,
            "hidden": jnp.arange(-12.0, 12.0).reshape(12, 2).astype(jnp.bfloat16),
            "pixels": jnp.arange(12 * 5, dtype=jnp.uint8).reshape(12, 5),
            "value": jnp.asarray([np.nan, -0.0, np.inf, *range(9)], jnp.float32)}  # bits, not values, move
    axes = {"obs": 1, "action": 0, "done": 0, "hidden": 0, "pixels": 0, "value": 0}
    order = jax.random.permutation(key, 12)
    got = jax.jit(lambda data, order: take_examples(data, axes, order))(data, order)
    assert jax.jit(lambda data, order: take_examples(data, axes, order)).lower(data, order).as_text().count(
        '"stablehlo.gather"') == 1
    for name, x in data.items():
        want = jnp.take(x, order, axis=axes[name])
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        np.testing.assert_array_equal(np.asarray(got[name]).view(np.uint8), np.asarray(want).view(np.uint8), name)


def test_pick_equals_take_along_axis_with_its_gradient():
    values = jax.random.normal(jax.random.PRNGKey(0), (5, 7, 3))
    action = jax.random.randint(jax.random.PRNGKey(1), (5, 7), 0, 3)

    def take(v):
        return jnp.take_along_axis(v, action[..., None], axis=-1)[..., 0]

    np.testing.assert_array_equal(pick(values, action), take(values))
    np.testing.assert_array_equal(jax.grad(lambda v: (pick(v, action) ** 2).sum())(values),
                                  jax.grad(lambda v: (take(v) ** 2).sum())(values))


@pytest.mark.parametrize("overrides", [TINY_RL, TINY_GRU, TINY_PQN], ids=["ppo", "ppo-gru", "pqn"])
def test_a_chunk_gathers_once_per_shuffle_and_never_scatters(overrides):
    """One seed's chunk, lowered (not compiled): the shuffle's one gather (inside the epochs' loop, so once in the
    text) and no scatter (take_along_axis's gradient). (DQN samples and writes its replay buffer by index: its
    gathers and scatters are the buffer.)"""
    cfg = config_lib.from_dict(RLConfig, config_lib.apply_overrides({}, list(overrides)))
    env = make_env(cfg.env)
    algorithm = algorithm_for(cfg, env)
    init, chunk = algorithm.make_seed_fns(cfg, env, algorithm.make_optimizer(cfg))
    key = jax.random.PRNGKey(0)
    text = jax.jit(chunk).lower(jax.eval_shape(init, key), key).as_text()
    assert text.count('"stablehlo.gather"') == 1
    assert '"stablehlo.scatter"' not in text
