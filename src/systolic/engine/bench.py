"""`systolic bench`: steady-state speed of a workload's real train step, without writing a run.

Compile time is measured apart; warm-up steps are excluded; the step time is the median over three windows of
the N steps, each window dispatched back to back and timed to its last step's completion, as training runs them
(host dispatch and data overlap the device's work; a host slower than the device shows). The step's memory is
the compiled program's memory analysis per device (engine/fit.py, which also refuses a step that does not fit).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np

from systolic.runtime.memory import ProgramMemory, size_text

from systolic.engine import fit
from systolic.engine.loop import Task
from systolic.observe.peak_flops import measured_matmul_flops


@dataclasses.dataclass(frozen=True)
class BenchResult:
    compile_s: float
    step_time_s: float  # the median window's seconds per step
    step_time_spread_s: float  # the slowest window's step time minus the fastest's
    items_per_s: float
    item_unit: str
    flops_per_step: float | None
    flops_per_s: float | None
    peak_flops: float | None
    peak_source: str
    mfu: float | None
    peak_memory_bytes: int | None  # per device, the compiled step's memory analysis: step_memory.peak_bytes
    step_memory: ProgramMemory | None  # its parts (None where the backend gives no analysis)
    devices: int
    platform: str
    notes: tuple[str, ...] = ()  # the task's own (e.g. a pipeline's bubble)


def benchmark(task: Task, steps: int = 10, warmup: int = 2) -> BenchResult:
    state = task.init_state()
    batch = next(task.data) if task.data is not None else None
    t = time.perf_counter()
    step_memory = fit.compile_step(task.train_step, state, batch, advice=task.memory_advice)  # the call reuses it
    state, _ = task.train_step(state, batch)
    jax.block_until_ready(state)
    compile_s = time.perf_counter() - t
    for _ in range(warmup):
        state, _ = task.train_step(state, next(task.data) if task.data is not None else None)
    jax.block_until_ready(state)
    times = _windows(task, state, steps)
    step_s = float(np.median(times))
    peak, source = task.peak_flops, "data sheet"
    if peak is None and jax.default_backend() == "cpu":
        # Fake CPU devices share the host's cores: the host's matmul rate is the peak, per process.
        peak, source = measured_matmul_flops() * jax.process_count(), "measured matmul"
    flops_per_s = task.flops_per_step / step_s if task.flops_per_step else None
    return BenchResult(
        compile_s=compile_s, step_time_s=step_s,
        step_time_spread_s=float(max(times) - min(times)),
        items_per_s=task.items_per_step / step_s, item_unit=task.item_unit,
        flops_per_step=task.flops_per_step, flops_per_s=flops_per_s, peak_flops=peak, peak_source=source,
        mfu=flops_per_s / peak if flops_per_s and peak else None,
        peak_memory_bytes=step_memory.peak_bytes if step_memory else None, step_memory=step_memory, devices=jax.device_count(), platform=jax.default_backend(),
        notes=task.notes,
    )


def _windows(task: Task, state: Any, steps: int) -> list[float]:
    """Seconds per step in (up to) three windows of steps dispatched back to back, each timed to its last step's
    completion: the steady state that training sees (its loop never waits for a step before dispatching the next, so
    the host's dispatch and the next batch overlap the device's work). Timing each step to completion instead
    added the host's share to every step (3 ms of gpt2-124m's 281 on the v5e chip)."""
    windows = min(3, steps)
    sizes = [steps // windows + (i < steps % windows) for i in range(windows)]
    per_step = []
    for size in sizes:
        batches = [next(task.data) if task.data is not None else None for _ in range(size)]
        t = time.perf_counter()
        for batch in batches:
            state, _ = task.train_step(state, batch)
        jax.block_until_ready(state)
        per_step.append((time.perf_counter() - t) / size)
    return per_step


def format_table(result: BenchResult) -> str:
    rows = [
        ("platform", f"{result.platform} x {result.devices}"),
        ("compile + first step", f"{result.compile_s:.2f} s"),
        ("step time (median)", f"{result.step_time_s * 1e3:.1f} ms (windows differ by {result.step_time_spread_s * 1e3:.1f} ms)"),
        (f"throughput", f"{result.items_per_s:,.0f} {result.item_unit}/s"),
        ("model FLOPs / step", f"{result.flops_per_step:.3e}" if result.flops_per_step else "n/a"),
        ("model FLOP/s", f"{result.flops_per_s / 1e9:,.1f} GFLOP/s" if result.flops_per_s else "n/a"),
        ("peak FLOP/s", f"{result.peak_flops / 1e9:,.1f} GFLOP/s ({result.peak_source})" if result.peak_flops else "unknown"),
        ("MFU", f"{100 * result.mfu:.1f}%" if result.mfu else "n/a"),
        ("step memory / device", _memory_text(result.step_memory)),
    ] + [("note", n) for n in result.notes]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _memory_text(m: ProgramMemory | None) -> str:
    """The compiled step's peak per device and its parts (the runtime's peak_bytes_in_use read 1.55 GB on a TPU v5e
    for a step that needed over 10 GB, so the compiler's analysis is the figure)."""
    if m is None:
        return "no memory analysis from this backend"
    return (f"{size_text(m.peak_bytes)} (compiled: arguments {size_text(m.argument_bytes)} + outputs "
            f"{size_text(m.output_bytes)} - donated {size_text(m.alias_bytes)} + temporaries {size_text(m.temp_bytes)} "
            f"+ code {size_text(m.code_bytes)}; a TPU's compiler checks the temporaries alone against the chip)")
