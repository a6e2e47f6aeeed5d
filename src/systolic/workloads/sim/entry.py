"""What the CLI calls for the `sim` workload: `simulate` (run a recipe, draw it) and `fit` (the inverse problem)."""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from systolic.engine import loop
from systolic.engine.plan import StepProgram
from systolic.observe.plot import plot_losses
from systolic.runtime import mesh as mesh_lib
from systolic.workloads import Workload
from systolic.workloads.sim import inverse, outputs
from systolic.workloads.sim.config import SimConfig
from systolic.workloads.sim.solver import Simulation, make_simulation, precision, to_host


_COLORMAPS = {"vorticity": "RdBu_r"}


def simulate(cfg: SimConfig, run_dir: Path, quiet: bool = False) -> loop.RunResult:
    say = (lambda *a: None) if quiet or jax.process_index() != 0 else print
    with precision(cfg):
        mesh = mesh_lib.make_mesh(cfg.mesh)
        sim = make_simulation(cfg, mesh)
        step_text = f"dt {sim.dt:.4g} ({sim.steps_per_frame} steps a frame)" if sim.dt else f"CFL {cfg.sim.cfl} steps"
        say(f"sim: {cfg.sim.equation} ({cfg.sim.solver}), grid {cfg.grid.n}^2, {cfg.sim.dtype}, "
            f"t_end {cfg.sim.t_end:g} in {cfg.output.frames} frames, {step_text}; mesh {mesh_lib.describe(mesh)} "
            f"({jax.device_count()} {jax.default_backend()} devices); run directory {run_dir}")
        settings = loop.LoopSettings(steps=cfg.output.frames, eval_every=cfg.output.frames, loop=cfg.loop,
                                     checkpoint=cfg.checkpoint, observe=cfg.observe, steps_key="output.frames",
                                     quiet=quiet)
        result = loop.train(simulation_task(sim, cfg, run_dir), settings, run_dir)
        if result.preempted or result.final_step < cfg.output.frames:
            say(f"stopped at frame {result.final_step} of {cfg.output.frames} with a checkpoint; run the same "
                "command again to continue.")
            return result
        final = to_host(sim.picture(result.state)) if cfg.output.images else None  # a collective: all take part
        pictures = draw(final, sim, cfg, run_dir, result) if jax.process_index() == 0 else []
    _report(say, result, pictures)
    return result


def simulation_task(sim: Simulation, cfg: SimConfig, run_dir: Path) -> loop.Task:
    """A simulation as the engine loop's task: one loop step is one frame; each frame writes a snapshot."""

    def snapshot(frame: int, state) -> None:
        if not cfg.output.images:
            return
        field = to_host(sim.picture(state))  # every process takes part in the gather; one writes
        if jax.process_index() == 0:
            outputs.save_snapshot(run_dir, frame, field, cfg.output.image_pixels)

    return loop.Task(
        workload="sim", abstract_state=sim.abstract_state, init_state=sim.initial_state, train_step=sim.frame_step,
        data=None, check=None, items_metric="steps", item_unit="steps",
        meta={"workload": "sim", "equation": cfg.sim.equation, "grid_n": cfg.grid.n, "dtype": cfg.sim.dtype},
        split=outputs.SPLIT, progress_keys=("time", *sim.plot_keys[:2]), label=sim.equation,
        nonfinite_advice="the simulation blew up: the step was too large for the scheme's stability or the grid too "
                         "coarse for the flow. Lower sim.cfl or sim.dt, raise grid.n or the viscosity/diffusivity, "
                         "and start again in a new --run-dir (the checkpoints here hold states from before the blow-up)",
        initial_metrics=sim.measure, after_step=snapshot)


def draw(final: np.ndarray | None, sim: Simulation, cfg: SimConfig, run_dir: Path,
         result: loop.RunResult) -> list[Path]:
    """final.png (the field `final`) and animation.gif with output.images; diagnostics.png with observe.plot."""
    cmap = cfg.output.colormap or _COLORMAPS.get(sim.picture_name, "viridis")
    symmetric = sim.picture_name == "vorticity"
    t = result.last_metrics.get("time", 0.0)
    made = []
    if final is not None:
        made += [outputs.draw_field(final, run_dir / "final.png", title=f"{sim.picture_name}, t = {t:.4g}", cmap=cmap,
                                    symmetric=symmetric, length=cfg.grid.length),
                 outputs.make_gif(outputs.load_snapshots(run_dir, result.final_step), run_dir / "animation.gif",
                                  cmap=cmap, symmetric=symmetric)]
    if cfg.observe.plot:
        made.append(outputs.plot_diagnostics(run_dir, sim.plot_keys, run_dir / "diagnostics.png"))
    return [p for p in made if p is not None]


