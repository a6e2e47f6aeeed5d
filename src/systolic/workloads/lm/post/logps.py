"""Log-probabilities of given tokens under the model: what DPO's and GRPO's losses are made of."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_logps(logits: jax.Array, targets: jax.Array, temperature: float = 1.0) -> jax.Array:
    """logits (B, T, V) float32, targets (B, T) int32 -> log p(target) (B, T) float32 under softmax(logits /
    temperature): GRPO's sampler draws from the tempered distribution, so its importance ratios compare those."""
    scaled = logits if temperature == 1.0 else logits / temperature  # (B, T, V)
    log_z = jax.nn.logsumexp(scaled, axis=-1)  # (B, T)
    return jnp.take_along_axis(scaled, targets[..., None], axis=-1)[..., 0] - log_z
