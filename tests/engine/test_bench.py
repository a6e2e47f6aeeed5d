import json
import subprocess
import sys

from tiny import LM_CLI_QUIET, TINY_LM

# `systolic` with the packages that only other workloads or options need hidden, as on the GPU machine, whose image
# has neither gymnax (rl) nor tensorboardX (observe.tensorboard) (benchmarks/harness/gpu.sh): the lm bench must not
# need them.
CLI_WITHOUT_OPTIONAL = """
import sys

class Hidden:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("gymnax", "tensorboardX", "sklearn"):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)")

sys.meta_path.insert(0, Hidden())
from systolic.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_bench_reports_step_time_throughput_and_mfu():
    proc = subprocess.run([sys.executable, "-c", CLI_WITHOUT_OPTIONAL, "bench", "lm", *TINY_LM, *LM_CLI_QUIET,
                           "--steps", "3", "--json"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["step_time_s"] > 0 and result["compile_s"] > 0
    assert result["items_per_s"] == 8 * 16 / result["step_time_s"]
    assert result["peak_source"] == "measured matmul" and 0 < result["mfu"] < 1
    # The compiled step's memory per device (engine/fit.py), not the runtime's peak_bytes_in_use (none on CPU).
    m = result["step_memory"]
    assert result["peak_memory_bytes"] == (m["argument_bytes"] + m["output_bytes"] - m["alias_bytes"] + m["temp_bytes"]
                                           + m["code_bytes"])
    assert m["alias_bytes"] > 0 and m["temp_bytes"] > 0 and 0 < result["peak_memory_bytes"] < 2**24
