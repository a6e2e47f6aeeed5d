"""The run directory: one folder per run holding its resolved config, checkpoints, metrics and pictures."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import yaml

from systolic import config as config_lib
from systolic.errors import UserError

CONFIG_FILE = "config.yaml"


class Prepared:
    """Undo for `prepare`: a run that fails on bad input leaves an existing run directory exactly as it was
    and removes one it created."""

    def __init__(self, run_dir: Path, created: bool, old_config: str | None):
        self.run_dir, self._created, self._old_config = run_dir, created, old_config

    def rollback(self) -> None:
        if self._created:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        elif self._old_config is not None:
            _write_atomic(self.run_dir / CONFIG_FILE, self._old_config)


def prepare(run_dir: Path, cfg: Any, *, must_match: tuple[str, ...] = ("workload", "model")) -> Prepared:
    """Creates `run_dir` and writes the resolved config. A directory that already holds a run must agree on the
    sections in `must_match`, because its checkpoints only fit that model."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--run-dir {run_dir} exists and is not a directory. Fix: pass a directory path.")
    created = not run_dir.exists()
    path = run_dir / CONFIG_FILE
    old_text = path.read_text(encoding="utf-8") if path.is_file() else None
    new = config_lib.to_dict(cfg)
    if old_text is not None and (run_dir / "checkpoints").exists():
        try:
            old = yaml.safe_load(old_text) or {}
        except yaml.YAMLError:
            old = {}
        for section in must_match:
            if old.get(section) != new.get(section):
                raise UserError(
                    f"{run_dir} already holds a run whose '{section}' settings differ from this one "
                    f"(saved: {_diff(old.get(section), new.get(section))}). Its checkpoints would not fit. Fix: pass "
                    f"a new --run-dir, or use the saved settings (see {path})."
                )
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_atomic(path, config_lib.dump_yaml(cfg))
    except OSError as e:
        raise UserError(f"Cannot write the run directory {run_dir}: {e}. Fix: pass a writable --run-dir.") from None
    return Prepared(run_dir, created, old_text)


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
