"""PPO on CartPole-v1: `systolic train rl --recipe rl-cartpole` against PureJaxRL's `ppo.py`, same machine, same
hyperparameters, seeds and environment steps, alternated runs.

    python benchmarks/peers/rl_vs_purejaxrl.py                # 3 pairs, the order flipped every pair
    python benchmarks/peers/rl_vs_purejaxrl.py --pairs 5
    python benchmarks/peers/rl_vs_purejaxrl.py --platform cpu --set rl.num_envs=2048 rl.updates_per_chunk=8 \
        rl.total_env_steps=4194304                      # the wide configuration: 2,048 environments x 8 seeds

Platform: each side's process runs where the caller's environment says (JAX_PLATFORMS as set, or unset: JAX's
choice, the TPU on the lent chip's machine), with the caller's PYTHONPATH kept after src/ (the chip's jax and the
carried wheels live there); `--platform cpu` (or tpu) sets JAX_PLATFORMS for both sides. On a machine without an
accelerator the default is the CPU run of docs/benchmarks.md. The parent process never starts a JAX backend (one
process at a time may hold a TPU): the float32 matmul peak is measured in a child process too. `--set KEY=VALUE`
overrides the recipe for both sides (rl.* and ppo.* keys: PureJaxRL's config is read from the overridden recipe).

PureJaxRL side: `make_train` below is PureJaxRL's `purejaxrl/ppo.py` (github.com/luchris429/purejaxrl, commit
31756b1), re-implemented line for line with two adaptations, both marked ADAPTED: gymnax 1.0.1's `step` returns
`terminated` and `truncated` where the gymnax of ppo.py returned one `done` (ppo.py's `done` is their OR), and
distrax (not installed) is replaced by the few lines of its `Categorical` that ppo.py uses. The seeds are vmapped
as PureJaxRL's README does: `jax.jit(jax.vmap(make_train(config)))(jax.random.split(PRNGKey(seed), num_seeds))`.
Its hyperparameters, seed count, base seed and update count are read from the rl-cartpole recipe, so both sides
run the same number of environment steps (systolic rounds `rl.total_env_steps` up to whole chunks; PureJaxRL's
TOTAL_TIMESTEPS is set to that rounded count). It runs in a plain JAX process: no systolic XLA flags.

systolic side: the real CLI, `python -m systolic train rl --recipe rl-cartpole` (evaluation, checkpoints, metrics
and plots included, as a user runs it), in its own process, with its persistent compilation cache off
(SYSTOLIC_COMPILE_CACHE=off) so that both sides compile from scratch in every run.

Reported per run: env steps/s (all seeds; steady state: systolic's `throughput:` line, which leaves out the
compiling first chunk, evaluations and checkpoint saves; PureJaxRL: the steps of the compiled program over its
execution time, compilation timed apart), wall time of the whole process, and each seed's final training return
(the mean return of the episodes that ended in the last 16 updates, systolic's last chunk: the same measure on both
sides). Then
the medians, their ratio, and the achieved FLOP/s of PPO's matmuls (rollout forward + update epochs forward and
backward, counted from the network sizes) as a fraction of a 2048^2 float32 matmul measured in this run (before
and after the pairs; the higher of the two is the peak, as the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RECIPE = "rl-cartpole"
HERE = Path(__file__).resolve()
SRC = str(HERE.parents[2] / "src")


# PUREJAXRL'S ppo.py ----------------------------------------------------------------------------------------------


def make_train(config):
    """PureJaxRL's `make_train` (purejaxrl/ppo.py), the loop as published; see the module docstring."""
    import flax.linen as nn
    import gymnax
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax.linen.initializers import constant, orthogonal
    from flax.training.train_state import TrainState
    from gymnax.wrappers.purerl import FlattenObservationWrapper, LogWrapper
    from typing import NamedTuple

    class Categorical(NamedTuple):  # ADAPTED: distrax.Categorical's sample, log_prob and entropy
        logits: jax.Array

        def sample(self, seed):
            return jax.random.categorical(seed, self.logits)

        def log_prob(self, value):
            log_p = jax.nn.log_softmax(self.logits)
            return jnp.take_along_axis(log_p, value[..., None], axis=-1)[..., 0]

        def entropy(self):
            log_p = jax.nn.log_softmax(self.logits)
            return -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)

    class ActorCritic(nn.Module):
        action_dim: int
        activation: str = "tanh"

        @nn.compact
        def __call__(self, x):
            activation = nn.relu if self.activation == "relu" else nn.tanh
            actor_mean = nn.Dense(64, kernel_init=orthogonal(np.sqrt(2)), bias_init=constant(0.0))(x)
            actor_mean = activation(actor_mean)
            actor_mean = nn.Dense(64, kernel_init=orthogonal(np.sqrt(2)), bias_init=constant(0.0))(actor_mean)
            actor_mean = activation(actor_mean)
            actor_mean = nn.Dense(self.action_dim, kernel_init=orthogonal(0.01), bias_init=constant(0.0))(actor_mean)
            pi = Categorical(logits=actor_mean)
            critic = nn.Dense(64, kernel_init=orthogonal(np.sqrt(2)), bias_init=constant(0.0))(x)
            critic = activation(critic)
            critic = nn.Dense(64, kernel_init=orthogonal(np.sqrt(2)), bias_init=constant(0.0))(critic)
            critic = activation(critic)
            critic = nn.Dense(1, kernel_init=orthogonal(1.0), bias_init=constant(0.0))(critic)
            return pi, jnp.squeeze(critic, axis=-1)

    class Transition(NamedTuple):
        done: jnp.ndarray
        action: jnp.ndarray
        value: jnp.ndarray
        reward: jnp.ndarray
        log_prob: jnp.ndarray
        obs: jnp.ndarray
        info: jnp.ndarray

    config["NUM_UPDATES"] = config["TOTAL_TIMESTEPS"] // config["NUM_STEPS"] // config["NUM_ENVS"]
    config["MINIBATCH_SIZE"] = config["NUM_ENVS"] * config["NUM_STEPS"] // config["NUM_MINIBATCHES"]
    env, env_params = gymnax.make(config["ENV_NAME"])
    env = FlattenObservationWrapper(env)
    env = LogWrapper(env)

    def linear_schedule(count):
        frac = 1.0 - (count // (config["NUM_MINIBATCHES"] * config["UPDATE_EPOCHS"])) / config["NUM_UPDATES"]
        return config["LR"] * frac

    def train(rng):
        # INIT NETWORK
        network = ActorCritic(env.action_space(env_params).n, activation=config["ACTIVATION"])
        rng, _rng = jax.random.split(rng)
        init_x = jnp.zeros(env.observation_space(env_params).shape)
        network_params = network.init(_rng, init_x)
        if config["ANNEAL_LR"]:
            tx = optax.chain(optax.clip_by_global_norm(config["MAX_GRAD_NORM"]),
                             optax.adam(learning_rate=linear_schedule, eps=1e-5))
        else:
            tx = optax.chain(optax.clip_by_global_norm(config["MAX_GRAD_NORM"]), optax.adam(config["LR"], eps=1e-5))
        train_state = TrainState.create(apply_fn=network.apply, params=network_params, tx=tx)

        # INIT ENV
        rng, _rng = jax.random.split(rng)
        reset_rng = jax.random.split(_rng, config["NUM_ENVS"])
        obsv, env_state = jax.vmap(env.reset, in_axes=(0, None))(reset_rng, env_params)

        # TRAIN LOOP
        def _update_step(runner_state, unused):
            # COLLECT TRAJECTORIES
            def _env_step(runner_state, unused):
                train_state, env_state, last_obs, rng = runner_state

                # SELECT ACTION
                rng, _rng = jax.random.split(rng)
                pi, value = network.apply(train_state.params, last_obs)
                action = pi.sample(seed=_rng)
                log_prob = pi.log_prob(action)

                # STEP ENV
                rng, _rng = jax.random.split(rng)
                rng_step = jax.random.split(_rng, config["NUM_ENVS"])
                # ADAPTED: gymnax 1.0.1 returns terminated and truncated; ppo.py's gymnax returned their OR as done.
                obsv, env_state, reward, terminated, truncated, info = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
                    rng_step, env_state, action, env_params)
                done = jnp.logical_or(terminated, truncated)
                transition = Transition(done, action, value, reward, log_prob, last_obs, info)
                runner_state = (train_state, env_state, obsv, rng)
                return runner_state, transition

            runner_state, traj_batch = jax.lax.scan(_env_step, runner_state, None, config["NUM_STEPS"])

            # CALCULATE ADVANTAGE
            train_state, env_state, last_obs, rng = runner_state
            _, last_val = network.apply(train_state.params, last_obs)

            def _calculate_gae(traj_batch, last_val):
                def _get_advantages(gae_and_next_value, transition):
                    gae, next_value = gae_and_next_value
                    done, value, reward = transition.done, transition.value, transition.reward
                    delta = reward + config["GAMMA"] * next_value * (1 - done) - value
                    gae = delta + config["GAMMA"] * config["GAE_LAMBDA"] * (1 - done) * gae
                    return (gae, value), gae

                _, advantages = jax.lax.scan(_get_advantages, (jnp.zeros_like(last_val), last_val), traj_batch,
                                             reverse=True, unroll=16)
                return advantages, advantages + traj_batch.value

            advantages, targets = _calculate_gae(traj_batch, last_val)

            # UPDATE NETWORK
            def _update_epoch(update_state, unused):
                def _update_minbatch(train_state, batch_info):
                    traj_batch, advantages, targets = batch_info

                    def _loss_fn(params, traj_batch, gae, targets):
                        # RERUN NETWORK
                        pi, value = network.apply(params, traj_batch.obs)
                        log_prob = pi.log_prob(traj_batch.action)

                        # CALCULATE VALUE LOSS
                        value_pred_clipped = traj_batch.value + (value - traj_batch.value).clip(
                            -config["CLIP_EPS"], config["CLIP_EPS"])
                        value_losses = jnp.square(value - targets)
                        value_losses_clipped = jnp.square(value_pred_clipped - targets)
                        value_loss = 0.5 * jnp.maximum(value_losses, value_losses_clipped).mean()

                        # CALCULATE ACTOR LOSS
                        ratio = jnp.exp(log_prob - traj_batch.log_prob)
                        gae = (gae - gae.mean()) / (gae.std() + 1e-8)
                        loss_actor1 = ratio * gae
                        loss_actor2 = jnp.clip(ratio, 1.0 - config["CLIP_EPS"], 1.0 + config["CLIP_EPS"]) * gae
                        loss_actor = -jnp.minimum(loss_actor1, loss_actor2)
                        loss_actor = loss_actor.mean()
                        entropy = pi.entropy().mean()

                        total_loss = loss_actor + config["VF_COEF"] * value_loss - config["ENT_COEF"] * entropy
                        return total_loss, (value_loss, loss_actor, entropy)

                    grad_fn = jax.value_and_grad(_loss_fn, has_aux=True)
                    total_loss, grads = grad_fn(train_state.params, traj_batch, advantages, targets)
                    train_state = train_state.apply_gradients(grads=grads)
                    return train_state, total_loss

                train_state, traj_batch, advantages, targets, rng = update_state
                rng, _rng = jax.random.split(rng)
                # Batching and Shuffling
                batch_size = config["MINIBATCH_SIZE"] * config["NUM_MINIBATCHES"]
                assert batch_size == config["NUM_STEPS"] * config["NUM_ENVS"], \
                    "batch size must be equal to number of steps * number of envs"
                permutation = jax.random.permutation(_rng, batch_size)
                batch = (traj_batch, advantages, targets)
                batch = jax.tree_util.tree_map(lambda x: x.reshape((batch_size,) + x.shape[2:]), batch)
                shuffled_batch = jax.tree_util.tree_map(lambda x: jnp.take(x, permutation, axis=0), batch)
                # Mini-batch Updates
                minibatches = jax.tree_util.tree_map(
                    lambda x: jnp.reshape(x, [config["NUM_MINIBATCHES"], -1] + list(x.shape[1:])), shuffled_batch)
                train_state, total_loss = jax.lax.scan(_update_minbatch, train_state, minibatches)
                update_state = (train_state, traj_batch, advantages, targets, rng)
                return update_state, total_loss

            # Updating Training State and Metrics:
            update_state = (train_state, traj_batch, advantages, targets, rng)
            update_state, loss_info = jax.lax.scan(_update_epoch, update_state, None, config["UPDATE_EPOCHS"])
            train_state = update_state[0]
            metric = traj_batch.info
            rng = update_state[-1]
            runner_state = (train_state, env_state, last_obs, rng)
            return runner_state, metric

        rng, _rng = jax.random.split(rng)
        runner_state = (train_state, env_state, obsv, _rng)
        runner_state, metric = jax.lax.scan(_update_step, runner_state, None, config["NUM_UPDATES"])
        return {"runner_state": runner_state, "metrics": metric}

    return train


