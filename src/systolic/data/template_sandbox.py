"""Chat templates rendered under a budget: Jinja's immutable sandbox, in a worker process with a memory limit and a
deadline.

A chat template is a program that comes with a model's folder (and a served model renders it for every request).
Jinja's sandbox bounds what a template may touch, not what it may cost, and hooks inside it could stop loops but not
one C call that runs for minutes or allocates gigabytes. A separate process stops all of these, whatever operation
does it, and its failure never takes the caller (a server, a data pipeline) down: it runs under an address-space
limit (`WORKER_MEMORY_BYTES`), the caller waits `TIME_BUDGET_S` for its answer and kills it after that, and the
caller refuses an answer over `max_chars` before tokenizing it. The cost is one pipe round trip per request and the
worker's start, once per process (the templates that motivated it, and the cost measured: docs/design-notes.md,
this module's section). The worker imports only the standard library and jinja2: run as a script
(`python -I this_file`) it starts without systolic's imports.

Rendering follows transformers: trim_blocks and lstrip_blocks, the loop-control extension, `raise_exception`,
`strftime_now`, a `tojson` that does not escape HTML, transformers' `{% generation %}` tag, and `namespace`/`dict`
kept away from Python internals.
"""

from __future__ import annotations

import atexit
import contextvars
import functools
import json
import os
import select
import subprocess
import sys
import threading
import time
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

TIME_BUDGET_S = 5.0  # per request (one conversation's renders); real templates take milliseconds
WORKER_MEMORY_BYTES = 4 << 30  # address space: the interpreter and jinja take ~50 MB, a legal answer a few hundred MB
RECURSION_LIMIT = 1000  # Python's frames: a macro level takes a few, so about 200 levels of macros

# Private-use characters that bracket `{% generation %}` output while its spans are found, then are removed.
OPEN, CLOSE = "\ue000", "\ue001"
_marking = contextvars.ContextVar("marking_generation", default=False)


class TemplateFailed(Exception):
    """A render that did not finish. `over_budget`: it exceeded the time, memory, output or recursion budget (the
    template is broken or hostile); else the template raised on this conversation (a rule it enforces, data of the
    wrong type)."""

    def __init__(self, message: str, *, over_budget: bool):
        super().__init__(message)
        self.over_budget = over_budget


