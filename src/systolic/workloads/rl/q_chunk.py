"""What the Q-learning algorithms (PQN, DQN) share: epsilon-greedy decay, a chunk of updates scanned, and its
per-seed metrics."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax

from systolic.optim.adamw import standard_promotion_schedule
from systolic.workloads.rl import episodes as episodes_lib


class ChunkMetrics(NamedTuple):  # per seed, scalars
    loss: jax.Array  # the TD loss 0.5 (Q(s, a) - G)^2, mean over the chunk's updates
    q_value: jax.Array  # mean Q(s, a) the chunk's updates saw
    epsilon: jax.Array  # the exploration rate of the chunk's last update
    episode_return: jax.Array  # mean over the episodes that finished in this chunk (else the previous value)
    episode_length: jax.Array
    episodes: jax.Array  # how many finished


def epsilon_schedule(section: Any, num_updates: int) -> optax.Schedule:
    """Update count -> exploration rate: linear from section.eps_start to section.eps_finish over section.eps_decay
    of the run's `num_updates` updates, then constant."""
    decay_updates = max(1, round(section.eps_decay * num_updates))
    return standard_promotion_schedule(optax.linear_schedule(section.eps_start, section.eps_finish, decay_updates))


def make_chunk(update: Callable, updates_per_chunk: int) -> Callable:
    """`chunk(state, key) -> (state, ChunkMetrics)`: `updates_per_chunk` calls of `update(state, key) -> (state,
    (loss, q_value, epsilon, finished returns' sum, finished lengths' sum, episodes finished))`. A chunk in which no
    episode finished keeps the previous return and length (state.last_return, state.last_length)."""

    def chunk(state: Any, key: jax.Array) -> tuple[Any, ChunkMetrics]:
        state, (losses, q_values, eps, return_sum, length_sum, episodes) = jax.lax.scan(
            update, state, jax.random.split(key, updates_per_chunk))
        state, n = episodes_lib.record_finished(state, return_sum, length_sum, episodes)
        metrics = ChunkMetrics(loss=losses.mean(), q_value=q_values.mean(), epsilon=eps[-1],
                               episode_return=state.last_return, episode_length=state.last_length, episodes=n)
        return state, metrics

    return chunk
