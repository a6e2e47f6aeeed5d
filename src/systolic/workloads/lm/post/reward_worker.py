"""The process that runs a user's reward functions (`reward.functions=module:function`), apart from the run.

A reward function is the user's code, called thousands of times inside a training run: one that never returns,
exits, raises a `BaseException` or crashes the interpreter would otherwise hang the run, end it with nothing trained
or kill it without a word. Here it runs in a child process that the run talks to over a pipe (post/rewards.py,
`UserRewards`): whatever the function does, the run sees an answer, a closed pipe or a deadline passing, and stops
with one paragraph naming the function and the record (exit 2).

The protocol is one JSON request a line on stdin and one JSON answer a line on the protocol pipe (the process's
original stdout; the user's own prints go to stderr): `{"load": [spec, ...]}` imports the functions and answers
`{"loaded": true}` or the first problem; `{"calls": [...]}` answers one line per call, in order: a value, the
exception raised, or a value that is not a real number. The caller enforces the time limit per answer line.
Standard library only, run by `python -c` so that the working directory is on sys.path and this file's folder is
not: nothing of systolic or jax is imported here. The messages' fields: docs/design-notes.md, this module's section.
"""

from __future__ import annotations

import importlib
import inspect
import json
import numbers
import os
import signal
import sys
from typing import Any, TextIO


def _load(specs: list[str]) -> tuple[list[Any], dict[str, Any] | None]:
    """The functions named by `specs`, or the first problem found."""
    functions = []
    for spec in specs:
        module_name, _, attr = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except BaseException as e:  # noqa: BLE001 -- sys.exit or anything else the module's own code does at import
            return functions, {"spec": spec, "problem": "import", "detail": f"{type(e).__name__}: {e}"}
        where = getattr(module, "__file__", None) or module_name
        if not hasattr(module, attr):
            return functions, {"spec": spec, "problem": "missing", "file": where}
        fn = getattr(module, attr)
        if not callable(fn):
            return functions, {"spec": spec, "problem": "not_callable", "detail": f"{type(fn).__name__} {fn!r:.40}"}
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # callables without a readable signature are called as they are
            signature = None
        if signature is not None:
            try:
                signature.bind("prompt", "completion", {})
            except TypeError as e:
                return functions, {"spec": spec, "problem": "signature", "detail": f"{attr}{signature} ({e})"}
        functions.append(fn)
    return functions, None


def _call(fn: Any, prompt: str, completion: str, fields: dict) -> dict[str, Any]:
    try:
        value = fn(prompt, completion, fields)
    except BaseException as e:  # noqa: BLE001 -- SystemExit, KeyboardInterrupt raised by hand, a user's own class
        return {"raised": f"{type(e).__name__}: {e}"[:2000]}
    if hasattr(value, "item") and not isinstance(value, numbers.Number):  # a NumPy scalar (np.bool_ is no Number)
        try:
            value = value.item()
        except BaseException as e:  # noqa: BLE001 -- an array of many values, or a user's own `item`
            return {"returned": f"{type(value).__name__} ({type(e).__name__}: {e})"[:200]}
    if isinstance(value, bool | int):
        return {"value": value}
    if isinstance(value, numbers.Real):
        try:
            return {"value": float(value)}  # NaN and inf travel as JSON's NaN and Infinity; the caller refuses them
        except (OverflowError, ValueError) as e:  # a Fraction past float's range
            return {"returned": f"{type(value).__name__} that is not a float ({e})"}
    return {"returned": f"{type(value).__name__} {value!r:.60}"}


def _answer(out: TextIO, answer: dict[str, Any]) -> None:
    # ensure_ascii: an exception's message may hold lone surrogates, which UTF-8 cannot write.
    out.write(json.dumps(answer) + "\n")
    out.flush()


def serve() -> None:
    """The worker's loop, until stdin closes (the run ended, or stopped this worker)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the run's to handle; it ends us by closing stdin
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")  # the protocol pipe
    os.dup2(2, 1)  # the user's prints, Python's and C's, go to stderr
    sys.stdout = sys.stderr
    functions: list[Any] = []
    for line in sys.stdin:
        request = json.loads(line)
        if "load" in request:
            functions, problem = _load(request["load"])
            _answer(out, problem or {"loaded": True})
            continue
        for index, prompt, completion, fields in request["calls"]:
            _answer(out, _call(functions[index], prompt, completion, fields))


if __name__ == "__main__":
    serve()
