"""`systolic simulate` runs in the engine's loop, so it gets what training gets: `--debug`, profiling, plots and
`loop.stop_at_step`."""

import json
import os
import subprocess
import sys

from systolic.cli import main
from tiny import TINY_SIM

SHORT = [*TINY_SIM, "sim.t_end=0.4", "output.frames=4", "output.images=false", "observe.tensorboard=false"]


def test_debug_names_the_frame_and_operation_of_an_injected_nan(tmp_path):
    """On one device, as `systolic simulate` runs by default on a CPU: a NaN field once made the adaptive step's
    loop spin forever there (one device has no all-reduce to drop the NaN), and checkify cannot instrument the
    frame (a while loop inside shard_map), so the step is re-run eagerly to name the operation."""
    env = {**os.environ, "XLA_FLAGS": ""}  # one CPU device, not the suite's eight
    proc = subprocess.run([sys.executable, "-m", "systolic", "simulate", *SHORT, "loop.poison_step=2", "--debug",
                           "--run-dir", str(tmp_path)], capture_output=True, text=True, timeout=300, env=env)
    err = " ".join(proc.stderr.split())
    assert proc.returncode == 3, err
    assert "--debug: step 2" in err and "nan" in err and "guard.py" in err and "in poisoned" in err, err
    assert "Traceback" not in err


def test_profile_plot_and_stop_at_step(tmp_path):
    run = tmp_path / "run"  # beside the next test's run: a run directory inside another run is refused
    assert main(["simulate", *SHORT, "observe.profile_steps=2-3", "loop.stop_at_step=3", "--run-dir", str(run)]) == 0
    assert list((run / "profile").rglob("*.xplane.pb")), "no trace written"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # stopped at frame 3 of 4, with a checkpoint
    assert (run / "checkpoints" / "3").is_dir() and not (run / "diagnostics.png").exists()
    assert main(["simulate", *SHORT, "--run-dir", str(run)]) == 0  # resumes and finishes: now the plot
    assert (run / "diagnostics.png").is_file()
    assert main(["simulate", *SHORT, "observe.plot=false", "--run-dir", str(tmp_path / "noplot")]) == 0
    assert not (tmp_path / "noplot" / "diagnostics.png").exists()
