"""PPO as pure functions: GAE, the clipped loss, observation normalisation, and one seed's chunk of updates.

`make_seed_fns` returns `init(key) -> SeedState` and `chunk(SeedState, key) -> (SeedState, ChunkMetrics)` for a
single seed; `train.py` vmaps them over seeds and jits them (`ALGORITHM` declares them, algorithm.py). A chunk is
`updates_per_chunk` PPO updates in one `lax.scan`, each update a `lax.scan` over rollout steps followed by epochs x
minibatches of Adam steps, so a whole chunk is one XLA program that never returns to Python.

Bootstrapping: an episode that *terminated* has no future (the target is the last reward); one that was
*truncated* by the time limit does, so its last target bootstraps from the value of the pre-reset observation
(`EnvStep.final_obs`). The advantage recursion stops at both kinds of boundary.
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from systolic.workloads.rl import episodes as episodes_lib
from systolic.workloads.rl import optimization, policy
from systolic.workloads.rl.algorithm import Actor, Algorithm, feed_forward
from systolic.workloads.rl.config import RLConfig
from systolic.workloads.rl.env_api import Env


# GAE AND LOSS -------------------------------------------------------------------------------------------------


def gae(rewards: jax.Array, values: jax.Array, next_values: jax.Array, terminated: jax.Array, done: jax.Array,
        *, gamma: float, lam: float) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation over a rollout, time on axis 0.

    Args:
      rewards, values: (T, ...) reward r_t and V(s_t) of each step.
      next_values: (T, ...) V(s_{t+1}) of the state the step really led to (the pre-reset observation when the
        episode ended there), so truncated episodes bootstrap correctly.
      terminated: (T, ...) the episode hit a terminal state at step t: no bootstrap.
      done: (T, ...) the episode ended at step t for any reason (terminated or truncated): the advantage of
        step t does not look past it.
    Returns:
      (advantages, returns) with returns = advantages + values, the value targets.
    """
    not_terminal = 1.0 - terminated.astype(jnp.float32)
    not_done = 1.0 - done.astype(jnp.float32)
    deltas = rewards + gamma * next_values * not_terminal - values  # (T, ...)

    def backward(next_advantage, step):
        delta, carry_on = step
        advantage = delta + gamma * lam * carry_on * next_advantage
        return advantage, advantage

    _, advantages = jax.lax.scan(backward, jnp.zeros_like(values[0]), (deltas, not_done), reverse=True)
    return advantages, advantages + values


class LossStats(NamedTuple):
    policy_loss: jax.Array
    value_loss: jax.Array
    entropy: jax.Array
    approx_kl: jax.Array
    clip_frac: jax.Array


def ppo_loss(log_prob: jax.Array, old_log_prob: jax.Array, advantages: jax.Array, values: jax.Array,
             old_values: jax.Array, returns: jax.Array, entropy: jax.Array, *, clip_eps: float, clip_value: bool,
             vf_coef: float, ent_coef: float, normalize_advantages: bool) -> tuple[jax.Array, LossStats]:
    """The clipped PPO objective over a minibatch (all inputs (B,)); returns (total loss to minimise, stats).

    total = policy_loss + vf_coef * value_loss - ent_coef * entropy, where
      policy_loss = mean(max(-A r, -A clip(r, 1 - eps, 1 + eps))), r = exp(log_prob - old_log_prob),
      value_loss = 0.5 mean((V - R)^2), or with clip_value 0.5 mean(max((V - R)^2, (V_clipped - R)^2)),
      V_clipped = old_V + clip(V - old_V, -eps, eps).
    """
    if normalize_advantages:
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    log_ratio = log_prob - old_log_prob
    ratio = jnp.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    policy_loss = -jnp.minimum(unclipped, clipped).mean()

    value_error = jnp.square(values - returns)
    if clip_value:
        values_clipped = old_values + jnp.clip(values - old_values, -clip_eps, clip_eps)
        value_error = jnp.maximum(value_error, jnp.square(values_clipped - returns))
    value_loss = 0.5 * value_error.mean()

    mean_entropy = entropy.mean()
    total = policy_loss + vf_coef * value_loss - ent_coef * mean_entropy
    # The low-variance KL estimator (r - 1) - log r (Schulman's k3): a diagnostic only.
    approx_kl = ((ratio - 1.0) - log_ratio).mean()
    clip_frac = (jnp.abs(ratio - 1.0) > clip_eps).astype(jnp.float32).mean()
    return total, LossStats(policy_loss, value_loss, mean_entropy, approx_kl, clip_frac)


