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


def nonfinite_report(loss: jax.Array, grads: Any) -> tuple[jax.Array, jax.Array]:
    """(loss and gradients all finite?, index of the first non-finite gradient leaf, -1 when there is none).

    Two scalars, fetched with the other metrics at the next log step: the guard adds no host sync per step.
    """
    flags = jnp.stack([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)])  # (leaves,)
    grads_ok = flags.all()
    return grads_ok & jnp.isfinite(loss), jnp.where(grads_ok, -1, jnp.argmin(flags)).astype(jnp.int32)


def make_train_step(loss_fn: LossFn, tx: optax.GradientTransformation, schedule: optax.Schedule | None = None,
                    grad_accum: int = 1, poison_step: int = 0
                    ) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]:
    """Returns an un-jitted `train_step(state, batch) -> (state, metrics)`; the caller jits it with shardings.

    An update whose loss or gradients are not finite is discarded inside the step (parameters and optimizer
    state stay as they were); the loop decides on the host, from `finite`/`nonfinite_at`, whether to halt or go
    on. `poison_step` > 0 makes that step's loss NaN, to test this path end to end.
    """

    def train_step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        def poisoned(params, batch, key):
            loss, metrics = loss_fn(params, batch, key)
            if poison_step:
                loss = loss * jnp.where(state.step + 1 == poison_step, jnp.nan, 1.0)
            return loss, metrics

        grad_fn = jax.value_and_grad(poisoned, has_aux=True)
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
        finite, nonfinite_at = nonfinite_report(loss, grads)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
        params, opt_state = keep(params, state.params), keep(opt_state, state.opt_state)
        metrics = {**metrics, "loss": loss, "grad_norm": optax.tree.norm(grads), "finite": finite,
                   "nonfinite_at": nonfinite_at}
        if schedule is not None:
            metrics["lr"] = schedule(state.step)
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state, rng=rng)
        return new_state, metrics

    return train_step
