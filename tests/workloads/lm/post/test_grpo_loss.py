"""GRPO's advantages and loss (post/grpo_loss.py) against a float64 NumPy reference written from TRL 1.16's
`GRPOTrainer` code, and against TRL's own `_compute_loss` run on the same tensors."""

import collections
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from systolic.workloads.lm.post.grpo_loss import group_advantages, grpo_loss, loss_weight

LOSSES = ("grpo", "dr_grpo", "dapo")
GROUP = 3
MAX_LEN = 6  # max_completion_len; the batch's completions are padded to T = 5 of them


def make_batch(seed: int = 0) -> dict[str, np.ndarray]:
    """Two groups of 3 completions of lengths 5, 3, 1, 4, 2, 5 (then padding), old and reference log-probabilities
    far enough from the policy's that the ratio leaves [0.8, 1.28] on both sides: clipping is active."""
    rng = np.random.default_rng(seed)
    logps = rng.uniform(-4.0, -0.1, (6, 5))  # (B, T)
    mask = (np.arange(5)[None, :] < np.array([5, 3, 1, 4, 2, 5])[:, None]).astype(np.float64)  # (B, T)
    return {"logps": logps, "old_logps": logps + rng.normal(0.0, 0.4, (6, 5)),
            "ref_logps": logps + rng.normal(0.0, 0.5, (6, 5)), "rewards": np.array([1.0, 0.0, 0.5, 2.0, 2.0, -1.0]),
            "mask": mask}


def reference_advantages(rewards: np.ndarray, group_size: int, scale: str) -> np.ndarray:
    grouped = rewards.reshape(-1, group_size)
    advantages = grouped - grouped.mean(axis=1, keepdims=True)
    if scale == "group":  # TRL's nanstd is Bessel-corrected; its epsilon 1e-4
        advantages = advantages / (grouped.std(axis=1, ddof=1, keepdims=True) + 1e-4)
    return advantages.reshape(-1)


def reference_loss(logps, old_logps, ref_logps, advantages, mask, *, clip_eps, eps_high, beta, loss, max_len):
    """TRL 1.16's `_compute_loss` for token-level importance sampling, use_bias_correction_kl (its default), one
    process, no accumulation, in float64 NumPy."""
    ratio = np.exp(logps - old_logps)
    adv = advantages[:, None]
    per_token = -np.minimum(ratio * adv, np.clip(ratio, 1 - clip_eps, 1 + eps_high) * adv)
    metrics = {}
    if beta:
        kl = (np.exp(ref_logps - logps) - (ref_logps - logps) - 1) * ratio
        per_token = per_token + beta * kl
        metrics["kl"] = (kl * mask).sum() / mask.sum()
    if loss == "grpo":
        value = ((per_token * mask).sum(-1) / np.maximum(mask.sum(-1), 1.0)).mean()
    elif loss == "dr_grpo":
        value = (per_token * mask).sum() / (per_token.shape[0] * max_len)
    else:
        value = (per_token * mask).sum() / max(mask.sum(), 1.0)
    low, high = (ratio < 1 - clip_eps) & (adv < 0), (ratio > 1 + eps_high) & (adv > 0)
    for name, hit in (("low", low), ("high", high), ("region", low | high)):
        metrics[f"clip_ratio/{name}_mean"] = (hit * mask).sum() / mask.sum()
    return value, metrics


def ours(batch, advantages, *, beta, loss, clip_eps=0.2, clip_eps_high=0.28):
    f32 = {k: jnp.asarray(v, jnp.float32) for k, v in batch.items()}
    return grpo_loss(f32["logps"], f32["old_logps"], f32["ref_logps"] if beta else None,
                     jnp.asarray(advantages, jnp.float32), f32["mask"], clip_eps=clip_eps, clip_eps_high=clip_eps_high,
                     beta=beta, loss=loss, max_completion_len=MAX_LEN)


@pytest.mark.parametrize("scale", ["group", "none"])
def test_group_advantages_match_the_reference(scale):
    rewards = np.array([1.0, 0.0, 0.5, 2.0, 2.0, 2.0, 0.3, -1.0, 4.0])
    got = group_advantages(jnp.asarray(rewards, jnp.float32), GROUP, scale)
    np.testing.assert_allclose(np.asarray(got), reference_advantages(rewards, GROUP, scale), rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(got)[3:6] == 0.0)  # equal rewards: no advantage


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss", LOSSES)
def test_loss_matches_the_float64_reference(loss, beta):
    batch = make_batch()
    advantages = reference_advantages(batch["rewards"], GROUP, "group")
    value, metrics = ours(batch, advantages, beta=beta, loss=loss)
    want, want_metrics = reference_loss(batch["logps"], batch["old_logps"], batch["ref_logps"], advantages,
                                        batch["mask"], clip_eps=0.2, eps_high=0.28, beta=beta, loss=loss,
                                        max_len=MAX_LEN)
    np.testing.assert_allclose(float(value), want, rtol=1e-5, atol=1e-7)
    assert set(metrics) == set(want_metrics)
    for name, v in want_metrics.items():
        np.testing.assert_allclose(float(metrics[name]), v, rtol=1e-5, atol=1e-7, err_msg=name)
    # The case exercises what it claims: both clips bite, on some tokens only.
    assert 0 < want_metrics["clip_ratio/low_mean"] and 0 < want_metrics["clip_ratio/high_mean"]
    assert want_metrics["clip_ratio/region_mean"] < 1