# THE JINJA ENVIRONMENT ----------------------------------------------------------------------------------------


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' tag for the text an assistant produces): rendered as
    its body, bracketed by OPEN/CLOSE while the caller is looking for it (a job's `mark`)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_output"), [], [], body).set_lineno(lineno)

    def _output(self, caller) -> str:
        text = caller()
        return f"{OPEN}{text}{CLOSE}" if _marking.get() else text


class _Namespace(Namespace):
    """`namespace(...)` that refuses underscore-prefixed names, a way towards Python internals that the sandbox does
    not check on namespaces."""

    def __init__(*args, **kwargs):  # Namespace's signature: `self` may also be a keyword
        self, attrs = args[0], dict(*args[1:], **kwargs)
        _check_public(attrs)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _check_public([name])
        Namespace.__setitem__(self, name, value)


class _DictMaker:
    """`dict` inside templates: makes dicts without handing the template the `dict` type itself."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, keys, value=None) -> dict:
        return dict.fromkeys(keys, value)


def _check_public(names) -> None:
    for name in names:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a template may not store the underscore-prefixed name {name!r}")


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates expect the plain JSON that transformers writes.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=_DictMaker(), namespace=_Namespace)
    return env


def check_syntax(source: str) -> None:
    """Parses `source`; raises jinja2.TemplateSyntaxError (RecursionError when it nests too deeply). Only parses:
    compiling folds constant expressions (`'x' * 10**10`, `'x' | center(10**10)`), which is the worker's to run."""
    _environment().parse(source)


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    return _environment().from_string(source)


# THE WORKER ---------------------------------------------------------------------------------------------------


def render_jobs(request: dict[str, Any]) -> list[str]:
    """The texts of a request's jobs, each `[messages, add_generation_prompt, mark]`, rendered with its template
    and variables. Raises TemplateFailed."""
    try:
        template = _compile(request["source"])
        texts = []
        for messages, add_generation_prompt, mark in request["jobs"]:
            token = _marking.set(mark)
            try:
                texts.append(template.render(messages=messages, tools=None, documents=None,
                                             add_generation_prompt=add_generation_prompt, **request["variables"]))
            finally:
                _marking.reset(token)
            if len(texts[-1]) > request["max_chars"]:
                raise TemplateFailed(f"it wrote {len(texts[-1]):,} characters, more than the {request['max_chars']:,} "
                                     "this conversation may take", over_budget=True)
        return texts
    except RecursionError:
        raise TemplateFailed(f"it recursed deeper than Python's limit of {RECURSION_LIMIT} frames (a macro or a "
                             "recursive loop that calls itself without end)", over_budget=True) from None
    except OverflowError as e:  # a range over the sandbox's MAX_RANGE, a number too large for an index or a float
        raise TemplateFailed(f"it made a range or number too large (OverflowError: {_sentence(e)})",
                             over_budget=True) from None
    except MemoryError:
        raise TemplateFailed(f"it needed more than {WORKER_MEMORY_BYTES >> 30} GiB of memory", over_budget=True) from None
    except (jinja2.TemplateError, TypeError, ValueError, LookupError, ArithmeticError, AttributeError) as e:
        # raise_exception, an undefined variable, a sandbox violation (a dunder attribute); data of the
        # wrong type ("text" + a list), a missing key, a division by zero
        raise TemplateFailed(f"{type(e).__name__}: {_sentence(e)}", over_budget=False) from None


def _sentence(e: Exception) -> str:
    return str(e)[:500].rstrip(".")


def _serve() -> None:
    """The worker's loop: one JSON request a line on stdin, one JSON answer a line on stdout, until stdin closes
    (the caller ended or dropped it)."""
    import resource
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the caller's to handle; it ends us by closing stdin
    _, hard = resource.getrlimit(resource.RLIMIT_AS)  # a soft limit may not exceed the hard one a container set
    soft = WORKER_MEMORY_BYTES if hard == resource.RLIM_INFINITY else min(WORKER_MEMORY_BYTES, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    sys.setrecursionlimit(RECURSION_LIMIT)
    for line in sys.stdin:
        try:
            answer = {"texts": render_jobs(json.loads(line))}
        except TemplateFailed as e:
            answer = {"error": str(e), "over_budget": e.over_budget}
        # ensure_ascii: lone surrogates in a text survive the pipe (the caller decides what to do with them)
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


# THE CALLER'S SIDE --------------------------------------------------------------------------------------------


class WorkerProcess:
    """A child process that answers each JSON line it is sent with JSON lines, started on first use and again after
    it was stopped or died. Also post/reward_worker.py's."""

    def __init__(self, argv: list[str], *, stderr: int | None = None):
        """`stderr`: where the worker's stderr goes (None: this process's own)."""
        self._argv, self._stderr = argv, stderr
        self.exit_status: int | None = None  # of the worker that ended before answering
        self._process: subprocess.Popen | None = None
        self._owner = 0  # the pid that started it: a forked child (a data loader's worker) starts its own
        self._pending = bytearray()  # bytes read past the last answer line
        atexit.register(self.stop)

    @property
    def running(self) -> bool:
        """Whether a worker of this process is running (else the next `send` starts one)."""
        return self._process is not None and self._owner == os.getpid()

    def send(self, request: dict[str, Any]) -> None:
        """Writes `request` to the worker, started if it is not running; a worker that ended is found by `receive`."""
        if not self.running:
            self._process = subprocess.Popen(self._argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                             stderr=self._stderr, bufsize=0)
            self._owner, self._pending = os.getpid(), bytearray()
        try:
            self._process.stdin.write((json.dumps(request) + "\n").encode())
            self._process.stdin.flush()
        except BrokenPipeError:
            pass

    def receive(self, timeout_s: float) -> bytes | None:
        """The worker's next answer line; b"" when it ended first, None when `timeout_s` passed first (either way it
        is stopped, and the next request starts a fresh one). An interrupt while waiting stops it too: its answer
        would be read as the next request's."""
        try:
            line = read_line(self._process.stdout.fileno(), time.monotonic() + timeout_s, self._pending)
        except BaseException:
            self.stop()
            raise
        if not line:
            self.exit_status = self.stop()
        return line

    def stop(self) -> int | None:
        """Kills the worker; its exit status (None when none was running here)."""
        process, self._process = self._process, None
        if process is None or self._owner != os.getpid():
            return None
        process.kill()
        code = process.wait()
        process.stdin.close()
        process.stdout.close()
        return code


class _Worker:
    """The render worker of this process. One request at a time (a lock): the server renders from a thread pool."""

    def __init__(self):
        self._lock = threading.Lock()
        # -I: no PYTHONPATH, user site or script folder; the worker needs only the standard library and jinja2.
        self._process = WorkerProcess([sys.executable, "-I", __file__], stderr=subprocess.DEVNULL)

    def render(self, request: dict[str, Any], timeout_s: float) -> list[str]:
        with self._lock:
            self._process.send(request)
            line = self._process.receive(timeout_s)
            if line is None:
                raise TemplateFailed(f"it ran for more than {timeout_s:g} s", over_budget=True)
            if not line:
                raise TemplateFailed(f"the process rendering it ended (exit status {self._process.exit_status}) "
                                     "before it finished", over_budget=True)
        answer = json.loads(line)
        if "error" in answer:
            raise TemplateFailed(answer["error"], over_budget=answer["over_budget"])
        return answer["texts"]


def read_line(fd: int, deadline: float, pending: bytearray) -> bytes | None:
    """One line from `fd` (b"" when it closed first), or None when `deadline` (time.monotonic) passes first. Reads
    in chunks; the bytes after the line (a worker may write several answer lines at once) wait in `pending` for the
    next call."""
    while b"\n" not in pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            return None
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b""
        pending += chunk
    end = pending.index(b"\n") + 1
    line = bytes(pending[:end])
    del pending[:end]
    return line


_WORKER = _Worker()


def render(source: str, variables: dict[str, str], jobs: list[tuple[list[dict[str, Any]], bool, bool]], *,
           max_chars: int) -> list[str]:
    """Each job's text, `(messages, add_generation_prompt, mark)` rendered by the template `source` with the special
    tokens `variables`, in the worker under the budgets above; each text at most `max_chars` characters. Raises
    TemplateFailed. The messages must be JSON values (they are sent to the worker as JSON)."""
    request = {"source": source, "variables": variables, "jobs": jobs, "max_chars": max_chars}
    return _WORKER.render(request, TIME_BUDGET_S)


if __name__ == "__main__":
    _serve()
