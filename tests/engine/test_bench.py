import json
import subprocess
import sys

TINY = ["model.d_model=32", "model.layers=1", "model.heads=2", "model.max_seq_len=32", "data.seq_len=16",
        "data.max_bytes=300000", "data.val_percent=30", "train.batch_size=8"]


def test_bench_reports_step_time_throughput_and_mfu():
    proc = subprocess.run([sys.executable, "-m", "systolic", "bench", "lm", *TINY, "--steps", "3", "--json"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["step_time_s"] > 0 and result["compile_s"] > 0
    assert result["items_per_s"] == 8 * 16 / result["step_time_s"]
    assert result["peak_source"] == "measured matmul" and 0 < result["mfu"] < 1
