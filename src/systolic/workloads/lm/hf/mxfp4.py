"""MXFP4 weights (the OCP Microscaling spec's FP4 format, as GPT-OSS checkpoints ship their experts) to float32.

A checkpoint with `quantization_config.quant_method = "mxfp4"` stores an expert matrix `X` (E, in, out) as two
tensors: `X_blocks` (E, out, in / 32, 16) uint8 and `X_scales` (E, out, in / 32) uint8. Each block holds 32
consecutive values along `in` as 4-bit E2M1 codes, two per byte, the low nibble first; each block shares one
E8M0 scale, a power of two 2^(byte - 127). An E2M1 code is a sign bit and three magnitude bits: 0, 0.5, 1, 1.5, 2,
3, 4, 6. Dequantizing gives (E, out, in), transposed to the (E, in, out) layout of transformers' GptOssExperts.
"""

from __future__ import annotations

import numpy as np

# The 16 E2M1 codes' values: the magnitudes 0, 0.5, ..., 6, then the same negated (sign bit 0x8).
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
BLOCK = 32  # values per scale
SCALE_BIAS = 127  # E8M0: the byte b means 2^(b - 127)


def quantized_names(name: str) -> tuple[str, str]:
    """The two stored tensors (blocks, scales) of the MXFP4 tensor `name`."""
    return f"{name}_blocks", f"{name}_scales"


def dequantized_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The float tensor's shape (E, in, out) for blocks of shape (E, out, in / 32, 16)."""
    *lead, out, groups, half = blocks_shape
    return (*lead, groups * half * 2, out)


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks (E, out, G, 16) uint8 and scales (E, out, G) uint8 -> float32 (E, G * 32, out). Exact: every value is
    a code's value times a power of two."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.dtype}{list(blocks.shape)} and scales {scales.dtype}"
                         f"{list(scales.shape)}: expected uint8 (..., G, 16) and uint8 (..., G)")
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # (E, out, G, 16, 2): low nibble first
    values = E2M1[codes].reshape(*blocks.shape[:-1], 2 * blocks.shape[-1])  # (E, out, G, 32)
    exponents = scales.astype(np.int32) - SCALE_BIAS  # (E, out, G)
    values = np.ldexp(values, exponents[..., None])  # (E, out, G, 32)
    return np.swapaxes(values.reshape(*blocks.shape[:-2], -1), -1, -2)  # (E, G * 32, out)
