"""What the CLI calls for the `sim` workload: `simulate` (run a recipe, draw it) and `fit` (the inverse problem)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from systolic.engine import loop
from systolic.engine.run import Run
from systolic.engine.state import param_count
from systolic.plan.planner import StepProgram
from systolic.observe.plot import plot_losses
from systolic.runtime import mesh as mesh_lib
from systolic.workloads.sim import inverse, outputs, taylor_green
from systolic.workloads.sim.config import SimConfig
from systolic.workloads.sim.simulation import Simulation, precision, to_host
from systolic.workloads.sim.solver import make_simulation


_COLORMAPS = {"vorticity": "RdBu_r", "vorticity magnitude": "inferno"}


def simulate(cfg: SimConfig, run_dir: Path, quiet: bool = False) -> loop.RunResult:
    run = Run.start(cfg, steps=cfg.output.frames, eval_every=cfg.output.frames, quiet=quiet,
                    steps_key="output.frames", noun="frame")
    say = run.say
    with precision(cfg):
        mesh = mesh_lib.make_mesh(cfg.mesh)
        sim = make_simulation(cfg, mesh)
        step_text = f"dt {sim.dt:.4g} ({sim.steps_per_frame} steps a frame)" if sim.dt else f"CFL {cfg.sim.cfl} steps"
        say(f"sim: {cfg.sim.equation} ({cfg.sim.solver}), grid {cfg.grid.n}^{cfg.sim.dimensions}, {cfg.sim.dtype}, "
            f"t_end {cfg.sim.t_end:g} in {cfg.output.frames} frames, {step_text}; mesh {mesh_lib.describe(mesh)} "
            f"({jax.device_count()} {jax.default_backend()} devices); run directory {run_dir}")
        result = run.loop(simulation_task(sim, cfg, run_dir), run_dir)
        if run.stopped(result):
            return result
        final = to_host(sim.picture(result.state)) if cfg.output.images else None  # a collective: all take part
        pictures = draw(final, sim, cfg, run_dir, result) if jax.process_index() == 0 else []
    _report(run, result, pictures)
    if cfg.sim.equation == "navier_stokes_3d" and cfg.navier_stokes_3d.initial == "taylor_green":
        _report_taylor_green(say, cfg, run_dir)
    return result


def simulation_task(sim: Simulation, cfg: SimConfig, run_dir: Path) -> loop.Task:
    """A simulation as the engine loop's task: one loop step is one frame; each frame writes a snapshot."""

    def snapshot(frame: int, state) -> None:
        spectrum = to_host(sim.spectrum(state)) if sim.spectrum is not None else None  # replicated: no gather
        if spectrum is not None and jax.process_index() == 0:
            outputs.save_spectrum(run_dir, frame, spectrum)
        if not cfg.output.images:
            return
        field = to_host(sim.picture(state))  # every process takes part in the gather; one writes
        if jax.process_index() == 0:
            outputs.save_snapshot(run_dir, frame, field, cfg.output.image_pixels)

    task = loop.Task(
        workload="sim", abstract_state=sim.abstract_state, init_state=sim.initial_state, train_step=sim.frame_step,
        data=None, check=None, items_metric="steps", item_unit="steps",
        meta={"workload": "sim", "equation": cfg.sim.equation, "grid_n": cfg.grid.n, "dtype": cfg.sim.dtype},
        split=outputs.SPLIT, progress_keys=("time", *sim.plot_keys[:2]), label=sim.equation,
        nonfinite_advice="the simulation blew up: the step was too large for the scheme's stability or the grid too "
                         "coarse for the flow. Lower sim.cfl or sim.dt, raise grid.n or the viscosity/diffusivity, "
                         "and start again in a new --run-dir (the checkpoints here hold states from before the blow-up)",
        initial_metrics=sim.measure)
    task.add_hook(snapshot, every=1)
    return task


def draw(final: np.ndarray | None, sim: Simulation, cfg: SimConfig, run_dir: Path,
         result: loop.RunResult) -> list[Path]:
    """final.png (the field `final`) and animation.gif with output.images; diagnostics.png with observe.plot, and
    in 3-D spectrum.png (E(k) over the run) and, for Taylor-Green, dissipation.png (against the reference at
    Re = 1600)."""
    cmap = cfg.output.colormap or _COLORMAPS.get(sim.picture_name, "viridis")
    symmetric = sim.picture_name == "vorticity"
    t = result.last_metrics.get("time", 0.0)
    made = []
    if final is not None:
        made += [outputs.draw_field(final, run_dir / "final.png", title=f"{sim.picture_name}, t = {t:.4g}", cmap=cmap,
                                    symmetric=symmetric, length=cfg.grid.length, axes=sim.picture_axes),
                 outputs.make_gif(outputs.load_snapshots(run_dir, result.final_step), run_dir / "animation.gif",
                                  cmap=cmap, symmetric=symmetric)]
    if cfg.observe.plot:
        made.append(outputs.plot_diagnostics(run_dir, sim.plot_keys, run_dir / "diagnostics.png"))
    if sim.spectrum is not None:
        times = {r["step"]: r["time"] for r in outputs.frame_records(run_dir)}
        made.append(outputs.plot_spectra(outputs.load_snapshots(run_dir, result.final_step, outputs.SPECTRA_DIR), times,
                                         run_dir / "spectrum.png"))
    if cfg.sim.equation == "navier_stokes_3d" and cfg.navier_stokes_3d.initial == "taylor_green":
        label = f"systolic {cfg.grid.n}^3, {cfg.sim.dtype}"
        run = (label, *outputs.series(run_dir, "time", "energy", "dissipation"))
        made.append(taylor_green.plot_dissipation([run], run_dir / "dissipation.png",
                                                  reference=taylor_green.is_reference_case(cfg)))
    return [p for p in made if p is not None]