def purejaxrl_config(cfg) -> dict:
    """ppo.py's config dict with the recipe's values (and the recipe's rounded step count)."""
    ppo, run = cfg.ppo, cfg.rl
    assert cfg.model.hidden == 64 and cfg.model.layers == 2, "ppo.py's network is two layers of 64"
    assert ppo.clip_value and ppo.normalize_advantages and not ppo.normalize_obs and ppo.reward_scale == 1.0
    return {"LR": ppo.lr, "NUM_ENVS": run.num_envs, "NUM_STEPS": run.num_steps,
            "TOTAL_TIMESTEPS": run.num_updates * run.env_steps_per_update, "UPDATE_EPOCHS": ppo.update_epochs,
            "NUM_MINIBATCHES": ppo.num_minibatches, "GAMMA": ppo.gamma, "GAE_LAMBDA": ppo.gae_lambda,
            "CLIP_EPS": ppo.clip_eps, "ENT_COEF": ppo.ent_coef, "VF_COEF": ppo.vf_coef,
            "MAX_GRAD_NORM": ppo.max_grad_norm, "ACTIVATION": cfg.model.activation, "ENV_NAME": cfg.env.name,
            "ANNEAL_LR": ppo.anneal_lr}


def recipe_config(overrides: list[str]):
    sys.path.insert(0, SRC)
    from systolic import config as config_lib
    from systolic.workloads.rl.config import RLConfig

    return config_lib.load(RLConfig, RECIPE, overrides, RECIPE)[0]


