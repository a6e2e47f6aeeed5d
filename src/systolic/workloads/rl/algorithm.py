"""The rl workload's algorithms as declared records: what train.py, the evaluator and the CLI need of each.

An algorithm is pure functions of one seed, which train.py vmaps over seeds and jits:
- `make_optimizer(cfg) -> optax.GradientTransformation`;
- `make_seed_fns(cfg, env, tx) -> (init(key) -> SeedState, chunk(SeedState, key) -> (SeedState, metrics))`, a chunk
  being `rl.updates_per_chunk` updates in one `lax.scan`; `metrics` is a NamedTuple of per-seed scalars holding
  `metric_names`, `episode_return`, `episode_length` and `episodes`;
- `make_act(cfg, env) -> act(params, seed_extra, obs) -> action`: the deterministic policy (argmax, Gaussian mean)
  that evaluation runs, `seed_extra` being what the seed carries besides its parameters (PPO: observation
  statistics; DQN: its target network and replay buffer, which acting ignores).
Every SeedState has `params`, `opt_state` and the per-environment fields `ENV_FIELDS`; its other fields are
per-seed values (train.py stores the three groups in the TrainState).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

ENV_FIELDS = ("env_state", "obs", "episode_return", "episode_length")  # (N, ...) per seed: split like environments


@dataclasses.dataclass(frozen=True)
class Algorithm:
    name: str  # as printed: "PPO"
    make_optimizer: Callable[..., Any]
    make_seed_fns: Callable[..., tuple[Callable, Callable]]
    make_act: Callable[..., Callable]
    seed_state: type  # the NamedTuple one seed carries
    metric_names: tuple[str, ...]  # logged as the mean over seeds
    per_seed_metrics: tuple[str, ...]  # also logged per seed, `<name>/seed<i>`
    nonfinite_advice: str


_MODULES = {"ppo": "systolic.workloads.rl.ppo", "pqn": "systolic.workloads.rl.pqn", "dqn": "systolic.workloads.rl.dqn"}


def get(name: str) -> Algorithm:
    """The algorithm `algo` names (the config's Literal allows only these)."""
    return importlib.import_module(_MODULES[name]).ALGORITHM
