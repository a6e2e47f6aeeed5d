"""A plan that does not fit is a plan: with --json, `fits: false`, the bytes needed and available per chip, and the
fix, exit 0; the human form keeps the one paragraph and exit 2. Here the lm's arithmetic lower bound refuses the
config before tracing (lm/preflight.py), so nothing compiles and each case takes a second."""

import importlib.util
import json

import pytest

from tiny import call

GIB = 2**30
# lm-tiny with 10^6-wide layers: about 3 x 10^13 parameters, far past any target, refused before tracing.
HUGE = ["--recipe", "lm-tiny", "model.d_model=1000000", "model.heads=4"]


def check_refused_plan(plan: dict, chips: int, hbm_gib: float) -> None:
    assert (plan["fits"], plan["precheck"], plan["chips"]) == (False, True, chips)
    assert plan["hbm_bytes"] == pytest.approx(hbm_gib * GIB)  # per chip
    assert plan["peak_bytes"] > 100 * plan["hbm_bytes"]  # per chip: the lower bound's total spread evenly
    assert f"over {chips} chips" in plan["notes"][0] and "nothing was traced or compiled" in plan["notes"][0]
    assert "model.remat=full" in plan["fix"] and "systolic plan lm --target <slice> --search" in plan["fix"]
    assert "needs at least" in plan["out_of_memory"] and plan["step_time_s"] is None and plan["params"] is None


def test_plan_json_of_a_config_past_the_lower_bound_is_a_plan_that_does_not_fit():
    code, out, err = call("plan", "lm", *HUGE, "--target", "h100", "--mesh", "fsdp=8", "--json")
    assert code == 0, err
    check_refused_plan(json.loads(out), chips=8, hbm_gib=80)


def test_plan_without_json_keeps_the_paragraph_and_exit_2():
    code, out, err = call("plan", "lm", *HUGE, "--target", "h100", "--mesh", "fsdp=8")
    assert code == 2 and out == ""
    paragraph = err.split("error: ", 1)[1]
    assert paragraph.startswith("Training this lm") and "needs at least" in paragraph and "model.remat=full" in paragraph


@pytest.mark.tpu_aot
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed: no TPU topology")
def test_plan_json_for_a_tpu_slice_says_it_does_not_fit():
    # As issue 41's llama-1b with model.layers=64 on v5e-8 (363.5 GiB needed, 126 available), with lm-tiny.
    code, out, err = call("plan", "lm", *HUGE, "--target", "v5e-8", "--mesh", "fsdp=8", "--json")
    assert code == 0, err
    check_refused_plan(json.loads(out), chips=8, hbm_gib=15.75)
