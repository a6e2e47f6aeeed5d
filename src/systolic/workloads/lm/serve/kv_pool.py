"""The paged KV pool's storage and size: keys and values in the model's compute dtype (`--kv-cache auto`, the
default), or in int8 with one float32 scale per (token, key/value head) (`--kv-cache int8`).

int8 is Qwix's symmetric absmax quantization over head_dim (`qwix.quantize(x, jnp.int8, channelwise_axes=...)`): one
head's key (or value) x is stored as round(x / s) with s = absmax(x) / 127.5, so every element comes back within
s / 2 = absmax(x) / 255 of its value. The pool is then a `qwix.QArray`: values (L, pages, page_size, KV * 2 * hd)
int8 beside scales (L, pages, page_size, KV * 2) float32, the float pool's layout with a scale for each head's key
and one for its value, so pages, page tables and the head axis's sharding are the same. paged_attention.py quantizes what it
writes and dequantizes the pages it reads. A cached token then takes hd + 4 bytes per head, keys and values and layer,
where bfloat16 takes 2 * hd and float32 4 * hd: at hd = 64, 0.53x of bfloat16's bytes and 0.27x of float32's, so
that many times as many pages fit in the same memory.

`pool_shape` and `token_bytes` are what `systolic plan` needs to compile the engine's step for a pool it does not
allocate, and to count its bytes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import qwix

from systolic.errors import UserError
from systolic.workloads.lm.commands import KV_CACHES
from systolic.workloads.lm.model.config import ModelConfig
from systolic.workloads.lm.model.layers import resolve_dtype
from systolic.workloads.lm.serve.paged_attention import Pool

SCALE_DTYPE = jnp.float32


def pool_shape(model: ModelConfig, pages: int, page_size: int, kv_cache: str) -> Pool:
    """The pool's arrays as `jax.ShapeDtypeStruct`s: one (L, pages, page_size, KV * 2 * hd) in the compute dtype
    (a token's row: each head's key and value side by side, head after head: paged_attention.py), or a QArray of
    int8 values of that shape and float32 scales (L, pages, page_size, KV * 2)."""
    _check(kv_cache)
    if model.mla.kv_lora_rank:  # MLA: one row of latent and RoPE key per token (lm/model/mla.py)
        shape, scales = (model.layers, pages, page_size, model.mla.cache_width), 1
    else:
        shape, scales = (model.layers, pages, page_size, model.n_kv_heads * 2 * model.d_head), 2 * model.n_kv_heads
    if kv_cache == "auto":
        return jax.ShapeDtypeStruct(shape, resolve_dtype(model.dtype))
    return qwix.QArray(jax.ShapeDtypeStruct(shape, jnp.int8),
                       jax.ShapeDtypeStruct((*shape[:-1], scales), SCALE_DTYPE), qtype=jnp.int8)


def token_bytes(model: ModelConfig, kv_cache: str) -> int:
    """Bytes one cached token takes in the pool, all layers, keys and values (and their scales) together: the
    formula 2 x layers x kv_heads x head_dim x bytes, plus 2 x layers x kv_heads x 4 for int8's scales; with MLA
    layers x (kv_lora_rank + qk_rope_head_dim) x bytes, plus layers x 4."""
    one = pool_shape(model, 1, 1, kv_cache)
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(one))


def make_pool(shape: Pool, sharding: jax.sharding.Sharding | None = None) -> Pool:
    """The zeroed pool of `pool_shape`'s shape, created in place on its devices: each of its arrays laid out as
    `sharding` says (the head axis split over the mesh, or one device)."""
    return jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shape),
                   out_shardings=pool_shardings(shape, sharding))()


def pool_shardings(shape: Pool, sharding: jax.sharding.Sharding | None) -> Any:
    """`sharding` for each array of the pool (an int8 pool's scales split as its values: same rank, same head
    axis), as a tree of the pool's structure for jit's in/out shardings; None: wherever jax puts it."""
    return None if sharding is None else jax.tree.map(lambda _: sharding, shape)


def _check(kv_cache: str) -> None:
    if kv_cache not in KV_CACHES:
        raise UserError(f"--kv-cache {kv_cache!r} is not a KV cache type. Expected one of {', '.join(KV_CACHES)} "
                        "(auto: the model's compute dtype). Fix: e.g. --kv-cache int8.")
