"""What the CLI calls for the `rl` workload: train (then report every seed's evaluation) and evaluate a run."""

from __future__ import annotations

from pathlib import Path

import jax

from systolic import outfile
from systolic.config import check_seed
from systolic.engine import loop
from systolic.engine.run import Run
from systolic.engine.state import param_count
from systolic.plan.planner import StepProgram
from systolic.runtime import mesh as mesh_lib
from systolic.runtime.sharding import activate
from systolic.workloads.rl import evaluate as evaluate_lib
from systolic.workloads.rl.config import RLConfig
from systolic.workloads.rl.envs import SOLVED_AT
from systolic.workloads.rl.plot import plot_returns
from systolic.workloads.rl.train import algorithm_for, build_task


def train(cfg: RLConfig, run_dir: Path, quiet: bool = False) -> loop.RunResult:
    mesh = mesh_lib.make_mesh(cfg.mesh)
    prepared = build_task(cfg, mesh)
    rl, spec = cfg.rl, prepared.env.spec
    # The engine's loop counts steps in chunks; evaluation runs every rl.eval_every chunks and at the end.
    run = Run.start(cfg, steps=rl.num_chunks, eval_every=rl.eval_every or rl.num_chunks, quiet=quiet,
                    steps_key="rl.total_env_steps")
    say = run.say
    algo = algorithm_for(cfg, prepared.env).name  # "PPO", "PPO (GRU)", ...
    hidden = f", observation components {list(cfg.env.hide_obs)} hidden" if cfg.env.hide_obs else ""
    say(f"rl: {algo} on {spec.name} ({'discrete' if spec.discrete else 'continuous'} actions{hidden}), "
        f"{rl.num_seeds} seeds x "
        f"{rl.num_envs} environments, {rl.num_updates} updates of {rl.env_steps_per_update} steps = "
        f"{rl.num_updates * rl.env_steps_per_update:,} environment steps per seed, in {rl.num_chunks} chunks of "
        f"{rl.updates_per_chunk} updates")
    say(f"mesh {mesh_lib.describe(mesh)} ({jax.device_count()} {jax.default_backend()} devices), "
        f"{prepared.layout} split over the data axes; run directory {run_dir}")
    with activate(mesh):
        result = run.loop(prepared.task, run_dir)
        if not result.eval_metrics:  # the run was already complete: evaluate what the checkpoint holds
            result.eval_metrics = prepared.task.evaluate(result.state)
    ev = result.eval_metrics
    per_seed = [ev[f"return/seed{i}"] for i in range(rl.num_seeds)]
    say(f"evaluation ({rl.eval_episodes} episodes per seed, deterministic policy): mean return {ev['return']:.1f}, "
        f"worst seed {ev['return_min']:.1f}; per seed: " + ", ".join(f"{r:.1f}" for r in per_seed))
    if spec.name in SOLVED_AT:
        target = SOLVED_AT[spec.name]
        solved = sum(r >= target for r in per_seed)
        say(f"{solved}/{rl.num_seeds} seeds reach the target mean return {target:g} on {spec.name}")
    run.say_throughput(result, "environment steps/s (all seeds)", first="first chunk (compile + run)")
    if jax.process_index() == 0 and cfg.observe.plot:
        path = plot_returns(run_dir, rl.num_seeds, rl.env_steps_per_chunk, title=f"{algo} on {spec.name}")
        if path is not None:
            say(f"return curves: {path}")
    return result


def evaluate(run_dir: Path, *, episodes: int, gymnasium: bool = False, gif: Path | None = None,
             seed: int = 0, force: bool = False) -> str:
    """`systolic eval rl RUN_DIR`: the report to print."""
    check_seed("--seed", seed)
    if gif is not None:
        outfile.check(gif, option="--gif", suffixes=(".gif",), force=force)
    return evaluate_lib.evaluate_run(run_dir, episodes=episodes, use_gymnasium=gymnasium, gif=gif, seed=seed)


def plan(cfg: RLConfig, devices: list) -> StepProgram:
    """One chunk step (`rl.updates_per_chunk` updates of every seed: rollouts, targets, minibatch epochs) lowered
    from abstract inputs on a mesh of `devices`, for `systolic plan`."""
    from systolic.workloads.rl.envs import make_env
    from systolic.workloads.rl.train import choose_layout, make_state_fns

    mesh = mesh_lib.make_mesh(cfg.mesh, devices)
    layout = choose_layout(cfg, mesh)
    _, chunk_step, abstract, _ = make_state_fns(cfg, make_env(cfg.env), mesh, layout)
    with activate(mesh):
        lowered = chunk_step.lower(abstract, None)
    run = cfg.rl
    return StepProgram(
        lowered=lowered, argument_bytes=mesh_lib.bytes_per_device(abstract),
        params=param_count(abstract.params) // run.num_seeds,
        items_per_step=run.num_seeds * run.env_steps_per_chunk, item_unit="env_steps", model_flops_per_step=None,
        dtype="float32",
        notes=(f"one step is a chunk of {run.updates_per_chunk} {cfg.algo.upper()} updates x {run.num_seeds} seeds, "
               f"split by {layout} over the data axes; parameters are per seed; no FLOP formula for the rl workload: "
               "the MFU is taken from XLA's count",))
