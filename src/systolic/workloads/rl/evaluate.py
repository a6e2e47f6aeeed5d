"""`systolic eval rl RUN_DIR`: every seed's trained policy, in its own simulator (gymnax, Brax) or in Gymnasium's
reference implementation (classic control only).

The Gymnasium check is independent of everything the policy was trained with: another simulator (Gymnasium's
own NumPy code, with its own time limit), the policy's weights copied out of the checkpoint, actions chosen
deterministically (argmax / Gaussian mean). It sees what the agent saw in training: Gymnasium's observations
pass through the same `env.hide_obs` mask (`envs.obs_view`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np

from systolic.config import MeshConfig
from systolic.engine import finished
from systolic.engine.state import TrainState
from systolic.errors import UserError
from systolic.runtime import mesh as mesh_lib
from systolic.runtime.sharding import activate
from systolic.workloads.rl import render
from systolic.workloads.rl.algorithm import Actor
from systolic.workloads.rl.config import RLConfig
from systolic.workloads.rl.env_api import Env
from systolic.workloads.rl.envs import SOLVED_AT, make_env, obs_view
from systolic.workloads.rl.train import algorithm_for, make_seed_evaluator, make_state_fns

# gymnax name -> Gymnasium id of the same environment (same observations, actions, rewards and time limit).
GYMNASIUM_IDS = {name: name for name in ("CartPole-v1", "Pendulum-v1", "Acrobot-v1", "MountainCar-v0",
                                         "MountainCarContinuous-v0")}


@dataclasses.dataclass
class RestoredRun:
    cfg: RLConfig
    env: Env
    state: TrainState
    step: int


def restore_run(run_dir: Path) -> RestoredRun:
    """The run's config and its newest intact checkpoint, on one device (whatever mesh it was trained on)."""
    with finished.open_run(run_dir, RLConfig, "systolic eval rl") as run:
        cfg: RLConfig = run.cfg
        env = make_env(cfg.env)
        mesh = mesh_lib.make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])
        with activate(mesh):
            _, _, abstract, _ = make_state_fns(cfg, env, mesh, "seeds")
            state = run.restore(abstract)
    return RestoredRun(cfg=cfg, env=env, state=state, step=run.step)


def make_act(cfg: RLConfig, env: Env) -> Actor:
    """The deterministic policy of every seed, jitted: `act(params, seed_extra, obs (S, B, *obs_shape), carry (S, B,
    C)) -> (actions (S, B, ...), carry)`."""
    actor = algorithm_for(cfg, env).make_act(cfg, env)
    return actor._replace(act=jax.jit(jax.vmap(actor.act)))


def gymnasium_returns(run: RestoredRun, episodes: int, seed: int) -> np.ndarray:
    """(S, E) undiscounted returns of each seed's deterministic policy in Gymnasium's implementation."""
    spec = run.env.spec
    if spec.name not in GYMNASIUM_IDS:
        raise UserError(f"--gymnasium: {spec.name} has no counterpart in Gymnasium that this check knows. Supported: "
                        f"{', '.join(GYMNASIUM_IDS)}. Fix: drop --gymnasium for this environment.")
    try:
        import gymnasium
    except ImportError:
        raise UserError("--gymnasium needs the gymnasium package, an optional dependency. Fix: "
                        "pip install 'systolic[dev]' (or pip install gymnasium).") from None
    num_seeds = run.cfg.rl.num_seeds
    envs = [[gymnasium.make(GYMNASIUM_IDS[spec.name], max_episode_steps=spec.max_episode_steps,
                            disable_env_checker=True) for _ in range(episodes)] for _ in range(num_seeds)]
    obs = np.zeros((num_seeds, episodes, *spec.obs_shape), np.float32)
    for s in range(num_seeds):
        for e in range(episodes):
            # The same start states for every seed's policy: episode e starts from seed + e.
            obs[s, e] = envs[s][e].reset(seed=seed + e)[0]
    returns = np.zeros((num_seeds, episodes))
    alive = np.ones((num_seeds, episodes), bool)
    actor, view = make_act(run.cfg, run.env), obs_view(run.cfg.env.hide_obs, spec)
    memory = actor.initial_carry((num_seeds, episodes))  # an episode ends only once here: never reset
    params, seed_extra = run.state.params, run.state.extra["seeds"]
    while alive.any():
        actions, memory = actor.act(params, seed_extra, view(obs), memory)
        actions = np.asarray(actions)  # (S, E) or (S, E, D)
        for s, e in zip(*np.nonzero(alive)):
            action = int(actions[s, e]) if spec.discrete else actions[s, e].astype(np.float32)
            next_obs, reward, terminated, truncated, _ = envs[s][e].step(action)
            obs[s, e] = next_obs
            returns[s, e] += float(reward)
            alive[s, e] = not (terminated or truncated)
    for row in envs:
        for env in row:
            env.close()
    return returns


