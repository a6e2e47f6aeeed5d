"""What the CLI calls for the `sim` workload: `simulate` (run a recipe, draw it) and `fit` (the inverse problem)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from systolic.config import TrainConfig
from systolic.engine import loop
from systolic.errors import UserError
from systolic.observe.plot import plot_losses
from systolic.runtime import mesh as mesh_lib
from systolic.workloads.sim import driver, inverse, outputs
from systolic.workloads.sim.config import SimConfig
from systolic.workloads.sim.solver import Simulation, make_simulation, precision, to_host

Config = SimConfig
DEFAULT_RECIPE = "sim-turbulence"

_COLORMAPS = {"vorticity": "RdBu_r"}


def simulate(cfg: SimConfig, run_dir: Path, quiet: bool = False) -> driver.SimResult:
    say = (lambda *a: None) if quiet or jax.process_index() != 0 else print
    with precision(cfg):
        mesh = mesh_lib.make_mesh(cfg.mesh)
        sim = make_simulation(cfg, mesh)
        step_text = f"dt {sim.dt:.4g} ({sim.steps_per_frame} steps a frame)" if sim.dt else f"CFL {cfg.sim.cfl} steps"
        say(f"sim: {cfg.sim.equation} ({cfg.sim.solver}), grid {cfg.grid.n}^2, {cfg.sim.dtype}, "
            f"t_end {cfg.sim.t_end:g} in {cfg.output.frames} frames, {step_text}; mesh {mesh_lib.describe(mesh)} "
            f"({jax.device_count()} {jax.default_backend()} devices); run directory {run_dir}")
        result = driver.run(sim, cfg, run_dir, quiet=quiet)
        if result.preempted:
            say(f"stopped at frame {int(jax.device_get(result.state.step))} of {cfg.output.frames} with a "
                "checkpoint; run the same command again to continue.")
            return result
        pictures = []
        if cfg.output.images:
            final = to_host(sim.picture(result.state))  # a collective: every process takes part
            if jax.process_index() == 0:
                pictures = draw(final, sim, cfg, run_dir, result)
    _report(say, result, pictures)
    return result


def draw(final: np.ndarray, sim: Simulation, cfg: SimConfig, run_dir: Path, result: driver.SimResult) -> list[Path]:
    """final.png (the field `final`), animation.gif and diagnostics.png in the run directory."""
    cmap = cfg.output.colormap or _COLORMAPS.get(sim.picture_name, "viridis")
    symmetric = sim.picture_name == "vorticity"
    t = result.final_metrics.get("time", 0.0)
    made = [
        outputs.draw_field(final, run_dir / "final.png", title=f"{sim.picture_name}, t = {t:.4g}", cmap=cmap,
                           symmetric=symmetric, length=cfg.grid.length),
        outputs.make_gif(outputs.load_snapshots(run_dir, int(jax.device_get(result.state.step))),
                         run_dir / "animation.gif", cmap=cmap, symmetric=symmetric),
        outputs.plot_diagnostics(run_dir, sim.plot_keys, run_dir / "diagnostics.png"),
    ]
    return [p for p in made if p is not None]


def _report(say, result: driver.SimResult, pictures: list[Path]) -> None:
    first, last = result.initial_metrics, result.final_metrics
    changes = ", ".join(f"{k} {first[k]:.6g} -> {last[k]:.6g}" for k in last
                        if k not in ("step", "time", "steps", "dt", "error") and isinstance(first.get(k), (int, float)))
    say(f"t = {last.get('time', 0):.4g}: {changes}")
    if "error" in last:
        say(f"relative L2 error against the exact solution: {last['error']:.3e}")
    if result.steps_per_s:
        say(f"throughput: {result.steps_per_s:,.1f} steps/s ({result.solver_steps} steps this run); first frame "
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
        settings = loop.LoopSettings(train=_train_settings(cfg), checkpoint=cfg.checkpoint, observe=cfg.observe,
                                     quiet=quiet)
        result = loop.train(task, settings, run_dir)
        viscosity = float(jnp.exp(result.state.params["log_viscosity"]))
    if result.preempted:
        say(f"stopped at step {result.final_step} of {cfg.fit.steps} with a checkpoint; run the same command again "
            "to continue.")
        return result
    if jax.process_index() == 0 and cfg.observe.plot:
        plot_losses(run_dir, out_name="viscosity.png", key="viscosity")
    error = abs(viscosity / problem.true_viscosity - 1)
    say(f"recovered viscosity {viscosity:.6g} (true {problem.true_viscosity:g}): relative error {100 * error:.3f}%; "
        f"final misfit {result.train_loss:.3e}; wall time {result.wall_s:.1f} s")
    return result


def _train_settings(cfg: SimConfig) -> TrainConfig:
    return TrainConfig(steps=cfg.fit.steps, eval_every=cfg.fit.steps, seed=cfg.sim.seed)


def train(cfg: SimConfig, run_dir: Path, quiet: bool = False) -> None:
    raise UserError(
        "The sim workload has no model to train. Fix: `systolic simulate --recipe sim-turbulence` runs a simulation, "
        "and `systolic fit sim --recipe sim-viscosity-inverse` fits the viscosity to observed snapshots."
    )