# OBSERVATION NORMALISATION ------------------------------------------------------------------------------------


def update_obs_stats(stats: dict[str, jax.Array], batch: jax.Array) -> dict[str, jax.Array]:
    """Merges a batch (B, *obs_shape) into running mean/variance (Chan et al.'s parallel algorithm)."""
    count = batch.shape[0]
    mean_b = batch.mean(axis=0)
    var_b = batch.var(axis=0)
    total = stats["count"] + count
    delta = mean_b - stats["mean"]
    mean = stats["mean"] + delta * count / total
    m2 = stats["var"] * stats["count"] + var_b * count + jnp.square(delta) * stats["count"] * count / total
    return {"mean": mean, "var": m2 / total, "count": total}


def normalize_obs(stats: dict[str, jax.Array], obs: jax.Array) -> jax.Array:
    return jnp.clip((obs - stats["mean"]) / jnp.sqrt(stats["var"] + 1e-8), -10.0, 10.0)


def initial_obs_stats(obs_shape: tuple[int, ...]) -> dict[str, jax.Array]:
    # A tiny prior count (as Gymnasium's NormalizeObservation) so the first merge is well defined.
    return {"mean": jnp.zeros(obs_shape, jnp.float32), "var": jnp.ones(obs_shape, jnp.float32),
            "count": jnp.asarray(1e-4, jnp.float32)}


# ONE SEED ---------------------------------------------------------------------------------------------------


class SeedState(NamedTuple):
    """Everything one seed's training carries from update to update (train.py stores it in a TrainState)."""

    params: Any
    opt_state: Any
    env_state: dict[str, jax.Array]  # (N, ...)
    obs: jax.Array  # (N, *obs_shape) raw observation to act on next
    episode_return: jax.Array  # (N,) undiscounted, unscaled return of the running episode
    episode_length: jax.Array  # (N,) int32
    obs_stats: dict[str, jax.Array]  # running observation mean/var/count
    last_return: jax.Array  # () mean return of the latest chunk with a finished episode
    last_length: jax.Array  # ()


class Transition(NamedTuple):  # each (T, N, ...) after the rollout scan
    obs: jax.Array  # normalised when ppo.normalize_obs, as the policy saw it
    action: jax.Array
    log_prob: jax.Array
    value: jax.Array
    reward: jax.Array  # scaled by ppo.reward_scale
    terminated: jax.Array
    done: jax.Array
    final_obs: jax.Array  # normalised like obs
    finished_return: jax.Array  # episode return where an episode ended at this step, else 0
    finished_length: jax.Array


class ChunkMetrics(NamedTuple):  # per seed, scalars
    loss: jax.Array
    policy_loss: jax.Array
    value_loss: jax.Array
    entropy: jax.Array
    approx_kl: jax.Array
    clip_frac: jax.Array
    episode_return: jax.Array  # mean over the episodes that finished in this chunk (else the previous value)
    episode_length: jax.Array
    episodes: jax.Array  # how many finished


def make_optimizer(cfg: RLConfig) -> optax.GradientTransformation:
    """Adam with global-norm clipping; with `ppo.anneal_lr` the learning rate decays linearly to 0 over all Adam steps
    of the run."""
    ppo = cfg.ppo
    adam_steps = cfg.rl.num_updates * ppo.update_epochs * ppo.num_minibatches
    return optimization.make_optimizer(partial(optax.adam, eps=ppo.adam_eps), lr=ppo.lr,
                                       max_grad_norm=ppo.max_grad_norm, anneal_steps=adam_steps if ppo.anneal_lr else 0)


