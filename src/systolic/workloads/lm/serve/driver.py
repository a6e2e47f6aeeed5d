"""The thread that drives the inference engine for the HTTP server.

The engine is single-threaded: only this thread calls it. It loops `step()` while there is work and sleeps when
there is none. The server's handlers, on the asyncio event loop, talk to it through a thread-safe inbox
(`submit`, `cancel`) and read each request's events from an asyncio queue that this thread fills through
`loop.call_soon_threadsafe`, one call per engine step. After every step and every inbox it publishes the
engine's statistics (`on_stats`), so a cancelled request's pages show as free at once.

Admission is bounded: at most `capacity` requests (the engine's batch plus the queue behind it) are in flight; past
that `submit` raises `QueueFull` rather than let the queue, and every client's wait, grow without bound. On
shutdown, `drain` takes no new requests and gives those in flight a grace period; what is left then fails with a
503, which the handlers send as an error event, so every stream still ends properly.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from systolic.errors import UserError
from systolic.workloads.lm.serve.engine import SamplingParams, TokenEvent

if TYPE_CHECKING:
    from systolic.workloads.lm.serve.engine import InferenceEngine

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """Every place in the batch and in the queue is taken."""


class Stopped(Exception):
    """The driver is shutting down and takes no new requests."""


class RequestFailed(Exception):
    """What a request ended with instead of a finished event: its input was refused by the engine (400), the
    server shut down before it finished (503), or the engine failed (500)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class RequestStream:
    """One request's events, read by the handler that submitted it, on the event loop."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.loop = loop
        self.finished = False  # a finished event or a failure was read: nothing left to cancel
        self._items: collections.deque[TokenEvent | RequestFailed] = collections.deque()
        self._arrived = asyncio.Event()

    async def next(self) -> TokenEvent:
        """The next event; raises RequestFailed instead when the request failed."""
        while not self._items:
            self._arrived.clear()
            await self._arrived.wait()
        item = self._items.popleft()
        if isinstance(item, RequestFailed):
            self.finished = True
            raise item
        self.finished = item.finish_reason is not None
        return item

    def ready(self) -> list[TokenEvent]:
        """The events already delivered, without waiting, up to the request's last (a failure stays queued)."""
        events = []
        while self._items and not self.finished and not isinstance(self._items[0], RequestFailed):
            events.append(self._items.popleft())
            self.finished = events[-1].finish_reason is not None
        return events

    async def collect(self) -> list[TokenEvent]:
        """Every event up to the finished one."""
        events = [await self.next()]
        while not self.finished:
            events.append(await self.next())
        return events

    def _put(self, item: TokenEvent | RequestFailed) -> None:
        self._items.append(item)
        self._arrived.set()


@dataclasses.dataclass(frozen=True)
class _Add:
    stream: RequestStream
    prompt_ids: np.ndarray
    params: SamplingParams


@dataclasses.dataclass(frozen=True)
class _Cancel:
    request_id: str


