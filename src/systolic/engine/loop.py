"""The train loop. It knows nothing about any workload: a workload hands it a `Task`.

Host work per step is one `next(data)` and one dispatch of the jitted step. Metrics stay on the device until
the next log step, when all steps since the last log are fetched in one transfer, so logging every step's loss
(and the non-finite guard's verdict) costs no extra synchronisation.

Reliability contract (docs/reliability.md): a run killed at any point resumes from its last complete
checkpoint and continues bit for bit; SIGTERM or a first Ctrl-C finishes the current step, checkpoints and
exits cleanly; a non-finite update is discarded and either halts the run or is skipped, by config.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import jax
import numpy as np

from systolic.config import CheckpointConfig, ObserveConfig, TrainConfig
from systolic.engine import debug
from systolic.engine.checkpoint import Checkpointer
from systolic.engine.state import TrainState
from systolic.errors import TrainingHalted
from systolic.observe.metrics import MetricsWriter, truncate_after
from systolic.observe.plot import plot_losses
from systolic.observe.progress import ProgressReporter


class DataStream(Protocol):
    """An iterator of device-ready batches whose position can be saved and restored (JSON-serialisable)."""

    def __next__(self) -> Any: ...
    def get_state(self) -> dict[str, Any]: ...
    def set_state(self, state: dict[str, Any]) -> None: ...


@dataclasses.dataclass
class Task:
    """What a workload hands the loop."""

    workload: str
    abstract_state: TrainState  # ShapeDtypeStructs carrying the target shardings (restore target)
    init_state: Callable[[], TrainState]
    train_step: Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]  # jitted
    data: DataStream | None  # None for workloads that make their own data (RL environments, simulations)
    evaluate: Callable[[TrainState], dict[str, float]] | None = None
    items_per_step: int = 0  # e.g. tokens per optimizer step, for throughput
    item_unit: str = "items"
    flops_per_step: float | None = None
    peak_flops: float | None = None  # all devices together
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)  # stored with every checkpoint


@dataclasses.dataclass(frozen=True)
class LoopSettings:
    train: TrainConfig
    checkpoint: CheckpointConfig
    observe: ObserveConfig
    quiet: bool = False


@dataclasses.dataclass
class RunResult:
    state: TrainState
    start_step: int
    final_step: int
    eval_metrics: dict[str, float]
    train_loss: float | None
    compile_s: float | None
    items_per_s: float | None
    wall_s: float
    preempted: bool = False


class StopSignals:
    """SIGTERM or a first SIGINT asks the loop to stop after the current step; a second SIGINT aborts at once."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():  # Python only allows handlers there
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name


class _NonFiniteGuard:
    """Host side of the guard: reads each step's verdict and applies `train.nonfinite`."""

    def __init__(self, cfg: TrainConfig, leaf_names: list[str]):
        self.cfg = cfg
        self.leaf_names = leaf_names
        self.in_a_row = 0
        self.skipped = 0

    def check(self, step: int, metrics: dict[str, Any]) -> None:
        loss = float(metrics["loss"])
        if "finite" not in metrics:  # a workload with its own step: judge by the loss alone
            finite, where = bool(np.isfinite(loss)), -1
        else:
            finite, where = bool(metrics["finite"]), int(metrics["nonfinite_at"])
        if finite:
            self.in_a_row = 0
            return
        self.skipped += 1
        self.in_a_row += 1
        culprit = (f"the gradient of {self.leaf_names[where]} (the first non-finite gradient leaf)" if where >= 0
                   else "the loss (all gradients were finite)")
        if self.cfg.nonfinite == "halt":
            raise TrainingHalted(
                f"Step {step} produced a non-finite value in {culprit}; loss {loss}. Its "
                "update was discarded and the run halted. The last checkpoint is intact. Fix: lower optim.lr, raise "
                "optim.warmup_steps or check the data near this step, then rerun the same command to resume; or set "
                "train.nonfinite=skip to drop such steps and go on."
            )
        if self.in_a_row > self.cfg.max_skipped:
            raise TrainingHalted(
                f"{self.in_a_row} steps in a row (up to step {step}) produced non-finite values, last in {culprit}; "
                f"more than train.max_skipped={self.cfg.max_skipped}, so the run halted. The last checkpoint is intact. "
                "Fix: lower optim.lr or check the data, then rerun the same command to resume."
            )


