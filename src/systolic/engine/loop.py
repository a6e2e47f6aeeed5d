"""The loop under every workload (train, fit, simulate). It knows nothing about any workload: one hands it a `Task`.

Host work per step is one `next(data)` and one dispatch of the jitted step. Metrics stay on the device until
the next log step, when all steps since the last log are fetched in one transfer, so logging every step's loss
(and the non-finite guard's verdict) costs no extra synchronisation.

Reliability contract (docs/reliability.md): a run killed at any point resumes from its last complete
checkpoint and continues bit for bit; SIGTERM or a first Ctrl-C finishes the current step, checkpoints and
exits cleanly; a non-finite update is discarded and either halts the run or is skipped, by config (guard.py).

Hooks: `after_step(step, state)` runs after every step (and after step 0 of a fresh run), e.g. a simulation's
snapshots; `initial_metrics(state)` is written as step 0 of a fresh run; `evaluate(state)` every eval_every steps.
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

from systolic.config import CheckpointConfig, LoopConfig, ObserveConfig
from systolic.engine import debug
from systolic.engine.checkpoint import Checkpointer
from systolic.engine.guard import VERDICT_KEYS, NonFiniteGuard
from systolic.engine.state import TrainState
from systolic.errors import TrainingHalted, UserError
from systolic.observe.metrics import MetricsWriter, read_metrics, truncate_after
from systolic.observe.plot import plot_losses
from systolic.observe.progress import ProgressReporter
from systolic.runtime import interrupts


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
    train_step: Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]  # from step.jit_step
    data: DataStream | None  # None for workloads that make their own data (RL environments, simulations)
    check: tuple[str, ...] | None = ("loss",)  # the metrics the guard checks (None: all); as given to jit_step
    evaluate: Callable[[TrainState], dict[str, float]] | None = None
    items_per_step: int = 0  # e.g. tokens per optimizer step, for throughput
    items_metric: str = ""  # instead: a metric that counts each step's items (a simulation's adaptive time steps)
    item_unit: str = "items"  # plural, as in "tokens/s"; the throughput metric is named from it (`throughput_key`)
    flops_per_step: float | None = None
    peak_flops: float | None = None  # all devices together
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)  # stored with every checkpoint; a resume must match
    split: str = "train"  # the metrics split of the step rows
    progress_keys: tuple[str, ...] = ("loss",)  # metrics shown beside the progress bar
    label: str = "train"  # the progress bar's name
    nonfinite_advice: str = ("lower optim.lr, raise optim.warmup_steps or check the data near this step, then rerun the "
                             "same command to resume; or set loop.nonfinite=skip to drop such steps and go on")
    initial_metrics: Callable[[TrainState], dict[str, jax.Array]] | None = None  # written as step 0 of a fresh run
    after_step: Callable[[int, TrainState], None] | None = None  # after every step, and step 0 of a fresh run
    # Host-side metrics that are exact functions of the step (a mixture's tokens per source so far), written with
    # each train row: no state to checkpoint, so a resumed run writes the same values.
    step_metrics: Callable[[int], dict[str, float]] | None = None
    notes: tuple[str, ...] = ()  # lines `systolic bench` prints under its table (an lm pipeline's schedule and bubble)

    @property
    def throughput_key(self) -> str:
        """The train rows' throughput metric: `tokens_per_s`, `env_steps_per_s`, `images_per_s`, `steps_per_s`."""
        return self.item_unit.replace(" ", "_") + "_per_s"


@dataclasses.dataclass(frozen=True)
class LoopSettings:
    steps: int  # the run's last step
    eval_every: int
    loop: LoopConfig
    checkpoint: CheckpointConfig
    observe: ObserveConfig
    steps_key: str = "train.steps"  # the setting `steps` comes from, for messages
    quiet: bool = False


@dataclasses.dataclass
class RunResult:
    state: TrainState
    start_step: int
    final_step: int
    eval_metrics: dict[str, float]
    first_metrics: dict[str, float]  # the run's step-0 row, or its first logged row (from metrics.jsonl on a resume)
    last_metrics: dict[str, float]  # the last logged step's metrics
    compile_s: float | None
    items_per_s: float | None  # steady state: without the compiling first step and evaluations
    items_done: float  # items of the steps this invocation ran
    wall_s: float
    preempted: bool = False

    @property
    def train_loss(self) -> float | None:
        return self.last_metrics.get("loss")


