import json
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
