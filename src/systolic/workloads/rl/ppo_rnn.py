"""Recurrent PPO (`model.gru_size` > 0), as PureJaxRL's `ppo_rnn.py`, on ppo.py's GAE, loss, observation
statistics, optimizer and chunk loop.

What memory changes against feed-forward PPO:
- each environment's GRU hidden state is part of the seed state (`hidden`, a per-environment field, so checkpoints
  and resumes carry it); it is reset to zeros after the step that ends an episode;
- the update keeps the hidden state the rollout started from and replays whole sequences from it (recurrent.py's
  `unroll`), so minibatches are sets of environments (`rl.num_envs / ppo.num_minibatches` each, every one with all
  of its `rl.num_steps` steps), not shuffled single steps;
- bootstrapping: a truncated step's value comes from its pre-reset observation *and* the hidden state its episode
  had after that step (`Transition.next_hidden`), not the zeros the next episode starts from.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from systolic.workloads.rl import optimization, policy, ppo, recurrent
from systolic.workloads.rl.algorithm import ENV_FIELDS, Actor, Algorithm
from systolic.workloads.rl.config import RLConfig
from systolic.workloads.rl.env_api import Env


class SeedState(NamedTuple):
    """ppo.SeedState plus each environment's hidden state."""

    params: Any
    opt_state: Any
    env_state: dict[str, jax.Array]  # (N, ...)
    obs: jax.Array  # (N, *obs_shape) raw observation to act on next
    episode_return: jax.Array  # (N,)
    episode_length: jax.Array  # (N,) int32
    hidden: jax.Array  # (N, H) the GRU state to act with next: zeros at an episode's start
    obs_stats: dict[str, jax.Array]
    last_return: jax.Array  # ()
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
    next_hidden: jax.Array  # (T, N, H) the hidden state after the step, before a reset: the episode's own
    finished_return: jax.Array
    finished_length: jax.Array


def make_init(cfg: RLConfig, env: Env, tx: optax.GradientTransformation):
    """`init(key) -> SeedState` for one seed."""
    spec, n_envs = env.spec, cfg.rl.num_envs

    def init(key: jax.Array) -> SeedState:
        net_key, env_key = jax.random.split(key)
        params = recurrent.init_params(spec, cfg.model, key=net_key)
        obs, env_state = jax.vmap(env.reset)(jax.random.split(env_key, n_envs))
        return SeedState(
            params=params, opt_state=tx.init(params), env_state=env_state, obs=obs,
            episode_return=jnp.zeros((n_envs,), jnp.float32), episode_length=jnp.zeros((n_envs,), jnp.int32),
            hidden=jnp.zeros((n_envs, cfg.model.gru_size), jnp.float32),
            obs_stats=ppo.initial_obs_stats(spec.obs_shape),
            last_return=jnp.zeros((), jnp.float32), last_length=jnp.zeros((), jnp.float32),
        )

    return init


def make_rollout(cfg: RLConfig, env: Env):
    """`rollout(SeedState, key) -> (SeedState, Transition (T, N, ...))`: `rl.num_steps` steps of every environment
    with the sampling policy, the hidden states carried and reset at episode ends."""
    spec, run, ppo_cfg = env.spec, cfg.rl, cfg.ppo
    graphdef = recurrent.make_graphdef(spec, cfg.model)
    n_obs_axes = len(spec.obs_shape)
    low = jnp.asarray(spec.action_low, jnp.float32) if not spec.discrete else None
    high = jnp.asarray(spec.action_high, jnp.float32) if not spec.discrete else None
    maybe_normalize = ppo.normalize_obs if ppo_cfg.normalize_obs else (lambda stats, obs: obs)

    def rollout_step(carry: SeedState, randomness) -> tuple[SeedState, Transition]:
        env_keys, resets, noise = randomness  # (N, 2), fresh reset states (N, ...), action noise (N, ...)
        stats = ppo.update_obs_stats(carry.obs_stats, carry.obs) if ppo_cfg.normalize_obs else carry.obs_stats
        obs = maybe_normalize(stats, carry.obs)  # (N, *obs_shape)
        next_hidden, dist, value = recurrent.step(graphdef, carry.params, carry.hidden, obs, n_obs_axes)
        action = dist.sample(noise)
        log_prob = dist.log_prob(action)
        env_action = action if spec.discrete else jnp.clip(action, low, high)
        step = jax.vmap(env.step)(env_keys, carry.env_state, env_action, resets)
        done = step.terminated | step.truncated
        episode_return = carry.episode_return + step.reward
        episode_length = carry.episode_length + 1
        transition = Transition(
            obs=obs, action=action, log_prob=log_prob, value=value, reward=step.reward * ppo_cfg.reward_scale,
            terminated=step.terminated, done=done, final_obs=maybe_normalize(stats, step.final_obs),
            next_hidden=next_hidden, finished_return=jnp.where(done, episode_return, 0.0),
            finished_length=jnp.where(done, episode_length, 0).astype(jnp.float32),
        )
        carry = carry._replace(env_state=step.state, obs=step.obs, obs_stats=stats,
                               hidden=jnp.where(done[:, None], 0.0, next_hidden),  # (N, H): a new episode forgets
                               episode_return=jnp.where(done, 0.0, episode_return),
                               episode_length=jnp.where(done, 0, episode_length))
        return carry, transition

    def rollout(state: SeedState, key: jax.Array) -> tuple[SeedState, Transition]:
        step_key, reset_key, noise_key = jax.random.split(key, 3)
        # All of the rollout's randomness is drawn here, in bulk (see envs.py for why).
        randomness = (jax.random.split(step_key, (run.num_steps, run.num_envs)),  # (T, N, 2)
                      jax.vmap(jax.vmap(env.reset))(jax.random.split(reset_key, (run.num_steps, run.num_envs))),
                      policy.action_noise(spec, (run.num_steps, run.num_envs), key=noise_key))  # (T, N, A or D)
        return jax.lax.scan(rollout_step, state, randomness, unroll=run.unroll)

    return rollout


