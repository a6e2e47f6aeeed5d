"""Will it fit? A size checked against the memory it will live in, before anything is traced or allocated.

A workload computes a lower bound on the bytes its state needs (an lm's parameters, gradients and optimizer
moments; a simulation's fields) and calls `check_fits`. The memory is the devices': on CPU the host's RAM (every
CPU device shares it), on a GPU or TPU the sum of the devices' `memory_stats()["bytes_limit"]` where the runtime
reports one, or what SYSTOLIC_DEVICE_MEMORY_BYTES states for each device (tests state a small one on CPU, which
reports none). `systolic plan` checks against its target instead (`budget`). A bound that is exceeded fails as
`DoesNotFit`, a UserError, in milliseconds, where the allocation would fail after minutes of tracing and compiling
as a RESOURCE_EXHAUSTED traceback (or not fail at all, and swap).

The second check is exact: a compiled program's memory analysis (`program_bytes`, per device) against one
device's memory (`device_bytes`), and the figures of a compile-time RESOURCE_EXHAUSTED (`needed_bytes`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any

from systolic.errors import UserError

DEVICE_MEMORY_ENV = "SYSTOLIC_DEVICE_MEMORY_BYTES"  # states each device's memory (bytes) where none is reported

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
    if (stated := _stated_bytes()) is not None:
        return len(devices) * stated, f"the memory of {len(devices)} device(s) ({DEVICE_MEMORY_ENV}={stated})"
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


class DoesNotFit(UserError):
    """A size that exceeds the memory it must live in; the figures stay readable (`systolic plan --json` prints them)."""

    def __init__(self, message: str, *, need_bytes: float, have_bytes: float, fix: str):
        super().__init__(message)
        self.need_bytes, self.have_bytes, self.fix = need_bytes, have_bytes, fix


def check_fits(need_bytes: float, devices: Sequence[Any], *, what: str, fix: str) -> None:
    """`DoesNotFit` when `need_bytes` (a lower bound, described by `what`) exceed the memory of `devices`."""
    have = available(devices)
    if have is None or need_bytes <= have[0]:
        return
    raise DoesNotFit(f"{what} needs at least {gib(need_bytes)}, but {have[1]} is {gib(have[0])}, so it cannot fit; "
                     f"nothing was traced or allocated. Fix: {fix}", need_bytes=need_bytes, have_bytes=have[0], fix=fix)


def _stated_bytes() -> int | None:
    """SYSTOLIC_DEVICE_MEMORY_BYTES, when set: the memory of each device."""
    text = os.environ.get(DEVICE_MEMORY_ENV, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise UserError(f"{DEVICE_MEMORY_ENV}={text!r}: expected a positive whole number of bytes, the memory of each "
                        f"device (e.g. {DEVICE_MEMORY_ENV}=17179869184 for 16 GiB). Fix: set it so, or unset it to use "
                        "what the runtime reports.")
    return int(text)


def device_bytes(device: Any) -> tuple[int, str] | None:
    """(bytes, description) of one device's memory: SYSTOLIC_DEVICE_MEMORY_BYTES where set, else the runtime's
    `memory_stats()["bytes_limit"]`; None where neither says (CPU)."""
    if (stated := _stated_bytes()) is not None:
        return stated, f"{DEVICE_MEMORY_ENV}"
    stats = memory_stats(device)
    return (int(stats["bytes_limit"]), "memory_stats bytes_limit") if stats else None


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """A compiled program's memory per device, from its memory analysis (bytes)."""

    argument_bytes: int
    output_bytes: int
    alias_bytes: int  # outputs that reuse a donated argument's buffer
    temp_bytes: int
    code_bytes: int

    @classmethod
    def of(cls, analysis: Any) -> ProgramMemory:
        return cls(int(analysis.argument_size_in_bytes), int(analysis.output_size_in_bytes),
                   int(analysis.alias_size_in_bytes), int(analysis.temp_size_in_bytes),
                   int(analysis.generated_code_size_in_bytes))

    @property
    def peak_bytes(self) -> int:
        """Arguments + outputs not aliased to them + temporaries + generated code."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + self.code_bytes


def program_bytes(analysis: Any) -> int:
    """Bytes per device of a compiled program (`compiled.memory_analysis()`): arguments + outputs not aliased to
    them + temporaries + generated code."""
    return ProgramMemory.of(analysis).peak_bytes


_SIZE = re.compile(r"([0-9.]+)\s*([KMGTP]?)i?B?\b")
_SIZE_TEXT = r"[0-9.]+[KMGTP]?i?B?"


def _bytes(text: str) -> float:
    number, unit = _SIZE.match(text).groups()  # type: ignore[union-attr]
    return float(number) * 1024 ** "_KMGTP".index(unit or "_") if unit else float(number)


def needed_bytes(message: str) -> float | None:
    """Bytes per device that a compile-time out-of-memory asked for, from its message: "...the total memory required
    for HLO temporaries (40.25G) exceeds available HBM (15.75G)" (the TPU compiler's: the temporaries are what it
    compares with the chip, and what fits by that test runs even where arguments + temporaries exceed the chip, as
    measured on a v5e) or "Used 31.72G of 15.75G hbm" (everything). G is 2**30, as XLA prints sizes."""
    if m := re.search(rf"temporaries \(({_SIZE_TEXT})\) exceeds available", message):
        return _bytes(m.group(1))
    if m := re.search(rf"Used ({_SIZE_TEXT}) of ({_SIZE_TEXT})", message):
        return _bytes(m.group(1))
    return None


def limit_bytes(message: str) -> float | None:
    """The device memory a compile-time out-of-memory names: "exceeds available HBM (15.75G)", "Used ... of 15.75G"."""
    if m := re.search(rf"available \w+ \(({_SIZE_TEXT})\)", message) or re.search(rf"Used {_SIZE_TEXT} of ({_SIZE_TEXT})", message):
        return _bytes(m.group(1))
    return None


def gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n < 2**60 else f"{n:.2e} bytes"


def size_text(b: float) -> str:
    """Bytes in the largest binary unit that keeps them at least 1: "15.75 GiB", "1.22 MiB"."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            return f"{b / size:,.2f} {unit}"
    return f"{b:,.0f} B"


def memory_stats(device: Any) -> dict[str, Any] | None:
    """A device's memory statistics when its runtime reports a limit (GPU, TPU); None otherwise (CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 (some runtimes raise instead of returning None)
        return None
    return stats if stats and "bytes_limit" in stats else None
