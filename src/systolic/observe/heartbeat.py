"""A line every few seconds while one long call runs (the TPU compiler on a billion-parameter step, reading a large
checkpoint): minutes without output look like a hang. Nothing is said for a call that ends before the first beat."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

EVERY_S = 20.0  # between lines: often enough to show life, rarely enough not to flood a log


@contextlib.contextmanager
def heartbeat(say: Callable[[str], None], what: str, every_s: float = EVERY_S) -> Iterator[None]:
    """Says `<what>: <n> s so far` every `every_s` seconds until the block ends (from a daemon thread: the block's
    own call, e.g. XLA's compile, holds no lock that printing needs)."""
    start = time.perf_counter()
    done = threading.Event()

    def beat() -> None:
        while not done.wait(every_s):
            say(f"{what}: {time.perf_counter() - start:.0f} s so far")

    thread = threading.Thread(target=beat, name="systolic-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