def _report(say, result: loop.RunResult, pictures: list[Path]) -> None:
    first, last = result.first_metrics, result.last_metrics
    changes = ", ".join(f"{k} {first[k]:.6g} -> {last[k]:.6g}" for k in last
                        if k not in ("step", "time", "steps", "dt", "error") and isinstance(first.get(k), (int, float)))
    say(f"t = {last.get('time', 0):.4g}: {changes}")
    if "error" in last:
        say(f"relative L2 error against the exact solution: {last['error']:.3e}")
    if result.items_per_s:
        say(f"throughput: {result.items_per_s:,.1f} steps/s ({result.items_done:.0f} steps this run); first frame "
            f"(compile) {result.compile_s:.1f} s; wall time {result.wall_s:.1f} s")
    if pictures:
        say("pictures: " + ", ".join(str(p) for p in pictures))


def fit(cfg: SimConfig, run_dir: Path, quiet: bool = False) -> loop.RunResult:
    say = (lambda *a: None) if quiet or jax.process_index() != 0 else print
    inverse.check_fit_config(cfg)
    with precision(cfg):
        mesh = mesh_lib.make_mesh(cfg.mesh)
        task, problem = inverse.build_task(cfg, mesh)
        say(f"fit: recover the viscosity (true {problem.true_viscosity:g}) from {cfg.output.frames} vorticity "
            f"snapshots ({cfg.grid.n}^2, noise {cfg.fit.noise:g} x rms) starting at {cfg.fit.initial_viscosity:g}; "
            f"{cfg.fit.steps} Adam steps on log(viscosity); mesh {mesh_lib.describe(mesh)}; run directory {run_dir}")
        settings = loop.LoopSettings(steps=cfg.fit.steps, eval_every=cfg.fit.steps, loop=cfg.loop,
                                     checkpoint=cfg.checkpoint, observe=cfg.observe, steps_key="fit.steps", quiet=quiet)
        result = loop.train(task, settings, run_dir)
        viscosity = float(jnp.exp(result.state.params["log_viscosity"]))
    if result.preempted or result.final_step < cfg.fit.steps:
        say(f"stopped at step {result.final_step} of {cfg.fit.steps} with a checkpoint; run the same command again "
            "to continue.")
        return result
    if jax.process_index() == 0 and cfg.observe.plot:
        plot_losses(run_dir, out_name="viscosity.png", key="viscosity")
    error = abs(viscosity / problem.true_viscosity - 1)
    say(f"recovered viscosity {viscosity:.6g} (true {problem.true_viscosity:g}): relative error {100 * error:.3f}%; "
        f"final misfit {result.train_loss:.3e}; wall time {result.wall_s:.1f} s")
    return result


def plan(cfg: SimConfig, devices: list) -> StepProgram:
    """One frame of `systolic simulate` (the solver's steps up to the next output time, the grid split in slabs
    over the mesh) lowered from abstract inputs on a mesh of `devices`, for `systolic plan`."""
    with precision(cfg):
        mesh = mesh_lib.make_mesh(cfg.mesh, devices)
        sim = make_simulation(cfg, mesh)
        lowered = sim.frame_step.lower(sim.abstract_state, None)
    fixed = sim.steps_per_frame > 0
    return StepProgram(
        lowered=lowered, argument_bytes=mesh_lib.bytes_per_device(sim.abstract_state),
        params=sum(math.prod(x.shape) for x in jax.tree.leaves(sim.abstract_state.params)),
        items_per_step=sim.steps_per_frame if fixed else 1, item_unit="steps" if fixed else "frames",
        model_flops_per_step=None, dtype=cfg.sim.dtype,
        notes=(f"one step is a frame of {cfg.sim.equation} on a {cfg.grid.n}^2 grid"
               + (f" ({sim.steps_per_frame} solver steps)" if fixed else " (adaptive steps: the loop's trip count "
                  "is data-dependent, so XLA's count has its body once)")
               + "; 'parameters' counts the grid's values; no FLOP formula for the sim workload: the MFU is taken "
                 "from XLA's count",))


WORKLOAD = Workload(name="sim", config=SimConfig, default_recipe="sim-turbulence",
                    commands={"simulate": simulate, "fit": fit, "plan": plan})