def run_purejaxrl_here(overrides: list[str]) -> dict:
    """This process is the PureJaxRL side: compile, run, report one JSON object."""
    t_start = time.perf_counter()
    import jax
    import numpy as np

    cfg = recipe_config(overrides)
    config = purejaxrl_config(cfg)
    rngs = jax.random.split(jax.random.PRNGKey(cfg.rl.seed), cfg.rl.num_seeds)
    train = jax.jit(jax.vmap(make_train(config)))
    t = time.perf_counter()
    compiled = train.lower(rngs).compile()
    compile_s = time.perf_counter() - t
    t = time.perf_counter()
    out = jax.block_until_ready(compiled(rngs))
    run_s = time.perf_counter() - t
    metrics = jax.device_get(out["metrics"])
    # The last chunk's worth of updates (systolic's last metrics row): the episodes that ended there, per seed.
    last = slice(-cfg.rl.updates_per_chunk, None)
    ended = np.asarray(metrics["returned_episode"][:, last])  # (S, U, T, N)
    returns = np.asarray(metrics["returned_episode_returns"][:, last])
    per_seed = [float(r[e].mean()) if e.any() else float("nan") for r, e in zip(returns, ended)]
    steps = cfg.rl.num_seeds * config["NUM_UPDATES"] * config["NUM_STEPS"] * config["NUM_ENVS"]
    return {"env_steps_per_s": steps / run_s, "compile_s": compile_s, "run_s": run_s, "steps_per_seed":
            steps // cfg.rl.num_seeds, "final_returns": per_seed, "process_s": time.perf_counter() - t_start,
            "backend": jax.default_backend()}


