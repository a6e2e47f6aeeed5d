"""The int8 KV pool's storage (`--kv-cache int8`): each entry of a token's row ([k | v] per key/value head, head
after head: pool.py) quantized to int8 with one float32 scale per head's key and per head's value, the int8
entries packed four to an int32 word, the scales in an array of their own:

    words  (L, pages, page_size, row / 4) int32: a row's entries in units of `unit` (512, or the row a device
           holds when that is not a multiple of 512): word j of a unit holds its entries j, j + unit / 4,
           j + unit / 2 and j + 3 unit / 4 in bytes 0 to 3;
    scales (L, pages, row / hd, page_size) float32: the scale of column c (head c // 2's key, c even, or value) of
           the token at each position, positions minor-most.

Why words: a TPU tiles int8 32 rows deep, and the TPU compiler copied a pool of int8 rows into 8-row tiles and back
twice a step; 32-bit words are written in place, and the kernel takes a byte of a 128-word tile with two shifts.
Why positions minor-most: a page's (2 KV, page_size) scales are whole lane tiles at pages of 128, which the kernel
reads without a relayout (docs/paged-attention.md has the measurements). Quantization is Qwix's symmetric absmax
over each head's key (or value) x: round(x / s) with s = absmax(x) / 127.5, back within s / 2 of its value.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import qwix

UNIT = 512  # entries a 128-lane tile of words holds


@functools.partial(jax.tree_util.register_dataclass, data_fields=["words", "scales"], meta_fields=["unit"])
@dataclasses.dataclass(frozen=True)
class Int8Pool:
    """An int8 pool (or its `jax.ShapeDtypeStruct`s, or one layer's or some pages' of it): see the module."""

    words: Any  # (..., page_size, row / 4) int32
    scales: Any  # (..., row / hd, page_size) float32
    unit: int  # entries per packed unit (static)

    @property
    def shape(self) -> tuple[int, ...]:
        """The pool's shape as int8 entries: (..., page_size, row)."""
        return (*self.words.shape[:-1], 4 * self.words.shape[-1])


def packing_unit(row: int) -> int:
    """Entries per packed unit for rows of `row` entries on one device: UNIT, or the row where it is not a multiple
    of UNIT (a device must hold whole units: the head axis is split over devices by whole heads)."""
    return UNIT if row % UNIT == 0 else row


def pack(q: jax.Array, unit: int) -> jax.Array:
    """int8 entries (..., row) -> int32 words (..., row / 4), the module's packing."""
    row = q.shape[-1]
    x = q.reshape(*q.shape[:-1], row // unit, 4, unit // 4).astype(jnp.int32) & 0xFF  # (..., units, 4, unit / 4)
    words = x[..., 0, :] | (x[..., 1, :] << 8) | (x[..., 2, :] << 16) | (x[..., 3, :] << 24)
    return words.reshape(*q.shape[:-1], row // 4)


def unpack(words: jax.Array, unit: int) -> jax.Array:
    """int32 words (..., row / 4) -> their int8 entries (..., row) as int32 in [-128, 127]: byte k of a word is
    (word << (24 - 8k)) >> 24 (an arithmetic shift: its sign)."""
    n = words.shape[-1]
    x = words.reshape(*words.shape[:-1], 4 * n // unit, unit // 4)
    return jnp.stack([(x << (24 - 8 * k)) >> 24 for k in range(4)], axis=-2).reshape(*words.shape[:-1], 4 * n)


def _absmax(x: jax.Array, width: int) -> qwix.QArray:
    """x (..., W) -> int8 values (..., W) and a float32 scale per `width` entries of each row (..., W / width).
    In float32 whatever x's dtype: bfloat16's 8-bit mantissa would round x / scale once more before the rounding to
    an integer."""
    return qwix.quantize(x.astype(jnp.float32), jnp.int8, channelwise_axes=tuple(range(x.ndim - 1)),
                         tiled_axes={x.ndim - 1: width})


def quantize(x: jax.Array, width: int, unit: int) -> tuple[jax.Array, jax.Array]:
    """Rows x (..., row) -> (words (..., row / 4) int32, scales (..., row / width) float32): a scale per `width`
    entries (a head's key or value)."""
    q = _absmax(x, width)
    return pack(q.qvalue, unit), q.scale


def as_stored(x: jax.Array) -> jax.Array:
    """x (..., hd) as an int8 pool gives it back (quantized and dequantized), in x's dtype."""
    return qwix.dequantize(_absmax(x, x.shape[-1])).astype(x.dtype)


def dequantize(words: jax.Array, scales: jax.Array, unit: int) -> jax.Array:
    """words (..., row / 4) and their rows' scales (..., row / width) -> the rows (..., row) in float32."""
    entries = unpack(words, unit).astype(jnp.float32)
    return entries * jnp.repeat(scales.astype(jnp.float32), entries.shape[-1] // scales.shape[-1], axis=-1)


def quantize_pool(pool: jax.Array, head_dim: int, unit: int | None = None) -> Int8Pool:
    """A float pool (L, pages, page_size, row) as the int8 pool stores it (unit: `packing_unit` of the row by
    default), a layer at a time (the whole pool in float32 at once need not fit)."""
    unit = unit or packing_unit(pool.shape[-1])

    def one(layer):  # (pages, page_size, row)
        words, scales = quantize(layer, head_dim, unit)
        return words, jnp.swapaxes(scales, -1, -2)

    words, scales = jax.lax.map(one, pool)
    return Int8Pool(words, scales, unit)
