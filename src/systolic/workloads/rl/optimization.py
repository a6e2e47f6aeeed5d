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

    def cut(axis: int, x: jax.Array) -> jax.Array:
        x = x.reshape(*x.shape[:axis], minibatches, n // minibatches, *x.shape[axis + 1:])  # (..., M, n/M, ...)
        return x if axis == 0 else jnp.moveaxis(x, axis, 0)  # (M, ..., n/M, ...)

    def epoch(carry: Any, order: jax.Array) -> tuple[Any, Any]:
        shuffled = take_examples(data, leaf_axes, order)
        return jax.lax.scan(step, carry, jax.tree.map(cut, leaf_axes, shuffled))

    orders = jax.vmap(lambda k: jax.random.permutation(k, n))(jax.random.split(key, epochs))  # (epochs, n)
    return jax.lax.scan(epoch, carry, orders)


def take_examples(data: Any, leaf_axes: Any, order: jax.Array) -> Any:
    """Every leaf of `data` with its examples (along its axis in `leaf_axes`) in `order`, (n,) int. The leaves are
    gathered together: their bits side by side in one (n, columns) uint32 array (a column per element of an example,
    whatever its dtype up to 32 bits), one gather of whole rows, split again (exact). On the TPU a gather's cost is
    per row, not per byte: PPO's six leaves gathered apart took 63% of a 2,048-environment update there
    (benchmarks/rl_profile.py, 2026-12-07). 64-bit leaves are gathered on their own."""
    leaves, treedef = jax.tree.flatten(data)
    axes = jax.tree.leaves(leaf_axes)
    n = order.shape[0]
    rows = [jnp.moveaxis(x, axis, 0) for axis, x in zip(axes, leaves, strict=True)]  # each (n, ...)
    packed = [i for i, x in enumerate(rows) if x.dtype.itemsize <= 4]
    out = [None if i in packed else x[order] for i, x in enumerate(rows)]
    if packed:
        columns = [_bits(rows[i]).reshape(n, -1) for i in packed]  # (n, c_i) uint32
        taken = jnp.concatenate(columns, axis=1)[order]  # (n, sum c_i)
        start = 0
        for i, width in zip(packed, (c.shape[1] for c in columns), strict=True):
            out[i] = _from_bits(taken[:, start:start + width].reshape(rows[i].shape), rows[i].dtype)
            start += width
    return jax.tree.unflatten(treedef, [jnp.moveaxis(x, 0, axis) for axis, x in zip(axes, out, strict=True)])


_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _bits(x: jax.Array) -> jax.Array:
    """x's bits as uint32, element for element (bool as 0 or 1)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(x, _UNSIGNED[x.dtype.itemsize]).astype(jnp.uint32)


def _from_bits(bits: jax.Array, dtype: Any) -> jax.Array:
    if dtype == jnp.bool_:
        return bits != 0
    return jax.lax.bitcast_convert_type(bits.astype(_UNSIGNED[jnp.dtype(dtype).itemsize]), dtype)
