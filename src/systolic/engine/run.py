"""The run driver: what every workload's run command (`train`, `simulate`, `fit`) does around the engine's loop.

A workload's entry function says its own start-up lines, builds its `Task` and reports its own results; the
rest is written once here: who prints (process 0, unless quiet), the loop's settings from the config sections
every workload shares, the "stopped ... run the same command again" line of an unfinished run, the "already
complete" line of a run that had nothing left to train, and the shape of the throughput line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import jax

from systolic.config import CheckpointConfig, LoopConfig, ObserveConfig
from systolic.engine.loop import LoopSettings, RunResult, Task, train

Say = Callable[..., None]  # `print`, or a no-op


class RunConfig(Protocol):
    """The sections every workload's config shares, which the loop reads."""

    loop: LoopConfig
    checkpoint: CheckpointConfig
    observe: ObserveConfig


@dataclasses.dataclass(frozen=True)
class Run:
    """One invocation of a run command: its printer and its loop settings."""

    settings: LoopSettings
    say: Say  # every process runs the same entry; one prints
    noun: str = "step"  # what a loop step is called in messages ("frame" for a simulation)
    # How to train a complete run further, for its "already complete" line; "": raise the steps setting.
    further: str = ""

    @classmethod
    def start(cls, cfg: RunConfig, *, steps: int, eval_every: int, quiet: bool, steps_key: str = "train.steps",
              noun: str = "step", further: str = "") -> Run:
        """`steps`: the run's last loop step, read from the setting `steps_key` (named in messages)."""
        settings = LoopSettings(steps=steps, eval_every=eval_every, loop=cfg.loop, checkpoint=cfg.checkpoint,
                                observe=cfg.observe, steps_key=steps_key, quiet=quiet)
        say = (lambda *a: None) if quiet or jax.process_index() != 0 else print
        return cls(settings, say, noun, further)

    def loop(self, task: Task, run_dir: Path) -> RunResult:
        """The engine's loop; a run whose checkpoint was already at its last step says so, and how to go on."""
        result = train(task, self.settings, run_dir)
        if self.already_complete(result):
            steps, key = self.settings.steps, self.settings.steps_key
            further = self.further or f"run the same command with {key} above {steps}"
            self.say(f"this run is already complete: its checkpoint is at {self.noun} {result.final_step} of {key}="
                     f"{steps}, so there was nothing to do. To go further, {further}; to start fresh, pass a new "
                     f"--run-dir (or checkpoint.resume=false to overwrite this one).")
        return result

    def already_complete(self, result: RunResult) -> bool:
        """Whether this invocation found the run at its last step and ran no step."""
        return result.start_step >= self.settings.steps

    def stopped(self, result: RunResult) -> bool:
        """Whether the run ended before its last step (a signal, `loop.stop_at_step`; if so, says how to go on,
        unless the loop already said it for a signal) or had nothing to do (Run.loop said so): either way the
        workload's end-of-run report has nothing new to show."""
        if self.already_complete(result):
            return True
        if not result.preempted and result.final_step >= self.settings.steps:
            return False
        if not result.preempted:  # a signal's stop was said by the loop, with the signal's name: say it once
            self.say(f"stopped at {self.noun} {result.final_step} of {self.settings.steps} with a checkpoint; run the "
                     "same command again to continue.")
        return True

    def say_throughput(self, result: RunResult, unit: str, *, first: str = "first step (compile)",
                       digits: int = 0) -> None:
        """`throughput: <rate> <unit>; <first> <s> s; wall time <s> s[; MFU <p>%]`, when the run timed steady-state
        steps; the MFU where the task counts its FLOPs and the chip's peak is known (not on a CPU)."""
        if result.items_per_s:
            mfu = f"; MFU {100 * result.mfu:.1f}%" if result.mfu else ""
            self.say(f"throughput: {result.items_per_s:,.{digits}f} {unit}; {first} {result.compile_s:.1f} s; "
                     f"wall time {result.wall_s:.1f} s{mfu}")
