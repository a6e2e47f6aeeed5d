"""The splash attention kernel's tiles per chip and head size: data measured on the chip, not guesses.

Each row names the command that measured it. A tile is capped by the sequence (and must divide it: the largest
of 512, 256, 128 that divides T otherwise, `splash_block` in attention.py). `fused_backward`: one backward kernel
computes dq, dk and dv from one pass over the softmax (the unfused pair recomputes it twice); with 64-wide heads the
kernel is bound by the softmax's elementwise work, not the matrix unit, so that pass is most of its time.
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


DEFAULT = SplashTiles(512, 512, 512, fused_backward=False, measured="")  # MaxText's default tiles; unmeasured chips

# (device_kind, head_dim) -> tiles
TUNED: dict[tuple[str, int], SplashTiles] = {}


def tiles_for(head_dim: int) -> SplashTiles:
    """The tiles for the chip the traced program is compiled for (the mesh's devices; compile-only ones included)."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    kind = device.device_kind if device is not None else jax.devices()[0].device_kind
    return TUNED.get((kind, head_dim), DEFAULT)
