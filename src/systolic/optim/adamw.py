"""The optimizer: AdamW with warmup + cosine decay and global-norm clipping, built from `OptimConfig`."""

from __future__ import annotations

import jax
import optax

from systolic.config import OptimConfig

# Optax mixes Python floats with int32 step counts (`b1 ** count` in Adam's bias correction, `count / steps` in
# the schedules), which jax's strict dtype promotion (on in our tests) rejects. That code is optax's, not ours, so
# only optax's calls run under standard promotion; our own code stays checked.


def standard_promotion(tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """`tx` with its `init` and `update` run under jax's standard dtype promotion (see above)."""

    def init(params):
        with jax.numpy_dtype_promotion("standard"):
            return tx.init(params)

    def update(updates, state, params=None, **extra_args):
        with jax.numpy_dtype_promotion("standard"):
            return tx.update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(init, update)


def standard_promotion_schedule(schedule: optax.Schedule) -> optax.Schedule:
    """`schedule` run under jax's standard dtype promotion (see above)."""

    def run(count):
        with jax.numpy_dtype_promotion("standard"):
            return schedule(count)

    return run


def make_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    return standard_promotion_schedule(optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=cfg.lr * cfg.min_lr_ratio,
    ))


def decay_mask(params):
    """Weight decay on matrices only: decaying norm scales and biases pulls them towards 0 and hurts."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    return standard_promotion(optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(
            make_schedule(cfg, total_steps),
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=decay_mask,
        ),
    ))