class StopSignals:
    """SIGTERM or a first SIGINT asks the loop to stop after the current step; a second SIGINT aborts at once."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        # A signal that reached the CLI's handler inside a callback XLA ran may have been swallowed there:
        # honour it now (runtime/interrupts.py).
        self.received = interrupts.received()
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


def train(task: Task, settings: LoopSettings, run_dir: Path) -> RunResult:
    t_begin = time.perf_counter()
    is_writer = jax.process_index() == 0
    total = settings.steps
    stop = min(settings.loop.stop_at_step or total, total)
    ckpt = Checkpointer(run_dir / "checkpoints", settings.checkpoint)
    progress = writer = None
    profiler = _Profiler(settings.observe.profile_range, run_dir / "profile")
    try:
        state, resumed_from = _restore_or_init(task, settings, ckpt, run_dir)
        start = int(jax.device_get(state.step))
        progress = ProgressReporter(total=total, start=start, mode=settings.observe.progress, quiet=settings.quiet,
                                    enabled=is_writer, description=task.label)
        if resumed_from is None and is_writer:
            truncate_after(run_dir, -1)  # starting at step 0: rows of a run that never checkpointed are not history
        writer = MetricsWriter(run_dir, tensorboard=settings.observe.tensorboard, enabled=is_writer)
        if resumed_from is not None:
            progress.log(f"resumed from checkpoint step {resumed_from} in {ckpt.directory}")
            rows = [r for r in read_metrics(run_dir) if r.get("split") == task.split] if is_writer else []
            first = _numbers(rows[0]) if rows else {}
            last = _numbers(rows[-1]) if rows else {}
        else:
            first = last = {}
            if task.initial_metrics is not None:
                first = last = _floats(task.initial_metrics(state))
                writer.write(0, task.split, first)
            if task.after_step is not None:
                task.after_step(0, state)
        guard = NonFiniteGuard(settings.loop, task.check, task.abstract_state.params, task.nonfinite_advice)
        pending: list[tuple[int, dict[str, jax.Array]]] = []
        eval_metrics: dict[str, float] = {}
        compile_s = None
        checked = debug.CheckedStep(task.train_step) if debug.current().checks else None  # --debug: under checkify
        recompiles = debug.RecompileWatch(checked or task.train_step)
        items_done = timed_items = timed_s = 0.0  # steady-state stepping only: no compile, no evaluation
        t_mark, step_mark = time.perf_counter(), start
        last_save = time.monotonic()
        every_s = settings.checkpoint.every_minutes * 60
        multi = jax.process_count() > 1
        preempted = False

        def save(state: TrainState) -> None:
            nonlocal last_save
            ckpt.save(state, task.data.get_state() if task.data is not None else None, task.meta)
            last_save = time.monotonic()

        with StopSignals() as signals, debug.value_checks():
            step = start
            while step < stop:
                step += 1
                batch = next(task.data) if task.data is not None else None
                profiler.before(step)
                args = {"state": state, "batch": batch}  # kept for the recompilation report (donated: metadata only)
                with jax.profiler.StepTraceAnnotation(task.label, step_num=step), _floating_point_errors(step):
                    state, metrics = checked(state, batch, step) if checked else task.train_step(state, batch)
                if (recompiled := recompiles.check(step, args)) is not None:
                    progress.log(f"[yellow]warning:[/] {recompiled}")
                del args
                profiler.after(step, state, progress)
                pending.append((step, metrics))
                if task.after_step is not None:
                    with _floating_point_errors(step):
                        task.after_step(step, state)
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
                    fetched = jax.device_get([m for _, m in pending])  # waits for the window's last step
                    # Windows tile the time: this one ends here and the next starts here, so the host's writing
                    # and logging below count in the next window's rate.
                    t_fetched = time.perf_counter()
                    elapsed = t_fetched - t_mark
                    window_items = 0.0
                    for (s, _), values in zip(pending, fetched):
                        guard.check_step(s, values)
                        last = _floats({k: v for k, v in values.items() if k not in VERDICT_KEYS})
                        if task.step_metrics is not None:
                            last |= task.step_metrics(s)
                        items = last[task.items_metric] if task.items_metric else task.items_per_step
                        items_done += items
                        if s > step_mark:  # since the clock last started: not the compiling step
                            window_items += items
                        # The window's rate goes into its last row; a window of only the compiling step has none.
                        if s == step and step > step_mark and elapsed > 0:
                            last[task.throughput_key] = window_items / elapsed
                        writer.write(s, task.split, last | ({"skipped_total": guard.skipped} if guard.skipped else {}))
                    pending.clear()
                    writer.flush()
                    stats: dict[str, float | str] = {k: last[k] for k in task.progress_keys if k in last}
                    if step > step_mark and elapsed > 0:
                        timed_items, timed_s = timed_items + window_items, timed_s + elapsed
                        stats[f"{task.item_unit}/s"] = window_items / elapsed
                        if task.flops_per_step and task.peak_flops:
                            stats["mfu"] = task.flops_per_step * (step - step_mark) / elapsed / task.peak_flops
                    if guard.skipped:
                        stats["skipped"] = f"{guard.skipped}"
                    progress.update(step, stats)
                    t_mark, step_mark = t_fetched, step
                if task.evaluate is not None and (step % settings.eval_every == 0 or step == total):
                    with _floating_point_errors(step):
                        eval_metrics = task.evaluate(state)
                    writer.write(step, "eval", eval_metrics)
                    writer.flush()
                    progress.log(f"step {step}: eval " + ", ".join(f"{k} {v:.4f}" for k, v in eval_metrics.items()))
                    t_mark, step_mark = time.perf_counter(), step  # evaluation is not throughput
                if save_now:
                    save(state)
            if preempted:
                progress.log(f"stopped at step {step} on {signals.received or 'a signal on another process'}; "
                             "checkpoint written. Run the same command again to continue.")
            ckpt.wait()
    finally:
        profiler.stop()
        for closer in (progress, writer):
            if closer is not None:
                closer.close()
        ckpt.close()
    if is_writer and settings.observe.plot:
        plot_losses(run_dir)
    return RunResult(state=state, start_step=start, final_step=int(jax.device_get(state.step)),
                     eval_metrics=eval_metrics, first_metrics=first, last_metrics=last, compile_s=compile_s,
                     items_per_s=timed_items / timed_s if timed_s else None, items_done=items_done,
                     wall_s=time.perf_counter() - t_begin, preempted=preempted)


def _floats(metrics: dict[str, Any]) -> dict[str, float]:
    """Fetched metrics as Python numbers (ints stay ints)."""
    return {k: v.item() if hasattr(v, "item") else v for k, v in jax.device_get(metrics).items()}


def _numbers(row: dict[str, Any]) -> dict[str, float]:
    """A metrics.jsonl row's numbers (non-finite values are stored as strings)."""
    return {k: float(v) if isinstance(v, str) else v for k, v in row.items()
            if k not in ("step", "split") and (isinstance(v, (int, float)) and not isinstance(v, bool)
                                                or v in ("nan", "inf", "-inf"))}


