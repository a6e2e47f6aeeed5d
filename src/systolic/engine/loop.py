"""The loop under every workload (train, fit, simulate). It knows nothing about any workload: one hands it a `Task`.

Host work per step is one `next(data)` and one dispatch of the jitted step. Metrics stay on the device until
the next log step, when all steps since the last log are fetched in one transfer, so logging every step's loss
(and the non-finite guard's verdict) costs no extra synchronisation.

Reliability contract (docs/reliability.md): a run killed at any point resumes from its last complete
checkpoint and continues bit for bit; SIGTERM or a first Ctrl-C finishes the current step, checkpoints and
exits cleanly; a non-finite update is discarded and either halts the run or is skipped, by config (guard.py).

Hooks, as Levanter's `trainer.add_hook(fn, every=N)`: `task.add_hook(fn, every=N)` runs `fn(step, state)` after
every step that is a multiple of N, and on the initial state of a fresh run as step 0. The loop's own concerns
(evaluation, the step-0 row, `step_metrics`) stay `Task` fields. `train` is made of small pieces, in the order a
step meets them: `_restore_or_init`, `_begin`, `_Stepper`, the hooks, `_MetricsWindow`, `agree_across_processes`,
`_evaluate` and `_Saving` (what each does: docs/design-notes.md, this module's section).
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
from systolic.engine import debug, fit
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


@dataclasses.dataclass(frozen=True)
class Hook:
    """`fn(step, state)`, run by the loop right after each step that is a multiple of `every` (Task.add_hook)."""

    fn: Callable[[int, TrainState], None]
    every: int = 1

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"Hook(every={self.every}): a hook runs every N >= 1 steps. Fix: pass every=1 or more.")

    def due(self, step: int) -> bool:
        return step % self.every == 0


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
    evaluate_at_start: bool = False  # also evaluate a fresh run's initial state, as step 0's eval row (post-training)
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
    # What to change when the compiled step does not fit a device's memory (engine/fit.py); an lm names model.remat
    # and `systolic plan --search`.
    memory_advice: str = ("shrink the model or the batch, or spread the state over more devices (a larger mesh.fsdp "
                          "or more chips); `systolic plan` with --target shows what fits a target")
    initial_metrics: Callable[[TrainState], dict[str, jax.Array]] | None = None  # written as step 0 of a fresh run
    # Host-side metrics of a step, written with its train row (called once per step, after the step's hooks): exact
    # functions of the step (a mixture's tokens per source so far; no state to checkpoint, so a resumed run writes
    # the same values), or what the task's data stream recorded for it (lm GRPO's rollout rewards and timings).
    step_metrics: Callable[[int], dict[str, float]] | None = None
    notes: tuple[str, ...] = ()  # lines `systolic bench` prints under its table (an lm pipeline's schedule and bubble)
    # What the first-step line adds: work done for the first step before it that the step's time does not include
    # (lm GRPO: the rollout it trains on). "" or None: nothing.
    first_step_note: Callable[[], str | None] | None = None
    hooks: list[Hook] = dataclasses.field(default_factory=list)  # in the order they run; see add_hook

    def add_hook(self, fn: Callable[[int, TrainState], None], every: int = 1) -> None:
        """Runs `fn(step, state)` after each step that is a multiple of `every`, and on a fresh run's initial
        state as step 0. Steps are the run's own numbers, so a resumed run calls `fn` at the steps an
        uninterrupted run would have (its start state was seen by the invocation that reached it)."""
        self.hooks.append(Hook(fn, every))

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
    items_per_s: float | None  # steady state: without the compiling first step, evaluations and saves
    items_done: float  # items of the steps this invocation ran
    wall_s: float
    preempted: bool = False
    mfu: float | None = None  # steady state, as items_per_s; None without the task's FLOPs or the chip's peak

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
    """Runs `task` from its newest checkpoint (or its initial state) to step `settings.steps`, or to an earlier
    stop: `loop.stop_at_step`, or a stop signal on any process."""
    t_begin = time.perf_counter()
    is_writer = jax.process_index() == 0
    ckpt = Checkpointer(run_dir / "checkpoints", settings.checkpoint)
    progress = writer = None
    profiler = _Profiler(settings.observe.profile_range, run_dir / "profile")
    try:
        state, resumed_from = _restore_or_init(task, settings, ckpt, run_dir)
        start = int(jax.device_get(state.step))
        progress = ProgressReporter(total=settings.steps, start=start, mode=settings.observe.progress,
                                    quiet=settings.quiet, enabled=is_writer, description=task.label)
        if resumed_from is None and is_writer:
            truncate_after(run_dir, -1)  # starting at step 0: rows of a run that never checkpointed are not history
        writer = MetricsWriter(run_dir, tensorboard=settings.observe.tensorboard, enabled=is_writer)
        if resumed_from is not None:
            progress.log(f"resumed from checkpoint step {resumed_from} in {ckpt.directory}")
        first, last = _begin(task, state, resumed_from is None, writer, progress, run_dir)
        guard = NonFiniteGuard(settings.loop, task.check, task.abstract_state.params, task.nonfinite_advice)
        stepper = _Stepper(task, profiler, progress)
        window = _MetricsWindow(task, guard, writer, progress, start, last)
        saving = _Saving(task, ckpt, settings.checkpoint)
        with StopSignals() as signals, debug.value_checks():
            state, eval_metrics, preempted = _run_steps(task, settings, state, start, stepper, window, saving,
                                                        signals, writer, progress)
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
                     eval_metrics=eval_metrics, first_metrics=first, last_metrics=window.last,
                     compile_s=window.compile_s, items_per_s=window.items_per_s, items_done=window.items_done,
                     wall_s=time.perf_counter() - t_begin, preempted=preempted, mfu=window.mfu)


def _run_steps(task: Task, settings: LoopSettings, state: TrainState, start: int, stepper: _Stepper,
               window: _MetricsWindow, saving: _Saving, signals: StopSignals, writer: MetricsWriter,
               progress: ProgressReporter) -> tuple[TrainState, dict[str, float], bool]:
    """Steps from `start` until the run's last step or an agreed stop: (state, the last evaluation's metrics,
    whether it stopped early)."""
    step = start
    stop = min(settings.loop.stop_at_step or settings.steps, settings.steps)
    multi = jax.process_count() > 1
    eval_metrics: dict[str, float] = {}
    preempted = False
    while step < stop:
        step += 1
        state, metrics = stepper(state, step)
        window.add(step, metrics)
        if step == start + 1:  # before the hooks: what they do after the step (a rollout) is not the step's time
            window.first_step_done(step, state)
        _run_hooks(task.hooks, step, state)
        # Stop and timed-checkpoint decisions must be the same on every process (each one's save and next step
        # are collective); with several processes they are agreed on at log steps only.
        regular_log = step % settings.observe.log_every == 0 or step == stop
        stop_now, timed = agree_across_processes(signals.received is not None, saving.overdue(),
                                                 multi and not regular_log)
        if stop_now:
            preempted = step < stop
            stop = step
        save_now = saving.due(step, stop) or timed
        # Every step up to a checkpoint is on disk before the checkpoint is: a crash can then lose only metrics
        # of steps that the resumed run redoes.
        if regular_log or save_now:
            window.flush(step)
        if task.evaluate is not None and (step % settings.eval_every == 0 or step == settings.steps):
            eval_metrics = _evaluate(task, step, state, writer, progress)
            window.restart_clock(step)  # evaluation is not throughput
        if save_now:
            saving.save(state)
            # Nor is writing a checkpoint: on the chip (2026-12-07) rl-cartpole's CLI rate, its 7 saves counted,
            # was 0.97M env steps/s where its compiled chunks alone ran 2.04M (benchmarks/peers/rl_profile.py).
            window.restart_clock(step)
    if preempted:
        progress.log(f"stopped at step {step} on {signals.received or 'a signal on another process'}; "
                     "checkpoint written. Run the same command again to continue.")
    return state, eval_metrics, preempted


def _begin(task: Task, state: TrainState, fresh: bool, writer: MetricsWriter, progress: ProgressReporter,
           run_dir: Path) -> tuple[dict[str, float], dict[str, float]]:
    """The run's first and latest train rows: a fresh run writes its step 0 (and runs its hooks on the initial
    state, then with `evaluate_at_start` its step-0 evaluation); a resumed one reads them back from metrics.jsonl
    (on process 0, which has it)."""
    if not fresh:
        rows = [r for r in read_metrics(run_dir) if r.get("split") == task.split] if jax.process_index() == 0 else []
        return (_numbers(rows[0]), _numbers(rows[-1])) if rows else ({}, {})
    first: dict[str, float] = {}
    if task.initial_metrics is not None:
        first = _floats(task.initial_metrics(state))
        writer.write(0, task.split, first)
    _run_hooks(task.hooks, 0, state)
    if task.evaluate_at_start and task.evaluate is not None:
        _evaluate(task, 0, state, writer, progress)
    return first, first


def _run_hooks(hooks: list[Hook], step: int, state: TrainState) -> None:
    for hook in hooks:
        if hook.due(step):
            with _floating_point_errors(step):
                hook.fn(step, state)


class _Stepper:
    """One train step with what surrounds it: the next batch, the memory check of the first (engine/fit.py),
    --debug's checkify, the recompilation warning and the profiler's trace."""

    def __init__(self, task: Task, profiler: _Profiler, progress: ProgressReporter):
        self.task, self.profiler, self.progress = task, profiler, progress
        self.checked = debug.CheckedStep(task.train_step) if debug.current().checks else None  # --debug
        self.recompiles = debug.RecompileWatch(self.checked or task.train_step)
        # --debug runs its own checkified program and --no-jit none: compiling the plain step would be wasted.
        self.fit_checked = self.checked is not None or not debug.current().jit

    def __call__(self, state: TrainState, step: int) -> tuple[TrainState, dict[str, jax.Array]]:
        task = self.task
        batch = next(task.data) if task.data is not None else None
        if not self.fit_checked:  # the first step: compiled here (the call below reuses it) and checked
            fit.compile_step(task.train_step, state, batch, advice=task.memory_advice)
            self.fit_checked = True
        self.profiler.before(step)
        args = {"state": state, "batch": batch}  # kept for the recompilation report (donated: metadata only)
        with jax.profiler.StepTraceAnnotation(task.label, step_num=step), _floating_point_errors(step):
            state, metrics = self.checked(state, batch, step) if self.checked else task.train_step(state, batch)
        if (recompiled := self.recompiles.check(step, args)) is not None:
            self.progress.log(f"[yellow]warning:[/] {recompiled}")
        del args
        self.profiler.after(step, state, self.progress)
        return state, metrics


class _MetricsWindow:
    """The steps since the last log step. Their metrics stay on the device until `flush`, which fetches them in
    one transfer, lets the guard read each step's verdict, writes one train row per step and shows the window's
    rate (and MFU) on the progress bar. Windows tile the time, apart from the compiling first step, evaluations
    and checkpoint saves (`restart_clock`), so their rates add up to the steady-state throughput."""

    def __init__(self, task: Task, guard: NonFiniteGuard, writer: MetricsWriter, progress: ProgressReporter,
                 start: int, last: dict[str, float]):
        self.task, self.guard, self.writer, self.progress = task, guard, writer, progress
        self.pending: list[tuple[int, dict[str, jax.Array]]] = []
        self.last = last  # the latest train row
        self.compile_s: float | None = None
        self.items_done = self.timed_items = self.timed_s = 0.0  # timed_*: steady-state stepping only
        self.timed_steps = 0
        self.restart_clock(start)

    @property
    def items_per_s(self) -> float | None:
        """The steady-state rate: without the compiling first step, evaluations and checkpoint saves."""
        return self.timed_items / self.timed_s if self.timed_s else None

    @property
    def mfu(self) -> float | None:
        """The steady-state model FLOPs utilisation, when the task counts its FLOPs and the chip has a known peak."""
        return self._mfu(self.timed_steps, self.timed_s)

    def _mfu(self, steps: int, seconds: float) -> float | None:
        task = self.task
        if not (seconds and task.flops_per_step and task.peak_flops):
            return None
        return task.flops_per_step * steps / seconds / task.peak_flops

    def add(self, step: int, metrics: dict[str, jax.Array]) -> None:
        self.pending.append((step, metrics))

    def restart_clock(self, step: int) -> None:
        self.t_mark, self.step_mark = time.perf_counter(), step

    def first_step_done(self, step: int, state: TrainState) -> None:
        """The first call compiles; it is timed apart so that throughput reflects the steady state."""
        jax.block_until_ready(state)
        self.compile_s = time.perf_counter() - self.t_mark
        self.restart_clock(step)
        note = self.task.first_step_note() if self.task.first_step_note is not None else None
        self.progress.log(f"first step (compile + run) took {self.compile_s:.1f} s" + (f"; {note}" if note else ""))
        self.progress.restart_clock(step)

    def flush(self, step: int) -> None:
        task = self.task
        fetched = jax.device_get([m for _, m in self.pending])  # waits for the window's last step
        # This window ends here and the next starts here, so the host's writing and logging below count in the
        # next window's rate.
        t_fetched = time.perf_counter()
        elapsed = t_fetched - self.t_mark
        timed = step > self.step_mark and elapsed > 0  # not a window of only the compiling step
        window_items = 0.0
        for (s, _), values in zip(self.pending, fetched):
            self.guard.check_step(s, values)
            self.last = _floats({k: v for k, v in values.items() if k not in VERDICT_KEYS})
            if task.step_metrics is not None:
                self.last |= task.step_metrics(s)
            items = self.last[task.items_metric] if task.items_metric else task.items_per_step
            self.items_done += items
            if s > self.step_mark:  # since the clock last started: not the compiling step
                window_items += items
            if s == step and timed:  # the window's rate goes into its last row
                self.last[task.throughput_key] = window_items / elapsed
            skipped = {"skipped_total": self.guard.skipped} if self.guard.skipped else {}
            self.writer.write(s, task.split, self.last | skipped)
        self.pending.clear()
        self.writer.flush()
        stats: dict[str, float | str] = {k: self.last[k] for k in task.progress_keys if k in self.last}
        if timed:
            self.timed_items, self.timed_s = self.timed_items + window_items, self.timed_s + elapsed
            self.timed_steps += step - self.step_mark
            stats[f"{task.item_unit}/s"] = window_items / elapsed
            if (mfu := self._mfu(step - self.step_mark, elapsed)) is not None:
                stats["mfu"] = mfu
        if self.guard.skipped:
            stats["skipped"] = f"{self.guard.skipped}"
        self.progress.update(step, stats)
        self.t_mark, self.step_mark = t_fetched, step


def _evaluate(task: Task, step: int, state: TrainState, writer: MetricsWriter,
              progress: ProgressReporter) -> dict[str, float]:
    """The task's evaluation of `state`, written as the step's eval row and logged."""
    with _floating_point_errors(step):
        metrics = task.evaluate(state)
    writer.write(step, "eval", metrics)
    writer.flush()
    progress.log(f"step {step}: eval " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return metrics


class _Saving:
    """When to checkpoint: every checkpoint.every_steps steps, at the run's stop, and when
    checkpoint.every_minutes have passed since the last save (a decision `agree_across_processes` shares)."""

    def __init__(self, task: Task, ckpt: Checkpointer, cfg: CheckpointConfig):
        self.task, self.ckpt, self.every_steps = task, ckpt, cfg.every_steps
        self.every_s = cfg.every_minutes * 60
        self.last_save = time.monotonic()

    def overdue(self) -> bool:
        return self.every_s > 0 and time.monotonic() - self.last_save > self.every_s

    def due(self, step: int, stop: int) -> bool:
        return step % self.every_steps == 0 or step == stop

    def save(self, state: TrainState) -> None:
        data = self.task.data
        self.ckpt.save(state, data.get_state() if data is not None else None, self.task.meta)
        self.last_save = time.monotonic()


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