class EngineDriver:
    """Owns `engine` and the thread that steps it. `on_stats(stats, inbox)` gets the engine's `stats()` and the
    number of requests submitted but not yet handed to the engine, from this thread."""

    def __init__(self, engine: InferenceEngine, *, capacity: int, on_stats: Callable[[dict[str, Any], int], None]):
        self._engine = engine
        self.capacity = capacity
        self._on_stats = on_stats
        self._lock = threading.Lock()  # guards the inbox, _in_flight and _stopping
        self._inbox: collections.deque[_Add | _Cancel] = collections.deque()
        self._wake = threading.Event()
        self._in_flight = 0  # submitted and not yet finished: what capacity bounds
        self._stopping = False
        self._deadline: float | None = None  # draining: when what is still in flight gets cancelled
        self._streams: dict[str, RequestStream] = {}  # the driver thread's own: requests the engine holds
        self._thread = threading.Thread(target=self._run, name="systolic-engine", daemon=True)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping and self._deadline is None

    def start(self) -> None:
        self._publish_stats()
        self._thread.start()

    def submit(self, request_id: str, prompt_ids: np.ndarray, params: SamplingParams) -> RequestStream:
        """Queues a request; call from the event loop that will read its stream. Raises QueueFull or Stopped."""
        stream = RequestStream(request_id, asyncio.get_running_loop())
        with self._lock:
            if self._stopping or self._deadline is not None:
                raise Stopped()
            if self._in_flight >= self.capacity:
                raise QueueFull()
            self._in_flight += 1
            self._inbox.append(_Add(stream, prompt_ids, params))
        self._wake.set()
        return stream

    def cancel(self, request_id: str) -> None:
        """Stops a request and frees its pages (a no-op once it finished); from any thread."""
        with self._lock:
            self._inbox.append(_Cancel(request_id))
        self._wake.set()

    def drain(self, grace_s: float) -> None:
        """Takes no new requests, lets those in flight run for `grace_s` seconds, then cancels the rest (each gets a
        503 failure, which its handler sends as OpenAI's error) and ends the thread; from any thread."""
        with self._lock:
            if self._deadline is None:
                self._deadline = time.monotonic() + grace_s
        self._wake.set()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Cancels every request still in flight (each gets a 503 failure) and ends the thread."""
        with self._lock:
            self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # THE DRIVER THREAD ----------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._wake.clear()  # before reading the inbox: a command queued after this wakes the wait below
            with self._lock:
                commands, deadline = list(self._inbox), self._deadline
                self._inbox.clear()
                stopping = self._stopping or (deadline is not None and time.monotonic() >= deadline)
            delivered = self._apply(commands)
            if stopping or (deadline is not None and not self._streams):
                self._shut_down(delivered)
                return
            if self._engine.has_work():
                delivered += self._step()
            self._deliver(delivered)
            self._publish_stats()
            if not self._engine.has_work():
                self._wake.wait(None if deadline is None else max(deadline - time.monotonic(), 0.0))

    def _apply(self, commands: list[_Add | _Cancel]) -> list[tuple[RequestStream, TokenEvent | RequestFailed]]:
        """Hands new requests to the engine and cancels others; returns what their streams must get."""
        out = []
        for command in commands:
            if isinstance(command, _Cancel):
                stream = self._streams.pop(command.request_id, None)
                if stream is not None:
                    self._engine.cancel(command.request_id)
                    self._finished()
                    out.append((stream, TokenEvent(command.request_id, None, "", None, "cancelled")))
                continue
            try:
                self._engine.add_request(command.stream.request_id, command.prompt_ids, command.params)
                self._streams[command.stream.request_id] = command.stream
            except UserError as e:  # the request's own fault: the handler answers 400
                self._finished()
                out.append((command.stream, RequestFailed(400, str(e))))
            except Exception:
                log.exception("the inference engine failed to take request %s", command.stream.request_id)
                self._finished()
                failure = RequestFailed(500, "The inference engine failed to take this request (a bug in systolic; "
                                             "the server log has the traceback).")
                out.append((command.stream, failure))
        return out

    def _step(self) -> list[tuple[RequestStream, TokenEvent | RequestFailed]]:
        try:
            events = self._engine.step()
        except Exception:
            # A bug: every request in the batch fails, and the server goes on taking new ones.
            log.exception("the inference engine's step failed; failing the %d requests it held", len(self._streams))
            return self._fail_all(RequestFailed(500, "The inference engine failed while generating this reply (a bug "
                                                     "in systolic; the server log has the traceback)."))
        out = []
        for event in events:
            stream = self._streams.get(event.request_id)
            if stream is None:  # cancelled since the step began
                continue
            if event.finish_reason is not None:
                del self._streams[event.request_id]
                self._finished()
            out.append((stream, event))
        return out

    def _shut_down(self, delivered: list[tuple[RequestStream, TokenEvent | RequestFailed]]) -> None:
        delivered += self._fail_all(RequestFailed(503, "The server shut down before this request finished. Fix: send "
                                                       "it again once the server is back."))
        with self._lock:  # requests that came in after the last inbox was read
            late, self._inbox = list(self._inbox), collections.deque()
        for command in late:
            if isinstance(command, _Add):
                self._finished()
                delivered.append((command.stream, RequestFailed(503, "The server is shutting down. Fix: send the "
                                                                     "request again once it is back.")))
        self._deliver(delivered)
        self._publish_stats()

    def _fail_all(self, failure: RequestFailed) -> list[tuple[RequestStream, TokenEvent | RequestFailed]]:
        out = []
        for request_id, stream in list(self._streams.items()):
            try:
                self._engine.cancel(request_id)
            except Exception:
                log.exception("cancelling request %s failed", request_id)
            self._finished()
            out.append((stream, failure))
        self._streams.clear()
        return out

    def _finished(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def _deliver(self, items: list[tuple[RequestStream, TokenEvent | RequestFailed]]) -> None:
        """Puts each item on its stream's queue, in one callback per event loop (one wake-up per step)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, TokenEvent | RequestFailed]]] = {}
        for stream, item in items:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the loop has closed: nobody is reading these streams any more
                pass

    def _publish_stats(self) -> None:
        with self._lock:
            inbox = sum(isinstance(c, _Add) for c in self._inbox)
        try:
            self._on_stats(self._engine.stats(), inbox)
        except Exception:
            log.exception("publishing the engine's statistics failed")


def _put_all(batch: list[tuple[RequestStream, TokenEvent | RequestFailed]]) -> None:
    for stream, item in batch:
        stream._put(item)