def make_seed_fns(cfg: RLConfig, env: Env, tx: optax.GradientTransformation):
    """Returns (init, chunk) for one seed: `init(key) -> SeedState`, `chunk(SeedState, key) -> (SeedState,
    ChunkMetrics)`."""
    spec, ppo, run = env.spec, cfg.ppo, cfg.rl
    graphdef = policy.make_graphdef(spec, cfg.model)
    n_obs_axes = len(spec.obs_shape)
    n_envs, n_steps = run.num_envs, run.num_steps
    batch_size = n_envs * n_steps
    low = jnp.asarray(spec.action_low, jnp.float32) if not spec.discrete else None
    high = jnp.asarray(spec.action_high, jnp.float32) if not spec.discrete else None
    maybe_normalize = normalize_obs if ppo.normalize_obs else (lambda stats, obs: obs)

    def init(key: jax.Array) -> SeedState:
        net_key, env_key = jax.random.split(key)
        params = policy.init_params(spec, cfg.model, key=net_key)
        obs, env_state = jax.vmap(env.reset)(jax.random.split(env_key, n_envs))
        return SeedState(
            params=params, opt_state=tx.init(params), env_state=env_state, obs=obs,
            episode_return=jnp.zeros((n_envs,), jnp.float32), episode_length=jnp.zeros((n_envs,), jnp.int32),
            obs_stats=initial_obs_stats(spec.obs_shape),
            last_return=jnp.zeros((), jnp.float32), last_length=jnp.zeros((), jnp.float32),
        )

    def rollout_step(carry: SeedState, randomness) -> tuple[SeedState, Transition]:
        env_keys, resets, noise = randomness  # (N, 2), fresh reset states (N, ...), action noise (N, ...)
        stats = update_obs_stats(carry.obs_stats, carry.obs) if ppo.normalize_obs else carry.obs_stats
        obs = maybe_normalize(stats, carry.obs)  # (N, *obs_shape)
        dist, value = policy.apply(graphdef, carry.params, obs, n_obs_axes)  # value (N,)
        action = dist.sample(noise)  # (N,) int32 or (N, D)
        log_prob = dist.log_prob(action)  # (N,)
        env_action = action if spec.discrete else jnp.clip(action, low, high)
        step = jax.vmap(env.step)(env_keys, carry.env_state, env_action, resets)
        done = step.terminated | step.truncated
        episode_return = carry.episode_return + step.reward
        episode_length = carry.episode_length + 1
        transition = Transition(
            obs=obs, action=action, log_prob=log_prob, value=value, reward=step.reward * ppo.reward_scale,
            terminated=step.terminated, done=done, final_obs=maybe_normalize(stats, step.final_obs),
            finished_return=jnp.where(done, episode_return, 0.0),
            finished_length=jnp.where(done, episode_length, 0).astype(jnp.float32),
        )
        carry = carry._replace(env_state=step.state, obs=step.obs, obs_stats=stats,
                               episode_return=jnp.where(done, 0.0, episode_return),
                               episode_length=jnp.where(done, 0, episode_length))
        return carry, transition

    def loss_fn(params: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, LossStats]:
        dist, values = policy.apply(graphdef, params, batch["obs"], n_obs_axes)
        return ppo_loss(dist.log_prob(batch["action"]), batch["log_prob"], batch["advantages"], values,
                        batch["value"], batch["returns"], dist.entropy(), clip_eps=ppo.clip_eps,
                        clip_value=ppo.clip_value, vf_coef=ppo.vf_coef, ent_coef=ppo.ent_coef,
                        normalize_advantages=ppo.normalize_advantages)

    def adam_step(carry, minibatch):
        params, opt_state = carry
        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, minibatch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), (loss, stats)

    def update(carry: SeedState, key: jax.Array) -> tuple[SeedState, tuple]:
        step_key, reset_key, noise_key, epoch_key = jax.random.split(key, 4)
        # COLLECT TRAJECTORIES. All of the rollout's randomness is drawn here, in bulk (see envs.py for why).
        randomness = (jax.random.split(step_key, (n_steps, n_envs)),  # (T, N, 2)
                      jax.vmap(jax.vmap(env.reset))(jax.random.split(reset_key, (n_steps, n_envs))),  # (T, N, ...)
                      policy.action_noise(spec, (n_steps, n_envs), key=noise_key))  # (T, N, A or D)
        carry, traj = jax.lax.scan(rollout_step, carry, randomness, unroll=run.unroll)  # traj: (T, N, ...)
        # BOOTSTRAP VALUES: V of the state each step really led to, in one batched pass.
        next_values = policy.value(graphdef, carry.params, traj.final_obs, n_obs_axes)  # (T, N)
        # ADVANTAGES
        advantages, returns = gae(traj.reward, traj.value, next_values, traj.terminated, traj.done,
                                  gamma=ppo.gamma, lam=ppo.gae_lambda)
        # UPDATE NETWORK
        batch = {"obs": traj.obs, "action": traj.action, "log_prob": traj.log_prob, "value": traj.value,
                 "advantages": advantages, "returns": returns}
        flat = jax.tree.map(lambda x: x.reshape(batch_size, *x.shape[2:]), batch)  # (T*N, ...)
        # Each epoch a fresh shuffle of the whole rollout, cut into equal minibatches (M, T*N/M, ...).
        (params, opt_state), (losses, stats) = optimization.shuffled_epochs(
            adam_step, (carry.params, carry.opt_state), flat, key=epoch_key, epochs=ppo.update_epochs,
            minibatches=ppo.num_minibatches)
        carry = carry._replace(params=params, opt_state=opt_state)
        episodes = traj.done.sum()
        return carry, (losses.mean(), jax.tree.map(jnp.mean, stats), traj.finished_return.sum(),
                       traj.finished_length.sum(), episodes)

    def chunk(state: SeedState, key: jax.Array) -> tuple[SeedState, ChunkMetrics]:
        return run_chunk(update, state, key, run.updates_per_chunk)

    return init, chunk


