"""The one JSON reader for files systolic did not necessarily write: a Hugging Face config.json, a safetensors
index, a checkpoint manifest. Any failure is a UserError naming the file, what was wrong and what was expected.

`json.loads` alone raises RecursionError on deeply nested input, accepts NaN and Infinity, and happily returns
a list where the caller indexes a dict; callers here say what shape they expect (`expect_object`) and get a
paragraph, not an AttributeError, when the file is something else.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from systolic.errors import UserError

DEFAULT_MAX_BYTES = 64 << 20  # far above any config or index; a guard against pointing at a weights file


def read_file(path: Path, *, expected: str, fix: str, max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    """The JSON value in `path` (a regular file of at most `max_bytes` UTF-8 bytes). `expected` describes the
    file ("a Hugging Face config.json, an object of model settings") and `fix` what to do, for the errors."""
    path = Path(path)
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise UserError(f"{path} is not a regular file. Expected {expected}. Fix: {fix}")
        if info.st_size > max_bytes:
            raise UserError(f"{path} is {info.st_size:,} bytes, more than the {max_bytes:,} that {expected} can "
                            f"plausibly need. Fix: {fix}")
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise UserError(f"Could not read {path} ({e.strerror}). Expected {expected}. Fix: {fix}") from None
    return loads(raw, str(path), expected=expected, fix=fix)


def loads(raw: bytes | str, source: str, *, expected: str, fix: str) -> Any:
    """The JSON value of `raw`; a UserError naming `source` when it is not UTF-8 JSON with finite numbers."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        return json.loads(text, parse_constant=_refuse_constant)
    except UnicodeDecodeError as e:
        why = f"it is not UTF-8 text (byte {e.start})"
    except json.JSONDecodeError as e:
        why = f"it is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})"
    except _NonFinite as e:
        why = f"it holds {e.args[0]}, which is not a JSON number"
    except ValueError as e:  # an integer of more than 4,300 digits
        why = f"it holds a value Python will not read ({e})"
    except RecursionError:
        why = "it nests too deeply to be a settings file"
    raise UserError(f"Could not read {source}: {why}. Expected {expected}. Fix: {fix}")


def expect_object(value: Any, source: str, *, expected: str, fix: str) -> dict[str, Any]:
    """`value` when it is a JSON object; a UserError saying what it is instead."""
    if not isinstance(value, dict):
        raise UserError(f"{source} holds a JSON {json_kind(value)}, not an object. Expected {expected}. Fix: {fix}")
    return value


def json_kind(value: Any) -> str:
    """The JSON name of a parsed value's type ("object", "array", "string", ...), for messages."""
    kinds = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return kinds.get(type(value), "null")


class _NonFinite(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise _NonFinite(name)