def _report_taylor_green(say, cfg: SimConfig, run_dir: Path) -> None:
    """The dissipation peak against the 512^3 reference, for the Re = 1600 case (on process 0, which has the
    metrics)."""
    if jax.process_index() != 0 or not taylor_green.is_reference_case(cfg):
        return
    found = taylor_green.compare(*outputs.series(run_dir, "time", "dissipation"))
    if found is None:
        say(f"dissipation peak: not reached yet (the rate still rises at the last frame; the reference peaks at "
            f"t = {taylor_green.reference_peak().time:.2f})")
        return
    say(f"dissipation peak {found['peak']:.5g} at t = {found['peak_time']:.3f} on {cfg.grid.n}^3; reference (512^3 "
        f"spectral DNS) {found['reference_peak']:.5g} at t = {found['reference_peak_time']:.3f}: height "
        f"{100 * found['peak_error']:+.2f}%, time {100 * found['peak_time_error']:+.2f}%")


def _report(run: Run, result: loop.RunResult, pictures: list[Path]) -> None:
    say, first, last = run.say, result.first_metrics, result.last_metrics
    changes = ", ".join(f"{k} {first[k]:.6g} -> {last[k]:.6g}" for k in last
                        if k not in ("step", "time", "steps", "dt", "error") and isinstance(first.get(k), (int, float)))
    say(f"t = {last.get('time', 0):.4g}: {changes}")
    if "error" in last:
        say(f"relative L2 error against the exact solution: {last['error']:.3e}")
    run.say_throughput(result, f"steps/s ({result.items_done:.0f} steps this run)", first="first frame (compile)",
                       digits=1)
    if pictures:
        say("pictures: " + ", ".join(str(p) for p in pictures))


def fit(cfg: SimConfig, run_dir: Path, quiet: bool = False) -> loop.RunResult:
    run = Run.start(cfg, steps=cfg.fit.steps, eval_every=cfg.fit.steps, quiet=quiet, steps_key="fit.steps")
    say = run.say
    inverse.check_fit_config(cfg)
    with precision(cfg):
        mesh = mesh_lib.make_mesh(cfg.mesh)
        task, problem = inverse.build_task(cfg, mesh)
        say(f"fit: recover the viscosity (true {problem.true_viscosity:g}) from {cfg.output.frames} vorticity "
            f"snapshots ({cfg.grid.n}^2, noise {cfg.fit.noise:g} x rms) starting at {cfg.fit.initial_viscosity:g}; "
            f"{cfg.fit.steps} Adam steps on log(viscosity); mesh {mesh_lib.describe(mesh)}; run directory {run_dir}")
        result = run.loop(task, run_dir)
        viscosity = float(jnp.exp(result.state.params["log_viscosity"]))
    if run.stopped(result):
        return result
    if jax.process_index() == 0 and cfg.observe.plot:
        plot_losses(run_dir, out_name="viscosity.png", key="viscosity")
    error = abs(viscosity / problem.true_viscosity - 1)
    say(f"recovered viscosity {viscosity:.6g} (true {problem.true_viscosity:g}): relative error {100 * error:.3f}%; "
        f"final misfit {result.train_loss:.3e}; wall time {result.wall_s:.1f} s")
    return result


def plan(cfg: SimConfig, devices: list) -> StepProgram:
    """One frame of `systolic simulate` (the solver's steps up to the next output time, the grid split in slabs
    over the mesh, or in 3-D in pencils over its two axes) lowered from abstract inputs on a mesh of `devices`,
    for `systolic plan`."""
    with precision(cfg):
        mesh = mesh_lib.make_mesh(cfg.mesh, devices)
        sim = make_simulation(cfg, mesh)
        lowered = sim.frame_step.lower(sim.abstract_state, None)
    fixed = sim.steps_per_frame > 0
    return StepProgram(
        lowered=lowered, argument_bytes=mesh_lib.bytes_per_device(sim.abstract_state),
        params=param_count(sim.abstract_state.params),
        items_per_step=sim.steps_per_frame if fixed else 1, item_unit="steps" if fixed else "frames",
        model_flops_per_step=None, dtype=cfg.sim.dtype,
        notes=(f"one step is a frame of {cfg.sim.equation} on a {cfg.grid.n}^{cfg.sim.dimensions} grid"
               + (f" ({sim.steps_per_frame} solver steps)" if fixed else " (adaptive steps: the loop's trip count "
                  "is data-dependent, so XLA's count has its body once)")
               + "; 'parameters' counts the grid's values; no FLOP formula for the sim workload: the MFU is taken "
                 "from XLA's count",))
