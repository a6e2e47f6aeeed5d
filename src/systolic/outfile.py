"""Files a command writes at a path the user names (`--out`, `--gif`): checked before the work, written whole.

A command never overwrites a file it did not create unless told to (`--force`), never writes into a run
directory's own files (its config, checkpoints, marker or lock) even then, and refuses a path whose extension
says it is another kind of file (`--gif run/config.yaml`). The file appears complete or not at all: it is written
beside its final name and renamed.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable
from pathlib import Path

from systolic.errors import UserError

# A run directory's own files (engine/rundir.py, engine/checkpoint.py): never an output, --force or not.
_RUN_FILES = ("config.yaml", ".systolic-run", ".lock", "checkpoints", "metrics.jsonl", "tokenizer.json")


def check(path: Path, *, option: str, suffixes: Iterable[str], force: bool) -> Path:
    """Refuses `path` as the output of `option` unless it ends in one of `suffixes`, is not a run directory's
    own file, and does not exist (or `force`). Returns it."""
    path = Path(path)
    suffixes = tuple(suffixes)
    if suffixes and not path.name.lower().endswith(suffixes):
        raise UserError(f"{option} {path}: expected a file name ending in {' or '.join(suffixes)}, so that no other "
                        f"kind of file is overwritten by mistake. Fix: e.g. {option} {path.with_suffix(suffixes[0])}.")
    if _is_run_file(path):
        raise UserError(f"{option} {path} is one of a run directory's own files; writing it would break the run. "
                        f"Fix: write elsewhere, e.g. {option} {path.parent / ('out' + (suffixes[0] if suffixes else ''))}.")
    if path.exists() and path.is_dir():
        raise UserError(f"{option} {path} is a folder. Fix: name a file, e.g. {option} {path / ('out' + (suffixes[0] if suffixes else ''))}.")
    if path.exists() and not force:
        raise UserError(f"{option} {path} already exists, and this command does not overwrite files it did not "
                        f"create. Fix: pass --force to replace it, or choose another path.")
    return path


def check_folder(path: Path, *, option: str) -> Path:
    """Refuses `path` as a folder that `option` creates when it would lie inside a run directory: a checkpoint step
    written by another command, or a stray folder among its steps, leaves the run unreadable, and a run's files are
    its own command's. (A run at `path` itself is not empty, which every caller refuses.) Returns it."""
    path = Path(path)
    run = next((p for p in path.absolute().parents if _is_run(p)), None)
    if run is not None:
        raise UserError(f"{option} {path} is inside the run directory {run}, whose files only the run's own command "
                        f"writes (a folder among its checkpoints makes the run unreadable). Expected a folder outside "
                        f"any run. Fix: e.g. {option} {run.parent / (path.name + '-out')}.")
    return path


def _is_run(folder: Path) -> bool:
    """A run directory: its marker, or (from before markers) a config.yaml beside a checkpoints folder. A folder with
    only `checkpoints/` in it may be a user's own (a home directory), and everything under it would be refused."""
    return ((folder / ".systolic-run").is_file()
            or (folder / "config.yaml").is_file() and (folder / "checkpoints").is_dir())


def _is_run_file(path: Path) -> bool:
    """A run directory's config, marker, lock or metrics, or anything in a run's checkpoints folder."""
    if path.name in _RUN_FILES and _is_run(path.parent):
        return True
    return any(p.name == "checkpoints" and _is_run(p.parent) for p in path.absolute().parents)


def write_bytes(path: Path, data: bytes) -> Path:
    """Writes `data` to `path` whole, through a uniquely named temporary file beside it and a rename: readers see
    the old file or the new one, and two processes writing at once do not mix their bytes."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
