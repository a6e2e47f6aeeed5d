"""PQN (parallel Q-learning, Gallici et al. 2024; purejaxql's `pqn_gymnax.py`) as pure functions of one seed.

Each update: an epsilon-greedy rollout of `rl.num_steps` steps from each of `rl.num_envs` environments, Q(lambda)
targets computed backwards over it, then `pqn.update_epochs` passes of shuffled minibatches of RAdam steps on the
squared TD error. No replay buffer and no target network: the many parallel environments decorrelate the data
and the LayerNorm after every hidden layer keeps the bootstrapped regression stable (the paper's argument).

Bootstrapping, as PPO's (ppo.py): a *terminated* episode's last target is its reward; a *truncated* one (the time
limit) bootstraps from max_a Q of the observation the step really led to (`EnvStep.final_obs`), and the lambda
recursion stops at both. purejaxql's gymnax of the time reported one `done` for both, so its targets treat a
time limit as a terminal state; these do not.

`make_seed_fns` returns `init(key) -> SeedState` and `chunk(SeedState, key) -> (SeedState, ChunkMetrics)`;
train.py vmaps them over seeds and jits them (`ALGORITHM` declares them, algorithm.py).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from systolic.workloads.rl import optimization, q_chunk, qnetwork
from systolic.workloads.rl.algorithm import Actor, Algorithm, feed_forward
from systolic.workloads.rl.config import RLConfig
from systolic.workloads.rl.env_api import Env
from systolic.workloads.rl.policy import pick

# Q(LAMBDA) TARGETS --------------------------------------------------------------------------------------------


def lambda_returns(rewards: jax.Array, next_q: jax.Array, terminated: jax.Array, done: jax.Array, *, gamma: float,
                   lam: float) -> jax.Array:
    """Q(lambda) targets over a rollout, time on axis 0 (Peng's Q(lambda), as PQN computes them).

    Args:
      rewards: (T, ...) reward r_t of each step.
      next_q: (T, ...) max_a Q(s'_t, a) of the state s'_t the step really led to (the pre-reset observation where
        an episode ended).
      terminated: (T, ...) the episode hit a terminal state at step t: nothing to bootstrap from.
      done: (T, ...) the episode ended at step t (terminated or truncated): the return does not look past it.
    Returns:
      (T, ...) targets G_t = r_t + gamma * (1 - terminated_t) * B_t, where B_t = next_q_t at the last step of the
      rollout or of an episode, else (1 - lam) * next_q_t + lam * G_{t+1}.
    """
    not_terminal = 1.0 - terminated.astype(jnp.float32)

    def backward(next_return, step):
        reward, q, carry_on, ended = step
        blend = jnp.where(ended, q, (1.0 - lam) * q + lam * next_return)
        target = reward + gamma * carry_on * blend
        return target, target

    # Seeded with next_q of the last step, so the last step's blend is next_q itself (nothing beyond the rollout).
    _, targets = jax.lax.scan(backward, next_q[-1], (rewards, next_q, not_terminal, done), reverse=True)
    return targets


# ONE SEED ---------------------------------------------------------------------------------------------------


class SeedState(NamedTuple):
    """Everything one seed carries from update to update (train.py stores it in a TrainState)."""

    params: Any
    opt_state: Any
    env_state: dict[str, jax.Array]  # (N, ...)
    obs: jax.Array  # (N, *obs_shape) observation to act on next
    episode_return: jax.Array  # (N,) undiscounted, unscaled return of the running episode
    episode_length: jax.Array  # (N,) int32
    last_return: jax.Array  # () mean return of the latest chunk with a finished episode
    last_length: jax.Array  # ()
    updates: jax.Array  # () int32 updates done: the exploration schedule's clock


class Transition(NamedTuple):  # each (T, N, ...) after the rollout scan
    obs: jax.Array
    action: jax.Array
    q_taken: jax.Array  # Q(s, a) of the action taken, as the acting network saw it
    reward: jax.Array  # scaled by pqn.reward_scale
    terminated: jax.Array
    done: jax.Array
    final_obs: jax.Array  # the observation the step led to, before any reset
    finished_return: jax.Array  # episode return where an episode ended at this step, else 0
    finished_length: jax.Array


def make_optimizer(cfg: RLConfig) -> optax.GradientTransformation:
    """RAdam with global-norm clipping, as purejaxql; with `pqn.anneal_lr` the learning rate decays linearly to 0 over
    all steps."""
    pqn = cfg.pqn
    steps = cfg.rl.num_updates * pqn.update_epochs * pqn.num_minibatches
    return optimization.make_optimizer(optax.radam, lr=pqn.lr, max_grad_norm=pqn.max_grad_norm,
                                       anneal_steps=steps if pqn.anneal_lr else 0)


def make_epsilon(cfg: RLConfig) -> optax.Schedule:
    """Update count -> exploration rate (q_chunk.epsilon_schedule of the pqn section)."""
    return q_chunk.epsilon_schedule(cfg.pqn, cfg.rl.num_updates)


def make_seed_fns(cfg: RLConfig, env: Env, tx: optax.GradientTransformation):
    """Returns (init, chunk) for one seed: `init(key) -> SeedState`, `chunk(SeedState, key) -> (SeedState,
    ChunkMetrics)`."""
    spec, pqn, run = env.spec, cfg.pqn, cfg.rl
    graphdef = qnetwork.make_graphdef(spec, cfg.model)
    n_envs, n_steps = run.num_envs, run.num_steps
    batch_size = n_envs * n_steps
    epsilon = make_epsilon(cfg)

    def q_values(params: Any, obs: jax.Array) -> jax.Array:
        return qnetwork.q_values(graphdef, params, obs)

    def init(key: jax.Array) -> SeedState:
        net_key, env_key = jax.random.split(key)
        params = qnetwork.init_params(spec, cfg.model, key=net_key)
        obs, env_state = jax.vmap(env.reset)(jax.random.split(env_key, n_envs))
        zero = jnp.zeros((), jnp.float32)
        return SeedState(params=params, opt_state=tx.init(params), env_state=env_state, obs=obs,
                         episode_return=jnp.zeros((n_envs,), jnp.float32),
                         episode_length=jnp.zeros((n_envs,), jnp.int32), last_return=zero, last_length=zero,
                         updates=jnp.zeros((), jnp.int32))

    def rollout_step(carry: SeedState, randomness) -> tuple[SeedState, Transition]:
        env_keys, resets, explore, random_action, eps = randomness  # (N, 2), reset states, (N,), (N,), ()
        q = q_values(carry.params, carry.obs)  # (N, A)
        action = jnp.where(explore < eps, random_action, jnp.argmax(q, axis=-1).astype(jnp.int32))  # (N,)
        step = jax.vmap(env.step)(env_keys, carry.env_state, action, resets)
        done = step.terminated | step.truncated
        episode_return = carry.episode_return + step.reward
        episode_length = carry.episode_length + 1
        transition = Transition(
            obs=carry.obs, action=action, q_taken=pick(q, action),
            reward=step.reward * pqn.reward_scale, terminated=step.terminated, done=done, final_obs=step.final_obs,
            finished_return=jnp.where(done, episode_return, 0.0),
            finished_length=jnp.where(done, episode_length, 0).astype(jnp.float32),
        )
        carry = carry._replace(env_state=step.state, obs=step.obs,
                               episode_return=jnp.where(done, 0.0, episode_return),
                               episode_length=jnp.where(done, 0, episode_length))
        return carry, transition

    def loss_fn(params: Any, minibatch: dict[str, jax.Array]) -> jax.Array:
        q = q_values(params, minibatch["obs"])  # (B, A)
        q_taken = pick(q, minibatch["action"])  # (B,)
        return 0.5 * jnp.square(q_taken - minibatch["target"]).mean()

    def radam_step(carry, minibatch):
        params, opt_state = carry
        loss, grads = jax.value_and_grad(loss_fn)(params, minibatch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    def update(carry: SeedState, key: jax.Array) -> tuple[SeedState, tuple]:
        step_key, reset_key, explore_key, action_key, epoch_key = jax.random.split(key, 5)
        eps = epsilon(carry.updates)
        # COLLECT TRAJECTORIES. All of the rollout's randomness is drawn here, in bulk (see envs.py for why).
        randomness = (jax.random.split(step_key, (n_steps, n_envs)),  # (T, N, 2)
                      jax.vmap(jax.vmap(env.reset))(jax.random.split(reset_key, (n_steps, n_envs))),  # (T, N, ...)
                      jax.random.uniform(explore_key, (n_steps, n_envs)),  # (T, N)
                      jax.random.randint(action_key, (n_steps, n_envs), 0, spec.action_dim, jnp.int32),  # (T, N)
                      jnp.broadcast_to(eps, (n_steps,)))
        carry, traj = jax.lax.scan(rollout_step, carry, randomness, unroll=run.unroll)  # traj: (T, N, ...)
        # Q(LAMBDA) TARGETS: max_a Q of the state each step really led to, in one batched pass. The parameters did
        # not change during the rollout, so these are the values the acting network saw (purejaxql reuses those).
        next_q = q_values(carry.params, traj.final_obs).max(axis=-1)  # (T, N)
        targets = lambda_returns(traj.reward, next_q, traj.terminated, traj.done, gamma=pqn.gamma, lam=pqn.q_lambda)
        # UPDATE NETWORK
        batch = {"obs": traj.obs, "action": traj.action, "target": targets}
        flat = jax.tree.map(lambda x: x.reshape(batch_size, *x.shape[2:]), batch)  # (T*N, ...)
        # Each epoch a fresh shuffle of the whole rollout, cut into equal minibatches (M, T*N/M, ...).
        (params, opt_state), losses = optimization.shuffled_epochs(
            radam_step, (carry.params, carry.opt_state), flat, key=epoch_key, epochs=pqn.update_epochs,
            minibatches=pqn.num_minibatches)
        carry = carry._replace(params=params, opt_state=opt_state, updates=carry.updates + 1)
        return carry, (losses.mean(), traj.q_taken.mean(), eps, traj.finished_return.sum(),
                       traj.finished_length.sum(), traj.done.sum())

    chunk = q_chunk.make_chunk(update, run.updates_per_chunk)
    return init, chunk


def make_act(cfg: RLConfig, env: Env) -> Actor:
    """The greedy policy, argmax_a Q, without memory: `act(params, seed_extra, obs (..., *obs_shape)) -> action
    (...)` as an Actor (algorithm.py)."""
    graphdef = qnetwork.make_graphdef(env.spec, cfg.model)

    def act(params: Any, seed_extra: dict[str, Any], obs: jax.Array) -> jax.Array:
        del seed_extra  # PQN's policy is its Q-network alone
        q = qnetwork.q_values(graphdef, params, obs)
        return jnp.argmax(q, axis=-1).astype(jnp.int32)

    return feed_forward(act)


ALGORITHM = Algorithm(
    name="PQN", make_optimizer=make_optimizer, make_seed_fns=make_seed_fns, make_act=make_act, seed_state=SeedState,
    metric_names=("loss", "q_value", "epsilon", "episode_return", "episode_length"),
    per_seed_metrics=("episode_return", "episode_length", "loss", "q_value"),
    nonfinite_advice="lower pqn.lr or pqn.max_grad_norm, or scale the rewards down (pqn.reward_scale), then rerun "
                     "the same command to resume; or set loop.nonfinite=skip to drop such steps and go on",
)