def device_returns(run: RestoredRun, episodes: int, seed: int) -> np.ndarray:
    evaluate_seeds = make_seed_evaluator(run.cfg, run.env, episodes)
    returns, _ = evaluate_seeds(run.state.params, run.state.extra["seeds"], jax.random.PRNGKey(seed))
    return np.asarray(returns)


def episode_observations(run: RestoredRun, seed_index: int, key: jax.Array) -> np.ndarray:
    """(T, *obs_shape) observations of one deterministic gymnax episode of one seed's policy, up to its end."""
    env, spec = run.env, run.env.spec
    actor = make_act(run.cfg, env)
    memory = actor.initial_carry((1, 1))
    params = jax.tree.map(lambda x: x[seed_index:seed_index + 1], run.state.params)
    seed_extra = jax.tree.map(lambda x: x[seed_index:seed_index + 1], run.state.extra["seeds"])
    reset_key, key = jax.random.split(key)
    obs, env_state = env.reset(reset_key)
    step = jax.jit(env.step)
    frames = [np.asarray(obs)]
    for _ in range(spec.max_episode_steps):
        key, step_key = jax.random.split(key)
        action, memory = actor.act(params, seed_extra, obs[None, None], memory)
        action = action[0, 0]
        out = step(step_key, env_state, action, (obs, env_state))  # the episode ends at its first end
        if bool(out.terminated | out.truncated):
            frames.append(np.asarray(out.final_obs))
            break
        obs, env_state = out.obs, out.state
        frames.append(np.asarray(obs))
    return np.stack(frames)


def evaluate_run(run_dir: Path, *, episodes: int, use_gymnasium: bool, gif: Path | None, seed: int) -> str:
    if episodes <= 0:
        raise UserError(f"--episodes {episodes}: the number of episodes per seed must be at least 1. Fix: e.g. "
                        "--episodes 100.")
    run = restore_run(Path(run_dir))
    name = run.env.spec.name
    if gif is not None:
        render.check_renderable(name, run.env.spec.obs_shape)  # before the slow part
    where = f"Gymnasium {GYMNASIUM_IDS.get(name, name)}" if use_gymnasium else f"{run.env.simulator} {name}"
    returns = gymnasium_returns(run, episodes, seed) if use_gymnasium else device_returns(run, episodes, seed)
    lines = [f"{run_dir}: checkpoint step {run.step}; {episodes} episodes per seed in {where}, deterministic policy"]
    for i, row in enumerate(returns):
        lines.append(f"  seed {i}: mean return {row.mean():8.2f}  std {row.std():7.2f}  min {row.min():8.2f}")
    per_seed = returns.mean(axis=1)
    lines.append(f"  all seeds: mean {per_seed.mean():.2f}, worst seed {per_seed.min():.2f}")
    if name in SOLVED_AT:
        solved = int((per_seed >= SOLVED_AT[name]).sum())
        lines.append(f"  {solved}/{len(per_seed)} seeds reach the target mean return {SOLVED_AT[name]:g}")
    if gif is not None:
        best = int(np.argmax(per_seed))
        observations = episode_observations(run, best, jax.random.PRNGKey(seed))
        path = render.save_gif(name, observations, gif)
        lines.append(f"  GIF of one gymnax episode of seed {best} ({len(observations) - 1} steps): {path}")
    return "\n".join(lines)
