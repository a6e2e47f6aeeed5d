"""The rl workload's `Task`: an algorithm's seeds vmapped into one train state, sharded over the mesh, chunked
for the loop.

One engine loop step = one chunk of `rl.updates_per_chunk` updates of the algorithm (`algo`: PPO, PQN or DQN,
algorithm.py) for every seed. Layout of the `TrainState` (S seeds, N environments per seed): `params` and
`opt_state` with a leading seed axis (S, ...); `extra["envs"]`, the environments' states, observations and running
episode statistics (and a recurrent policy's hidden states), (S, N, ...); `extra["seeds"]`, the rest of each seed's
state, (S, ...); `rng`, the run's key, from which each chunk splits a key and folds in the seed index, so seed i's
stream does not depend on how many seeds run beside it. What `extra["seeds"]` holds per algorithm:
docs/design-notes.md, this module's section.

Sharding: the seed axis is split over the mesh's data-parallel axes when the seed count divides evenly (every
device trains whole seeds, nothing is communicated); otherwise the environment axis is, and XLA averages the
gradients of each minibatch across devices.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from systolic.engine.loop import Task
from systolic.engine.step import jit_step
from systolic.engine.state import TrainState, make_sharded_state
from systolic.errors import ConfigError
from systolic.runtime import memory
from systolic.runtime import mesh as mesh_lib
from systolic.runtime.cpu_tuning import cpu_compiler_options
from systolic.workloads.rl import algorithm as algorithm_lib
from systolic.workloads.rl.algorithm import Algorithm
from systolic.workloads.rl.config import RLConfig
from systolic.workloads.rl.env_api import Env
from systolic.workloads.rl.envs import make_env
from systolic.workloads.rl.episodes import make_episode_fn

DATA_AXES = ("data", "fsdp")  # the mesh axes that carry independent experience
CHECKED = ("loss",)  # every seed's chunk loss (mean; PQN, DQN: the TD loss); the guard also checks every parameter


def choose_layout(cfg: RLConfig, mesh: Mesh) -> str:
    """'seeds' or 'envs': which axis of the experience is split over the data-parallel devices."""
    dp = mesh_lib.data_parallel_size(mesh)
    if cfg.rl.num_seeds % dp == 0:
        return "seeds"
    if cfg.rl.num_envs % dp == 0:
        return "envs"
    raise ConfigError(
        f"rl.num_seeds={cfg.rl.num_seeds} and rl.num_envs={cfg.rl.num_envs}: neither splits evenly over the {dp} "
        f"data-parallel devices of the mesh ({mesh_lib.describe(mesh)}). The rl workload gives each device whole "
        f"seeds, or else an equal share of every seed's environments. Fix: use a multiple of {dp} for one of them "
        f"(e.g. rl.num_seeds={dp * max(1, round(cfg.rl.num_seeds / dp))}), or a smaller mesh.data."
    )


def state_shardings(abstract: TrainState, mesh: Mesh, layout: str) -> TrainState:
    replicated = NamedSharding(mesh, P())
    per_seed = NamedSharding(mesh, P(DATA_AXES) if layout == "seeds" else P())
    per_env = NamedSharding(mesh, P(DATA_AXES) if layout == "seeds" else P(None, DATA_AXES))

    def seed_leaf(x):
        return per_seed if x.ndim else replicated

    return TrainState(step=replicated, params=jax.tree.map(seed_leaf, abstract.params),
                      opt_state=jax.tree.map(seed_leaf, abstract.opt_state), rng=replicated,
                      extra={"envs": jax.tree.map(lambda _: per_env, abstract.extra["envs"]),
                             "seeds": jax.tree.map(seed_leaf, abstract.extra["seeds"])})


def to_train_state(step: jax.Array, rng: jax.Array, seeds: NamedTuple, env_fields: tuple[str, ...]) -> TrainState:
    fields = seeds._asdict()
    params, opt_state = fields.pop("params"), fields.pop("opt_state")
    envs = {name: fields.pop(name) for name in env_fields}
    return TrainState(step=step, params=params, opt_state=opt_state, rng=rng, extra={"envs": envs, "seeds": fields})


def from_train_state(state: TrainState, seed_state: type) -> Any:
    return seed_state(params=state.params, opt_state=state.opt_state, **state.extra["envs"], **state.extra["seeds"])


def seed_keys(key: jax.Array, num_seeds: int) -> jax.Array:
    """(S, 2) keys: seed i's key is `fold_in(key, i)`, the same whatever the number of seeds."""
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.arange(num_seeds))


