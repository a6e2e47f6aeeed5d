"""The generic train step (loss -> gradients, optionally accumulated -> optimizer update) and `jit_step`, which
guards and compiles every workload's step.

A workload supplies `loss_fn(params, batch, key) -> (loss, metrics)`; this module knows nothing else about it.
A state with frozen parameters (`TrainState.frozen`) passes them too, as `loss_fn(params, batch, key, frozen=...)`:
gradients, clipping and the optimizer then cover `params` alone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from systolic.config import LoopConfig
from systolic.engine.guard import guard_step
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


CHECKED = ("loss", "grad_norm")  # what the guard checks besides the parameters (grad_norm: every gradient)


def make_train_step(loss_fn: LossFn, tx: optax.GradientTransformation, schedule: optax.Schedule | None = None,
                    grad_accum: int = 1, loss_terms: Callable[[Any], jax.Array] | None = None,
                    ) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]:
    """Returns an un-jitted `train_step(state, batch) -> (state, metrics)`; `jit_step` guards and jits it.

    With `grad_accum` > 1 the step's loss and gradients combine the micro-batches': equally by default, which is
    the whole batch's mean when `loss_fn` is a mean over equally many terms per micro-batch. A loss that is a mean
    over a varying number of terms (tokens under a loss mask) passes `loss_terms(micro_batch) -> float32 scalar`,
    their number: each micro-batch then counts by its share of the terms, so the step's loss is the mean over all
    the batch's terms, exactly as without accumulation."""

    def train_step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        # Frozen parameters are an argument, not a closed-over constant, and outside what is differentiated: no
        # weight gradients are computed for them (only the activations' gradients flow through them).
        loss = functools.partial(loss_fn, frozen=state.frozen) if jax.tree.leaves(state.frozen) else loss_fn
        grad_fn = jax.value_and_grad(loss, has_aux=True)
        rng, step_key = jax.random.split(state.rng)
        if grad_accum == 1:
            (loss, metrics), grads = grad_fn(state.params, batch, step_key)
        else:
            micro = _split_micro(batch, grad_accum)
            keys = jax.random.split(step_key, grad_accum)
            zeros = jax.tree.map(jnp.zeros_like, state.params)

            def accumulate(carry, inputs):
                grads_sum, loss_sum, weight_sum = carry
                mb, key = inputs
                (loss, metrics), grads = grad_fn(state.params, mb, key)
                weight = jnp.ones((), jnp.float32) if loss_terms is None else loss_terms(mb)  # () float32
                grads_sum = jax.tree.map(lambda total, g: total + weight * g, grads_sum, grads)
                return (grads_sum, loss_sum + weight * loss, weight_sum + weight), metrics

            zero = jnp.zeros((), jnp.float32)
            (grads, loss, weight), metrics = jax.lax.scan(accumulate, (zeros, zero, zero), (micro, keys))
            weight = jnp.maximum(weight, 1.0)  # a batch with no loss terms at all: zero loss and gradients
            grads = jax.tree.map(lambda g: g / weight, grads)
            loss = loss / weight
            metrics = jax.tree.map(jnp.mean, metrics)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {**metrics, "loss": loss, "grad_norm": optax.tree.norm(grads)}
        if schedule is not None:
            metrics["lr"] = schedule(state.step)
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state, rng=rng)
        return new_state, metrics

    return train_step


def jit_step(step_fn: Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]], *, state_shardings: Any,
             batch_sharding: Any, mesh: Mesh, loop: LoopConfig, check: tuple[str, ...] | None,
             compiler_options: dict[str, Any] | None = None):
    """Every workload's step goes through here: the non-finite guard (engine/guard.py) around it, then `jit` with
    explicit shardings (the state comes back laid out as it went in, so the second call does not compile again)
    and the state donated (its buffers are reused for the new state)."""
    replicated = NamedSharding(mesh, P())
    return jax.jit(guard_step(step_fn, check=check, poison_step=loop.poison_step),
                   in_shardings=(state_shardings, batch_sharding), out_shardings=(state_shardings, replicated),
                   donate_argnums=0, compiler_options=compiler_options)
