"""The rl programs gather as little as they can: on the TPU a gather's cost is per row, not per byte (PPO's shuffle,
six leaves gathered apart, took 63% of a 2,048-environment update there, and the action's log-probability, a
one-element gather, 17% in the loss and 4% in the rollout; benchmarks/peers/rl_profile.py, 2026-12-07). So the shuffle
moves narrow examples inside the sort that makes its order (no gather; 4x faster than one packed gather there),
gathers wide ones in one pass, and the chosen action's value is a select, exactly as before."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import TINY_GRU, TINY_PQN, TINY_RL

from systolic import config as config_lib
from systolic.workloads.rl.config import RLConfig
from systolic.workloads.rl.envs import make_env
from systolic.workloads.rl.optimization import SORT_CARRY_COLUMNS, random_order, shuffle_examples, take_examples
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


@pytest.mark.parametrize("width", [3, SORT_CARRY_COLUMNS + 1], ids=["sorted along", "gathered"])
def test_shuffle_examples_puts_every_leaf_in_random_order(width):
    """Both paths (examples of `width` + 4 words: moved by the sort, or gathered as rows) give exactly each leaf
    taken in their order (`random_order`, or `jax.random.permutation` as before the sort), bits and all."""
    key, n = jax.random.PRNGKey(3), 40
    data = {"obs": jax.random.normal(key, (2, n, width)),  # examples on axis 1
            "action": jnp.arange(n, dtype=jnp.int32), "done": jnp.arange(n) % 3 == 0,
            "half": jnp.arange(n, dtype=jnp.bfloat16), "value": jnp.full((n,), np.nan).at[1:].set(-0.0)}
    axes = {"obs": 1, "action": 0, "done": 0, "half": 0, "value": 0}
    shuffle = jax.jit(lambda data, key: shuffle_examples(data, axes, key))
    sorted_along = width + 4 <= SORT_CARRY_COLUMNS
    got = shuffle(data, key)
    order = random_order(key, n) if sorted_along else jax.random.permutation(key, n)
    assert sorted(np.asarray(order).tolist()) == list(range(n)) and (np.asarray(order) != np.arange(n)).any()
    for name, x in data.items():
        want = jnp.take(x, order, axis=axes[name])
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        np.testing.assert_array_equal(np.asarray(got[name]).view(np.uint8), np.asarray(want).view(np.uint8), name)
    text = shuffle.lower(data, key).as_text()
    assert text.count('"stablehlo.gather"') == (not sorted_along)
    assert text.count('"stablehlo.sort"') == 1


def test_random_order_draws_every_permutation_equally_often():
    """24,000 orders of 4: each of the 24 permutations ~1,000 times (chi-square, 23 degrees of freedom: the 99.99th
    percentile is 57.2)."""
    orders = np.asarray(jax.vmap(lambda k: random_order(k, 4))(jax.random.split(jax.random.PRNGKey(0), 24_000)))
    codes = orders @ np.array([64, 16, 4, 1])
    counts = np.array([np.sum(codes == c) for c in np.unique(codes)])
    assert len(counts) == 24
    assert np.sum((counts - 1000) ** 2 / 1000) < 57.2


def test_pick_equals_take_along_axis_with_its_gradient():
    values = jax.random.normal(jax.random.PRNGKey(0), (5, 7, 3))
    action = jax.random.randint(jax.random.PRNGKey(1), (5, 7), 0, 3)

    def take(v):
        return jnp.take_along_axis(v, action[..., None], axis=-1)[..., 0]

    np.testing.assert_array_equal(pick(values, action), take(values))
    np.testing.assert_array_equal(jax.grad(lambda v: (pick(v, action) ** 2).sum())(values),
                                  jax.grad(lambda v: (take(v) ** 2).sum())(values))


@pytest.mark.parametrize(("overrides", "gathers"), [(TINY_RL, 0), (TINY_GRU, 1), (TINY_PQN, 0)],
                         ids=["ppo", "ppo-gru", "pqn"])
def test_a_chunk_gathers_at_most_once_per_shuffle_and_never_scatters(overrides, gathers):
    """One seed's chunk, lowered (not compiled): PPO's and PQN's single steps move inside the shuffle's sort (no
    gather), the recurrent policy's whole environments in its one gather (inside the epochs' loop, so once in the
    text), and no scatter (take_along_axis's gradient). (DQN samples and writes its replay buffer by index: its
    gathers and scatters are the buffer.)"""
    cfg = config_lib.from_dict(RLConfig, config_lib.apply_overrides({}, list(overrides)))
    env = make_env(cfg.env)
    algorithm = algorithm_for(cfg, env)
    init, chunk = algorithm.make_seed_fns(cfg, env, algorithm.make_optimizer(cfg))
    key = jax.random.PRNGKey(0)
    text = jax.jit(chunk).lower(jax.eval_shape(init, key), key).as_text()
    assert text.count('"stablehlo.gather"') == gathers
    assert '"stablehlo.scatter"' not in text
