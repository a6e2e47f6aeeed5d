"""Ctrl-C and SIGTERM at every phase of a command, not only while the train loop runs.

The CLI installs `install()` first thing. Until the train loop takes over (engine/loop.py `StopSignals`, which
stops after the current step with a checkpoint), a signal raises `Interrupted` in the main thread, so start-up,
tracing and compiling unwind through the CLI's rollback and exit 130 (SIGINT) or 143 (SIGTERM). Python's default
SIGTERM kills the process with no message and no rollback.

Three places where raising at once would lose or corrupt something: the import of a compiled extension (so until
`arm()`, which the CLI calls after importing them, a signal is only recorded, and `arm()` raises it), a
garbage-collection callback or `__del__` (`_unraisable` delivers the signal again a moment later), and a Python
callback that XLA called (every signal is also recorded; the train loop reads the record when it starts and stops
after its first step). A second SIGINT always raises (the user insists). Why each, with the crash measured:
docs/design-notes.md, this module's section.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143}


class Interrupted(KeyboardInterrupt):
    """A SIGINT or SIGTERM before (or after) the train loop; `name` is the signal's."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.name, 130)


_received: list[str] = []
_armed: list[bool] = [False]


def install() -> dict[int, Any]:
    """Routes SIGINT and SIGTERM through `_handle` (main thread only: Python allows handlers nowhere else).
    Returns the previous handlers for `restore` (the CLI runs in-process in tests)."""
    _received.clear()
    _armed[0] = False
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, _handle)
        if sys.unraisablehook is not _unraisable:
            _previous_hook[0] = sys.unraisablehook
            sys.unraisablehook = _unraisable
    return previous


def restore(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    if sys.unraisablehook is _unraisable:
        sys.unraisablehook = _previous_hook[0]


def _unraisable(info: Any) -> None:
    if isinstance(info.exc_value, Interrupted):
        signum = signal.Signals[info.exc_value.name]
        threading.Timer(0.01, os.kill, (os.getpid(), signum)).start()
        return
    _previous_hook[0](info)


_previous_hook: list[Any] = [sys.unraisablehook]


def received() -> str | None:
    """The first signal's name since `install`, or None."""
    return _received[0] if _received else None


def arm() -> None:
    """From now on a signal raises `Interrupted`; one that came before raises here."""
    _armed[0] = True
    if _received:
        raise Interrupted(_received[0])


def _handle(signum: int, frame: Any) -> None:
    name = signal.Signals(signum).name
    _received.append(name)
    if _armed[0] or _received.count("SIGINT") > 1:
        raise Interrupted(_received[0])
