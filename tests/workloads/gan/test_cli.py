"""The real CLI on a tiny gan recipe: train (with evaluation and pictures), then sample from the run directory."""

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_train_then_sample(tmp_path, tiny_overrides):
    run_dir = tmp_path / "run"
    overrides = [o for o in tiny_overrides if not o.startswith("observe.")] + ["train.eval_every=4", "observe.log_every=2"]
    train = subprocess.run([sys.executable, "-m", "systolic", "train", "gan", "--run-dir", str(run_dir), *overrides],
                           capture_output=True, text=True, timeout=600)
    assert train.returncode == 0, train.stderr
    assert "Fréchet classifier distance" in train.stdout
    for name in ("samples.png", "curves.png", "classifier.npz", "metrics.jsonl", "samples/step_000004.png"):
        assert (run_dir / name).exists(), name
    out = tmp_path / "grid.png"
    sample = subprocess.run([sys.executable, "-m", "systolic", "sample", "gan", str(run_dir), "--count", "16",
                             "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert sample.returncode == 0, sample.stderr
    from PIL import Image

    assert Image.open(out).size[0] >= 256