def test_the_three_normalisations_differ_on_this_batch():
    batch = make_batch()
    advantages = reference_advantages(batch["rewards"], GROUP, "group")
    values = {loss: float(ours(batch, advantages, beta=0.0, loss=loss)[0]) for loss in LOSSES}
    assert len({round(v, 6) for v in values.values()}) == 3, values


def test_clip_eps_high_zero_means_symmetric_clipping():
    batch = make_batch()
    advantages = reference_advantages(batch["rewards"], GROUP, "group")
    value, metrics = ours(batch, advantages, beta=0.0, loss="dapo", clip_eps_high=0.0)
    want, want_metrics = reference_loss(batch["logps"], batch["old_logps"], None, advantages, batch["mask"],
                                        clip_eps=0.2, eps_high=0.2, beta=0.0, loss="dapo", max_len=MAX_LEN)
    np.testing.assert_allclose(float(value), want, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["clip_ratio/high_mean"]), want_metrics["clip_ratio/high_mean"])


@pytest.mark.parametrize("loss", LOSSES)
def test_a_group_of_equal_rewards_contributes_zero_gradient(loss):
    batch = make_batch()
    batch["rewards"] = np.array([0.7, 0.7, 0.7, 2.0, 0.0, -1.0])
    advantages = jnp.asarray(group_advantages(jnp.asarray(batch["rewards"], jnp.float32), GROUP, "group"))
    f32 = {k: jnp.asarray(v, jnp.float32) for k, v in batch.items()}

    def loss_of(logps, beta):
        return grpo_loss(logps, f32["old_logps"], f32["ref_logps"], advantages, f32["mask"], clip_eps=0.2,
                         clip_eps_high=0.0, beta=beta, loss=loss, max_completion_len=MAX_LEN)[0]

    grad = np.asarray(jax.grad(loss_of)(f32["logps"], 0.0))  # (B, T)
    assert np.all(grad[:GROUP] == 0.0)
    assert np.any(grad[GROUP:] != 0.0)  # the other group's tokens do move (those whose ratio is clipped do not)
    assert np.all(grad[batch["mask"] == 0] == 0.0)  # padding never does
    # The KL penalty still pulls the equal group towards the reference: that term is not the rewards'.
    assert np.any(np.asarray(jax.grad(loss_of)(f32["logps"], 0.04))[:GROUP] != 0.0)


def test_padding_positions_cannot_turn_the_loss_into_nan():
    """A padding position's log-probabilities far apart (exp of their gap overflows float32) change nothing."""
    batch = make_batch()
    advantages = reference_advantages(batch["rewards"], GROUP, "group")
    clean = ours(batch, advantages, beta=0.04, loss="dapo")[0]
    pad = batch["mask"] == 0
    batch["logps"] = np.where(pad, -200.0, batch["logps"])
    batch["ref_logps"] = np.where(pad, 0.0, batch["ref_logps"])
    batch["old_logps"] = np.where(pad, -400.0, batch["old_logps"])
    dirty = ours(batch, advantages, beta=0.04, loss="dapo")[0]
    assert float(dirty) == float(clean)


@pytest.mark.parametrize("loss", LOSSES)
def test_micro_batches_weighted_by_loss_weight_give_the_whole_batch_loss(loss):
    """What engine/step.py does with `loss_terms` when train.grad_accum > 1: the weighted mean of the micro-batches'
    losses and gradients is the whole batch's, although the halves hold different numbers of tokens."""
    batch = make_batch()
    advantages = jnp.asarray(reference_advantages(batch["rewards"], GROUP, "group"), jnp.float32)
    f32 = {k: jnp.asarray(v, jnp.float32) for k, v in batch.items()}

    def loss_of(logps, rows):
        return grpo_loss(logps[rows], f32["old_logps"][rows], f32["ref_logps"][rows], advantages[rows],
                         f32["mask"][rows], clip_eps=0.2, clip_eps_high=0.28, beta=0.04, loss=loss,
                         max_completion_len=MAX_LEN)[0]

    whole, whole_grad = jax.value_and_grad(loss_of)(f32["logps"], slice(None))
    halves = (slice(0, 3), slice(3, 6))
    weights = [loss_weight(f32["mask"][rows], loss) for rows in halves]
    parts = [jax.value_and_grad(loss_of)(f32["logps"], rows) for rows in halves]
    total = sum(w * v for w, (v, _) in zip(weights, parts, strict=True)) / sum(weights)
    np.testing.assert_allclose(float(total), float(whole), rtol=1e-6)
    grad = np.concatenate([np.asarray(w * g[rows]) for w, (_, g), rows in zip(weights, parts, halves, strict=True)])
    np.testing.assert_allclose(grad / float(sum(weights)), np.asarray(whole_grad), rtol=1e-5, atol=1e-8)


