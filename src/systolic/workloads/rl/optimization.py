"""How the rl algorithms optimise: one optimizer factory, and epochs of shuffled minibatches.

PPO (feed-forward and recurrent) and PQN update their networks the same way: `update_epochs` passes over the
update's rollout, each a fresh random order of its examples (single steps, or a recurrent policy's whole
environments) cut into equal minibatches, one optimizer step each. DQN samples its minibatches from the replay
buffer instead and only shares the optimizer factory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from systolic.optim.adamw import standard_promotion


def make_optimizer(rule: Callable[[optax.ScalarOrSchedule], optax.GradientTransformation], *, lr: float,
                   max_grad_norm: float, anneal_steps: int) -> optax.GradientTransformation:
    """`rule(learning_rate)` (optax.adam, optax.radam, ...) after global-norm clipping at `max_grad_norm`. With
    `anneal_steps` > 0 the learning rate decays linearly from `lr` to 0 over that many optimizer steps; with 0 it
    stays `lr`."""
    rate = optax.linear_schedule(lr, 0.0, anneal_steps) if anneal_steps else lr
    return standard_promotion(optax.chain(optax.clip_by_global_norm(max_grad_norm), rule(rate)))


def shuffled_epochs(step: Callable[[Any, Any], tuple[Any, Any]], carry: Any, data: Any, *, key: jax.Array,
                    epochs: int, minibatches: int, axes: Any = 0) -> tuple[Any, Any]:
    """`epochs` passes of `step(carry, minibatch) -> (carry, out)` over `data`, each a fresh random order of its n
    examples cut into `minibatches` equal minibatches, scanned in turn.

    The examples lie along axis `axes` of every leaf of `data` (an int for all, or a tree of ints that is a prefix
    of `data`'s): a leaf (..., n, ...) gives minibatches (M, ..., n/M, ...). Returns the last carry and the outs,
    stacked (epochs, M, ...).
    """
    leaf_axes = jax.tree.map(lambda axis, part: jax.tree.map(lambda _: axis, part), axes, data)
    sizes = {x.shape[axis] for axis, x in zip(jax.tree.leaves(leaf_axes), jax.tree.leaves(data), strict=True)}
    assert len(sizes) == 1, f"the leaves of `data` hold different numbers of examples: {sizes}"
    n = sizes.pop()

    def cut(axis: int, x: jax.Array, order: jax.Array) -> jax.Array:
        x = x[(slice(None),) * axis + (order,)]  # the examples in this epoch's order
        x = x.reshape(*x.shape[:axis], minibatches, n // minibatches, *x.shape[axis + 1:])  # (..., M, n/M, ...)
        return x if axis == 0 else jnp.moveaxis(x, axis, 0)  # (M, ..., n/M, ...)

    def epoch(carry: Any, order: jax.Array) -> tuple[Any, Any]:
        return jax.lax.scan(step, carry, jax.tree.map(lambda axis, x: cut(axis, x, order), leaf_axes, data))

    orders = jax.vmap(lambda k: jax.random.permutation(k, n))(jax.random.split(key, epochs))  # (epochs, n)
    return jax.lax.scan(epoch, carry, orders)
