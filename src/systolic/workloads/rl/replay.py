"""A uniform replay buffer held on the device: a fixed-size circular store of transitions, written by the jitted loop.

Flashbax's flat buffer in semantics (purejaxrl's DQN uses that one): `add` writes a batch of transitions at the
write position, wrapping round and overwriting the oldest once full; `sample` draws a batch uniformly, with
replacement, from the transitions written so far. Written by us as three pure functions on a `ReplayBuffer`, a
named pytree of fixed-shape arrays, so the buffer lives inside the train state: it is vmapped over seeds with the
rest, sharded with it, and saved in (and restored from) every checkpoint like any other array, so a resumed run
samples exactly what an uninterrupted one would.

Unlike flashbax's, which stores a sequence and pairs each step with the next one, a stored transition carries its
own `next_obs`: the observation the step really led to, before any automatic reset, so a transition cut by a time
limit can bootstrap from it (envs.py).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class ReplayBuffer(NamedTuple):
    data: dict[str, jax.Array]  # each (capacity, ...)
    position: jax.Array  # () int32: where the next transition goes
    size: jax.Array  # () int32: how many slots hold a transition (capacity once full)


def init_buffer(capacity: int, example: dict[str, jax.Array]) -> ReplayBuffer:
    """An empty buffer of `capacity` transitions shaped like `example` (one unbatched transition)."""
    data = {name: jnp.zeros((capacity, *x.shape), x.dtype) for name, x in example.items()}
    return ReplayBuffer(data=data, position=jnp.zeros((), jnp.int32), size=jnp.zeros((), jnp.int32))


def add(buffer: ReplayBuffer, batch: dict[str, jax.Array]) -> ReplayBuffer:
    """Writes a batch of B transitions (each leaf (B, ...)), oldest first; B must not exceed the capacity (the
    config checks), or one batch would write some slots twice."""
    capacity = capacity_of(buffer)
    count = jax.tree.leaves(batch)[0].shape[0]
    slots = (buffer.position + jnp.arange(count, dtype=jnp.int32)) % capacity  # (B,)
    data = {name: buffer.data[name].at[slots].set(batch[name]) for name in buffer.data}
    return ReplayBuffer(data=data, position=(buffer.position + count) % capacity,
                        size=jnp.minimum(buffer.size + count, capacity))


def sample(buffer: ReplayBuffer, batch_size: int, *, key: jax.Array) -> dict[str, jax.Array]:
    """`batch_size` transitions drawn uniformly with replacement from the filled slots (each leaf (batch_size, ...)).
    The buffer must hold at least one transition."""
    slots = jax.random.randint(key, (batch_size,), 0, jnp.maximum(buffer.size, 1), jnp.int32)  # (batch_size,)
    return {name: x[slots] for name, x in buffer.data.items()}


def capacity_of(buffer: ReplayBuffer) -> int:
    return jax.tree.leaves(buffer.data)[0].shape[0]
