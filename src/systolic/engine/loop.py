"""The train loop. It knows nothing about any workload: a workload hands it a `Task`.

Host work per step is one `next(data)` and one dispatch of the jitted step. Metrics stay on the device until
the next log step, when all steps since the last log are fetched in one transfer, so logging every step's loss
costs no extra synchronisation.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import jax

from systolic.config import CheckpointConfig, ObserveConfig, TrainConfig
from systolic.engine.checkpoint import Checkpointer
from systolic.engine.state import TrainState
from systolic.errors import UserError
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
    compiles = 0
    writer = MetricsWriter(run_dir, tensorboard=settings.observe.tensorboard, enabled=is_writer)
    pending: list[tuple[int, dict[str, jax.Array]]] = []
    eval_metrics: dict[str, float] = {}
    last_loss = compile_s = None
    timed_steps, timed_s = 0, 0.0  # steady-state training only: no compile, no evaluation
    t_mark, step_mark = time.perf_counter(), start
    try:
        for step in range(start + 1, stop + 1):
            batch = next(task.data) if task.data is not None else None
            state, metrics = task.train_step(state, batch)
            pending.append((step, metrics))
            if step == start + 1:
                # The first call compiles; time it separately so throughput reflects steady state.
                jax.block_until_ready(state)
                compile_s = time.perf_counter() - t_mark
                t_mark, step_mark = time.perf_counter(), step
                progress.log(f"first step (compile + run) took {compile_s:.1f} s")
                progress.restart_clock(step)
                compiles = _cache_size(task.train_step)
            if step % settings.observe.log_every == 0 or step == stop:
                fetched = jax.device_get([m for _, m in pending])
                for (s, _), values in zip(pending, fetched):
                    writer.write(s, "train", values)
                pending.clear()
                last_loss = float(fetched[-1]["loss"])
                _check_finite(last_loss, step)
                elapsed = time.perf_counter() - t_mark
                stats: dict[str, float | str] = {"loss": last_loss}
                if step > step_mark and elapsed > 0:
                    timed_steps, timed_s = timed_steps + step - step_mark, timed_s + elapsed
                    stats[f"{task.item_unit}/s"] = task.items_per_step * (step - step_mark) / elapsed
                    if task.flops_per_step and task.peak_flops:
                        stats["mfu"] = task.flops_per_step * (step - step_mark) / elapsed / task.peak_flops
                progress.update(step, stats)
                if _cache_size(task.train_step) > compiles:
                    compiles = _cache_size(task.train_step)
                    progress.log(f"[yellow]warning:[/] the train step compiled again (now {compiles} versions) at "
                                 f"step {step}: an input's shape, dtype or sharding changed between steps. Run with "
                                 "JAX_EXPLAIN_CACHE_MISSES=1 to see which.")
                t_mark, step_mark = time.perf_counter(), step
            if task.evaluate is not None and (step % settings.train.eval_every == 0 or step == total):
                eval_metrics = task.evaluate(state)
                writer.write(step, "eval", eval_metrics)
                progress.log(f"step {step}: eval " + ", ".join(f"{k} {v:.4f}" for k, v in eval_metrics.items()))
                t_mark, step_mark = time.perf_counter(), step  # evaluation time is not training throughput
            if step % settings.checkpoint.every_steps == 0 or step == stop:
                ckpt.save(state, task.data.get_state() if task.data is not None else None, task.meta)
        ckpt.wait()
    finally:
        progress.close()
        writer.close()
        ckpt.close()
    if is_writer and settings.observe.plot:
        plot_losses(run_dir)
    return RunResult(state=state, start_step=start, final_step=int(jax.device_get(state.step)),
                     eval_metrics=eval_metrics, train_loss=last_loss, compile_s=compile_s,
                     items_per_s=task.items_per_step * timed_steps / timed_s if timed_s else None,
                     wall_s=time.perf_counter() - t_begin)


def _restore_or_init(task: Task, settings: LoopSettings, ckpt: Checkpointer,
                     run_dir: Path) -> tuple[TrainState, int | None]:
    latest = ckpt.latest_step() if settings.checkpoint.resume else None
    if latest is None:
        return task.init_state(), None
    meta = ckpt.restore_meta(latest)
    if meta.get("workload") != task.workload:
        raise UserError(
            f"The checkpoint at {ckpt.directory}/{latest} was written by the '{meta.get('workload')}' workload, not "
            f"'{task.workload}'. Fix: pass a fresh --run-dir for this run, or run the matching workload."
        )
    state, data_state, _ = ckpt.restore(latest, task.abstract_state)
    if task.data is not None:
        task.data.set_state(data_state)
    if jax.process_index() == 0:
        truncate_after(run_dir, latest)
    return state, latest


def _check_finite(loss: float, step: int) -> None:
    if loss != loss or loss in (float("inf"), float("-inf")):
        raise UserError(
            f"The training loss became {loss} at or before step {step}. The last checkpoint is intact. Fix: lower "
            "optim.lr, raise optim.warmup_steps, or check the data; then rerun the same command to resume."
        )


def _cache_size(fn: Any) -> int:
    """How many versions a jitted function has compiled; 0 for a plain function (e.g. under --no-jit)."""
    return fn._cache_size() if hasattr(fn, "_cache_size") else 0