def train(task: Task, settings: LoopSettings, run_dir: Path) -> RunResult:
    t_begin = time.perf_counter()
    is_writer = jax.process_index() == 0
    total = settings.train.steps
    stop = min(settings.train.stop_at_step or total, total)
    ckpt = Checkpointer(run_dir / "checkpoints", settings.checkpoint)
    state, resumed_from = _restore_or_init(task, settings, ckpt, run_dir)
    start = int(jax.device_get(state.step))
    progress = ProgressReporter(total=total, start=start, mode=settings.observe.progress, quiet=settings.quiet,
                                enabled=is_writer)
    if resumed_from is not None:
        progress.log(f"resumed from checkpoint step {resumed_from} in {ckpt.directory}")
    writer = MetricsWriter(run_dir, tensorboard=settings.observe.tensorboard, enabled=is_writer)
    leaf_names = ["params" + jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(task.abstract_state.params)[0]]
    guard = _NonFiniteGuard(settings.train, leaf_names)
    pending: list[tuple[int, dict[str, jax.Array]]] = []
    eval_metrics: dict[str, float] = {}
    last_loss = compile_s = None
    checked = debug.CheckedStep(task.train_step) if debug.current().checks else None  # --debug: under checkify
    recompiles = debug.RecompileWatch(checked or task.train_step)
    timed_steps, timed_s = 0, 0.0  # steady-state training only: no compile, no evaluation
    t_mark, step_mark = time.perf_counter(), start
    last_save = time.monotonic()
    every_s = settings.checkpoint.every_minutes * 60
    multi = jax.process_count() > 1
    preempted = False
    profiler = _Profiler(settings.observe.profile_range, run_dir / "profile", progress)

    def save(state: TrainState) -> None:
        nonlocal last_save
        ckpt.save(state, task.data.get_state() if task.data is not None else None, task.meta)
        last_save = time.monotonic()

    try:
        with StopSignals() as signals, debug.value_checks():
            step = start
            while step < stop:
                step += 1
                batch = next(task.data) if task.data is not None else None
                profiler.before(step)
                args = {"state": state, "batch": batch}  # kept for the recompilation report (donated: metadata only)
                with jax.profiler.StepTraceAnnotation("train", step_num=step), _floating_point_errors(step):
                    state, metrics = checked(state, batch, step) if checked else task.train_step(state, batch)
                if (recompiled := recompiles.check(step, args)) is not None:
                    progress.log(f"[yellow]warning:[/] {recompiled}")
                del args
                profiler.after(step, state)
                pending.append((step, metrics))
                if step == start + 1:
                    # The first call compiles; time it separately so throughput reflects steady state.
                    jax.block_until_ready(state)
                    compile_s = time.perf_counter() - t_mark
                    t_mark, step_mark = time.perf_counter(), step
                    progress.log(f"first step (compile + run) took {compile_s:.1f} s")
                    progress.restart_clock(step)
                # Stop and timed-checkpoint decisions must be the same on every process (each one's save and
                # next step are collective); with several processes they are agreed on at log steps only.
                regular_log = step % settings.observe.log_every == 0 or step == stop
                stop_now, timed = agree_across_processes(signals.received is not None,
                                         every_s > 0 and time.monotonic() - last_save > every_s, multi and not regular_log)
                if stop_now:
                    preempted = step < stop
                    stop = step
                save_now = step % settings.checkpoint.every_steps == 0 or step == stop or timed
                # Every step up to a checkpoint is on disk before the checkpoint is: a crash can then lose only
                # metrics of steps that the resumed run redoes.
                if regular_log or save_now:
                    fetched = jax.device_get([m for _, m in pending])
                    for (s, _), values in zip(pending, fetched):
                        guard.check(s, values)
                        writer.write(s, "train", {k: v for k, v in values.items() if k not in ("finite", "nonfinite_at")}
                                     | ({"skipped_total": guard.skipped} if guard.skipped else {}))
                    pending.clear()
                    writer.flush()
                    last_loss = float(fetched[-1]["loss"])
                    elapsed = time.perf_counter() - t_mark
                    stats: dict[str, float | str] = {"loss": last_loss}
                    if step > step_mark and elapsed > 0:
                        timed_steps, timed_s = timed_steps + step - step_mark, timed_s + elapsed
                        stats[f"{task.item_unit}/s"] = task.items_per_step * (step - step_mark) / elapsed
                        if task.flops_per_step and task.peak_flops:
                            stats["mfu"] = task.flops_per_step * (step - step_mark) / elapsed / task.peak_flops
                    if guard.skipped:
                        stats["skipped"] = f"{guard.skipped}"
                    progress.update(step, stats)
                    t_mark, step_mark = time.perf_counter(), step
                if task.evaluate is not None and (step % settings.train.eval_every == 0 or step == total):
                    with _floating_point_errors(step):
                        eval_metrics = task.evaluate(state)
                    writer.write(step, "eval", eval_metrics)
                    writer.flush()
                    progress.log(f"step {step}: eval " + ", ".join(f"{k} {v:.4f}" for k, v in eval_metrics.items()))
                    t_mark, step_mark = time.perf_counter(), step  # evaluation time is not training throughput
                if save_now:
                    save(state)
            if preempted:
                progress.log(f"stopped at step {step} on {signals.received or 'a signal on another process'}; "
                             "checkpoint written. Run the same command again to continue.")
            ckpt.wait()
    finally:
        profiler.stop()
        progress.close()
        writer.close()
        ckpt.close()
    if is_writer and settings.observe.plot:
        plot_losses(run_dir)
    return RunResult(state=state, start_step=start, final_step=int(jax.device_get(state.step)),
                     eval_metrics=eval_metrics, train_loss=last_loss, compile_s=compile_s,
                     items_per_s=task.items_per_step * timed_steps / timed_s if timed_s else None,
                     wall_s=time.perf_counter() - t_begin, preempted=preempted)