def bootstrap_values(graphdef, params: Any, traj: Transition, n_obs_axes: int) -> jax.Array:
    """(T, N) V of the state each step really led to: its pre-reset observation seen with the hidden state its
    episode had (where no episode ended, this is the next step's value)."""
    _, _, values = recurrent.step(graphdef, params, traj.next_hidden, traj.final_obs, n_obs_axes)
    return values


def make_seed_fns(cfg: RLConfig, env: Env, tx: optax.GradientTransformation):
    """Returns (init, chunk) for one seed, as ppo.make_seed_fns."""
    spec, ppo_cfg, run = env.spec, cfg.ppo, cfg.rl
    graphdef = recurrent.make_graphdef(spec, cfg.model)
    n_obs_axes = len(spec.obs_shape)
    rollout = make_rollout(cfg, env)

    def loss_fn(params: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, ppo.LossStats]:
        # RERUN NETWORK over the minibatch's whole sequences, from the hidden state the rollout started with.
        dist, values, _ = recurrent.unroll(graphdef, params, batch["hidden"], batch["obs"], batch["done"],
                                           n_obs_axes)  # (T, B)
        return ppo.ppo_loss(dist.log_prob(batch["action"]), batch["log_prob"], batch["advantages"], values,
                            batch["value"], batch["returns"], dist.entropy(), clip_eps=ppo_cfg.clip_eps,
                            clip_value=ppo_cfg.clip_value, vf_coef=ppo_cfg.vf_coef, ent_coef=ppo_cfg.ent_coef,
                            normalize_advantages=ppo_cfg.normalize_advantages)

    def adam_step(carry, minibatch):
        params, opt_state = carry
        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, minibatch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), (loss, stats)

    def update(carry: SeedState, key: jax.Array) -> tuple[SeedState, tuple]:
        rollout_key, epoch_key = jax.random.split(key)
        first_hidden = carry.hidden  # (N, H): where the update's replay starts
        # COLLECT TRAJECTORIES
        carry, traj = rollout(carry, rollout_key)  # traj: (T, N, ...)
        # BOOTSTRAP VALUES, with each episode's own hidden state, in one batched pass.
        next_values = bootstrap_values(graphdef, carry.params, traj, n_obs_axes)  # (T, N)
        # ADVANTAGES
        advantages, returns = ppo.gae(traj.reward, traj.value, next_values, traj.terminated, traj.done,
                                      gamma=ppo_cfg.gamma, lam=ppo_cfg.gae_lambda)
        # UPDATE NETWORK: minibatches of whole environments, time kept in order.
        sequences = {"obs": traj.obs, "done": traj.done, "action": traj.action, "log_prob": traj.log_prob,
                     "value": traj.value, "advantages": advantages, "returns": returns}  # (T, N, ...)
        # Each epoch a fresh shuffle of the environments, cut into equal groups: sequences (M, T, N/M, ...), the
        # hidden states they start from (M, N/M, H).
        data = {**sequences, "hidden": first_hidden}
        axes = {**{name: 1 for name in sequences}, "hidden": 0}
        (params, opt_state), (losses, stats) = optimization.shuffled_epochs(
            adam_step, (carry.params, carry.opt_state), data, key=epoch_key, epochs=ppo_cfg.update_epochs,
            minibatches=ppo_cfg.num_minibatches, axes=axes)
        carry = carry._replace(params=params, opt_state=opt_state)
        return carry, (losses.mean(), jax.tree.map(jnp.mean, stats), traj.finished_return.sum(),
                       traj.finished_length.sum(), traj.done.sum())

    def chunk(state: SeedState, key: jax.Array) -> tuple[SeedState, ppo.ChunkMetrics]:
        return ppo.run_chunk(update, state, key, run.updates_per_chunk)

    return make_init(cfg, env, tx), chunk


def make_act(cfg: RLConfig, env: Env) -> Actor:
    """The deterministic policy with its GRU memory: `act(params, seed_extra, obs (..., *obs_shape), hidden (...,
    H)) -> (action (...), hidden)`, on observations normalised with the seed's statistics."""
    spec = env.spec
    graphdef = recurrent.make_graphdef(spec, cfg.model)
    maybe_normalize = ppo.normalize_obs if cfg.ppo.normalize_obs else (lambda stats, obs: obs)

    def act(params: Any, seed_extra: dict[str, Any], obs: jax.Array, hidden: jax.Array) -> tuple[jax.Array, jax.Array]:
        obs = maybe_normalize(seed_extra["obs_stats"], obs)
        hidden, dist, _ = recurrent.step(graphdef, params, hidden, obs, len(spec.obs_shape))
        action = dist.mode()
        if not spec.discrete:
            action = jnp.clip(action, jnp.asarray(spec.action_low), jnp.asarray(spec.action_high))
        return action, hidden

    return Actor(act=act, carry_size=cfg.model.gru_size)


ALGORITHM = Algorithm(
    name="PPO (GRU)", make_optimizer=ppo.make_optimizer, make_seed_fns=make_seed_fns, make_act=make_act,
    seed_state=SeedState, metric_names=ppo.ALGORITHM.metric_names, per_seed_metrics=ppo.ALGORITHM.per_seed_metrics,
    nonfinite_advice=ppo.ALGORITHM.nonfinite_advice, env_fields=(*ENV_FIELDS, "hidden"),
)
