import json
import struct
import sys

import pytest

from systolic.errors import UserError
from systolic.observe.metrics import MetricsWriter, read_metrics


def test_metrics_lines_are_written_without_tensorboard(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False)
    writer.write(3, "train", {"loss": 2.5, "bad": float("nan")})
    writer.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 3, "split": "train", "loss": 2.5,
                                                                    "bad": "nan"}
    assert read_metrics(tmp_path)[0]["loss"] == 2.5
    assert not (tmp_path / "tensorboard").exists()


def test_missing_tensorboardx_is_a_user_error_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # as on a machine without it: import raises
    with pytest.raises(UserError, match="observe.tensorboard=false"):
        MetricsWriter(tmp_path, tensorboard=True)


def read_scalars(folder) -> tuple[dict[int, dict[str, float]], int]:
    """(step -> {tag: value}, how many events held them) from the TFRecord event files under `folder` (length, CRC,
    an Event proto, CRC)."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[int, dict[str, float]] = {}
    events = 0
    for path in folder.rglob("events.out.tfevents.*"):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = Event.FromString(data[at + 12:at + 12 + length])
            at += 16 + length
            events += bool(event.summary.value)
            for value in event.summary.value:
                out.setdefault(event.step, {})[value.tag] = value.simple_value
    return out, events


def test_tensorboard_gets_every_finite_number_of_a_row_as_a_scalar_in_one_event(tmp_path):
    """One event a row: each event is a put on tensorboardX's queue (~0.6 ms), and rl writes rows of ~40 scalars
    between its chunks."""
    writer = MetricsWriter(tmp_path, tensorboard=True)
    writer.write(3, "train", {"loss": 2.5, "bad": float("nan"), "note": "text", "return/seed0": 7, "done": True})
    writer.write(4, "eval", {"loss": 1.5})
    writer.close()
    assert read_scalars(tmp_path / "tensorboard") == ({3: {"train/loss": 2.5, "train/return/seed0": 7.0,
                                                          "train/done": 1.0}, 4: {"eval/loss": 1.5}}, 2)
