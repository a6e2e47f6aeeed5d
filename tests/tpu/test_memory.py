"""What fits on the chip: the TPU compiler's own threshold (RESOURCE_EXHAUSTED when a program's temporaries exceed
the chip's bytes_limit), and a step over it ending in the one-paragraph DoesNotFit before any step runs (engine/
fit.py), not in a traceback. llama-1b cut to 8 layers at 8 x 2048: remat=except_mlp fits, remat=dots does not
(measured on the lent v5e, 2026-12-06: temporaries 12.66 GiB, and 17.75G of 15.75G)."""

import pytest

from systolic import config as config_lib
from systolic.engine import fit
from systolic.runtime.memory import DoesNotFit
from systolic.workloads.lm.config import LMConfig
from systolic.workloads.lm.entry import build_bench_task

pytestmark = pytest.mark.tpu

BASE = ["model.layers=8", "train.batch_size=8", "data.max_bytes=3000000"]


def _compile(remat: str):
    cfg, _ = config_lib.load(LMConfig, "llama-1b", [*BASE, f"model.remat={remat}"], "lm-tiny", "lm")
    with build_bench_task(cfg) as task:
        state = task.init_state()
        return fit.compile_step(task.train_step, state, next(task.data), advice="lower train.batch_size")


def test_the_chips_threshold_is_the_compilers_and_a_step_over_it_is_one_paragraph(chip, record_property):
    if chip.platform != "tpu":
        pytest.skip("the TPU compiler's threshold: the CPU stand-in has none")
    limit = chip.memory_stats()["bytes_limit"]
    fits = _compile("except_mlp")
    record_property("except_mlp arguments / temporaries GiB", f"{fits.argument_bytes / 2**30:.2f} / "
                                                              f"{fits.temp_bytes / 2**30:.2f}")
    assert fits.temp_bytes <= limit
    with pytest.raises(DoesNotFit) as refused:
        _compile("dots")
    text = str(refused.value)
    record_property("dots refused", text)
    assert "RESOURCE_EXHAUSTED" in text and "Fix: lower train.batch_size" in text and "\n" not in text.strip()
    assert refused.value.have_bytes == pytest.approx(limit, rel=0.01) and refused.value.need_bytes > limit
