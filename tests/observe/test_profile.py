import subprocess
import sys

from tiny import LM_CLI_QUIET, TINY_LM

TINY = [*TINY_LM, *LM_CLI_QUIET, "train.steps=4", "-q"]  # steps 2-3 profiled, then one more


def test_profile_steps_write_a_trace(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "systolic", "train", "lm", *TINY, "observe.profile_steps=2-3",
                           "--run-dir", str(run)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    traces = list((run / "profile").rglob("*.xplane.pb"))
    assert traces and traces[0].stat().st_size > 0
