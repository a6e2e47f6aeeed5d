"""50 training steps of the tiny lm on the chip against the same 50 on the host's CPU, in float32 at 'highest' matmul
precision (the chip's default float32 product takes one bf16 pass, about three digits), XLA attention on both: the
loss curves agree to a relative 1e-3 at every step (measured on the chip: recorded as the `max_relative_diff`
property in the junit XML)."""

import jax
import numpy as np
import pytest

pytestmark = pytest.mark.tpu

STEPS = 50


def test_fifty_steps_on_the_chip_follow_the_cpu(tiny_lm, chip, host, one_device_mesh, record_property):
    cfg = tiny_lm.make_cfg("model.dtype=float32", "model.attention=xla", f"train.steps={STEPS}")
    with jax.default_matmul_precision("highest"):
        _, _, on_chip = tiny_lm.run_steps(cfg, one_device_mesh(chip), STEPS)
        with jax.default_device(host):
            _, _, on_host = tiny_lm.run_steps(cfg, one_device_mesh(host), STEPS)
    on_chip, on_host = np.array(on_chip), np.array(on_host)
    diff = float(np.max(np.abs(on_chip - on_host) / np.abs(on_host)))
    record_property("max_relative_diff", f"{diff:.2e}")
    record_property("losses", f"first {on_host[0]:.4f}, last {on_host[-1]:.4f}")
    assert on_host[-1] < on_host[0] - 0.5, f"the model did not learn: {on_host[0]:.3f} -> {on_host[-1]:.3f}"
    np.testing.assert_allclose(on_chip, on_host, rtol=1e-3)
