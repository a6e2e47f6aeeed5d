"""The guarded reader of a safetensors file's header, and of the index that lists a sharded checkpoint's files.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON ({name: {dtype, shape,
data_offsets}}, plus an optional "__metadata__"), then the tensors' bytes. The `safetensors` library raises its
own SafetensorError (or allocates N bytes first) on a damaged file; this module checks every field against the
file's real size before the library opens it, so a garbage, truncated or oversized header is a UserError that
names the file and the field.
"""

from __future__ import annotations

import dataclasses
import math
import os
import stat
import struct
from pathlib import Path
from typing import Any

from systolic import safe_json
from systolic.errors import UserError

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
              "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # what converts to float32 parameters without a quantization scheme
_FIX = "download the file again (a complete safetensors file, as save_pretrained writes it)."


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors a safetensors file declares, every field checked against the file's size."""
    path = Path(path)
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise _bad(path, "it is not a regular file (a device or a pipe)")
        size = info.st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _bad(path, f"it is {size} bytes, shorter than the 8-byte header length")
            (length,) = struct.unpack("<Q", head)
            if length > MAX_HEADER_BYTES or 8 + length > size:
                raise _bad(path, f"its header claims {length:,} bytes, but the file has {size - 8:,} after the length "
                           f"field (and a header may have at most {MAX_HEADER_BYTES:,})")
            raw = f.read(length)
    except OSError as e:
        raise UserError(f"Could not read {path} ({e.strerror}). Fix: check the file's permissions.") from None
    header = safe_json.expect_object(
        safe_json.loads(raw, f"the header of {path}", expected="a safetensors header (a JSON object of tensors)", fix=_FIX),
        f"the header of {path}", expected="a JSON object of tensors", fix=_FIX)
    data_bytes = size - 8 - length
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _tensor(path, name, entry, data_bytes)
    return tensors


def _tensor(path: Path, name: str, entry: Any, data_bytes: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise _bad(path, f"tensor {name!r} is described by {entry!r}, not an object with dtype, shape and data_offsets")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in ITEM_BYTES:
        raise _bad(path, f"tensor {name!r} has dtype {dtype!r}, not one of {', '.join(ITEM_BYTES)}")
    if not isinstance(shape, list) or not all(_count(n) for n in shape):
        raise _bad(path, f"tensor {name!r} has shape {shape!r}, not a list of sizes")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_count(n) for n in offsets)
            or not offsets[0] <= offsets[1] <= data_bytes):
        raise _bad(path, f"tensor {name!r} has data_offsets {offsets!r}, not [begin, end] within the "
                   f"{data_bytes:,} bytes of data (is the file truncated?)")
    if offsets[1] - offsets[0] != math.prod(shape) * ITEM_BYTES[dtype]:
        raise _bad(path, f"tensor {name!r} spans {offsets[1] - offsets[0]:,} bytes, but shape {shape} of {dtype} "
                   f"needs {math.prod(shape) * ITEM_BYTES[dtype]:,}")
    return TensorInfo(dtype, tuple(shape))


def _count(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**62


def _bad(path: Path, why: str) -> UserError:
    return UserError(f"{path} is not a valid safetensors file: {why}. Expected an 8-byte header length, a JSON header "
                     f"of {{name: {{dtype, shape, data_offsets}}}} and the tensors' bytes. Fix: {_FIX}")


def read_index(index: Path) -> list[str]:
    """The file names that model.safetensors.index.json's weight_map points at: plain names inside its folder."""
    expected = "a safetensors index: an object with a weight_map of {tensor name: file name}"
    fix = "download the index again with the model, or delete it if the folder has a single model.safetensors."
    data = safe_json.expect_object(safe_json.read_file(index, expected=expected, fix=fix), str(index),
                                   expected=expected, fix=fix)
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise UserError(f"{index} has weight_map = {_short(weight_map)}. Expected {expected}. Fix: {fix}")
    files = sorted(set(weight_map.values()))
    for name in files:
        if (not name or name != os.path.basename(name) or name in (".", "..") or "\\" in name or "\0" in name
                or len(name.encode("utf-8", "surrogatepass")) > 255):
            raise UserError(
                f"{index} points at {_short(name)}, which is not a file name inside {index.parent}. An index lists the "
                "shards beside it (model-00001-of-00002.safetensors); a path that leaves the folder is refused. "
                f"Fix: {fix}"
            )
    return files


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 80 else text[:77] + "..."
