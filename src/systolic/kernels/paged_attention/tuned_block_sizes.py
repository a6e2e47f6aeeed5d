"""The paged attention family's block sizes per chip and head width: data measured on the chip, not guesses.

Each row names the command and figure behind it (docs/paged-attention.md has the history). `blocks_for` picks the
row for the chip the traced program is compiled for (the mesh's devices, compile-only ones included), then the
chip's default row, then DEFAULT (the same numbers, unmeasured, for chips never timed and for the interpreter).
"""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class PagedBlocks:
    block_keys: int  # keys a token reads per DMA'd block (whole pages of them)
    tokens_per_block: int  # tokens a grid step (a block of queries in VMEM)
    fused_heads: int  # heads of 64 whose [k | v] tiles meet the MXU in one matmul (block-diagonal queries)
    measured: str  # the command and figure behind the row ("" for the untuned default)


DEFAULT = PagedBlocks(256, 32, 8, measured="")

V5E = "TPU v5 lite"
# (device_kind, head_dim) -> blocks; (device_kind, None): the chip's blocks for other head widths.
TUNED: dict[tuple[str, int | None], PagedBlocks] = {
    (V5E, 64): PagedBlocks(256, 32, 8, measured=(
        "llama-1b's 16 layers, 256 sequences x 256 positions, 2026-12-07: 8 heads fused 4.81 ms against 8.70 one "
        "head at a time; 8 and 128 tokens a grid step the same as 32; the kernel 3.50 ms over int8 pages, 4.22 over "
        "bfloat16 pages of 16 (python benchmarks/kernels/paged_attention.py --rows llama-1b:256:256 --kv-cache int8)")),
    (V5E, None): PagedBlocks(256, 32, 8, measured="heads of 64's blocks; block_keys not yet swept on the chip"),
}

# The plain-JAX path's keys a token reads per iteration of its online softmax, by platform (rounded to whole pages):
# on XLA:CPU a block that stays in cache is worth more iterations: 16 keys ran 16 decodes over 600 positions 2-3x
# faster than 64 or 128 (heads of a 256-wide model); an accelerator prefers fewer, larger blocks.
REFERENCE_KEYS_PER_BLOCK = {"cpu": 16}
REFERENCE_KEYS_DEFAULT = 256

# Tokens whose int8 scales one XLA scatter writes (off a TPU, or in pages the kernels do not take): compiled for a
# v5e, a scatter of 768 or fewer was written in place, 1,024 by copying the whole scales array into another layout
# a layer at a time (llama-1b w8a8 on the v5e: 270 ms a 1,024-token step).
SCALE_WRITES = 512


def blocks_for(head_dim: int, device_kind: str | None = None) -> PagedBlocks:
    """The blocks for `device_kind` (default: the chip the traced program is compiled for) and `head_dim`."""
    kind = device_kind or _compiled_kind()
    return TUNED.get((kind, head_dim)) or TUNED.get((kind, None), DEFAULT)


def _compiled_kind() -> str:
    device = jax.sharding.get_abstract_mesh().abstract_device
    return device.device_kind if device is not None else jax.devices()[0].device_kind
