"""GAE, the PPO loss, the action distributions and observation statistics against plain NumPy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from systolic.workloads.rl import policy, ppo


def gae_reference(rewards, values, next_values, terminated, done, gamma, lam):
    """The definition, not the recursion: A_t = sum_l (gamma lam)^l delta_{t+l}, summed up to and including the
    step where the episode ends; delta_t bootstraps from V(s_{t+1}) unless the episode terminated at t."""
    T = len(rewards)
    deltas = rewards + gamma * next_values * (1.0 - terminated) - values
    advantages = np.zeros_like(values)
    for t in range(T):
        total = np.zeros_like(values[t])
        open_ = np.ones_like(values[t])  # 1 while the episode that step t belongs to has not ended
        for k in range(t, T):
            total += open_ * (gamma * lam) ** (k - t) * deltas[k]
            open_ = open_ * (1.0 - done[k])
        advantages[t] = total
    return advantages, advantages + values


def test_gae_matches_reference_with_terminations_and_truncations():
    rng = np.random.default_rng(0)
    T, N = 24, 5
    rewards = rng.normal(size=(T, N)).astype(np.float32)
    values = rng.normal(size=(T, N)).astype(np.float32)
    next_values = rng.normal(size=(T, N)).astype(np.float32)
    terminated = rng.random((T, N)) < 0.1
    truncated = (rng.random((T, N)) < 0.1) & ~terminated
    done = terminated | truncated
    assert terminated.any() and truncated.any()
    adv, ret = ppo.gae(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(next_values), jnp.asarray(terminated),
                       jnp.asarray(done), gamma=0.97, lam=0.9)
    ref_adv, ref_ret = gae_reference(rewards, values, next_values, terminated.astype(np.float32),
                                     done.astype(np.float32), 0.97, 0.9)
    np.testing.assert_allclose(np.asarray(adv), ref_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ret), ref_ret, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ending, expected_last_target", [("terminated", 1.0), ("truncated", 1.0 + 0.5 * 10.0)])
def test_truncation_bootstraps_and_termination_does_not(ending, expected_last_target):
    """A 3-step episode with reward 1 per step, V = 0 everywhere except the state after the last step (V = 10).
    With lam = 1 the targets are discounted returns: a terminated episode ends there, a truncated one does not."""
    gamma = 0.5
    rewards = jnp.ones((3, 1))
    values = jnp.zeros((3, 1))
    next_values = jnp.array([[0.0], [0.0], [10.0]])
    terminated = jnp.array([[False], [False], [ending == "terminated"]])
    done = jnp.array([[False], [False], [True]])
    _, returns = ppo.gae(rewards, values, next_values, terminated, done, gamma=gamma, lam=1.0)
    last = expected_last_target
    np.testing.assert_allclose(np.asarray(returns)[:, 0], [1 + gamma * (1 + gamma * last), 1 + gamma * last, last],
                               rtol=1e-6)


def ppo_loss_reference(log_prob, old_log_prob, adv, values, old_values, returns, entropy, *, clip_eps, clip_value,
                       vf_coef, ent_coef, normalize_advantages):
    if normalize_advantages:
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    ratio = np.exp(log_prob - old_log_prob)
    policy_loss = np.mean(np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - clip_eps, 1 + clip_eps)))
    err = (values - returns) ** 2
    if clip_value:
        clipped = old_values + np.clip(values - old_values, -clip_eps, clip_eps)
        err = np.maximum(err, (clipped - returns) ** 2)
    value_loss = 0.5 * err.mean()
    total = policy_loss + vf_coef * value_loss - ent_coef * entropy.mean()
    return total, policy_loss, value_loss


@pytest.mark.parametrize("clip_value", [True, False])
@pytest.mark.parametrize("normalize_advantages", [True, False])
def test_ppo_loss_matches_reference(clip_value, normalize_advantages):
    rng = np.random.default_rng(1)
    B = 64
    old_log_prob = rng.normal(-1.0, 0.3, B)
    log_prob = old_log_prob + rng.normal(0, 0.3, B)  # ratios well outside [0.8, 1.2] for some samples
    adv = rng.normal(size=B)
    old_values = rng.normal(size=B)
    values = old_values + rng.normal(0, 0.5, B)
    returns = rng.normal(size=B)
    entropy = rng.random(B)
    kwargs = dict(clip_eps=0.2, clip_value=clip_value, vf_coef=0.5, ent_coef=0.01,
                  normalize_advantages=normalize_advantages)
    total, stats_ = ppo.ppo_loss(*(jnp.asarray(x, jnp.float32) for x in
                                   (log_prob, old_log_prob, adv, values, old_values, returns, entropy)), **kwargs)
    ref_total, ref_policy, ref_value = ppo_loss_reference(log_prob, old_log_prob, adv, values, old_values, returns,
                                                          entropy, **kwargs)
    np.testing.assert_allclose(float(total), ref_total, rtol=1e-5)
    np.testing.assert_allclose(float(stats_.policy_loss), ref_policy, rtol=1e-5)
    np.testing.assert_allclose(float(stats_.value_loss), ref_value, rtol=1e-5)
    ratio = np.exp(log_prob - old_log_prob)
    np.testing.assert_allclose(float(stats_.clip_frac), np.mean(np.abs(ratio - 1) > 0.2), rtol=1e-6)
    assert 0 < float(stats_.clip_frac) < 1


def test_ppo_loss_gradient_is_zero_where_clipped():
    """The clipped objective gives no gradient for a sample whose ratio is already past the clip in the
    direction its advantage pushes."""
    old = jnp.zeros(2)
    adv = jnp.array([1.0, 1.0])

    def loss(log_prob):
        return ppo.ppo_loss(log_prob, old, adv, jnp.zeros(2), jnp.zeros(2), jnp.zeros(2), jnp.zeros(2),
                            clip_eps=0.2, clip_value=False, vf_coef=0.0, ent_coef=0.0, normalize_advantages=False)[0]

    grad = jax.grad(loss)(jnp.array([0.5, 0.0]))  # ratio e^0.5 > 1.2: clipped; ratio 1: not
    assert float(grad[0]) == 0.0 and float(grad[1]) < 0.0


def test_categorical_matches_numpy():
    logits = jnp.array([[0.5, -1.0, 2.0], [0.0, 0.0, 0.0]])
    p = np.exp(np.asarray(logits)) / np.exp(np.asarray(logits)).sum(-1, keepdims=True)
    dist = policy.Categorical(logits)
    np.testing.assert_allclose(np.asarray(dist.log_prob(jnp.array([2, 1]))), np.log([p[0, 2], p[1, 1]]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(dist.entropy()), -(p * np.log(p)).sum(-1), rtol=1e-6)
    # Gumbel-max sampling follows the softmax probabilities.
    noise = jax.random.gumbel(jax.random.PRNGKey(0), (20000, 3))
    samples = np.asarray(policy.Categorical(jnp.broadcast_to(logits[0], (20000, 3))).sample(noise))
    np.testing.assert_allclose(np.bincount(samples, minlength=3) / 20000, p[0], atol=0.015)


def test_diag_gaussian_matches_scipy():
    mean = jnp.array([[0.3, -1.0], [2.0, 0.5]])
    log_std = jnp.array([-0.5, 0.2])
    action = jnp.array([[0.0, 0.0], [1.5, 1.0]])
    dist = policy.DiagGaussian(mean, log_std)
    ref = stats.norm.logpdf(np.asarray(action), np.asarray(mean), np.exp(np.asarray(log_std))).sum(-1)
    np.testing.assert_allclose(np.asarray(dist.log_prob(action)), ref, rtol=1e-5)
    ref_entropy = stats.norm.entropy(scale=np.exp(np.asarray(log_std))).sum()
    np.testing.assert_allclose(np.asarray(dist.entropy()), [ref_entropy, ref_entropy], rtol=1e-5)


def test_running_obs_stats_match_numpy():
    rng = np.random.default_rng(2)
    data = rng.normal(3.0, 2.0, (10, 32, 4)).astype(np.float32)
    running = ppo.initial_obs_stats((4,))
    for batch in data:
        running = ppo.update_obs_stats(running, jnp.asarray(batch))
    flat = data.reshape(-1, 4)
    np.testing.assert_allclose(np.asarray(running["mean"]), flat.mean(0), rtol=1e-4)
    np.testing.assert_allclose(np.asarray(running["var"]), flat.var(0), rtol=1e-3)
    normalized = np.asarray(ppo.normalize_obs(running, jnp.asarray(flat)))
    np.testing.assert_allclose(normalized.mean(0), 0.0, atol=1e-3)
    np.testing.assert_allclose(normalized.std(0), 1.0, atol=1e-3)


def test_learning_rate_anneals_to_zero_over_the_run():
    from systolic import config as config_lib
    from systolic.workloads.rl.config import RLConfig

    cfg = config_lib.from_dict(RLConfig, config_lib.apply_overrides({}, [
        "rl.num_envs=4", "rl.num_steps=8", "rl.total_env_steps=64", "rl.updates_per_chunk=1",
        "ppo.update_epochs=2", "ppo.num_minibatches=2", "ppo.lr=0.1", "ppo.max_grad_norm=1e9"]))
    assert cfg.rl.num_updates == 2
    tx = ppo.make_optimizer(cfg)
    params = {"w": jnp.zeros(())}
    state = tx.init(params)
    steps = []
    for _ in range(cfg.rl.num_updates * 4):  # 2 updates x 2 epochs x 2 minibatches
        updates, state = tx.update({"w": jnp.ones(())}, state, params)
        steps.append(-float(updates["w"]))  # Adam's first step size is the learning rate itself
    assert steps[0] == pytest.approx(0.1, rel=1e-3)
    assert steps[-1] < steps[0] / 4 and steps == sorted(steps, reverse=True)
