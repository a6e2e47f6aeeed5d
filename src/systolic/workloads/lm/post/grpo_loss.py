"""GRPO's advantages and loss as TRL 1.16's `GRPOTrainer` computes them (`_generate_and_score_completions` and
`_compute_loss`, loss types grpo, dr_grpo and dapo, token-level importance sampling): pure functions of arrays, so a
test checks them against a NumPy reference and the train task composes them with the model's forward pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# TRL's constant: the group std's guard in the advantages' denominator (a group of equal rewards has std 0).
ADVANTAGE_EPS = 1e-4


def group_advantages(rewards: jax.Array, group_size: int, scale: str) -> jax.Array:
    """rewards (N,) float32 of N / group_size consecutive groups -> advantages (N,) float32: each reward minus its
    group's mean, divided by (its group's std + 1e-4) when `scale` is "group" (grpo.scale_rewards=none: not divided,
    Dr. GRPO). The std is the unbiased one (Bessel's n - 1, TRL's `nanstd`), so equal rewards give advantage 0."""
    grouped = rewards.reshape(-1, group_size)  # (N / G, G)
    mean = grouped.mean(axis=1, keepdims=True)  # (N / G, 1)
    advantages = grouped - mean  # (N / G, G)
    if scale == "group":
        std = jnp.sqrt(jnp.square(advantages).sum(axis=1, keepdims=True) / (group_size - 1))  # (N / G, 1)
        advantages = advantages / (std + ADVANTAGE_EPS)
    return advantages.reshape(-1)  # (N,)


def grpo_loss(logps: jax.Array, old_logps: jax.Array, ref_logps: jax.Array | None, advantages: jax.Array,
              mask: jax.Array, *, clip_eps: float, clip_eps_high: float, beta: float, loss: str,
              max_completion_len: int, kl_ratio_weighted: bool = True) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The clipped surrogate loss of a batch of completions () float32 and its metrics, as TRL 1.16 computes them.

    Args:
      logps: (B, T) float32, the policy's log-probabilities of the completion tokens (differentiated).
      old_logps: (B, T) float32, those of the policy that sampled them (equal to `logps` on the first of
        grpo.num_iterations updates, so the ratio is 1 there).
      ref_logps: (B, T) float32, the reference policy's (init.from); None when beta == 0.
      advantages: (B,) float32, from `group_advantages`.
      mask: (B, T) float32, 1 on completion tokens, 0 on padding.
      clip_eps, clip_eps_high: the ratio is clipped to [1 - clip_eps, 1 + (clip_eps_high or clip_eps)].
      beta: the k3 KL penalty's weight (0: none).
      loss: grpo (each completion's token mean, then the mean over completions), dr_grpo (the token sum over
        B * max_completion_len) or dapo (the token sum over the number of completion tokens in the batch).
      kl_ratio_weighted: TRL's use_bias_correction_kl (its default, True): the KL term times the importance ratio,
        whose gradient makes the KL's the unbiased reverse-KL gradient (DeepSeek-V3.2). Its value is unchanged
        where the ratio is 1; its gradient is not.

    dapo's denominator in TRL is the number of completion tokens in the whole generation batch (all processes and
    accumulation steps); here the batch under jit is global, so the sums run over all devices' tokens alike. With
    train.grad_accum > 1 the engine combines micro-batches by `loss_weight`, which keeps every normalisation exact.

    Metrics (TRL's names, means over completion tokens): clip_ratio/low_mean (ratio below 1 - clip_eps with a
    negative advantage), clip_ratio/high_mean (above 1 + eps_high with a positive one), clip_ratio/region_mean
    (either: the share of tokens whose gradient the clip removed) and, when beta > 0, kl.
    """
    eps_high = clip_eps_high or clip_eps
    live = mask > 0  # (B, T)
    # Padding positions hold whatever log-probabilities the forward pass gave them; their differences are zeroed
    # before exp, so an overflow there cannot turn into inf * 0 = NaN in the sums or in the gradient.
    log_ratio = jnp.where(live, logps - old_logps, 0.0)  # (B, T)
    ratio = jnp.exp(log_ratio)  # (B, T)
    adv = advantages[:, None]  # (B, 1)
    clipped = jnp.clip(ratio, 1 - clip_eps, 1 + eps_high)  # (B, T)
    per_token = -jnp.minimum(ratio * adv, clipped * adv)  # (B, T)

    def token_mean(x: jax.Array) -> jax.Array:  # over the batch's completion tokens, TRL's global_masked_mean
        return (x * mask).sum() / jnp.maximum(mask.sum(), 1.0)

    metrics = {}
    if beta != 0.0:
        ref_gap = jnp.where(live, ref_logps - logps, 0.0)  # (B, T)
        kl = jnp.exp(ref_gap) - ref_gap - 1  # (B, T), the k3 estimator of KL(policy || reference), >= 0
        if kl_ratio_weighted:
            kl = kl * ratio
        per_token = per_token + beta * kl
        metrics["kl"] = token_mean(kl)
    low = (ratio < 1 - clip_eps) & (adv < 0)  # (B, T)
    high = (ratio > 1 + eps_high) & (adv > 0)  # (B, T)
    metrics["clip_ratio/low_mean"] = token_mean(low.astype(jnp.float32))
    metrics["clip_ratio/high_mean"] = token_mean(high.astype(jnp.float32))
    metrics["clip_ratio/region_mean"] = token_mean((low | high).astype(jnp.float32))
    return normalise(per_token * mask, mask, loss, max_completion_len), metrics


def normalise(token_losses: jax.Array, mask: jax.Array, loss: str, max_completion_len: int) -> jax.Array:
    """token_losses (B, T) float32, zero off the mask -> the batch's loss () float32 under grpo.loss's normalisation."""
    if loss == "grpo":  # (B,) means over each completion's own tokens, then their mean: short completions weigh more
        return (token_losses.sum(axis=1) / jnp.maximum(mask.sum(axis=1), 1.0)).mean()
    if loss == "dr_grpo":  # a constant denominator: no length bias
        return token_losses.sum() / (token_losses.shape[0] * max_completion_len)
    assert loss == "dapo", loss  # GRPOConfig's Literal admits only the three
    return token_losses.sum() / jnp.maximum(mask.sum(), 1.0)  # every token weighs the same, wherever it is


def loss_weight(mask: jax.Array, loss: str) -> jax.Array:
    """What one micro-batch's `grpo_loss` counts for when train.grad_accum > 1 (engine/step.py's `loss_terms`),
    () float32: dapo's loss is a mean over tokens, so a micro-batch weighs its number of completion tokens; grpo's and
    dr_grpo's are means over completions (micro-batches hold equally many), so each weighs 1. The step's loss is then
    the whole batch's under the same normalisation, as TRL's accumulation gives it."""
    return mask.sum().astype(jnp.float32) if loss == "dapo" else jnp.ones((), jnp.float32)
