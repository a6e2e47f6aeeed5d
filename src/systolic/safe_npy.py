"""The one reader for `.npy` and `.npz` files systolic did not necessarily write itself: a prepared dataset's unigram
table, a gan run's cached classifier. Any failure is a UserError naming the file, what was wrong and the fix.

`np.load` alone unpickles object arrays when asked to, raises half a dozen types for a truncated or garbled file,
and trusts the header's shape: a header that claims 10^12 elements allocates them before reading a byte. Here
nothing is unpickled, each array's header is checked against the shape and dtype the caller expects before its
data is read, and the data must be as long as the header says.
"""

from __future__ import annotations

import math
import os
import stat
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

import numpy as np

from systolic.errors import UserError

# An expected shape: one entry per axis, an int for a fixed length or None for any length.
Shape = tuple[int | None, ...]


def read_array(path: Path, *, kind: str, shape: Shape, expected: str, fix: str, max_bytes: int = 1 << 32) -> np.ndarray:
    """The array in the `.npy` file `path`: of numpy dtype kind `kind` ("i" signed integer, "f" float, ...) and
    `shape`. `expected` describes the file for the errors, `fix` says what to do."""
    path = Path(path)
    with _opened(path, expected, fix, max_bytes) as f:
        return _read_one(f, str(path), kind, shape, expected, fix, max_bytes)


def read_arrays(path: Path, shapes: dict[str, Shape], *, kind: str, expected: str, fix: str,
                max_bytes: int = 1 << 32) -> dict[str, np.ndarray]:
    """Every array of the `.npz` file `path`, which must hold exactly the names in `shapes`, each of dtype kind
    `kind` and its shape."""
    path = Path(path)
    with _opened(path, expected, fix, max_bytes) as f:
        try:
            archive = zipfile.ZipFile(f)
            names = {name.removesuffix(".npy"): name for name in archive.namelist()}
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
            raise _error(str(path), f"it is not a readable .npz archive ({e})", expected, fix) from None
        if names.keys() != shapes.keys():
            missing, extra = sorted(shapes.keys() - names.keys()), sorted(names.keys() - shapes.keys())
            raise _error(str(path), f"it holds the arrays {sorted(names)[:8]} (missing {missing[:4]}, unexpected "
                         f"{extra[:4]})", expected, fix)
        out = {}
        for name, want in shapes.items():
            try:
                with archive.open(names[name]) as member:
                    out[name] = _read_one(member, f"{path} (array {name!r})", kind, want, expected, fix,
                                          max_bytes)
            except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as e:
                raise _error(f"{path} (array {name!r})", f"it cannot be read ({type(e).__name__}: {e})", expected,
                             fix) from None
        return out


class _opened:
    """`open(path, "rb")` as a context, after checking it is a regular file of at most `max_bytes`."""

    def __init__(self, path: Path, expected: str, fix: str, max_bytes: int):
        self.path, self.expected, self.fix, self.max_bytes = path, expected, fix, max_bytes

    def __enter__(self) -> IO[bytes]:
        try:
            info = os.stat(self.path)
            if not stat.S_ISREG(info.st_mode):
                raise _error(str(self.path), "it is not a regular file", self.expected, self.fix)
            if info.st_size > self.max_bytes:
                raise _error(str(self.path), f"it is {info.st_size:,} bytes, more than {self.max_bytes:,}",
                             self.expected, self.fix)
            self.file = open(self.path, "rb")  # noqa: SIM115 (closed by __exit__)
        except OSError as e:
            raise _error(str(self.path), f"it cannot be read ({e.strerror})", self.expected, self.fix) from None
        return self.file

    def __exit__(self, *exc: object) -> None:
        self.file.close()


def _read_one(f: IO[bytes], source: str, kind: str, shape: Shape, expected: str, fix: str,
              max_bytes: int) -> np.ndarray:
    """One array from the open `.npy` stream `f`, its header checked before its data is read."""
    try:
        version = np.lib.format.read_magic(f)
        header: Callable = {(1, 0): np.lib.format.read_array_header_1_0,
                            (2, 0): np.lib.format.read_array_header_2_0}.get(version)
        if header is None:
            raise ValueError(f"format version {version}")
        found_shape, fortran, dtype = header(f)
    except Exception as e:  # noqa: BLE001 - numpy parses the header with ast and tokenize: any of their errors
        raise _error(source, f"it is not a .npy array ({type(e).__name__}: {str(e)[:120]})", expected, fix) from None
    if dtype.hasobject:
        raise _error(source, "it holds Python objects (a pickle), which systolic never loads", expected, fix)
    if dtype.kind != kind or dtype.subdtype is not None or dtype.names:
        raise _error(source, f"its dtype is {dtype}, not {_KINDS.get(kind, kind)}", expected, fix)
    if len(found_shape) != len(shape) or any(w is not None and w != n for w, n in zip(shape, found_shape, strict=False)):
        want = "(" + ", ".join("any" if w is None else str(w) for w in shape) + (",)" if len(shape) == 1 else ")")
        raise _error(source, f"its shape is {found_shape}, not {want}", expected, fix)
    count = math.prod(found_shape)  # Python ints: a header's 10^30 elements neither overflow nor get allocated
    if min(found_shape, default=0) < 0 or count * dtype.itemsize > max_bytes:
        raise _error(source, f"its header claims the shape {found_shape}, more than the file can hold", expected, fix)
    data = f.read(count * dtype.itemsize)
    if len(data) != count * dtype.itemsize or f.read(1):
        raise _error(source, f"it holds {len(data):,} bytes of data where its header promises "
                     f"{count * dtype.itemsize:,} (truncated or padded)", expected, fix)
    array = np.frombuffer(data, dtype).reshape(found_shape, order="F" if fortran else "C")
    return array.astype(dtype.newbyteorder("="), copy=True)


_KINDS = {"i": "a signed integer type", "u": "an unsigned integer type", "f": "a floating-point type"}


def _error(source: str, why: str, expected: str, fix: str) -> UserError:
    return UserError(f"Could not read {source}: {why}. Expected {expected}. Fix: {fix}")
