"""The run directory: one folder per run holding its resolved config, checkpoints, metrics and pictures."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from systolic import config as config_lib
from systolic.errors import UserError

CONFIG_FILE = "config.yaml"


def prepare(run_dir: Path, cfg: Any, *, must_match: tuple[str, ...] = ("workload", "model")) -> None:
    """Creates `run_dir` and writes the resolved config. A directory that already holds a run must agree on the
    sections in `must_match`, because its checkpoints only fit that model."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / CONFIG_FILE
    new = config_lib.to_dict(cfg)
    if path.exists() and (run_dir / "checkpoints").exists():
        old = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        for section in must_match:
            if old.get(section) != new.get(section):
                raise UserError(
                    f"{run_dir} already holds a run whose '{section}' settings differ from this one "
                    f"(saved: {_diff(old.get(section), new.get(section))}). Its checkpoints would not fit. Fix: pass "
                    f"a new --run-dir, or use the saved settings (see {path})."
                )
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(config_lib.dump_yaml(cfg), encoding="utf-8")
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
