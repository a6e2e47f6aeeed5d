"""The simulation loop: frames, metrics, snapshots and checkpoints; rerunning the same command resumes.

Why not the engine's `loop.train`: it requires and checks a `loss` metric (with advice about learning rates
when it is not finite), a simulation writes a snapshot every frame for the pictures, and its progress is
simulated time and solver steps per second. Everything else is the engine's, with the same guarantees as a
training run (docs/reliability.md): the `TrainState`; the `Checkpointer` (checksummed, falls back past a
damaged step, `checkpoint.every_minutes`); `StopSignals` (SIGTERM or a first Ctrl-C finishes the frame,
checkpoints and exits 0); `MetricsWriter` (metrics.jsonl + TensorBoard, flushed before every checkpoint and
truncated to it on resume) and `ProgressReporter`. A blow-up (non-finite diagnostics) halts with exit code 3.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import jax

from systolic.engine.checkpoint import Checkpointer
from systolic.engine.loop import StopSignals, agree_across_processes
from systolic.engine.state import TrainState
from systolic.errors import TrainingHalted, UserError
from systolic.observe.metrics import MetricsWriter, read_metrics, truncate_after
from systolic.observe.progress import ProgressReporter
from systolic.workloads.sim import outputs
from systolic.workloads.sim.config import SimConfig
from systolic.workloads.sim.solver import Simulation, to_host


@dataclasses.dataclass
class SimResult:
    state: TrainState
    start_frame: int
    initial_metrics: dict[str, float]  # frame 0 (from metrics.jsonl on a resumed run)
    final_metrics: dict[str, float]
    solver_steps: int  # time steps taken by this invocation
    steps_per_s: float | None  # steady state: without the first (compiling) frame
    compile_s: float | None
    wall_s: float
    preempted: bool = False  # stopped early on SIGTERM / Ctrl-C, with a checkpoint


def checkpoint_meta(cfg: SimConfig) -> dict[str, Any]:
    """Stored with every checkpoint; a resume must agree on all of it or the fields would not fit."""
    return {"workload": "sim", "equation": cfg.sim.equation, "grid_n": cfg.grid.n, "dtype": cfg.sim.dtype}


def run(sim: Simulation, cfg: SimConfig, run_dir: Path, quiet: bool = False) -> SimResult:
    t_begin = time.perf_counter()
    is_writer = jax.process_index() == 0
    total = cfg.output.frames
    ckpt = Checkpointer(run_dir / "checkpoints", cfg.checkpoint)
    writer = progress = None
    try:
        state, resumed_from = _restore_or_init(sim, cfg, ckpt, run_dir)
        start = int(jax.device_get(state.step))
        progress = ProgressReporter(total=total, start=start, mode=cfg.observe.progress, quiet=quiet,
                                    enabled=is_writer, description=sim.equation)
        writer = MetricsWriter(run_dir, tensorboard=cfg.observe.tensorboard, enabled=is_writer)
        if resumed_from is None:
            initial = _floats(sim.measure(state))
            writer.write(0, outputs.SPLIT, initial)
            _snapshot(sim, state, cfg, run_dir, 0, is_writer)
            final = initial
        else:
            progress.log(f"resumed from frame {resumed_from} (t = {float(jax.device_get(state.extra['time'])):.4g}) "
                         f"in {ckpt.directory}")
            records = _records(run_dir)
            initial = next((r for r in records if r["step"] == 0), {})
            final = records[-1] if records else {}
        pending: list[tuple[int, dict[str, jax.Array]]] = []
        compile_s = None
        steps_done = timed_steps = 0
        timed_s = 0.0
        t_mark = time.perf_counter()
        last_save, every_s = time.monotonic(), cfg.checkpoint.every_minutes * 60
        multi = jax.process_count() > 1
        preempted = False
        with StopSignals() as signals:
            frame, stop = start, total
            while frame < stop:
                frame += 1
                state, metrics = sim.frame_step(state)
                pending.append((frame, metrics))
                if frame == start + 1:
                    jax.block_until_ready(state)  # the first call compiles: time it apart from the steady state
                    compile_s = time.perf_counter() - t_mark
                    t_mark = time.perf_counter()
                    progress.log(f"first frame (compile + run) took {compile_s:.1f} s")
                    progress.restart_clock(frame)
                _snapshot(sim, state, cfg, run_dir, frame, is_writer)
                # SIGTERM / Ctrl-C: finish this frame, checkpoint, exit cleanly. Every process must decide alike.
                regular_log = frame % cfg.observe.log_every == 0 or frame == stop
                timed_due = every_s > 0 and time.monotonic() - last_save > every_s
                stop_now, timed = agree_across_processes(signals.received is not None, timed_due, multi and not regular_log)
                if stop_now:
                    preempted, stop = frame < total, frame
                save_now = frame % cfg.checkpoint.every_steps == 0 or frame == stop or timed
                if regular_log or save_now:  # every frame up to a checkpoint is on disk before the checkpoint
                    for (f, _), values in zip(pending, jax.device_get([m for _, m in pending])):
                        final = _floats(values)
                        writer.write(f, outputs.SPLIT, final)
                        _check_finite(final, f)
                        steps_done += int(final["steps"])
                        timed_steps += int(final["steps"]) if f > start + 1 else 0
                    pending.clear()
                    writer.flush()
                    timed_s = time.perf_counter() - t_mark
                    stats: dict[str, float | str] = {"t": final["time"], **{k: final[k] for k in sim.plot_keys[:2]}}
                    if timed_steps:
                        stats["steps/s"] = timed_steps / timed_s
                    progress.update(frame, stats)
                if save_now:
                    ckpt.save(state, None, checkpoint_meta(cfg))
                    last_save = time.monotonic()
            if preempted:
                progress.log(f"stopped at frame {frame} on {signals.received or 'a signal on another process'}; "
                             "checkpoint written. Run the same command again to continue.")
            ckpt.wait()
    finally:
        for closer in (progress, writer):
            if closer is not None:
                closer.close()
        ckpt.close()
    return SimResult(state=state, start_frame=start, initial_metrics=initial, final_metrics=final,
                     solver_steps=steps_done, steps_per_s=timed_steps / timed_s if timed_steps else None,
                     compile_s=compile_s, wall_s=time.perf_counter() - t_begin, preempted=preempted)


def _restore_or_init(sim: Simulation, cfg: SimConfig, ckpt: Checkpointer,
                     run_dir: Path) -> tuple[TrainState, int | None]:
    latest = ckpt.latest_step() if cfg.checkpoint.resume else None
    if latest is None:
        return sim.initial_state(), None
    try:
        saved = ckpt.restore_meta(latest)
    except Exception:  # noqa: BLE001 - a damaged step: restore_latest below reports it and falls back
        saved = None
    wanted = checkpoint_meta(cfg)
    if saved is not None and saved.get("workload") == "sim" and saved != wanted:
        changed = ", ".join(f"{k}: {saved.get(k)!r} -> {v!r}" for k, v in wanted.items() if saved.get(k) != v)
        raise UserError(
            f"The checkpoint at {ckpt.directory}/{latest} holds a different simulation ({changed}), so its fields "
            "cannot continue this one. Fix: pass a new --run-dir, or set checkpoint.resume=false to start over here."
        )
    found = ckpt.restore_latest(sim.abstract_state, "sim")  # verifies checksums; falls back past damaged steps
    if found is None:
        return sim.initial_state(), None
    state, _, step = found
    if step > cfg.output.frames:
        raise UserError(
            f"The checkpoint at {ckpt.directory}/{step} is at frame {step}, past this run's last frame "
            f"{cfg.output.frames} (output.frames). Fix: raise output.frames (keeping sim.t_end / output.frames the "
            "same), or pass a new --run-dir."
        )
    if jax.process_index() == 0:
        truncate_after(run_dir, step)
    return state, step


def _snapshot(sim: Simulation, state: TrainState, cfg: SimConfig, run_dir: Path, frame: int, is_writer: bool) -> None:
    if not cfg.output.images:
        return
    field = to_host(sim.picture(state))  # every process takes part in the gather; one writes
    if is_writer:
        outputs.save_snapshot(run_dir, frame, field, cfg.output.image_pixels)


def _floats(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: v.item() for k, v in jax.device_get(metrics).items()}  # Python floats (ints for step counts)


def _records(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(run_dir) if r.get("split") == outputs.SPLIT]


def _check_finite(metrics: dict[str, float], frame: int) -> None:
    bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
    if bad:
        raise TrainingHalted(
            f"The simulation blew up at frame {frame} (t = {metrics.get('time')}): {bad}. The step was too large "
            "for the scheme's stability or the grid too coarse for the flow. Fix: lower sim.cfl or sim.dt, raise "
            "grid.n or the viscosity/diffusivity, and start again in a new --run-dir (the checkpoints here hold "
            "states from before the blow-up)."
        )
