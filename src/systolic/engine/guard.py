"""The non-finite guard, once for every workload: a step whose checked metrics or new parameters are not finite
is discarded inside the step, and the loop halts or skips on the host as `loop.nonfinite` says.

Device side (`guard_step`, traced into the jitted step): after the workload's own step, every checked metric and,
unless `grad_norm` is among them, every floating-point parameter leaf of the new state is tested; if any is NaN/Inf, `params`, `opt_state` and
`extra` stay as they were (the step counter and the key advance, so a skipped step is not retried with the same
randomness). Two scalars, `finite` and `nonfinite_at` (the index of the first offending name), travel with the
metrics and are read at the next log step: the guard adds no host sync per step.

Host side (`NonFiniteGuard`): reads the verdicts in step order and raises `TrainingHalted` (exit code 3) naming
the step and the offending metric or parameter, with the workload's advice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp

from systolic.config import LoopConfig
from systolic.engine.state import TrainState
from systolic.errors import TrainingHalted

VERDICT_KEYS = ("finite", "nonfinite_at")  # what the guard adds to a step's metrics


def _float_leaves(tree: Any) -> list[tuple[str, Any]]:
    return [("params" + jax.tree_util.keystr(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
            if jnp.issubdtype(leaf.dtype, jnp.inexact)]


def checked_metrics(metric_keys: Iterable[str], check: tuple[str, ...] | None) -> list[str]:
    """The metrics that must be finite, in `check`'s order; `check` None means all of them, sorted by name."""
    keys = set(metric_keys) - set(VERDICT_KEYS)
    return sorted(keys) if check is None else [k for k in check if k in keys]


def scans_params(metric_keys: Iterable[str], check: tuple[str, ...] | None) -> bool:
    """Whether the guard tests the new parameters leaf by leaf: not when the global gradient norm is checked. A
    finite norm means every gradient is finite, and the update of finite parameters by finite gradients is finite,
    so the scan would only read every parameter once more per step (4% of a llama step on the v5e chip)."""
    return "grad_norm" not in checked_metrics(metric_keys, check)


def checked_names(metric_keys: Iterable[str], check: tuple[str, ...] | None, params: Any) -> list[str]:
    """What `nonfinite_at` indexes: the checked metrics, then (`scans_params`) the floating-point parameter leaves."""
    leaves = [name for name, _ in _float_leaves(params)] if scans_params(metric_keys, check) else []
    return checked_metrics(metric_keys, check) + leaves


def guard_step(step_fn: Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]], *,
               check: tuple[str, ...] | None, poison_step: int = 0):
    """Wraps an un-jitted `step(state, batch) -> (state, metrics)`; `check` names the metrics that must be finite
    (None: all). `poison_step` > 0 makes that step's input parameters NaN (`loop.poison_step`, a testing aid)."""

    def guarded(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        inputs = state
        if poison_step:
            def poisoned(x):
                return x * jnp.where(state.step + 1 == poison_step, jnp.nan, 1.0).astype(x.dtype)

            params = jax.tree.map(lambda x: poisoned(x) if jnp.issubdtype(x.dtype, jnp.inexact) else x, state.params)
            inputs = state.replace(params=params)
        new, metrics = step_fn(inputs, batch)
        flags = [jnp.isfinite(metrics[k]).all() for k in checked_metrics(metrics, check)]
        if scans_params(metrics, check):
            flags += [jnp.isfinite(leaf).all() for _, leaf in _float_leaves(new.params)]
        flags = jnp.stack(flags)  # (names,)
        finite = flags.all()

        def keep(new_tree: Any, old_tree: Any) -> Any:
            return jax.tree.map(lambda a, b: jnp.where(finite, a, b), new_tree, old_tree)

        new = new.replace(params=keep(new.params, state.params), opt_state=keep(new.opt_state, state.opt_state),
                          extra=keep(new.extra, state.extra))
        at = jnp.where(finite, -1, jnp.argmin(flags)).astype(jnp.int32)
        return new, {**metrics, "finite": finite, "nonfinite_at": at}

    return guarded


class NonFiniteGuard:
    """Host side: reads each step's verdict (in step order) and applies `loop.nonfinite`."""

    def __init__(self, cfg: LoopConfig, check: tuple[str, ...] | None, params: Any, advice: str):
        self.cfg, self.check, self.params, self.advice = cfg, check, params, advice
        self.in_a_row = 0
        self.skipped = 0

    def check_step(self, step: int, metrics: dict[str, Any]) -> None:
        if bool(metrics["finite"]):
            self.in_a_row = 0
            return
        self.skipped += 1
        self.in_a_row += 1
        name = checked_names(metrics, self.check, self.params)[int(metrics["nonfinite_at"])]
        shown = ", ".join(f"{k} {float(metrics[k]):.6g}" for k in checked_metrics(metrics, self.check)[:4])
        culprit = f"{name} (the first non-finite value; {shown})"
        if self.cfg.nonfinite == "halt":
            raise TrainingHalted(
                f"Step {step} produced a non-finite value in {culprit}. Its update was discarded and the run halted; "
                f"checkpoints written before it are intact. Fix: {self.advice}."
            )
        if self.in_a_row > self.cfg.max_skipped:
            raise TrainingHalted(
                f"{self.in_a_row} steps in a row (up to step {step}) produced non-finite values, last in {culprit}; "
                f"more than loop.max_skipped={self.cfg.max_skipped}, so the run halted. Checkpoints written "
                f"before them are intact. Fix: {self.advice}."
            )