class _Profiler:
    """Captures an XLA/JAX trace of steps [first, last] (view it in TensorBoard's profile tab, XProf or Perfetto)."""

    def __init__(self, steps: tuple[int, int] | None, directory: Path):
        self.steps, self.directory, self.active = steps, directory, False

    def before(self, step: int) -> None:
        if self.steps and step == self.steps[0] and jax.process_index() == 0:
            jax.profiler.start_trace(str(self.directory))
            self.active = True

    def after(self, step: int, state: Any, progress: ProgressReporter) -> None:
        if self.active and step >= self.steps[1]:
            jax.block_until_ready(state)  # the trace must contain the device work, not just the dispatch
            self.stop()
            progress.log(f"profile of steps {self.steps[0]}-{self.steps[1]} written to {self.directory}")

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
    _check_meta(task, ckpt)
    found = ckpt.restore_latest(task.abstract_state, task.workload)  # verifies checksums; falls back past damage
    if found is None:
        return task.init_state(), None
    state, data_state, step = found
    if jax.tree.leaves(state.frozen):
        # Checkpoints leave frozen parameters out (a LoRA run's base weights): init_state rebuilds them, from the
        # same source or seed; its fresh trainable parameters and optimizer state are dropped.
        state = state.replace(frozen=task.init_state().frozen)
    if step > settings.steps:
        raise UserError(
            f"The checkpoint at {ckpt.directory}/{step} is at step {step}, past this run's last step "
            f"{settings.steps} ({settings.steps_key}). Fix: raise {settings.steps_key}, or pass a new --run-dir."
        )
    if task.data is not None:
        task.data.set_state(data_state)
    if jax.process_index() == 0:
        truncate_after(run_dir, step)
    return state, step


def _check_meta(task: Task, ckpt: Checkpointer) -> None:
    """A resume must agree with what the newest checkpoint was written for (its shapes would not fit otherwise)."""
    latest = ckpt.latest_step()
    if latest is None:
        return
    try:
        saved = ckpt.restore_meta(latest)
    except Exception:  # noqa: BLE001 - a damaged step: restore_latest reports it and falls back
        return
    if not isinstance(saved, dict) or saved.get("workload") != task.workload:
        return  # restore_latest names the other workload
    changed = ", ".join(f"{k}: {saved.get(k)!r} -> {v!r}" for k, v in task.meta.items() if saved.get(k) != v)
    if changed:
        raise UserError(
            f"The checkpoint at {ckpt.directory}/{latest} was written for a different setup ({changed}), so it "
            "cannot continue this run. Nothing was changed. Fix: pass a new --run-dir, or set "
            "checkpoint.resume=false to start over here."
        )


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

