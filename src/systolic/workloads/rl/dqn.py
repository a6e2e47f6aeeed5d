"""DQN (Mnih et al. 2015; purejaxrl's `dqn.py`) with a replay buffer on the device, as pure functions of one seed.

Each update: `rl.num_steps` epsilon-greedy steps from each of `rl.num_envs` environments go into the seed's replay
buffer (replay.py); then, once `dqn.learning_starts` environment steps are done, `dqn.gradient_steps` Adam steps,
each on `dqn.batch_size` transitions sampled uniformly from the buffer, regress Q(s, a) on the one-step target
r + gamma * (1 - terminated) * max_a' Q_target(s', a'). The target network is a copy of the online one, refreshed
every `dqn.target_update_every` environment steps. The buffer, the target network and the exploration clock are
part of the seed's state, so they are checkpointed and a resumed run continues bit for bit.

A stored transition keeps the observation its step really led to (`EnvStep.final_obs`, before any reset) and whether
the episode *terminated*, so a time-limit truncation bootstraps from Q_target of that observation. The Q-network is
qnetwork.py's (LayerNorm after every hidden layer, as PQN's) and the gradient norm is clipped (`dqn.max_grad_norm`).
Where this departs from purejaxrl: docs/design-notes.md, this module's section.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from systolic.workloads.rl import optimization, q_chunk, qnetwork, replay
from systolic.workloads.rl.algorithm import Actor, Algorithm, feed_forward
from systolic.workloads.rl.config import RLConfig
from systolic.workloads.rl.env_api import Env
from systolic.workloads.rl.policy import pick


def td_targets(rewards: jax.Array, next_q_target: jax.Array, terminated: jax.Array, *, gamma: float) -> jax.Array:
    """One-step targets r + gamma * (1 - terminated) * max_a' Q_target(s', a'); all inputs (B,), next_q_target being
    the max already, of the observation the step led to (pre-reset: a truncated step bootstraps from it)."""
    return rewards + gamma * (1.0 - terminated.astype(jnp.float32)) * next_q_target


class SeedState(NamedTuple):
    """Everything one seed carries from update to update (train.py stores it in a TrainState)."""

    params: Any
    opt_state: Any
    env_state: dict[str, jax.Array]  # (N, ...)
    obs: jax.Array  # (N, *obs_shape) observation to act on next
    episode_return: jax.Array  # (N,) undiscounted return of the running episode
    episode_length: jax.Array  # (N,) int32
    target_params: Any  # the target network: a copy of params, refreshed every dqn.target_update_every env steps
    buffer: replay.ReplayBuffer  # dqn.buffer_size transitions: obs, action, reward, next_obs, terminated
    last_return: jax.Array  # () mean return of the latest chunk with a finished episode
    last_length: jax.Array  # ()
    updates: jax.Array  # () int32 updates done: the clock of exploration, learning start and target copies


def make_optimizer(cfg: RLConfig) -> optax.GradientTransformation:
    """Adam with global-norm clipping; with `dqn.anneal_lr` the learning rate decays linearly to 0 over the run."""
    dqn = cfg.dqn
    steps = cfg.rl.num_updates * dqn.gradient_steps
    return optimization.make_optimizer(optax.adam, lr=dqn.lr, max_grad_norm=dqn.max_grad_norm,
                                       anneal_steps=steps if dqn.anneal_lr else 0)


def make_epsilon(cfg: RLConfig) -> optax.Schedule:
    """Update count -> exploration rate (q_chunk.epsilon_schedule of the dqn section)."""
    return q_chunk.epsilon_schedule(cfg.dqn, cfg.rl.num_updates)


def make_seed_fns(cfg: RLConfig, env: Env, tx: optax.GradientTransformation):
    """Returns (init, chunk) for one seed: `init(key) -> SeedState`, `chunk(SeedState, key) -> (SeedState,
    ChunkMetrics)`."""
    spec, dqn, run = env.spec, cfg.dqn, cfg.rl
    graphdef = qnetwork.make_graphdef(spec, cfg.model)
    n_envs, n_steps = run.num_envs, run.num_steps
    steps_per_update = run.env_steps_per_update
    epsilon = make_epsilon(cfg)

    def q_values(params: Any, obs: jax.Array) -> jax.Array:
        return qnetwork.q_values(graphdef, params, obs)

    def init(key: jax.Array) -> SeedState:
        net_key, env_key = jax.random.split(key)
        params = qnetwork.init_params(spec, cfg.model, key=net_key)
        obs, env_state = jax.vmap(env.reset)(jax.random.split(env_key, n_envs))
        example = {"obs": obs[0], "action": jnp.zeros((), jnp.int32), "reward": jnp.zeros((), jnp.float32),
                   "next_obs": obs[0], "terminated": jnp.zeros((), bool)}
        zero = jnp.zeros((), jnp.float32)
        return SeedState(params=params, opt_state=tx.init(params), env_state=env_state, obs=obs,
                         episode_return=jnp.zeros((n_envs,), jnp.float32),
                         episode_length=jnp.zeros((n_envs,), jnp.int32), target_params=params,
                         buffer=replay.init_buffer(dqn.buffer_size, example), last_return=zero, last_length=zero,
                         updates=jnp.zeros((), jnp.int32))

    def rollout_step(carry: SeedState, randomness) -> tuple[SeedState, tuple]:
        env_keys, resets, explore, random_action, eps = randomness  # (N, 2), reset states, (N,), (N,), ()
        greedy = jnp.argmax(q_values(carry.params, carry.obs), axis=-1).astype(jnp.int32)  # (N,)
        action = jnp.where(explore < eps, random_action, greedy)
        step = jax.vmap(env.step)(env_keys, carry.env_state, action, resets)
        done = step.terminated | step.truncated
        episode_return = carry.episode_return + step.reward
        episode_length = carry.episode_length + 1
        transition = {"obs": carry.obs, "action": action, "reward": step.reward, "next_obs": step.final_obs,
                      "terminated": step.terminated}
        finished = (jnp.where(done, episode_return, 0.0), jnp.where(done, episode_length, 0).astype(jnp.float32),
                    done)
        carry = carry._replace(env_state=step.state, obs=step.obs,
                               episode_return=jnp.where(done, 0.0, episode_return),
                               episode_length=jnp.where(done, 0, episode_length))
        return carry, (transition, finished)

    def loss_fn(params: Any, target_params: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        next_q = q_values(target_params, batch["next_obs"]).max(axis=-1)  # (B,)
        targets = td_targets(batch["reward"], next_q, batch["terminated"], gamma=dqn.gamma)
        q = q_values(params, batch["obs"])  # (B, A)
        q_taken = pick(q, batch["action"])  # (B,)
        return 0.5 * jnp.square(q_taken - targets).mean(), q_taken.mean()

    def gradient_step(carry, key):
        params, opt_state, target_params, buffer = carry
        batch = replay.sample(buffer, dqn.batch_size, key=key)
        (loss, q_mean), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, target_params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, target_params, buffer), (loss, q_mean)

    def update(carry: SeedState, key: jax.Array) -> tuple[SeedState, tuple]:
        step_key, reset_key, explore_key, action_key, learn_key = jax.random.split(key, 5)
        eps = epsilon(carry.updates)
        # COLLECT TRANSITIONS. All of the rollout's randomness is drawn here, in bulk (see envs.py for why).
        randomness = (jax.random.split(step_key, (n_steps, n_envs)),  # (T, N, 2)
                      jax.vmap(jax.vmap(env.reset))(jax.random.split(reset_key, (n_steps, n_envs))),  # (T, N, ...)
                      jax.random.uniform(explore_key, (n_steps, n_envs)),  # (T, N)
                      jax.random.randint(action_key, (n_steps, n_envs), 0, spec.action_dim, jnp.int32),  # (T, N)
                      jnp.broadcast_to(eps, (n_steps,)))
        carry, (transitions, (finished_return, finished_length, done)) = jax.lax.scan(
            rollout_step, carry, randomness, unroll=run.unroll)
        # STORE: time-major, so the buffer's order is the order of experience.
        flat = jax.tree.map(lambda x: x.reshape(steps_per_update, *x.shape[2:]), transitions)  # (T*N, ...)
        buffer = replay.add(carry.buffer, flat)
        # LEARN, once enough experience is in: the gradient steps run either way (under vmap a branch would run both
        # sides anyway) and their result is kept only when it is time.
        env_steps = (carry.updates + 1) * steps_per_update  # per seed, after this update's rollout
        learning = env_steps >= dqn.learning_starts
        (params, opt_state, _, _), (losses, q_means) = jax.lax.scan(
            gradient_step, (carry.params, carry.opt_state, carry.target_params, buffer),
            jax.random.split(learn_key, dqn.gradient_steps))
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(learning, n, o), new, old)  # noqa: E731
        params, opt_state = keep(params, carry.params), keep(opt_state, carry.opt_state)
        # TARGET NETWORK: copied when this update crosses a multiple of target_update_every environment steps.
        crossed = env_steps // dqn.target_update_every > (env_steps - steps_per_update) // dqn.target_update_every
        target_params = jax.tree.map(lambda p, t: jnp.where(crossed, p, t), params, carry.target_params)
        carry = carry._replace(params=params, opt_state=opt_state, target_params=target_params, buffer=buffer,
                               updates=carry.updates + 1)
        loss = jnp.where(learning, losses.mean(), 0.0)
        return carry, (loss, q_means.mean(), eps, finished_return.sum(), finished_length.sum(), done.sum())

    chunk = q_chunk.make_chunk(update, run.updates_per_chunk)
    return init, chunk


def make_act(cfg: RLConfig, env: Env) -> Actor:
    """The greedy policy, argmax_a Q, without memory: `act(params, seed_extra, obs (..., *obs_shape)) -> action
    (...)` as an Actor (algorithm.py)."""
    graphdef = qnetwork.make_graphdef(env.spec, cfg.model)

    def act(params: Any, seed_extra: dict[str, Any], obs: jax.Array) -> jax.Array:
        del seed_extra  # the online network alone acts; the target network and the buffer are for learning
        return jnp.argmax(qnetwork.q_values(graphdef, params, obs), axis=-1).astype(jnp.int32)

    return feed_forward(act)


ALGORITHM = Algorithm(
    name="DQN", make_optimizer=make_optimizer, make_seed_fns=make_seed_fns, make_act=make_act, seed_state=SeedState,
    metric_names=("loss", "q_value", "epsilon", "episode_return", "episode_length"),
    per_seed_metrics=("episode_return", "episode_length", "loss", "q_value"),
    nonfinite_advice="lower dqn.lr or dqn.max_grad_norm, then rerun the same command to resume; or set "
                     "loop.nonfinite=skip to drop such steps and go on",
)
