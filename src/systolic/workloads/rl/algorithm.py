"""The rl workload's algorithms as declared records: what train.py, the evaluator and the CLI need of each.

An algorithm is pure functions of one seed, which train.py vmaps over seeds and jits:
- `make_optimizer(cfg) -> optax.GradientTransformation`;
- `make_seed_fns(cfg, env, tx) -> (init(key) -> SeedState, chunk(SeedState, key) -> (SeedState, metrics))`, a chunk
  being `rl.updates_per_chunk` updates in one `lax.scan`; `metrics` is a NamedTuple of per-seed scalars holding
  `metric_names`, `episode_return`, `episode_length` and `episodes`;
- `make_act(cfg, env) -> Actor`: the deterministic policy (argmax, Gaussian mean) that evaluation runs,
  `act(params, seed_extra, obs, carry) -> (action, carry)`, `seed_extra` being what the seed carries besides its
  parameters (PPO: observation statistics; DQN: its target network and replay buffer, which acting ignores) and
  `carry` the policy's memory of the episode so far (a GRU's hidden state; size 0 for a feed-forward policy). An
  episode starts from `Actor.initial_carry`; a caller that starts a new episode in a slot resets its carry.
Every SeedState has `params`, `opt_state` and the per-environment fields `env_fields`; its other fields are
per-seed values (train.py stores the three groups in the TrainState).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

ENV_FIELDS = ("env_state", "obs", "episode_return", "episode_length")  # (N, ...) per seed: split like environments


class Actor(NamedTuple):
    """A deterministic policy with memory: `act(params, seed_extra, obs (..., *obs_shape), carry (..., C)) ->
    (action (...), carry (..., C))`."""

    act: Callable[[Any, Any, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]
    carry_size: int  # C; 0 for a policy without memory

    def initial_carry(self, batch_shape: tuple[int, ...]) -> jax.Array:
        """The carry at an episode's start, (*batch_shape, C) zeros."""
        return jnp.zeros((*batch_shape, self.carry_size), jnp.float32)


def feed_forward(act: Callable[[Any, Any, jax.Array], jax.Array]) -> Actor:
    """The Actor of a policy without memory, `act(params, seed_extra, obs) -> action`: its carry is empty."""
    return Actor(act=lambda params, seed_extra, obs, carry: (act(params, seed_extra, obs), carry), carry_size=0)


@dataclasses.dataclass(frozen=True)
class Algorithm:
    name: str  # as printed: "PPO"
    make_optimizer: Callable[..., Any]
    make_seed_fns: Callable[..., tuple[Callable, Callable]]
    make_act: Callable[..., Actor]
    seed_state: type  # the NamedTuple one seed carries
    metric_names: tuple[str, ...]  # logged as the mean over seeds
    per_seed_metrics: tuple[str, ...]  # also logged per seed, `<name>/seed<i>`
    nonfinite_advice: str
    env_fields: tuple[str, ...] = ENV_FIELDS  # the seed state's per-environment fields


_MODULES = {"ppo": "systolic.workloads.rl.ppo", "pqn": "systolic.workloads.rl.pqn", "dqn": "systolic.workloads.rl.dqn"}


def get(name: str, *, recurrent: bool = False) -> Algorithm:
    """The algorithm `algo` names (the config's Literal allows only these); `recurrent` (model.gru_size > 0, which
    the config allows for PPO only) picks PPO's recurrent variant."""
    module = "systolic.workloads.rl.ppo_rnn" if recurrent else _MODULES[name]
    return importlib.import_module(module).ALGORITHM
