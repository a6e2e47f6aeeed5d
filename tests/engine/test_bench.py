import json
import subprocess
import sys

from tiny import LM_CLI_QUIET, TINY_LM


def test_bench_reports_step_time_throughput_and_mfu():
    proc = subprocess.run([sys.executable, "-m", "systolic", "bench", "lm", *TINY_LM, *LM_CLI_QUIET, "--steps", "3",
                           "--json"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["step_time_s"] > 0 and result["compile_s"] > 0
    assert result["items_per_s"] == 8 * 16 / result["step_time_s"]
    assert result["peak_source"] == "measured matmul" and 0 < result["mfu"] < 1
