"""DPO's arithmetic, as TRL 1.16's `DPOTrainer._compute_loss` does it: sequence log-probabilities of packed rows, the
sigmoid, IPO and robust losses, and the metrics under TRL's names. Pure functions of arrays; the model's forward
passes and the train state are dpo_task.py's.

A pair's log-probability ratio to the reference is log pi(y|x) - log pi_ref(y|x), each the sum over the
completion's tokens (TRL's default, no length normalisation). With delta = ratio(chosen) - ratio(rejected):

- sigmoid (Rafailov et al. 2023): -log sigmoid(beta * delta).
- ipo (Azar et al. 2023): (ratio(chosen) / |chosen| - ratio(rejected) / |rejected| - 1 / (2 beta))^2: TRL divides
  each ratio by its completion's length in tokens (confirmed with the IPO authors, its comment says), so beta
  means the same for long and short completions.
- robust (Chowdhury et al. 2024): (-(1 - eps) log sigmoid(beta delta) + eps log sigmoid(-beta delta)) / (1 - 2 eps)
  with eps = label_smoothing, unbiased under a share eps of flipped labels.

The loss is the mean over the batch's pairs. Rewards are beta * ratio (TRL's implicit rewards).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from systolic.workloads.lm.config import DPOConfig


def sequence_sums(values: jax.Array, sequence: jax.Array, pairs: int) -> jax.Array:
    """values (B, T) float32 of targets, sequence (B, T) int32 (the sequence of the row a target scores, -1: none)
    -> (B, pairs, 2) float32: each pair slot's (chosen, rejected) sum. Per row, so the batch axis keeps its
    sharding."""
    slots = 2 * pairs
    index = jnp.where(sequence < 0, slots, sequence)  # (B, T): slot `slots` collects what no sequence owns

    def row(v, i):  # (T,), (T,) -> (slots + 1,)
        return jax.ops.segment_sum(v, i, num_segments=slots + 1)

    sums = jax.vmap(row)(values, index)[:, :slots]  # (B, 2 * pairs)
    return sums.reshape(sums.shape[0], pairs, 2)  # (B, pairs, 2): slot 2k chosen, 2k + 1 rejected


def pair_losses(policy: jax.Array, reference: jax.Array, lengths: jax.Array, cfg: DPOConfig) -> jax.Array:
    """Each pair's loss (...) float32 from the policy's and the reference's sequence log-probabilities (..., 2)
    (chosen, rejected) and the completions' lengths in tokens (..., 2)."""
    ratios = policy - reference  # (..., 2)
    delta = ratios[..., 0] - ratios[..., 1]  # (...)
    if cfg.loss == "sigmoid":
        return -jax.nn.log_sigmoid(cfg.beta * delta)
    if cfg.loss == "ipo":
        per_token = ratios / jnp.maximum(lengths, 1.0)  # (..., 2)
        return jnp.square(per_token[..., 0] - per_token[..., 1] - 1 / (2 * cfg.beta))
    eps = cfg.label_smoothing  # robust
    return ((-(1 - eps) * jax.nn.log_sigmoid(cfg.beta * delta) + eps * jax.nn.log_sigmoid(-cfg.beta * delta))
            / (1 - 2 * eps))


def masked_mean(x: jax.Array, valid: jax.Array) -> jax.Array:
    """The mean of x over the pairs where `valid` (same shape, float32) is 1; 0 for none. Under jit it runs over
    the global batch, so every device divides by the same count."""
    return (x * valid).sum() / jnp.maximum(valid.sum(), 1.0)


def reward_metrics(policy: jax.Array, reference: jax.Array, valid: jax.Array, beta: float) -> dict[str, jax.Array]:
    """TRL's `rewards/*` and `logps/*` (means over the valid pairs) from (B, K, 2) sequence log-probabilities."""
    rewards = beta * (policy - reference)  # (B, K, 2)
    chosen, rejected = rewards[..., 0], rewards[..., 1]  # (B, K) each
    return {
        "rewards/chosen": masked_mean(chosen, valid),
        "rewards/rejected": masked_mean(rejected, valid),
        "rewards/accuracies": masked_mean((chosen > rejected).astype(jnp.float32), valid),
        "rewards/margins": masked_mean(chosen - rejected, valid),
        "logps/chosen": masked_mean(policy[..., 0], valid),
        "logps/rejected": masked_mean(policy[..., 1], valid),
    }


def logit_metrics(mean_logits: jax.Array, lengths: jax.Array) -> dict[str, jax.Array]:
    """TRL's `logits/chosen` and `logits/rejected`: the logits' mean over the vocabulary, averaged over the batch's
    chosen (rejected) completion tokens. `mean_logits` (B, K, 2) are their sums per sequence, `lengths` (B, K, 2)
    the token counts."""
    totals, counts = mean_logits.sum(axis=(0, 1)), lengths.sum(axis=(0, 1))  # (2,) each
    per_token = totals / jnp.maximum(counts, 1.0)
    return {"logits/chosen": per_token[0], "logits/rejected": per_token[1]}