# TRL ITSELF ---------------------------------------------------------------------------------------------------


def trl_compute_loss(batch, advantages, *, beta, loss, clip_eps=0.2, clip_eps_high=0.28):
    """TRL's own `GRPOTrainer._compute_loss` on these tensors: the trainer's model call returns the given
    log-probabilities, and a stand-in `self` carries the settings it reads (one process, no accumulation)."""
    torch = pytest.importorskip("torch")
    trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    logps = torch.tensor(batch["logps"], dtype=torch.float32, requires_grad=True)
    mask = torch.tensor(batch["mask"], dtype=torch.float32)
    b, t = mask.shape
    accelerator = types.SimpleNamespace(num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x)
    args = types.SimpleNamespace(delta=None, use_bias_correction_kl=True, steps_per_generation=1)
    trainer = types.SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token", loss_type=loss,
        epsilon_low=clip_eps, epsilon_high=clip_eps_high or clip_eps, beta=beta, args=args, use_vllm=False,
        model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=1, accelerator=accelerator,
        max_completion_length=MAX_LEN, _entropy_bonus_enabled=False, aux_loss_enabled=False,
        _metrics=collections.defaultdict(lambda: collections.defaultdict(list)),
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None))
    inputs = {"prompt_ids": torch.zeros((b, 1), dtype=torch.long), "prompt_mask": torch.ones((b, 1)),
              "completion_ids": torch.zeros((b, t), dtype=torch.long), "completion_mask": mask,
              "advantages": torch.tensor(advantages, dtype=torch.float32),
              "old_per_token_logps": torch.tensor(batch["old_logps"], dtype=torch.float32),
              "ref_per_token_logps": torch.tensor(batch["ref_logps"], dtype=torch.float32),
              "num_items_in_batch": mask.sum()}
    value = trl_grpo.GRPOTrainer._compute_loss(trainer, None, inputs)
    value.backward()
    return float(value.detach()), logps.grad.numpy(), {k: v[0] for k, v in trainer._metrics["train"].items()}


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss", LOSSES)
def test_loss_gradient_and_metrics_equal_trls(loss, beta):
    batch = make_batch(seed=1)
    advantages = reference_advantages(batch["rewards"], GROUP, "group")
    want, want_grad, want_metrics = trl_compute_loss(batch, advantages, beta=beta, loss=loss)
    f32 = {k: jnp.asarray(v, jnp.float32) for k, v in batch.items()}

    def loss_of(logps):
        return grpo_loss(logps, f32["old_logps"], f32["ref_logps"], jnp.asarray(advantages, jnp.float32),
                         f32["mask"], clip_eps=0.2, clip_eps_high=0.28, beta=beta, loss=loss,
                         max_completion_len=MAX_LEN)

    (value, metrics), grad = jax.value_and_grad(loss_of, has_aux=True)(f32["logps"])
    np.testing.assert_allclose(float(value), want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5, atol=1e-7)
    for name, v in metrics.items():
        np.testing.assert_allclose(float(v), want_metrics[name], rtol=1e-5, atol=1e-7, err_msg=name)
    assert ("kl" in metrics) == bool(beta)


def test_group_advantages_equal_trls_formula():
    """TRL's lines (sum_then_normalize, scale_rewards=group) with its own nanstd, on float32 rewards."""
    torch = pytest.importorskip("torch")
    nanstd = pytest.importorskip("trl.trainer.utils").nanstd
    rewards = np.array([1.0, 0.0, 0.5, 2.0, 2.0, 2.0, 0.3, -1.0, 4.0], np.float32)
    r = torch.tensor(rewards)
    mean = r.view(-1, GROUP).mean(dim=1).repeat_interleave(GROUP)
    std = nanstd(r.view(-1, GROUP), dim=1).repeat_interleave(GROUP)
    want = ((r - mean) / (std + 1e-4)).numpy()
    np.testing.assert_allclose(np.asarray(group_advantages(jnp.asarray(rewards), GROUP, "group")), want, rtol=1e-6,
                               atol=1e-7)
