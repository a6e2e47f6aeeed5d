"""Terminal progress: a rich bar on an interactive terminal, plain log lines otherwise, nothing with -q."""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class ProgressReporter:
    def __init__(self, *, total: int, start: int, mode: str = "auto", quiet: bool = False, enabled: bool = True,
                 description: str = "train", unit: str = "step"):
        self.enabled = enabled and not quiet
        self.unit = unit  # what is counted, in the plain lines
        self.console = Console(stderr=True, no_color=not sys.stderr.isatty(), soft_wrap=True)
        self.total = total
        self._start_step = start
        self._start_time = time.perf_counter()
        use_bar = mode == "on" or (mode == "auto" and sys.stderr.isatty())
        self._bar = None
        if self.enabled and use_bar:
            self._bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self._task = self._bar.add_task(description, total=total, completed=start, stats="")
            self._bar.start()

    def update(self, step: int, stats: dict[str, float | str]) -> None:
        if not self.enabled:
            return
        text = " | ".join(_format(k, v) for k, v in stats.items())
        if self._bar is not None:
            self._bar.update(self._task, completed=step, stats=text)
        else:
            self.console.print(f"{self.unit} {step}/{self.total} | {text} | ETA {self._eta(step)}", highlight=False)

    def restart_clock(self, step: int) -> None:
        """ETA from here on: called once the first (compiling) step is done so compile time does not skew it."""
        self._start_step, self._start_time = step, time.perf_counter()

    def log(self, message: str) -> None:
        if self.enabled:
            self.console.print(message, highlight=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def _eta(self, step: int) -> str:
        done = step - self._start_step
        if done <= 0:
            return "?"
        seconds = (time.perf_counter() - self._start_time) / done * (self.total - step)
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def _format(key: str, value: float | str) -> str:
    if isinstance(value, str):
        return f"{key} {value}"
    if key.endswith("/s"):
        return f"{value:,.0f} {key}"
    if key == "mfu":
        return f"MFU {100 * value:.1f}%"
    if key.startswith("frac_"):  # a share: frac_reward_zero_std 100%
        return f"{key} {value:.0%}"
    if key == "lr":
        return f"lr {value:.2e}"
    return f"{key} {value:.4f}"
