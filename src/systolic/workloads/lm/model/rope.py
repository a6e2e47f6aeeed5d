"""Rotary position embeddings in Hugging Face Llama's rotate-half layout, with the RoPE scalings of the open model
families (`model.rope_scaling`): linear (position interpolation), llama3 (Llama 3.1+) and YaRN. With
`model.rope_local_theta` (Gemma 3) the sliding-window layers rotate by their own base, unscaled.

The inverse frequencies are a function of the config alone, so they are computed once per trace on the host, in
NumPy float32 with the operations of transformers' `modeling_rope_utils.py` in the same order: an imported model
rotates by exactly the frequencies it was trained with (a 1-ulp difference in a frequency grows with the position).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from systolic.workloads.lm.model.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig, *, local: bool = False) -> tuple[np.ndarray, float]:
    """(inv_freq float32 (hd/2,), attention_scaling): the rotation speed of each pair of dimensions, and the factor
    on cos and sin (1.0 except for YaRN); `local`: of the sliding layers, which differ with model.rope_local_theta."""
    dim, theta, scaling = cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling
    if local and cfg.rope_local_theta:
        theta, scaling = cfg.rope_local_theta, dataclasses.replace(scaling, type="none")
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)  # (hd/2,) float32, as torch's
    # torch raises a Python float to a float32 tensor's powers in double precision, then rounds to float32.
    pos_freqs = (theta ** exponents.astype(np.float64)).astype(np.float32)  # (hd/2,)
    inv_freq = 1 / pos_freqs
    if scaling.type == "none":
        return inv_freq, 1.0
    if scaling.type == "linear":
        return inv_freq / np.float32(scaling.factor), 1.0
    if scaling.type == "llama3":
        return _llama3(inv_freq, cfg), 1.0
    assert scaling.type == "yarn", scaling.type
    return _yarn(pos_freqs, cfg)


def _llama3(inv_freq: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """Llama 3.1's scaling: wavelengths longer than original / low_freq_factor are divided by factor, shorter than
    original / high_freq_factor kept, and those in between blended linearly in original / wavelength."""
    s = cfg.rope_scaling
    factor, low, high, original = np.float32(s.factor), s.low_freq_factor, s.high_freq_factor, s.original_max_seq_len
    low_freq_wavelen, high_freq_wavelen = original / low, original / high
    # torch computes `scalar / tensor` as reciprocal(tensor) * scalar: the same here, to the last bit.
    wavelen = (1 / inv_freq) * np.float32(2 * math.pi)  # (hd/2,)
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = ((1 / wavelen) * np.float32(original) - np.float32(low)) / np.float32(high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(pos_freqs: np.ndarray, cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """YaRN: dimensions that turn more than beta_fast times within the original context keep their frequency
    (extrapolation), those that turn fewer than beta_slow times are divided by factor (interpolation), with a linear
    ramp over the dimensions in between; cos and sin are scaled by attention_factor (the paper's sqrt(1/t))."""
    s = cfg.rope_scaling
    dim, theta, factor = cfg.rope_dim, cfg.rope_theta, s.factor

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times in the original context
        return dim * math.log(s.original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers does: no division by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)  # (hd/2,)
    extrapolation_weight = 1 - ramp
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (np.float32(factor) * pos_freqs)
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    scale = s.attention_factor or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return inv_freq.astype(np.float32), float(scale)


def rope_tables(positions: jax.Array, cfg: ModelConfig, *, local: bool = False) -> tuple[jax.Array, jax.Array]:
    """cos and sin of positions (B, T) (B may be 1: every row alike), each (B, T, hd), in the rotate-half layout
    of Hugging Face Llama (hd: model.rope_dim), scaled as `model.rope_scaling` says (`local`: the sliding layers'
    tables)."""
    inv_freq, scale = inverse_frequencies(cfg, local=local)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # (B, T, hd/2)
    angles = jnp.concatenate([angles, angles], axis=-1)  # (B, T, hd)
    if scale == 1.0:
        return jnp.cos(angles), jnp.sin(angles)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotates x (B, T, N, hd) by position: x*cos + rotate_half(x)*sin, in float32."""
    cos, sin = rope[0][:, :, None, :], rope[1][:, :, None, :]  # (B, T, 1, hd)
    h = x.astype(jnp.float32)
    x1, x2 = jnp.split(h, 2, axis=-1)  # (B, T, N, hd/2) each
    rotated = jnp.concatenate([-x2, x1], axis=-1)  # (B, T, N, hd)
    return (h * cos + rotated * sin).astype(x.dtype)
