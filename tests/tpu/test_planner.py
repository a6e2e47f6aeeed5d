"""`systolic plan --target v5e-1` against the chip it plans for: the expected step time (the roofline times the
chip's calibration, plan/targets.py) within 20% of the step `systolic bench` measures, and the planned peak memory
within 10% of the compiled step's on the chip. A 4-layer llama-1b at 4 x 2048 with remat=dots: the training rows'
shape, small enough to compile twice in a test."""

import pytest

from systolic import config as config_lib
from systolic import workloads
from systolic.engine.bench import benchmark
from systolic.plan import targets
from systolic.plan.planner import plan_step
from systolic.workloads.lm.config import LMConfig
from systolic.workloads.lm.entry import build_bench_task

pytestmark = pytest.mark.tpu

OVERRIDES = ["model.layers=4", "train.batch_size=4", "model.remat=dots", "data.max_bytes=3000000"]


def test_plan_for_v5e_1_is_within_its_stated_error_of_the_chip(chip, record_property):
    if chip.platform != "tpu":
        pytest.skip("compares the plan with a TPU's measured step: the CPU stand-in says nothing of it")
    cfg, _ = config_lib.load(LMConfig, "llama-1b", OVERRIDES, "lm-tiny", "lm")
    plan = plan_step("lm", workloads.get("lm").command("plan"), cfg, targets.resolve("v5e-1", mesh_devices=1),
                     mesh="data=1")
    with build_bench_task(cfg) as task:
        measured = benchmark(task, steps=9)
    time_error = plan.expected_step_time_s / measured.step_time_s - 1
    memory_error = plan.peak_bytes / measured.peak_memory_bytes - 1
    record_property("step ms planned / measured", f"{plan.expected_step_time_s * 1e3:.1f} / "
                                                  f"{measured.step_time_s * 1e3:.1f}")
    record_property("peak GiB planned / measured", f"{plan.peak_bytes / 2**30:.2f} / "
                                                   f"{measured.peak_memory_bytes / 2**30:.2f}")
    assert abs(time_error) <= 0.20, (plan.expected_step_time_s, measured.step_time_s, plan.calibration)
    assert abs(memory_error) <= 0.10, (plan.peak_bytes, measured.peak_memory_bytes)