def run_chunk(update, state: Any, key: jax.Array, updates: int) -> tuple[Any, ChunkMetrics]:
    """`updates` PPO updates in one `lax.scan` and their metrics; `update(state, key) -> (state, (loss, LossStats,
    finished return sum, finished length sum, episodes))`, `state` any seed state with `last_return`/`last_length`
    (feed-forward or recurrent PPO's)."""
    state, (losses, stats, return_sum, length_sum, episodes) = jax.lax.scan(
        update, state, jax.random.split(key, updates))
    state, n = episodes_lib.record_finished(state, return_sum, length_sum, episodes)
    metrics = ChunkMetrics(loss=losses.mean(), policy_loss=stats.policy_loss.mean(),
                           value_loss=stats.value_loss.mean(), entropy=stats.entropy.mean(),
                           approx_kl=stats.approx_kl.mean(), clip_frac=stats.clip_frac.mean(),
                           episode_return=state.last_return, episode_length=state.last_length, episodes=n)
    return state, metrics


def make_act(cfg: RLConfig, env: Env) -> Actor:
    """The deterministic policy (argmax, or the Gaussian mean clipped to the action bounds), on observations
    normalised with the seed's statistics, without memory: `act(params, seed_extra, obs (..., *obs_shape)) -> action
    (...)` as an Actor (algorithm.py)."""
    spec = env.spec
    graphdef = policy.make_graphdef(spec, cfg.model)
    maybe_normalize = normalize_obs if cfg.ppo.normalize_obs else (lambda stats, obs: obs)

    def act(params: Any, seed_extra: dict[str, Any], obs: jax.Array) -> jax.Array:
        dist, _ = policy.apply(graphdef, params, maybe_normalize(seed_extra["obs_stats"], obs), len(spec.obs_shape))
        action = dist.mode()
        if not spec.discrete:
            action = jnp.clip(action, jnp.asarray(spec.action_low), jnp.asarray(spec.action_high))
        return action

    return feed_forward(act)


ALGORITHM = Algorithm(
    name="PPO", make_optimizer=make_optimizer, make_seed_fns=make_seed_fns, make_act=make_act, seed_state=SeedState,
    metric_names=("loss", "policy_loss", "value_loss", "entropy", "approx_kl", "clip_frac", "episode_return",
                  "episode_length"),
    per_seed_metrics=("episode_return", "episode_length", "loss", "entropy"),
    nonfinite_advice="lower ppo.lr or ppo.max_grad_norm, or set ppo.normalize_obs=true, then rerun the same command "
                     "to resume; or set loop.nonfinite=skip to drop such steps and go on",
)
