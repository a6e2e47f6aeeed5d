"""Will it fit? A size checked against the memory it will live in, before anything is traced or allocated.

A workload computes a lower bound on the bytes its state needs (an lm's parameters, gradients and optimizer
moments; a simulation's fields) and calls `check_fits`. The memory is the devices': on CPU the host's RAM (every
CPU device shares it), on a GPU or TPU the sum of the devices' `memory_stats()["bytes_limit"]` where the runtime
reports one. `systolic plan` checks against its target instead (`budget`). A bound that is exceeded fails as a
UserError in milliseconds, where the allocation would fail after minutes of tracing and compiling as a
RESOURCE_EXHAUSTED traceback (or not fail at all, and swap).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator, Sequence
from typing import Any

from systolic.errors import UserError

_BUDGET: contextvars.ContextVar[tuple[int, str] | None] = contextvars.ContextVar("memory_budget", default=None)


@contextlib.contextmanager
def budget(total_bytes: int, where: str) -> Iterator[None]:
    """Within this block, `check_fits` compares against `total_bytes` (described by `where`, e.g. "8 x TPU v5e"),
    not this machine's devices: `systolic plan` sizes a target it does not run on."""
    token = _BUDGET.set((int(total_bytes), where))
    try:
        yield
    finally:
        _BUDGET.reset(token)


def host_bytes() -> int | None:
    """The host's physical memory, or None where os.sysconf cannot say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def available(devices: Sequence[Any]) -> tuple[int, str] | None:
    """(bytes, description) of the memory `devices` hold between them; None when unknown."""
    if (override := _BUDGET.get()) is not None:
        return override
    if not devices:
        return None
    if devices[0].platform == "cpu":
        total = host_bytes()
        return (total, "host memory (os.sysconf), shared by the CPU devices") if total else None
    limits = []
    for device in devices:
        stats = memory_stats(device)
        if stats is None:
            return None
        limits.append(int(stats["bytes_limit"]))
    return sum(limits), f"the memory of {len(limits)} {devices[0].platform} device(s) (memory_stats bytes_limit)"


def check_fits(need_bytes: float, devices: Sequence[Any], *, what: str, fix: str) -> None:
    """A UserError when `need_bytes` (a lower bound, described by `what`) exceed the memory of `devices`."""
    have = available(devices)
    if have is None or need_bytes <= have[0]:
        return
    raise UserError(f"{what} needs at least {gib(need_bytes)}, but {have[1]} is {gib(have[0])}, so it cannot fit; "
                    f"nothing was traced or allocated. Fix: {fix}")


def gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n < 2**60 else f"{n:.2e} bytes"


def memory_stats(device: Any) -> dict[str, Any] | None:
    """A device's memory statistics when its runtime reports a limit (GPU, TPU); None otherwise (CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 (some runtimes raise instead of returning None)
        return None
    return stats if stats and "bytes_limit" in stats else None