class _Profiler:
    """Captures an XLA/JAX trace of steps [first, last] (view it in TensorBoard's profile tab, XProf or Perfetto)."""

    def __init__(self, steps: tuple[int, int] | None, directory: Path, progress: ProgressReporter):
        self.steps, self.directory, self.progress, self.active = steps, directory, progress, False

    def before(self, step: int) -> None:
        if self.steps and step == self.steps[0] and jax.process_index() == 0:
            jax.profiler.start_trace(str(self.directory))
            self.active = True

    def after(self, step: int, state: Any) -> None:
        if self.active and step >= self.steps[1]:
            jax.block_until_ready(state)  # the trace must contain the device work, not just the dispatch
            self.stop()
            self.progress.log(f"profile of steps {self.steps[0]}-{self.steps[1]} written to {self.directory}")

    def stop(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False


def agree_across_processes(stop: bool, timed: bool, skip: bool) -> tuple[bool, bool]:
    """The same (stop, timed checkpoint) decision on every process: any process asking is enough."""
    if skip:
        return False, False
    if jax.process_count() == 1:
        return stop, timed
    from jax.experimental import multihost_utils

    votes = multihost_utils.process_allgather(np.array([stop, timed], np.int32))  # (processes, 2)
    return bool(votes[..., 0].any()), bool(votes[..., 1].any())


def _restore_or_init(task: Task, settings: LoopSettings, ckpt: Checkpointer,
                     run_dir: Path) -> tuple[TrainState, int | None]:
    if not settings.checkpoint.resume:
        return task.init_state(), None
    found = ckpt.restore_latest(task.abstract_state, task.workload)
    if found is None:
        return task.init_state(), None
    state, data_state, step = found
    if task.data is not None:
        task.data.set_state(data_state)
    if jax.process_index() == 0:
        truncate_after(run_dir, step)
    return state, step


@contextlib.contextmanager
def _floating_point_errors(step: int) -> Iterator[None]:
    """--debug's jax_debug_nans/infs raise FloatingPointError from any jitted code (evaluation, a workload's own
    step): stop the run the way the non-finite guard does, naming the step, the operation and the line."""
    try:
        yield
    except FloatingPointError as e:
        raise TrainingHalted(
            f"--debug: step {step} produced a non-finite value: {debug.describe_floating_point_error(e)}. The run "
            "halted; the last checkpoint is intact. Fix: inspect that line (with --no-jit a breakpoint() there stops "
            "in pdb), then rerun the same command to resume."
        ) from None

