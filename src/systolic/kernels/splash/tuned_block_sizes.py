"""The splash attention kernel's tiles per chip and head size: data measured on the chip, not guesses.

Each row names the command that measured it. A tile is capped by the sequence (and must divide it: the largest
of 512, 256, 128 that divides T otherwise, `splash_block` in lm/model/attention.py). `fused_backward`: one backward
kernel computes dq, dk and dv from one pass over the softmax (the unfused pair recomputes it twice); with 64-wide
heads the kernel is bound by the softmax's elementwise work, not the matrix unit, so that pass is most of its time.
"""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class SplashTiles:
    block_q: int
    block_kv: int
    block_kv_compute: int
    fused_backward: bool
    measured: str  # the command and figure behind the row ("" for the untuned default)
    tflops: float | None = None  # forward + backward at these tiles, model FLOPs (causal half) per second / 1e12


DEFAULT = SplashTiles(512, 512, 512, fused_backward=False, measured="")  # MaxText's default tiles; unmeasured chips

# (device_kind, head_dim, seq_len) -> tiles; (device_kind, None, None): the chip's tiles for other shapes. Measured by
# `python benchmarks/kernels/splash_blocks.py` on the lent v5e chip, 2026-12-06 (jax 0.10.2): forward + backward of the
# training rows' attention, bfloat16.
V5E = "TPU v5 lite"
TUNED: dict[tuple[str, int | None, int | None], SplashTiles] = {
    (V5E, 64, 1024): SplashTiles(1024, 1024, 512, fused_backward=True, tflops=20.1, measured=(
        "32 x 1024, 12 heads: 7.69 ms (20.1 TFLOP/s); q512 kv512 c256 fused 8.53 ms, q1024 kv1024 c1024 fused 7.75, "
        "q128 fused 28.74")),
    (V5E, 64, 2048): SplashTiles(512, 512, 512, fused_backward=True, tflops=27.5, measured=(
        "4 x 2048, 32 heads (8 kv): 7.48 ms (27.5 TFLOP/s); unfused 8.68 ms, q256 fused 13.71, XLA's attention 23.16")),
    # Not timed alone: the rate is what the llama 8-layer row with 16 heads of 128 leaves for the kernel once its
    # matmuls take the chip's calibrated time (plan/targets.py; docs/planning.md "The planner against the chip").
    (V5E, 128, 2048): SplashTiles(512, 512, 512, fused_backward=True, tflops=90.0, measured=(
        "4 x 2048, 16 heads of 128 (8 kv): inferred from the training row's 208.3 ms "
        "(benchmarks/harness/tpu.sh train)")),
    (V5E, None, None): SplashTiles(512, 512, 512, fused_backward=True, measured="the 2048-token row's tiles"),
}


def tiles_for(head_dim: int, seq_len: int) -> SplashTiles:
    """The tiles for the chip the traced program is compiled for (the mesh's devices; compile-only ones included)."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    kind = device.device_kind if device is not None else jax.devices()[0].device_kind
    return TUNED.get((kind, head_dim, seq_len)) or TUNED.get((kind, None, None), DEFAULT)