@dataclasses.dataclass
class BuiltRLTask:
    """What `build_task` returns: the engine's `Task`, and beside it the environment and the layout the entry
    reports."""

    task: Task
    env: Env
    layout: str  # "seeds" or "envs": what is split over the data-parallel devices


def algorithm_for(cfg: RLConfig, env: Env) -> Algorithm:
    """The algorithm `algo` chose, checked against the environment."""
    if cfg.algo in ("pqn", "dqn") and not env.spec.discrete:
        raise ConfigError(
            f"algo={cfg.algo} on {env.spec.name}: {cfg.algo.upper()} learns a Q-value per action, so it needs "
            f"discrete actions, and "
            f"{env.spec.name}'s are continuous. Fix: train it with PPO (--recipe rl-pendulum), or pick a discrete "
            "environment (CartPole-v1, Acrobot-v1, Breakout-MinAtar, ...)."
        )
    return algorithm_lib.get(cfg.algo, recurrent=cfg.model.gru_size > 0)


def memory_bytes(cfg: RLConfig, env: Env) -> int:
    """A lower bound on a run's memory: each seed's float32 network with its gradient and Adam moments, and one
    update's rollout (observations, actions, rewards, done flags) of every environment of every seed."""
    run, net, obs = cfg.rl, cfg.model, env.spec.obs_size
    network = obs * net.hidden + (net.layers - 1) * net.hidden**2 + net.hidden * env.spec.action_dim
    rollout = run.num_envs * run.num_steps * (obs + 3)
    if net.gru_size:  # the GRU's weights, and the hidden state of every rollout step (kept for bootstrapping)
        network += 3 * net.gru_size * (net.hidden + net.gru_size)
        rollout += run.num_envs * run.num_steps * net.gru_size
    return run.num_seeds * 4 * (4 * network + rollout)


def check_fits(cfg: RLConfig, env: Env, mesh: Mesh) -> None:
    """A UserError, before anything is traced, when the run cannot fit in the mesh's memory."""
    run = cfg.rl
    memory.check_fits(
        memory_bytes(cfg, env), list(mesh.devices.flat),
        what=(f"This rl run ({run.num_seeds} seeds x {run.num_envs} environments x {run.num_steps} steps of "
              f"{env.spec.name}, model.hidden={cfg.model.hidden} x model.layers={cfg.model.layers})"),
        fix="lower rl.num_envs, rl.num_steps, rl.num_seeds or model.hidden, or use more devices.",
    )


def make_state_fns(cfg: RLConfig, env: Env, mesh: Mesh, layout: str):
    """Returns (init_state, chunk_step, abstract_state, shardings); `chunk_step(state, None)` is jitted."""
    check_fits(cfg, env, mesh)
    algo = algorithm_for(cfg, env)
    tx = algo.make_optimizer(cfg)
    init_seed, chunk_seed = algo.make_seed_fns(cfg, env, tx)
    num_seeds = cfg.rl.num_seeds

    def make_state(key: jax.Array) -> TrainState:
        init_key, rng = jax.random.split(key)
        # lax.map, not vmap: a vmapped orthogonal init is a batched QR, and jaxlib's CPU QR kernel splits a batch
        # over the same thread pool it runs on; two of them at once (actor and critic) can wait on each other
        # forever (measured: 1 in 4 runs hung on 2 cores). One seed at a time keeps every QR unbatched.
        seeds = jax.lax.map(init_seed, seed_keys(init_key, num_seeds))
        return to_train_state(jnp.zeros((), jnp.int32), rng, seeds, algo.env_fields)

    def chunk_step(state: TrainState, batch: None) -> tuple[TrainState, dict[str, jax.Array]]:
        del batch  # the environments make the data
        rng, chunk_key = jax.random.split(state.rng)
        seeds, metrics = jax.vmap(chunk_seed)(from_train_state(state, algo.seed_state),
                                              seed_keys(chunk_key, num_seeds))
        return to_train_state(state.step + 1, rng, seeds, algo.env_fields), flatten_metrics(algo, metrics)

    state = make_sharded_state(make_state, (jax.random.PRNGKey(cfg.rl.seed),),
                               lambda abstract: state_shardings(abstract, mesh, layout))
    shardings = state.shardings
    step = jit_step(chunk_step, state_shardings=shardings, batch_sharding=None, mesh=mesh, loop=cfg.loop,
                    check=CHECKED, compiler_options=cpu_compiler_options(1))
    return state.init, step, state.abstract, shardings