def measure_peak_here() -> dict:
    """This process measures a 2048^2 float32 matmul's FLOP/s on its JAX backend (the parent never opens one)."""
    import jax

    sys.path.insert(0, SRC)
    from systolic.observe.peak_flops import measured_matmul_flops

    return {"flops_per_s": measured_matmul_flops(2048), "backend": jax.default_backend()}


# THE TWO SIDES, EACH IN ITS OWN PROCESS ------------------------------------------------------------------------


# PureJaxRL's train vmaps its network init over seeds: on a CPU its orthogonal init is then a batched QR, and
# jaxlib 0.10's QR kernel splits a batch into tasks on the thread pool it runs on and waits for them. The actor's
# and the critic's QR, run at once by XLA:CPU's concurrency-minded schedule, can each hold one of a 2-core host's
# two pool threads and wait forever (2026-12-06: its side hung in 2 of 5 runs of the dry-run recipe; py-spy and
# gdb: two threads in lapack_sgeqrf_ffi -> ParallelBatchMap -> BlockingCounter::Wait). This scheduler flag (XLA:CPU
# only; nothing on the chip) ran 12,000 such programs without a hang where the default hung within 200 (a vmapped
# init of six orthogonal 64 x 64 layers over 8 seeds, this host); both sides get it, so that they run alike.
# systolic's own rl init maps over seeds one at a time instead (workloads/rl/train.py).
CPU_XLA_FLAGS = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def clean_env(platform: str | None) -> dict[str, str]:
    """The caller's environment without XLA and systolic settings (both sides run plain, but for CPU_XLA_FLAGS),
    src/ first on PYTHONPATH and the caller's entries kept after it; JAX_PLATFORMS as the caller set it unless
    `platform` names one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "SYSTOLIC_"))}
    env["XLA_FLAGS"] = CPU_XLA_FLAGS
    env["PYTHONPATH"] = os.pathsep.join([SRC, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)])
    if platform:
        env["JAX_PLATFORMS"] = platform
    return env


def run_child(side: str, args) -> dict:
    """One `--side` process (the same overrides); its last stdout line is its JSON result."""
    t = time.perf_counter()
    overrides = ["--set", *args.set] if args.set else []
    proc = subprocess.run([sys.executable, str(HERE), "--side", side, *overrides], env=clean_env(args.platform),
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{side} side failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result | {"wall_s": time.perf_counter() - t}


def run_systolic(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="rl-vs-purejaxrl-") as run_dir:
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "systolic", "train", "rl", "--recipe", RECIPE, "--run-dir",
                               run_dir, *args.set], env=clean_env(args.platform) | {"SYSTOLIC_COMPILE_CACHE": "off"},
                              capture_output=True, text=True, timeout=1800)
        wall = time.perf_counter() - t
        if proc.returncode != 0:
            raise SystemExit(f"systolic side failed:\n{proc.stderr[-3000:]}")
        rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    rate = re.search(r"throughput: ([\d,]+) environment steps/s", proc.stdout)
    compile_s = re.search(r"first chunk \(compile \+ run\) ([\d.]+) s", proc.stdout)
    last = [r for r in rows if r["split"] == "train"][-1]
    final_eval = [r for r in rows if r["split"] == "eval"][-1]
    seeds = sorted(int(k.rpartition("seed")[2]) for k in last if k.startswith("episode_return/seed"))
    return {"env_steps_per_s": float(rate.group(1).replace(",", "")), "compile_s": float(compile_s.group(1)),
            "wall_s": wall, "final_returns": [last[f"episode_return/seed{i}"] for i in seeds],
            "eval_returns": [final_eval[f"return/seed{i}"] for i in seeds]}


def ppo_flops_per_env_step(cfg, obs_size: int, actions: int) -> float:
    """Matmul FLOPs of PPO per environment step: the rollout's forward pass of actor and critic, and
    `update_epochs` forward + backward passes (3x a forward) over every transition."""
    h, layers = cfg.model.hidden, cfg.model.layers
    actor = obs_size * h + (layers - 1) * h * h + h * actions  # multiply-adds per sample
    critic = obs_size * h + (layers - 1) * h * h + h
    forward = 2 * (actor + critic)
    return forward + cfg.ppo.update_epochs * 3 * forward


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--platform", help="JAX_PLATFORMS for both sides (cpu, tpu); default: the caller's")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="recipe overrides for both sides, e.g. rl.num_envs=2048")
    parser.add_argument("--no-peak", action="store_true", help="skip the matmul peak (two processes fewer)")
    parser.add_argument("--json", type=Path, help="append the summary as one JSON line to this file")
    parser.add_argument("--side", choices=["purejaxrl", "peak"], help=argparse.SUPPRESS)  # a child process's role
    args = parser.parse_args()
    if args.side == "purejaxrl":
        print(json.dumps(run_purejaxrl_here(args.set)))
        return 0
    if args.side == "peak":
        print(json.dumps(measure_peak_here()))
        return 0

    cfg = recipe_config(args.set)
    platform = args.platform or os.environ.get("JAX_PLATFORMS") or "JAX's choice"
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start; platform {platform}; recipe "
          f"{RECIPE}{' ' + ' '.join(args.set) if args.set else ''}: {cfg.rl.num_seeds} seeds x {cfg.rl.num_envs} "
          f"envs, {cfg.rl.num_updates} updates = {cfg.rl.num_updates * cfg.rl.env_steps_per_update:,} env steps per "
          "seed")
    peak_before = None if args.no_peak else run_child("peak", args)
    sides = {"systolic": lambda: run_systolic(args), "purejaxrl": lambda: run_child("purejaxrl", args)}
    results: dict[str, list[dict]] = {name: [] for name in sides}
    for pair in range(args.pairs):
        for name in (("systolic", "purejaxrl") if pair % 2 == 0 else ("purejaxrl", "systolic")):
            r = sides[name]()
            results[name].append(r)
            print(f"pair {pair + 1} {name:>9}: {r['env_steps_per_s']:9,.0f} env steps/s, wall {r['wall_s']:5.1f} s "
                  f"(compile {r['compile_s']:.1f} s), final training return per seed "
                  f"{' '.join(f'{x:.0f}' for x in r['final_returns'])}"
                  + (f"; evaluation {' '.join(f'{x:.0f}' for x in r['eval_returns'])}" if "eval_returns" in r else "")
                  + (f"; backend {r['backend']}" if "backend" in r else "")
                  + f" (load {os.getloadavg()[0]:.1f})", flush=True)
    flops = ppo_flops_per_env_step(cfg, obs_size=4, actions=2)
    peak = None
    if not args.no_peak:
        peak_after = run_child("peak", args)
        peak = max(peak_before["flops_per_s"], peak_after["flops_per_s"])
        print(f"\nmatmul peak (2048^2 float32, {peak_after['backend']}): {peak_before['flops_per_s'] / 1e9:.1f} "
              f"GFLOP/s before the pairs, {peak_after['flops_per_s'] / 1e9:.1f} after; PPO matmul FLOPs per env step: "
              f"{flops / 1e3:.1f} k")
    print("| side | env steps/s (median) | runs | wall s (median) | final training return, mean over seeds "
          "(median run) | PPO GFLOP/s | of peak |")
    print("|---|---|---|---|---|---|---|")
    summary = {"overrides": args.set, "platform": platform, "pairs": args.pairs, "seeds": cfg.rl.num_seeds,
               "envs": cfg.rl.num_envs, "env_steps_per_seed": cfg.rl.num_updates * cfg.rl.env_steps_per_update,
               "peak_flops_per_s": peak}
    for name, runs in results.items():
        rate = statistics.median(r["env_steps_per_s"] for r in runs)
        returns = statistics.median(statistics.fmean(r["final_returns"]) for r in runs)
        summary[name] = {"env_steps_per_s": rate, "runs": [r["env_steps_per_s"] for r in runs],
                         "final_return": returns, "wall_s": statistics.median(r["wall_s"] for r in runs),
                         "compile_s": statistics.median(r["compile_s"] for r in runs)}
        each = ", ".join(f"{r['env_steps_per_s']:,.0f}" for r in runs)
        of_peak = f"{100 * rate * flops / peak:.1f}%" if peak else "-"
        print(f"| {name} | {rate:,.0f} | {each} | {summary[name]['wall_s']:.1f} | {returns:.1f} | "
              f"{rate * flops / 1e9:.1f} | {of_peak} |")
    summary["ratio"] = summary["systolic"]["env_steps_per_s"] / summary["purejaxrl"]["env_steps_per_s"]
    print(f"\nsystolic / PureJaxRL (median env steps/s): {summary['ratio']:.2f}x")
    if args.json:
        with open(args.json, "a", encoding="utf-8") as f:
            f.write(json.dumps(summary) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
