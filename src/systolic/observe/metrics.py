"""Metrics to `metrics.jsonl` (one JSON object per line) and TensorBoard event files in the run directory."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from systolic.errors import UserError

METRICS_FILE = "metrics.jsonl"


class MetricsWriter:
    """Only the writing process (process 0) should construct one with `enabled=True`."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = True, enabled: bool = True):
        self.path = Path(run_dir) / METRICS_FILE
        self.enabled = enabled
        self._tb = None
        if enabled and tensorboard:
            try:
                from tensorboardX import SummaryWriter  # heavy import, only when used
            except ModuleNotFoundError as e:
                raise UserError(
                    f"observe.tensorboard=true writes TensorBoard files with tensorboardX, which is not installed "
                    f"({e}). Fix: pip install tensorboardX (a systolic dependency), or observe.tensorboard=false "
                    "(metrics.jsonl is written either way)."
                ) from None
            from tensorboardX.proto.summary_pb2 import Summary

            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
            self._summary = Summary  # a row's scalars in one event (write)
        self._file = open(self.path, "a", encoding="utf-8") if enabled else None

    def write(self, step: int, split: str, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": int(step), "split": split, **{k: _plain(v) for k, v in values.items()}}
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            # One event holding the row's scalars, not an add_scalar each: every event is a put on tensorboardX's
            # multiprocessing queue, ~0.6 ms under its writer's lock, so rl's rows of ~40 per-seed scalars took ~9 ms
            # each, the loop's time between chunks (rl-cartpole's CLI at 0.85x PureJaxRL on the chip, 2026-12-07,
            # its compiled chunks at 3.5x). TensorBoard reads the values of one event as separate scalars.
            scalars = [self._summary.Value(tag=f"{split}/{key}", simple_value=float(value))
                       for key, value in record.items()
                       if key not in ("step", "split") and isinstance(value, (int, float)) and math.isfinite(value)]
            if scalars:
                self._tb._get_file_writer().add_summary(self._summary(value=scalars), int(step))

    def flush(self) -> None:
        if self.enabled:
            self._file.flush()
            if self._tb is not None:
                self._tb.flush()

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            if self._tb is not None:
                self._tb.close()


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Infinity; keep the information as text
    return value


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of `<run_dir>/metrics.jsonl`. A line that is not a record, an object with an integer "step"
    and a string "split" (a line cut short by a crash, or damaged), is skipped: the history is a report, and one
    bad line must not stop a resume or a plot."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    records = []
    for line in path.read_bytes().decode("utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # bad JSON, a 5,000-digit number, deep nesting
            continue
        if (isinstance(record, dict) and isinstance(record.get("step"), int) and not isinstance(record["step"], bool)
                and isinstance(record.get("split"), str)):
            records.append(record)
    return records


def truncate_after(run_dir: Path, step: int) -> None:
    """Drops records newer than `step` (work that a resume redoes), so the file stays one consistent history.

    Written to a temporary file and renamed, so a crash here cannot lose the records that are kept.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return
    kept = [r for r in read_metrics(run_dir) if r.get("step", 0) <= step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
    os.replace(tmp, path)
