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

    def epoch(carry: Any, key: jax.Array) -> tuple[Any, Any]:
        shuffled = shuffle_examples(data, leaf_axes, key)
        return jax.lax.scan(step, carry, jax.tree.map(cut, leaf_axes, shuffled))

    return jax.lax.scan(epoch, carry, jax.random.split(key, epochs))


# On the TPU a sort moving a few 32-bit columns beats a gather of rows: at 8 x 262,144 PPO examples of 9 columns, one
# sort carrying them took 12.5 ms, a permutation and one gather of the packed rows 6.4 + 47.6 ms (the gather's cost is
# per row, ~23 ns; a sort's grows with its operands; v5e, 2026-12-07: docs/benchmarks-history.md, the rl shuffle as a
# sort). Wider examples (image observations, a recurrent policy's whole environments) are gathered as rows. The bound
# is an estimate from that one width (the 11-operand sort at ~1.1 ms an operand reaches the gather's 48 ms near 40
# operands), not measured at others.
SORT_CARRY_COLUMNS = 32


def random_order(key: jax.Array, n: int) -> jax.Array:
    """A uniformly random permutation of range(n), (n,) int32: iota sorted by 64 random bits a position (two uint32
    keys, so ties, which a stable sort would leave in order, have probability ~n^2 / 2^65). `shuffle_examples(..., key)`
    puts narrow examples in exactly this order."""
    return _sorted_by_random_keys(key, [jnp.arange(n, dtype=jnp.int32)])[0]


def _sorted_by_random_keys(key: jax.Array, columns: list[jax.Array]) -> list[jax.Array]:
    """The (n,) `columns` moved together into the order of 64 random bits a position drawn from `key`."""
    high, low = jax.random.bits(key, (2, columns[0].shape[0]), jnp.uint32)
    return list(jax.lax.sort((high, low, *columns), num_keys=2)[2:])


def shuffle_examples(data: Any, leaf_axes: Any, key: jax.Array) -> Any:
    """Every leaf of `data` with its examples (along its axis in `leaf_axes`) in a random order drawn from `key`,
    exact for any dtype (bits move, not values). Examples of up to SORT_CARRY_COLUMNS 32-bit words travel inside the
    sort that makes the order, `random_order(key, n)`, a column per operand; wider ones, few (a recurrent policy's
    environments), in one gather of whole rows (as `take_examples`) in `jax.random.permutation(key, n)`'s order."""
    columns, unpack = _as_columns(data, leaf_axes)  # (n, C) uint32
    n, width = columns.shape
    if width > SORT_CARRY_COLUMNS:
        return unpack(columns[jax.random.permutation(key, n)])
    moved = _sorted_by_random_keys(key, [columns[:, j] for j in range(width)])  # C of (n,)
    return unpack(jnp.stack(moved, axis=1))


def take_examples(data: Any, leaf_axes: Any, order: jax.Array) -> Any:
    """Every leaf of `data` with its examples (along its axis in `leaf_axes`) in `order`, (n,) int. The leaves are
    gathered together: their bits side by side in one (n, columns) uint32 array, one gather of whole rows, split
    again (exact). On the TPU a gather's cost is per row, not per byte: PPO's six leaves gathered apart took 63% of
    a 2,048-environment update there (benchmarks/peers/rl_profile.py, 2026-12-07)."""
    columns, unpack = _as_columns(data, leaf_axes)
    return unpack(columns[order])


def _as_columns(data: Any, leaf_axes: Any) -> tuple[jax.Array, Callable[[jax.Array], Any]]:
    """`data`'s examples as rows of bits: (n, C) uint32, a column per 32 bits of an example whatever its leaves'
    dtypes, and the function that splits such an (n, C) array back into `data`'s leaves, shapes and dtypes."""
    leaves, treedef = jax.tree.flatten(data)
    axes = jax.tree.leaves(leaf_axes)
    rows = [jnp.moveaxis(x, axis, 0) for axis, x in zip(axes, leaves, strict=True)]  # each (n, ...)
    columns = [_bits(x) for x in rows]  # (n, c_i) uint32

    def unpack(packed: jax.Array) -> Any:
        out, start = [], 0
        for x, c in zip(rows, columns, strict=True):
            out.append(_from_bits(packed[:, start:start + c.shape[1]], x.shape, x.dtype))
            start += c.shape[1]
        return jax.tree.unflatten(treedef, [jnp.moveaxis(x, 0, axis) for axis, x in zip(axes, out, strict=True)])

    return jnp.concatenate(columns, axis=1), unpack


_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _bits(x: jax.Array) -> jax.Array:
    """(n, ...) -> (n, c) uint32: an example's bits, a column per element up to 32 bits (bool as 0 or 1), two per
    64-bit element."""
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    elif x.dtype.itemsize == 8:
        bits = jax.lax.bitcast_convert_type(x, jnp.uint32)  # (..., 2)
    else:
        bits = jax.lax.bitcast_convert_type(x, _UNSIGNED[x.dtype.itemsize]).astype(jnp.uint32)
    return bits.reshape(x.shape[0], -1)


def _from_bits(bits: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """The inverse of `_bits`: (n, c) uint32 -> `shape` of `dtype`."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bool_:
        return (bits != 0).reshape(shape)
    if dtype.itemsize == 8:
        return jax.lax.bitcast_convert_type(bits.reshape(*shape, 2), dtype)
    return jax.lax.bitcast_convert_type(bits.astype(_UNSIGNED[dtype.itemsize]).reshape(shape), dtype)
