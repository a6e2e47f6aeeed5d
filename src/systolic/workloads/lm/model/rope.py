"""Rotary position embeddings in Hugging Face Llama's rotate-half layout, with the RoPE scalings of the open model
families (`model.rope_scaling`): linear (position interpolation), llama3 (Llama 3.1+), YaRN and LongRoPE (Phi-3). With
`model.rope_local_theta` (Gemma 3) the sliding-window layers rotate by their own base, unscaled; with
`model.partial_rotary_factor` (Phi-4-mini) only the first `d_rope` dimensions of each head rotate.

LongRoPE picks its set of frequencies per forward pass as transformers does: the long factors when the sequence
reaches past original_max_seq_len (its largest position + 1, per row), the short ones otherwise, for every position
of the pass. Decoding (lm/model/decode.py) gives what transformers' Phi-3 `generate` gives, which recomputes its cache
over the whole sequence at the step that takes it past original_max_seq_len (`longrope_switch_step`); so does the
inference engine (lm/serve/scheduler.py), which rotates every chunk by its sequence's known length (`extent`) and
computes a sequence's cache again when its next token takes it past the original context.

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


def inverse_frequencies(cfg: ModelConfig, *, local: bool = False, long: bool = False) -> tuple[np.ndarray, float]:
    """(inv_freq float32 (d_rope/2,), attention_scaling): the rotation speed of each pair of rotated dimensions, and
    the factor on cos and sin (1.0 except for YaRN and LongRoPE); `local`: of the sliding layers, which differ with
    model.rope_local_theta; `long`: LongRoPE's set for sequences past original_max_seq_len (else its short set)."""
    dim, theta, scaling = cfg.d_rope, cfg.rope_theta, cfg.rope_scaling
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
    if scaling.type == "longrope":
        return _longrope(pos_freqs, cfg, long)
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
    dim, theta, factor = cfg.d_rope, cfg.rope_theta, s.factor

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


def _longrope(pos_freqs: np.ndarray, cfg: ModelConfig, long: bool) -> tuple[np.ndarray, float]:
    """LongRoPE: each frequency divided by its own factor (the long or the short set); cos and sin scaled by
    attention_factor, by default sqrt(1 + ln(factor) / ln(original_max_seq_len)) (1 for factor <= 1)."""
    s = cfg.rope_scaling
    ext = np.asarray(s.long_factor if long else s.short_factor, np.float32)  # (d_rope/2,)
    scale = s.attention_factor or (math.sqrt(1 + math.log(s.factor) / math.log(s.original_max_seq_len))
                                   if s.factor > 1 else 1.0)
    return (1.0 / (ext * pos_freqs)).astype(np.float32), float(scale)


def rope_tables(positions: jax.Array, cfg: ModelConfig, *, local: bool = False,
                extent: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """cos and sin of positions (B, T) (B may be 1: every row alike), each (B, T, d_rope), in the rotate-half layout
    of Hugging Face Llama, scaled as `model.rope_scaling` says (`local`: the sliding layers' tables). LongRoPE
    takes its long set where `extent` (B or 1, T or 1), the sequence length each token decides by, passes
    original_max_seq_len; by default each row's largest position + 1."""
    inv_freq, scale = inverse_frequencies(cfg, local=local)
    inv = jnp.asarray(inv_freq)  # (d_rope/2,)
    if cfg.rope_scaling.type == "longrope" and not (local and cfg.rope_local_theta):
        if extent is None:
            extent = jnp.max(positions, axis=-1, keepdims=True) + 1  # (B or 1, 1)
        long = (extent > cfg.rope_scaling.original_max_seq_len)[..., None]  # (B or 1, T or 1, 1)
        inv = jnp.where(long, jnp.asarray(inverse_frequencies(cfg, long=True)[0]), inv)  # (B or 1, T or 1, d_rope/2)
    angles = positions.astype(jnp.float32)[..., None] * inv  # (B, T, d_rope/2)
    angles = jnp.concatenate([angles, angles], axis=-1)  # (B, T, d_rope)
    if scale == 1.0:
        return jnp.cos(angles), jnp.sin(angles)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotates x (B, T, N, hd) by position: x*cos + rotate_half(x)*sin, in float32, over the tables' first d_rope
    dimensions (the rest pass unrotated: partial RoPE).

    rotate_half is a product with a signed permutation (`_half_turn`) rather than slices of the head: on a TPU the
    halves of a 64-wide head are 32 of a vector register's 128 lanes, and the sliced float32 copies took 9% of a
    llama step (profile on the v5e chip, 2026-12-06: 28 ms of 299). One nonzero per column makes the product exact."""
    cos, sin = rope[0][:, :, None, :], rope[1][:, :, None, :]  # (B, T, 1, d_rope)
    hd, d_rope = x.shape[-1], cos.shape[-1]
    if d_rope < hd:  # the unrotated dimensions: cos 1 and sin 0
        pad = [(0, 0)] * 3 + [(0, hd - d_rope)]
        cos, sin = jnp.pad(cos, pad, constant_values=1.0), jnp.pad(sin, pad)  # (B, T, 1, hd)
    h = x.astype(jnp.float32)
    rotated = jnp.einsum("btnd,de->btne", h, _half_turn(hd, d_rope), precision=jax.lax.Precision.HIGHEST)  # [-x2, x1, 0]
    return (h * cos + rotated * sin).astype(x.dtype)


def _half_turn(hd: int, d_rope: int) -> jax.Array:
    """(hd, hd) P with x @ P = concat(-x2, x1, 0) for x = concat(x1, x2, rest), x1 and x2 d_rope/2 wide."""
    half = d_rope // 2
    p = np.zeros((hd, hd), np.float32)
    p[np.arange(half) + half, np.arange(half)] = -1.0  # output i < half: -x2[i]
    p[np.arange(half), np.arange(half) + half] = 1.0  # output half + i: x1[i]
    return jnp.asarray(p)


def rotate(x: jax.Array, rope: tuple[jax.Array, jax.Array], on: bool | jax.Array) -> jax.Array:
    """x (B, T, N, hd) rotated by `rope` on a layer that rotates (`on`: a Python bool, or traced in a scan of RoPE
    and NoPE layers, where the select keeps a NoPE layer's x bit for bit)."""
    if on is True:
        return apply_rope(x, rope)
    if on is False:
        return x
    return jnp.where(on, apply_rope(x, rope), x)



def longrope_context(cfg: ModelConfig) -> int:
    """LongRoPE's original context: a sequence of more tokens rotates by the long factors; 0 without LongRoPE."""
    return cfg.rope_scaling.original_max_seq_len if cfg.rope_scaling.type == "longrope" else 0


def longrope_switch_step(cfg: ModelConfig, prompt_len: int, new_tokens: int) -> int | None:
    """The decode step (1 ... new_tokens - 1; step i feeds the (i-1)-th new token) at which a sequence decoded from a
    prompt of prompt_len passes LongRoPE's original_max_seq_len, where transformers' Phi-3 `generate` recomputes its
    cache with the long factors; None when there is no such step (no LongRoPE, or no crossing)."""
    if not longrope_context(cfg):
        return None
    step = longrope_context(cfg) + 1 - prompt_len
    return step if 1 <= step < new_tokens else None