def flatten_metrics(algo: Algorithm, metrics: NamedTuple) -> dict[str, jax.Array]:
    """Per-seed (S,) metrics -> scalars the loop logs: the mean over seeds under each name, the worst seed's
    return, and `<name>/seed<i>` for the per-seed curves."""
    out = {name: getattr(metrics, name).mean() for name in algo.metric_names}
    out["episode_return_min"] = metrics.episode_return.min()
    out["episodes"] = metrics.episodes.sum()
    for name in algo.per_seed_metrics:
        values = getattr(metrics, name)
        for i in range(values.shape[0]):
            out[f"{name}/seed{i}"] = values[i]
    return out


def make_seed_evaluator(cfg: RLConfig, env: Env, episodes: int):
    """Jitted `(params, seed_extra, key) -> (returns, lengths)`, each (S, E): every seed's deterministic policy;
    `seed_extra` is the train state's `extra["seeds"]`."""
    run = make_episode_fn(env, algorithm_for(cfg, env).make_act(cfg, env), episodes)

    @jax.jit(compiler_options=cpu_compiler_options(1))
    def evaluate_seeds(params, seed_extra, key):
        return jax.vmap(run, in_axes=(0, 0, None))(params, seed_extra, key)

    return evaluate_seeds


def eval_summary(returns: np.ndarray, lengths: np.ndarray) -> dict[str, float]:
    """(S, E) episode returns -> logged metrics: overall mean, worst seed's mean, each seed's mean."""
    per_seed = returns.mean(axis=1)
    out = {"return": float(per_seed.mean()), "return_min": float(per_seed.min()),
           "length": float(lengths.mean())}
    out.update({f"return/seed{i}": float(r) for i, r in enumerate(per_seed)})
    return out


def build_task(cfg: RLConfig, mesh: Mesh) -> BuiltRLTask:
    env = make_env(cfg.env)
    layout = choose_layout(cfg, mesh)
    init, step, abstract, _ = make_state_fns(cfg, env, mesh, layout)
    evaluate_seeds = make_seed_evaluator(cfg, env, cfg.rl.eval_episodes)
    eval_key = jax.random.PRNGKey(cfg.rl.seed + 1)

    def evaluate(state: TrainState) -> dict[str, float]:
        # The same episodes (same key) at every evaluation, so curves compare policies, not luck.
        returns, lengths = jax.device_get(evaluate_seeds(state.params, state.extra["seeds"], eval_key))
        return eval_summary(np.asarray(returns), np.asarray(lengths))

    run = cfg.rl
    task = Task(
        workload="rl",
        abstract_state=abstract,
        init_state=init,
        train_step=step,
        data=None,
        evaluate=evaluate,
        items_per_step=run.num_seeds * run.env_steps_per_chunk,
        item_unit="env_steps",
        check=CHECKED,
        nonfinite_advice=algorithm_for(cfg, env).nonfinite_advice,
        meta={"workload": "rl", "env": cfg.env.name, "algo": cfg.algo},
    )
    return BuiltRLTask(task=task, env=env, layout=layout)

