"""The generic train step: loss -> gradients (optionally accumulated) -> optimizer update.

A workload supplies `loss_fn(params, batch, key) -> (loss, metrics)`; this module knows nothing else about it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from systolic.engine.state import TrainState

LossFn = Callable[[Any, Any, jax.Array], tuple[jax.Array, dict[str, jax.Array]]]


def _split_micro(batch: Any, accum: int) -> Any:
    """(B, ...) -> (accum, B/accum, ...) such that each device keeps its own rows.

    With B split over the data axes in contiguous blocks, reshaping to (B/accum, accum) keeps axis 0 split the same
    way; moving `accum` to the front is then a local transpose, where a plain (accum, B/accum) reshape would move
    rows between devices.
    """

    def split(x):
        x = x.reshape(x.shape[0] // accum, accum, *x.shape[1:])  # (B/A, A, ...)
        return jnp.moveaxis(x, 1, 0)  # (A, B/A, ...)

    return jax.tree.map(split, batch)


def make_train_step(loss_fn: LossFn, tx: optax.GradientTransformation, schedule: optax.Schedule | None = None,
                    grad_accum: int = 1) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]:
    """Returns an un-jitted `train_step(state, batch) -> (state, metrics)`; the caller jits it with shardings."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def train_step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        rng, step_key = jax.random.split(state.rng)
        if grad_accum == 1:
            (loss, metrics), grads = grad_fn(state.params, batch, step_key)
        else:
            micro = _split_micro(batch, grad_accum)
            keys = jax.random.split(step_key, grad_accum)
            zeros = jax.tree.map(jnp.zeros_like, state.params)

            def accumulate(carry, inputs):
                grads_sum, loss_sum = carry
                mb, key = inputs
                (loss, metrics), grads = grad_fn(state.params, mb, key)
                return (jax.tree.map(jnp.add, grads_sum, grads), loss_sum + loss), metrics

            (grads, loss), metrics = jax.lax.scan(accumulate, (zeros, jnp.zeros((), jnp.float32)), (micro, keys))
            grads = jax.tree.map(lambda g: g / grad_accum, grads)
            loss = loss / grad_accum
            metrics = jax.tree.map(jnp.mean, metrics)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {**metrics, "loss": loss, "grad_norm": optax.tree.norm(grads)}
        if schedule is not None:
            metrics["lr"] = schedule(state.step)
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state, rng=rng)
        return new_state, metrics

    return train_step
