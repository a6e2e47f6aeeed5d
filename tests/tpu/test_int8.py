"""An int8 training step (model.quant=int8, lm/model/quant.py) on the chip: it runs, and the program the chip runs
multiplies int8 by int8 in the projections (s8 x s8 dots in the compiled HLO), where a model without it has none."""

import jax
import numpy as np
import pytest

from hlo import int8_dots

from systolic.workloads.lm.entry import plan

pytestmark = pytest.mark.tpu

PROJECTIONS = 7  # wq, wk, wv, wo, w_gate, w_up, w_down: each block's forward pass, the layers scanned


def test_int8_train_step_runs_on_the_chip_with_int8_dots(tiny_lm, chip, one_device_mesh, record_property):
    # Qwix's backward pass multiplies int32 products by float scales, traced under the caller's promotion: standard,
    # as test_qat.py sets for quantization-aware training (users run standard).
    with jax.numpy_dtype_promotion("standard"):
        counts, losses = _compile_and_run(tiny_lm, chip, one_device_mesh)
    record_property("s8_dots", str(counts))
    assert counts["none"] == 0 and counts["int8"] >= PROJECTIONS, counts
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses


def _compile_and_run(tiny_lm, chip, one_device_mesh) -> tuple[dict[str, int], list[float]]:
    """The s8 x s8 dots of the compiled train step without and with model.quant=int8, and 3 steps' losses with."""
    counts = {}
    for q in ("none", "int8"):
        cfg = tiny_lm.make_cfg(f"model.quant={q}", "model.scan_layers=true", "model.dtype=bfloat16", "model.attention=xla")
        hlo = plan(cfg, [chip]).lowered.compile().as_text()
        counts[q] = int8_dots(hlo)
    _, _, losses = tiny_lm.run_steps(cfg, one_device_mesh(chip), 3)
    return counts, losses
