"""The train state: one named pytree that holds everything a step changes and a checkpoint must keep."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """`params` and `opt_state` may be nested (a GAN keeps two of each); `extra` holds workload state that is
    neither (environment states, BatchNorm statistics, an EMA of the weights). `rng` is raw uint32 key data so
    Orbax stores it like any other array.

    `frozen` holds parameters that the step reads but never trains (a LoRA run's base weights): they get no
    gradients and no optimizer state, and checkpoints leave them out, so the workload's `init_state` must rebuild
    them identically on every call (from a source run or a seed); a resumed run takes them from there."""

    step: jax.Array  # int32 scalar: optimizer steps taken
    params: Any
    opt_state: Any
    rng: jax.Array  # uint32 (2,)
    extra: Any = dataclasses.field(default_factory=dict)
    frozen: Any = dataclasses.field(default_factory=dict)

    def replace(self, **changes: Any) -> "TrainState":
        return dataclasses.replace(self, **changes)


def param_count(params: Any) -> int:
    """Scalars in a pytree of parameters (arrays, ShapeDtypeStructs, or an `nnx.State` of them): what every
    workload reports as its parameter count, and what `systolic plan` sizes."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(params))


@dataclasses.dataclass(frozen=True)
class ShardedState:
    """A train state that is born sharded: what every workload builds before its loop starts."""

    init: Callable[[], TrainState]  # computes the initial state on the mesh (compiled once, at XLA:CPU level 0)
    abstract: TrainState  # ShapeDtypeStructs carrying the target shardings: restore and AOT target
    shardings: TrainState


def make_sharded_state(make_state: Callable[..., TrainState], args: tuple[Any, ...],
                       shardings: Callable[[TrainState], TrainState],
                       context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> ShardedState:
    """`make_state(*args)` traced once for shapes; `shardings(shapes)` gives each leaf's NamedSharding; `context`
    (e.g. the mesh and logical-axis rules) is entered for tracing and for the init itself."""
    from systolic.runtime.cpu_tuning import compile_once
    from systolic.runtime.sharding import with_shardings

    with context():
        shapes = jax.eval_shape(make_state, *args)
    target = shardings(shapes)
    jitted = jax.jit(make_state, out_shardings=target)

    def init() -> TrainState:
        with context():
            return compile_once(jitted, *args)(*args)

    return ShardedState(init=init, abstract=with_shardings(shapes, target), shardings=target)


def optimizer_shardings(opt_state: Any, param_shardings: Any, default: Any) -> Any:
    """The shardings of an optimizer state: each leaf laid out as the parameter it belongs to, the one whose whole
    key path ends the leaf's (Adam's `...mu['blocks'][0]['attn']['wq']` is `params['blocks'][0]['attn']['wq']`'s),
    `default` for the rest (step counts, coefficients). Unlike `optax.tree_map_params` this sees through
    `optax.partition`'s masked states, whose trees hold placeholders where the other partition's parameters are."""
    is_sharding = lambda x: isinstance(x, jax.sharding.Sharding)  # noqa: E731
    flat = jax.tree_util.tree_flatten_with_path(param_shardings, is_leaf=is_sharding)[0]
    by_path = {tuple(path): s for path, s in flat}

    def leaf_sharding(path, _):
        return next((by_path[tuple(path[i:])] for i in range(len(path)) if tuple(path[i:]) in by_path), default)

    return jax.tree_util.tree_map_with_path(leaf_sharding, opt_state)
