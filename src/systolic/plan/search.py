"""`systolic plan --search`: the largest per-chip batch that fits, and with which rematerialisation, as MaxText's
estimator searches it: compile candidates, never the same one twice, and keep what the compiler said of each.

Per policy (the workload's `PlanSearch.remats`, e.g. the lm's `model.remat` none, dots, full: each saves less of the
forward pass than the one before, so fits at least the batch the one before fits), a bisection over per-chip batches
that are powers of two (times `train.grad_accum`), from what the previous policy fitted up to MAX_PER_CHIP: a batch
that fits means every smaller one fits. At most ceil(log2(MAX_PER_CHIP) + 1) compiles for the first policy and fewer
for the next; a compile-time out-of-memory is fast, a program that fits takes the full compile time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from systolic.plan.planner import Plan, ms_text, plan_step
from systolic.plan.targets import Target
from systolic.runtime.memory import size_text

MAX_PER_CHIP = 64  # sequences (lm) per data-parallel device: 2**0 ... 2**6


@dataclasses.dataclass(frozen=True)
class Candidate:
    remat: str
    per_chip: int  # batch per data-parallel device
    batch: int  # global: per_chip x the data-parallel devices
    plan: Plan


def search(workload: str, plan_fn: Callable[[Any, list[Any]], Any], cfg: Any, target: Target, *, mesh: str,
           data_parallel: int, grad_accum: int, remats: tuple[str, ...], configure: Callable[[Any, str, int], Any],
           train_items: float | None = None, price_per_chip_hour: float | None = None,
           say: Callable[[str], None] = lambda _: None,
           progress: Callable[[str], None] = lambda _: None) -> list[Candidate]:
    """Every candidate compiled, in the order tried. `configure(cfg, remat, global_batch)` is the config to plan;
    `say` gets each candidate's row, `progress` plan_step's lines, each naming the candidate."""
    tried: list[Candidate] = []
    steps = MAX_PER_CHIP.bit_length()  # exponents 0 .. log2(MAX_PER_CHIP)
    fits_below = -1  # the largest exponent known to fit (for the policy before: a lower bound for this one)
    for remat in remats:
        lo, hi = fits_below, steps
        while lo + 1 < hi:
            mid = (lo + hi) // 2
            per_chip = grad_accum * 2**mid
            batch = per_chip * data_parallel
            named = f"model.remat={remat} train.batch_size={batch}: "
            plan = plan_step(workload, plan_fn, configure(cfg, remat, batch), target, mesh=mesh,
                             train_items=train_items, price_per_chip_hour=price_per_chip_hour,
                             progress=lambda line, named=named: progress(line.replace("plan: ", "plan: " + named, 1)))
            tried.append(Candidate(remat, per_chip, batch, plan))
            say(format_row(tried[-1]))
            lo, hi = (mid, hi) if plan.fits else (lo, mid)
        fits_below = lo
    return tried


def best(tried: list[Candidate]) -> Candidate | None:
    """The largest batch that fits; of equal batches, the fastest roofline step (the least recomputation)."""
    fitting = [c for c in tried if c.plan.fits]
    return max(fitting, key=lambda c: (c.batch, -(c.plan.step_time_s or 0.0))) if fitting else None


HEADER = f"{'remat':<6} {'batch/chip':>10} {'batch':>7} {'memory per chip':<34} {'step (roofline)':>15} " \
         f"{'items/s':>12} {'compile':>8}"


def format_row(c: Candidate) -> str:
    p = c.plan
    if p.fits:
        memory = f"fits, {size_text(p.peak_bytes)}"
        step, rate = ms_text(p.step_time_s or 0.0), f"{p.items_per_s or 0:,.0f}"
    else:
        memory = f"DOES NOT FIT, needs {size_text(p.peak_bytes)}" if p.peak_bytes else "DOES NOT FIT"
        step, rate = "-", "-"
    return f"{c.remat:<6} {c.per_chip:>10} {c.batch:>7} {memory:<34} {step:>15} {rate:>12} {p.compile_s:>7.0f}s"


def format_search(tried: list[Candidate], hbm_bytes: float) -> str:
    lines = [HEADER, *map(format_row, tried)]
    chosen = best(tried)
    if chosen is None:
        lines.append(f"nothing fits in {size_text(hbm_bytes)} per chip, even one sequence per chip with remat=full: "
                     "more chips, a larger --mesh fsdp, or a shorter data.seq_len")
    else:
        p = chosen.plan
        lines.append(f"largest batch that fits: {chosen.per_chip} per chip ({chosen.batch} in all) with "
                     f"model.remat={chosen.remat}: {size_text(p.peak_bytes)} of {size_text(hbm_bytes)} per chip, roofline "
                     f"{ms_text(p.step_time_s or 0.0)} a step, {p.items_per_s or 0:,.0f} {p.item_unit}/s")
    return "\n".join(lines)
