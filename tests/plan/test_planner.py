"""`systolic plan` on a 1B-parameter Llama: compiled ahead of time on fake devices, never allocated."""

import json
import os
import subprocess
import sys

import pytest

# `python -m systolic ARGS` that also reports its peak resident memory, and keeps the command's exit status.
PEAK_RSS = """
import resource, runpy, sys
sys.argv = ["systolic"] + sys.argv[1:]
try:
    runpy.run_module("systolic", run_name="__main__")
    code = 0
except SystemExit as e:
    code = e.code
print("PEAK_RSS_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)
sys.exit(code)
"""


def plan(mesh: str) -> tuple[dict, int]:
    # Standard dtype promotion: a GPU plan traces jax's own XLA attention in bfloat16, which promotes with float32
    # inside jax (jax/_src/nn/functions.py), forward and backward; conftest.py's strict promotion rejects that.
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUMPY_DTYPE_PROMOTION")}
    proc = subprocess.run([sys.executable, "-c", PEAK_RSS, "plan", "lm", "--recipe", "llama-1b", "--target", "h200",
                           "--mesh", mesh, "--json"], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0 and "PEAK_RSS_KB" in proc.stderr, proc.stderr
    rss_kb = int(proc.stderr.split("PEAK_RSS_KB")[-1].split()[0])
    return json.loads(proc.stdout.strip().splitlines()[-1]), rss_kb * 1024


@pytest.mark.slow
def test_plan_1b_without_allocating_and_memory_falls_with_fsdp():
    p8, rss = plan("fsdp=8")
    assert 0.9e9 < p8["params"] < 1.1e9
    assert rss < 0.5 * p8["params"] * 4, "plan must not materialise the float32 weights"
    assert p8["chips"] == 8 and "XLA:CPU" in p8["compiler"]
    assert p8["xla_flops_per_step"] > p8["model_flops_per_step"]  # remat + masked attention
    p4, _ = plan("fsdp=4")
    # Parameters and optimizer state are split over fsdp: twice the devices, about half the bytes each.
    assert p8["argument_bytes"] == pytest.approx(p4["argument_bytes"] / 2, rel=0.05)


def test_plan_reports_the_all_to_all_of_expert_parallelism():
    """A tiny mixture of 8 experts on fsdp=2 x expert=4 for 8 GPUs: the plan counts the dispatch/combine all-to-all
    and says what the formula and the dropless slots count."""
    from tiny import TINY_MOE

    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUMPY_DTYPE_PROMOTION")}
    proc = subprocess.run([sys.executable, "-m", "systolic", "plan", "lm", *TINY_MOE, "model.moe.experts=8",
                           "--target", "h100", "--mesh", "fsdp=2,expert=4", "--json"],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr
    p = json.loads(proc.stdout.strip().splitlines()[-1])
    assert p["mesh"] == "data=1 x fsdp=2 x expert=4 x tensor=1" and p["chips"] == 8
    a2a = p["collectives"]["all-to-all"]
    assert a2a["count"] >= 8 and a2a["wire_bytes"] == pytest.approx(a2a["bytes"] * 3 / 4)  # a ring over 4
    notes = " ".join(p["notes"])
    assert "2 of 8 experts per token" in notes and "fixed slots sized for the worst case, 4x the rows routed" in notes
