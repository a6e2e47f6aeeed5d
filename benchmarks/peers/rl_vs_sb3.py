"""PPO on CartPole-v1: systolic (JAX, environments on the device, seeds vmapped) vs Stable-Baselines3 (PyTorch +
Gymnasium), same CPU, same PPO hyperparameters (the rl-cartpole recipe: PureJaxRL's CartPole settings).

    pip install -e '.[bench]'            # stable-baselines3, torch==2.13.0 (CPU), gymnasium
    python benchmarks/peers/rl_vs_sb3.py                    # systolic on 1 CPU device, then SB3; prints the ratio
    python benchmarks/peers/rl_vs_sb3.py --devices 2        # systolic on 2 CPU devices (one per core), seeds split
    python benchmarks/peers/rl_vs_sb3.py --skip-sb3 --sb3-steps-per-s 1270

Reported: environment steps per second (systolic: all seeds together, training only, compile excluded; SB3: its
`learn` loop, one seed) and the wall time until the mean return of training episodes reaches 475 (systolic:
the mean over seeds of the episodes each seed finished in a chunk, and also when every seed has; SB3: the mean
of its last 100 episodes, its own `ep_rew_mean`). Measured results are recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=1, help="CPU devices for systolic (XLA host devices)")
    parser.add_argument("--recipe", default="rl-cartpole")
    parser.add_argument("--target", type=float, default=475.0)
    parser.add_argument("--sb3-max-steps", type=int, default=500_000, help="SB3 stops here if it has not reached "
                        "the target")
    parser.add_argument("--skip-sb3", action="store_true")
    parser.add_argument("--sb3-steps-per-s", type=float, help="with --skip-sb3: a previously measured SB3 figure")
    parser.add_argument("overrides", nargs="*", help="systolic config overrides, e.g. rl.num_seeds=16")
    return parser.parse_args()


def run_systolic(args: argparse.Namespace) -> dict[str, float]:
    import jax

    from systolic import config as config_lib
    from systolic.config import MeshConfig
    from systolic.runtime import mesh as mesh_lib
    from systolic.runtime.sharding import activate
    from systolic.workloads.rl.config import RLConfig
    from systolic.workloads.rl.train import build_task

    cfg, _ = config_lib.load(RLConfig, args.recipe, args.overrides, "rl-cartpole")
    mesh = mesh_lib.make_mesh(MeshConfig(data=args.devices), jax.devices()[:args.devices])
    t_start = time.perf_counter()
    prepared = build_task(cfg, mesh)
    task, run = prepared.task, cfg.rl
    mean_at = all_at = None
    with activate(mesh):
        state = task.init_state()
        state, metrics = task.train_step(state, None)
        jax.block_until_ready(state)
        compile_s = time.perf_counter() - t_start
        t_train = time.perf_counter()
        history = [metrics]
        for chunk in range(2, run.num_chunks + 1):
            state, metrics = task.train_step(state, None)
            history.append(metrics)
            # Fetching every chunk's metrics is one small transfer; it lets us stop the clock at the target.
            values = jax.device_get(metrics)
            per_seed = [float(values[f"episode_return/seed{i}"]) for i in range(run.num_seeds)]
            now = time.perf_counter()
            if mean_at is None and sum(per_seed) / len(per_seed) >= args.target:
                mean_at = (now - t_start, chunk * run.env_steps_per_chunk)
            if all_at is None and min(per_seed) >= args.target:
                all_at = (now - t_start, chunk * run.env_steps_per_chunk)
        jax.block_until_ready(state)
        train_s = time.perf_counter() - t_train
        evaluation = task.evaluate(state)
    steps = (run.num_chunks - 1) * run.num_seeds * run.env_steps_per_chunk
    return {"steps_per_s": steps / train_s, "compile_s": compile_s, "train_s": train_s,
            "wall_s": time.perf_counter() - t_start, "seeds": run.num_seeds,
            "mean_at_s": mean_at[0] if mean_at else float("nan"), "mean_at_steps": mean_at[1] if mean_at else 0,
            "all_at_s": all_at[0] if all_at else float("nan"), "all_at_steps": all_at[1] if all_at else 0,
            "eval_min": evaluation["return_min"], "eval_mean": evaluation["return"]}


def run_sb3(args: argparse.Namespace) -> dict[str, float]:
    import numpy as np
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env

    torch.set_num_threads(1)  # measured faster than 2 threads for this 64x64 MLP on this CPU

    class StopAtTarget(BaseCallback):
        def __init__(self, t0: float):
            super().__init__()
            self.t0, self.reached = t0, None

        def _on_step(self) -> bool:
            return self.reached is None  # False stops learn()

        def _on_rollout_end(self) -> None:
            buffer = self.model.ep_info_buffer
            if self.reached is None and len(buffer) >= 10 and np.mean([e["r"] for e in buffer]) >= args.target:
                self.reached = (time.perf_counter() - self.t0, self.num_timesteps)

    # The same PPO as the rl-cartpole recipe: 4 envs x 128 steps, 4 epochs of 4 minibatches (128), lr 2.5e-4
    # linearly annealed, gamma 0.99, GAE 0.95, clip 0.2, entropy 0.01, value 0.5, grad norm 0.5, 64x64 tanh MLPs.
    env = make_vec_env("CartPole-v1", n_envs=4, seed=0)
    model = PPO("MlpPolicy", env, n_steps=128, batch_size=128, n_epochs=4, learning_rate=lambda f: 2.5e-4 * f,
                gamma=0.99, gae_lambda=0.95, clip_range=0.2, ent_coef=0.01, vf_coef=0.5, max_grad_norm=0.5,
                seed=0, device="cpu", verbose=0)
    t0 = time.perf_counter()
    callback = StopAtTarget(t0)
    model.learn(total_timesteps=args.sb3_max_steps, callback=callback)
    wall = time.perf_counter() - t0
    return {"steps_per_s": model.num_timesteps / wall, "wall_s": wall, "steps": model.num_timesteps,
            "at_s": callback.reached[0] if callback.reached else float("nan"),
            "at_steps": callback.reached[1] if callback.reached else 0}


def main() -> int:
    args = parse()
    # XLA reads the host device count once, when jax starts: set it before importing anything that imports jax.
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from systolic.runtime import cpu_tuning

    # systolic's XLA:CPU choices for rl, as `systolic train rl` makes them (without the allocator setting).
    cpu_tuning.apply_at_start(workload="rl", stepping=False)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f} at start; python {sys.version.split()[0]}")
    s = run_systolic(args)
    print(f"systolic ({args.recipe}, {s['seeds']} seeds on {args.devices} CPU device(s)): "
          f"{s['steps_per_s']:,.0f} env steps/s; first chunk (compile) {s['compile_s']:.1f} s; "
          f"mean return >= {args.target:g} after {s['mean_at_s']:.1f} s ({s['mean_at_steps']:,} steps per seed), "
          f"every seed after {s['all_at_s']:.1f} s ({s['all_at_steps']:,}); final deterministic evaluation: mean "
          f"{s['eval_mean']:.1f}, worst seed {s['eval_min']:.1f}; wall {s['wall_s']:.1f} s")
    if args.skip_sb3:
        if args.sb3_steps_per_s:
            print(f"ratio (env steps/s, given SB3 {args.sb3_steps_per_s:,.0f}): "
                  f"{s['steps_per_s'] / args.sb3_steps_per_s:.0f}x")
        return 0
    b = run_sb3(args)
    reached = (f"{b['at_s']:.1f} s ({b['at_steps']:,} steps)" if b["at_steps"]
               else f"not within {b['steps']:,} steps")
    print(f"stable-baselines3 (1 seed, 4 envs, torch 1 thread): {b['steps_per_s']:,.0f} env steps/s; "
          f"ep_rew_mean >= {args.target:g} after {reached}; wall {b['wall_s']:.1f} s")
    print(f"ratio (env steps/s): {s['steps_per_s'] / b['steps_per_s']:.0f}x; "
          f"per seed: {s['steps_per_s'] / s['seeds'] / b['steps_per_s']:.1f}x")
    if b["at_steps"] and s["mean_at_steps"]:
        print(f"ratio (wall time to mean return {args.target:g}, systolic including compile): "
              f"{b['at_s'] / s['mean_at_s']:.1f}x")
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
