"""The optimizer: AdamW with warmup + cosine decay and global-norm clipping, built from `OptimConfig`; Adam's
moments stored in a chosen dtype (`scale_by_adam`)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
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


def scale_by_adam(*, b1: float, b2: float, eps: float, moment_dtype: Any = None) -> optax.GradientTransformation:
    """Adam's scaling (optax.scale_by_adam's numbers) with both moments stored in `moment_dtype` (None: each as its
    parameter). The arithmetic runs in float32 whatever the storage: each step reads the moments up to float32,
    updates them, computes the step from the float32 values, and rounds them back (to nearest) for storage.

    optax's `mu_dtype` covers only the first moment. The state is optax's `ScaleByAdamState`, so a checkpoint's tree
    is the same whichever dtype saved it (and the same as optax.adamw's, which lm runs saved before)."""

    def init(params):
        zeros = lambda p: jnp.zeros(p.shape, moment_dtype or p.dtype)  # noqa: E731
        return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=jax.tree.map(zeros, params),
                                      nu=jax.tree.map(zeros, params))

    def update(updates, state, params=None):
        del params
        up = lambda m, g: m.astype(jnp.promote_types(m.dtype, g.dtype))  # noqa: E731  # bfloat16 -> float32
        mu = jax.tree.map(lambda g, m: (1 - b1) * g + b1 * up(m, g), updates, state.mu)
        nu = jax.tree.map(lambda g, v: (1 - b2) * jnp.square(g) + b2 * up(v, g), updates, state.nu)
        count = optax.safe_increment(state.count)
        # Bias corrections in the default float (float32; float64 under x64, as optax's): b ** count in bfloat16
        # would round to 1 (and divide by 0) within a few steps.
        real = jnp.result_type(float)
        c1, c2 = (1 - jnp.asarray(b, real) ** count.astype(real) for b in (b1, b2))
        steps = jax.tree.map(lambda m, v: (m / c1.astype(m.dtype)) / (jnp.sqrt(v / c2.astype(v.dtype)) + eps), mu, nu)
        return steps, optax.ScaleByAdamState(count=count, mu=jax.tree.map(lambda m, o: m.astype(o.dtype), mu, state.mu),
                                             nu=jax.tree.map(lambda v, o: v.astype(o.dtype), nu, state.nu))

    return optax.GradientTransformation(init, update)


def adamw(cfg: OptimConfig, learning_rate: optax.ScalarOrSchedule, *, moment_dtype: Any = None
          ) -> optax.GradientTransformation:
    """optax.adamw (decay on matrices only, `decay_mask`), its moments stored in `moment_dtype` (None: as the
    parameters); the same chain, so the same state tree."""
    return optax.chain(
        scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, moment_dtype=moment_dtype),
        optax.add_decayed_weights(cfg.weight_decay, decay_mask),
        optax.scale_by_learning_rate(learning_rate),
    )


def make_optimizer(cfg: OptimConfig, schedule: optax.Schedule, *, moment_dtype: Any = None
                   ) -> optax.GradientTransformation:
    """Clipping of the global gradient norm, then AdamW at the rate lr(t) = `schedule(t)` (`make_schedule`: the one
    the train step also logs, built once by the caller)."""
    return standard_promotion(optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        adamw(cfg, schedule, moment_dtype=moment_dtype),
    ))
