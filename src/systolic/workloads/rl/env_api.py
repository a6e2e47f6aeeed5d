"""What every environment adapter offers, and what the algorithms see of an environment: the interface `Env`, its
`EnvSpec` and one transition, `EnvStep` (envs.py explains the design: the explicit pre-reset observation, the reset
drawn by the caller, states as plain dicts of strongly typed arrays).

Its own module, below the adapters (envs.py for gymnax, brax_envs.py for Brax) and the algorithms, so that none of
them imports another to know the interface.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """What the policy and the run need to know about an environment."""

    name: str
    obs_shape: tuple[int, ...]
    discrete: bool
    action_dim: int  # discrete: number of actions; continuous: size of the action vector
    action_low: tuple[float, ...]  # continuous only: bounds the environment clips to
    action_high: tuple[float, ...]
    max_episode_steps: int

    @property
    def obs_size(self) -> int:
        size = 1
        for d in self.obs_shape:
            size *= d
        return size


class EnvStep(NamedTuple):
    """One transition of a (single, unbatched) environment; vmap the adapter's `step` for a batch."""

    obs: jax.Array  # the next observation to act on (a new episode's first one after a reset)
    state: dict[str, jax.Array]
    reward: jax.Array  # float32 ()
    terminated: jax.Array  # bool (): the episode reached a terminal state; do not bootstrap
    truncated: jax.Array  # bool (): the time limit cut the episode; bootstrap from final_obs
    final_obs: jax.Array  # the observation the transition really led to (pre-reset), for bootstrapping


class Env(Protocol):
    """What an environment adapter offers (one unbatched environment; vmap `reset` and `step` for a batch)."""

    spec: EnvSpec
    simulator: str  # as printed: "gymnax", "Brax"

    def reset(self, key: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]: ...

    def step(self, key: jax.Array, state: dict[str, jax.Array], action: jax.Array,
             reset: tuple[jax.Array, dict[str, jax.Array]]) -> EnvStep: ...


def strong_array(x: Any) -> jax.Array:
    """The same array without a weak type (envs.py says why): `astype` to its own dtype drops it."""
    x = jnp.asarray(x)
    return x.astype(x.dtype)


def as_obs(obs: jax.Array) -> jax.Array:
    return jnp.asarray(obs, jnp.float32)
