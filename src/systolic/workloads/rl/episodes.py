"""Episodes: the training returns a chunk reports, and evaluation (one seed's deterministic policy for whole episodes
in parallel, in one jitted scan)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from systolic.workloads.rl.algorithm import Actor
from systolic.workloads.rl.env_api import Env


def make_episode_fn(env: Env, actor: Actor, episodes: int):
    """`run(params, seed_extra, key) -> (returns (E,), lengths (E,))`: `actor` (an algorithm's deterministic policy,
    algorithm.py) for `episodes` full episodes in parallel, each cut at the environment's time limit."""
    spec = env.spec

    def run(params: Any, seed_extra: Any, key: jax.Array) -> tuple[jax.Array, jax.Array]:
        reset_key, key = jax.random.split(key)
        obs, env_state = jax.vmap(env.reset)(jax.random.split(reset_key, episodes))

        def body(carry, step_keys):
            obs, env_state, memory, total, length, alive = carry
            action, memory = actor.act(params, seed_extra, obs, memory)
            # Each episode counts until its first end; what follows is ignored, so no reset (of the environment or
            # the policy's memory) is needed.
            step = jax.vmap(env.step)(step_keys, env_state, action, (obs, env_state))
            total = total + jnp.where(alive, step.reward, 0.0)
            length = length + alive.astype(jnp.int32)
            alive = alive & ~(step.terminated | step.truncated)
            return (step.obs, step.state, memory, total, length, alive), None

        init = (obs, env_state, actor.initial_carry((episodes,)), jnp.zeros((episodes,)),
                jnp.zeros((episodes,), jnp.int32), jnp.ones((episodes,), bool))
        step_keys = jax.random.split(key, (spec.max_episode_steps, episodes))  # (T, E, 2)
        (_, _, _, total, length, _), _ = jax.lax.scan(body, init, step_keys)
        return total, length

    return run


def record_finished(state: Any, return_sum: jax.Array, length_sum: jax.Array,
                    episodes: jax.Array) -> tuple[Any, jax.Array]:
    """A chunk's training episodes -> (state with `last_return`/`last_length` the mean return and length of the
    episodes that finished in it, number finished). The sums and counts are per update, (U,); a chunk in which no
    episode finished keeps the previous values."""
    n = episodes.sum()
    per_episode = lambda total: total.astype(jnp.float32) / jnp.maximum(n, 1).astype(jnp.float32)  # noqa: E731
    return state._replace(last_return=jnp.where(n > 0, per_episode(return_sum.sum()), state.last_return),
                          last_length=jnp.where(n > 0, per_episode(length_sum.sum()), state.last_length)), n
