"""The train state: one named pytree that holds everything a step changes and a checkpoint must keep."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """`params` and `opt_state` may be nested (a GAN keeps two of each); `extra` holds workload state that is
    neither (environment states, BatchNorm statistics, an EMA of the weights). `rng` is raw uint32 key data so
    Orbax stores it like any other array."""

    step: jax.Array  # int32 scalar: optimizer steps taken
    params: Any
    opt_state: Any
    rng: jax.Array  # uint32 (2,)
    extra: Any = dataclasses.field(default_factory=dict)

    def replace(self, **changes: Any) -> "TrainState":
        return dataclasses.replace(self, **changes)
