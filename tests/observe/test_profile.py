import subprocess
import sys

TINY = ["model.d_model=32", "model.layers=1", "model.heads=2", "model.max_seq_len=32", "data.seq_len=16",
        "data.max_bytes=300000", "data.val_percent=30", "train.batch_size=8", "train.steps=4",
        "train.eval_batches=1", "sample.max_new_tokens=0", "observe.tensorboard=false", "-q"]


def test_profile_steps_write_a_trace(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "systolic", "train", "lm", *TINY, "observe.profile_steps=2-3",
                           "--run-dir", str(run)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    traces = list((run / "profile").rglob("*.xplane.pb"))
    assert traces and traces[0].stat().st_size > 0
