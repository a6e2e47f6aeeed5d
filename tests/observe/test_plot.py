"""The end-of-run loss picture is optional: a machine without matplotlib (the lent TPU's image) finishes the run."""

import sys
from pathlib import Path

from tiny import LM_CLI_QUIET, TINY_LM, call


def test_train_without_matplotlib_skips_the_picture(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    run = tmp_path / "run"
    quiet = [o for o in LM_CLI_QUIET if o != "observe.plot=false"]  # plots on: this test checks them
    code, _, err = call("train", "lm", *TINY_LM, *quiet, "train.steps=2", "--run-dir", str(run))
    assert code == 0
    assert "matplotlib is not installed, so loss.png was not drawn" in err
    assert (run / "metrics.jsonl").is_file() and not (run / "loss.png").exists()
