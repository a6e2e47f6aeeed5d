"""The run directory: one folder per run holding its resolved config, checkpoints, metrics and pictures.

Three guarantees (docs/reliability.md):
- **Only systolic's own folders are written.** A run directory carries a marker file written when it is created
  (`.systolic-run`: workload and version). An existing folder that is not empty and has no marker is refused
  before anything in it changes: it may be a user's own work.
- **One writer at a time.** A command that writes a run directory holds an OS file lock on `.lock` for its whole
  life; a second writer is refused with the holder's PID. The kernel drops the lock when its process dies, so a
  killed run's lock is taken over without a stale-lock check.
- **A failed command leaves no trace.** `transaction` runs a command so that, if it fails, `Prepared.rollback`
  returns an existing run directory to what it was (its config, its metrics rows, no new files) and removes one
  the command created, up to the first folder it created (`--run-dir a/b/c` where only `a` existed removes `a/b`).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from systolic import config as config_lib
from systolic import outfile
from systolic import safe_yaml
from systolic.errors import CheckpointWriteError, TrainingHalted, UserError

CONFIG_FILE = "config.yaml"
MARKER_FILE = ".systolic-run"
LOCK_FILE = ".lock"
METRICS_FILE = "metrics.jsonl"  # observe/metrics.py's; repeated here, which must not import observe
METRICS_SAVED = ".metrics.jsonl.rollback"  # a hard link to metrics.jsonl while a command may roll back
# The workloads of the versions before markers existed: only they can have left an unmarked run. A history, not a
# second registry: a workload added since writes markers from its first run.
LEGACY_WORKLOADS = ("lm", "rl", "gan", "sim")


class Prepared:
    """A prepared run directory, locked by this process until `release`; `rollback` undoes what preparing and
    the failed command did to it."""

    def __init__(self, run_dir: Path, lock: "RunLock", created: Path | None, old_config: str | None,
                 before: dict[str, Any]):
        self.run_dir, self.lock = run_dir, lock
        self._created, self._old_config, self._before = created, old_config, before

    def rollback(self) -> None:
        """Existing directory: back to its old config, metrics rows and entries; new directory: removed."""
        if self._created is not None:
            shutil.rmtree(self._created, ignore_errors=True)
            return
        for entry in self.run_dir.iterdir() if self.run_dir.is_dir() else ():
            if entry.name not in self._before and entry.name not in (LOCK_FILE, METRICS_SAVED):
                shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() and not entry.is_symlink() else entry.unlink(missing_ok=True)
        metrics, saved = self.run_dir / METRICS_FILE, self.run_dir / METRICS_SAVED
        if saved.is_file() or (metrics.is_file() and METRICS_FILE in self._before):
            if saved.is_file():
                os.replace(saved, metrics)  # the old file, if a restart rewrote it (the link kept its inode)
            with open(metrics, "r+b") as f:  # rows are only ever appended to it: cut the new ones off
                f.truncate(self._before[METRICS_FILE])
        if self._old_config is not None:
            _write_atomic(self.run_dir / CONFIG_FILE, self._old_config)

    def wrote_checkpoint(self) -> bool:
        """Whether this command saved a checkpoint that was not there before (then a failure keeps the run)."""
        ckpts = self.run_dir / "checkpoints"
        now = {p.name for p in ckpts.iterdir()} if ckpts.is_dir() else set()
        return bool({n for n in now if n.isdigit()} - set(self._before.get("checkpoints/", "").split(",")))

    def release(self) -> None:
        (self.run_dir / METRICS_SAVED).unlink(missing_ok=True)
        self.lock.release()


class RunLock:
    """An exclusive `flock` on RUN_DIR/.lock, which holds the holder's PID for the error message of the next one."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            holder = _read_pid(self.path)
            raise UserError(
                f"{self.path.parent} is in use by another systolic command (process {holder or 'unknown'} holds "
                f"{self.path}). Two commands writing one run directory would overwrite each other's checkpoints. "
                f"Fix: wait for that command to finish (or stop it), or pass another --run-dir."
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def prepare(run_dir: Path, cfg: Any, *, must_match: tuple[str, ...] = ("workload", "model")) -> Prepared:
    """Creates (or checks) `run_dir`, locks it, and writes the resolved config. A directory that already holds a
    run must agree on the sections in `must_match`, because its checkpoints only fit that model."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--run-dir {run_dir} exists and is not a directory. Fix: pass a directory path.")
    check_owned(run_dir)
    created = _first_missing(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = RunLock(run_dir)
        lock.acquire()
    except UserError:
        raise  # another command holds it: nothing of ours to undo (it may be using a folder we made)
    except OSError as e:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise UserError(f"Cannot write the run directory {run_dir}: {e}. Fix: pass a writable --run-dir.") from None
    try:
        return _prepare_locked(run_dir, cfg, lock, created, must_match)
    except BaseException:
        lock.release()
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise


def prepare_run(workload: Any, recipe: str | None, overrides: list[str], run_dir: Path | None,
                dir_suffix: str = "") -> tuple[Any, Path, Prepared | None]:
    """The config (`recipe` + `overrides`, completed by `workload.resolve_config`), the run directory (default
    runs/<recipe><dir_suffix>) and, on process 0, that directory prepared for a run of `workload` (a
    workloads.Workload, passed in: the engine does not import the workloads)."""
    name = workload.name
    # Check the recipe's workload before its keys: another workload's sections would read as misspellings.
    recipe_path = config_lib.recipe_path(recipe or workload.default_recipe, name)
    declared = config_lib.read_yaml(recipe_path).get("workload", name)
    if declared != name:
        raise UserError(f"Recipe '{recipe_path.stem}' is for the '{declared}' workload, not '{name}'. Fix: pick a "
                        f"recipe for {name}, or run the {declared} workload (e.g. `systolic train {declared} --recipe "
                        f"{recipe_path.stem}`).")
    cfg, recipe = config_lib.load(workload.config, recipe, overrides, workload.default_recipe, name)
    run_dir = run_dir or Path("runs") / f"{recipe}{dir_suffix}"
    if workload.resolve_config is not None:  # settings taken from elsewhere, e.g. lm's init.from=RUN_DIR
        cfg = workload.resolve_config(cfg, overrides, run_dir)
    import jax

    return cfg, run_dir, prepare(run_dir, cfg) if jax.process_index() == 0 else None


def transaction(prepared: Prepared | None, run: Callable[[], Any]) -> None:
    """Runs `run` so that a command that fails, for whatever reason (bad input found while starting, Ctrl-C, a
    bug), leaves the run directory as it was: a new one is removed, an existing one gets back its config, metrics
    rows and entries. Once the command has written a checkpoint, what it wrote is the run's history and stays (a
    halt, a failed checkpoint write, or an interrupt then resumes from there). `prepared` is None on the
    processes other than 0, which leave the directory to process 0."""
    try:
        run()
    except (TrainingHalted, CheckpointWriteError):
        raise  # what the run wrote up to its halt is the evidence the message points to
    except BaseException:
        if prepared is not None and not prepared.wrote_checkpoint():
            prepared.rollback()
        raise


def _prepare_locked(run_dir: Path, cfg: Any, lock: RunLock, created: Path | None,
                    must_match: tuple[str, ...]) -> Prepared:
    marker = run_dir / MARKER_FILE
    if created is None and not marker.is_file():
        check_owned(run_dir)  # again under the lock: another command may have written it meanwhile
        # Not empty: a run from before markers existed (check_owned recognised it), marked for good. Empty (a
        # folder the user made): the snapshot below is empty, so a failure removes all it gets and keeps the folder.
        if _entries(run_dir) - {LOCK_FILE}:
            _write_marker(marker, cfg)
    path = run_dir / CONFIG_FILE
    old_text = path.read_text(encoding="utf-8") if path.is_file() else None
    before = _snapshot(run_dir)
    new = config_lib.to_dict(cfg)
    if old_text is not None and (run_dir / "checkpoints").exists():
        try:
            old = safe_yaml.load_text(old_text, str(path)) or {}
        except UserError:
            old = {}  # damaged: compared as empty, so the new config's sections differ and it is refused
        old = _with_defaults(old if isinstance(old, dict) else {}, type(cfg))
        for section in must_match:
            if old.get(section) != new.get(section):
                raise UserError(
                    f"{run_dir} already holds a run whose '{section}' settings differ from this one "
                    f"(saved: {_diff(old.get(section), new.get(section))}). Its checkpoints would not fit. Fix: pass "
                    f"a new --run-dir, or use the saved settings (see {path})."
                )
    try:
        if not marker.is_file():
            _write_marker(marker, cfg)
        _write_atomic(path, config_lib.dump_yaml(cfg))
    except OSError as e:
        raise UserError(f"Cannot write the run directory {run_dir}: {e}. Fix: pass a writable --run-dir.") from None
    return Prepared(run_dir, lock, created, old_text, before)


def _with_defaults(old: dict[str, Any], schema: type) -> dict[str, Any]:
    """A saved config as this version reads it: keys added since it was written take their defaults (which keep
    the old behaviour), so a run from an older systolic still matches its own settings. Unreadable: as saved."""
    try:
        return config_lib.to_dict(config_lib.from_dict(schema, old))
    except UserError:
        return old


def check_owned(run_dir: Path) -> None:
    """Refuses an existing, non-empty folder that is not a systolic run directory, and a folder inside another run
    (`--run-dir RUN/checkpoints/new` would leave RUN unreadable), before anything touches it."""
    outfile.check_folder(run_dir, option="--run-dir")
    if not run_dir.is_dir() or (run_dir / MARKER_FILE).is_file() or _is_legacy_run(run_dir):
        return
    entries = sorted(_entries(run_dir) - {LOCK_FILE})
    if entries:
        shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
        raise UserError(
            f"--run-dir {run_dir} is a folder that systolic did not create (it holds {shown}, and no {MARKER_FILE} "
            f"marker). A run would overwrite its config.yaml and append to its metrics.jsonl, so nothing in it was "
            f"touched. Fix: pass a new or empty --run-dir (e.g. --run-dir {run_dir / 'run'}), or one that a systolic "
            f"command created."
        )


def _is_legacy_run(run_dir: Path) -> bool:
    """A run written before markers existed: a config.yaml naming a workload, beside a checkpoints folder."""
    path = run_dir / CONFIG_FILE
    if not (path.is_file() and (run_dir / "checkpoints").is_dir()) or path.stat().st_size > 1 << 20:
        return False
    try:
        tree = safe_yaml.read_file(path)
    except UserError:
        return False
    return isinstance(tree, dict) and tree.get("workload") in LEGACY_WORKLOADS


def _first_missing(path: Path) -> Path | None:
    """The outermost folder of `path` that does not exist yet (what creating it makes), or None."""
    missing = None
    for p in (path, *path.parents):
        if p.exists():
            break
        missing = p
    return missing


def _entries(run_dir: Path) -> set[str]:
    return {p.name for p in run_dir.iterdir()}


def _snapshot(run_dir: Path) -> dict[str, Any]:
    """What rollback restores: the top-level names, the metrics file's length, the checkpoint steps."""
    before: dict[str, Any] = {name: 0 for name in _entries(run_dir)}
    metrics = run_dir / METRICS_FILE
    if metrics.is_file():
        before[METRICS_FILE] = metrics.stat().st_size
        (run_dir / METRICS_SAVED).unlink(missing_ok=True)  # left by a command that was killed
        try:
            os.link(metrics, run_dir / METRICS_SAVED)  # no copy: survives the file being replaced
        except OSError:
            pass  # no hard links here: a failed restart cannot bring back rows it dropped (appends still can)
    ckpts = run_dir / "checkpoints"
    before["checkpoints/"] = ",".join(p.name for p in ckpts.iterdir()) if ckpts.is_dir() else ""
    return before


def _write_marker(marker: Path, cfg: Any) -> None:
    _write_atomic(marker, json.dumps({"workload": cfg.workload, "systolic": _version()}) + "\n")


def _version() -> str:
    try:
        return metadata.version("systolic")
    except metadata.PackageNotFoundError:
        return "unknown"


def _read_pid(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if text.isdigit() else None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _diff(old: Any, new: Any) -> str:
    if isinstance(old, dict) and isinstance(new, dict):
        changed = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
        return "; ".join(changed)
    return f"{old!r} -> {new!r}"


def load_config(run_dir: Path, schema_for: Any) -> Any:
    """Reads `<run_dir>/config.yaml`; `schema_for(workload_name)` gives the config class to build."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise UserError(f"{run_dir} is not a systolic run directory: it has no {CONFIG_FILE}. Fix: pass the directory a "
                        "`systolic train` run wrote (default runs/<recipe>).")
    tree = config_lib.read_yaml(path)
    return config_lib.from_dict(schema_for(tree.get("workload")), tree)
