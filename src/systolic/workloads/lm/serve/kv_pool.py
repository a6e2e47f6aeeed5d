"""The paged KV pool's storage and size: keys and values in the model's compute dtype (`--kv-cache auto`, the
default), or in int8 with one float32 scale per (token, key/value head) (`--kv-cache int8`).

int8 (int8_pool.py) is Qwix's symmetric absmax quantization of each head's key and value, its entries packed four
to an int32 word beside float32 scales (L, pages, KV * 2, page_size); pages and page tables are the float pool's.
On a TPU an int8 pool's pages hold 128 tokens (`default_page_size`): the Pallas kernel reads a page's scales as
whole lane tiles. paged_attention.py quantizes what it writes and dequantizes the pages it reads. A cached token then
takes hd + 4 bytes per head, keys and values and layer, where bfloat16 takes 2 * hd and float32 4 * hd: at hd = 64,
0.53x of bfloat16's bytes and 0.27x of float32's, so that many times as many pages fit in the same memory.

`pool_shape` and `token_bytes` are what `systolic plan` needs to compile the engine's step for a pool it does not
allocate, and to count its bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from systolic.errors import UserError
from systolic.kernels import paged_attention as kernel_lib
from systolic.workloads.lm.commands import KV_CACHES
from systolic.workloads.lm.model.config import ModelConfig
from systolic.workloads.lm.model.layers import resolve_dtype
from systolic.workloads.lm.serve.int8_pool import Int8Pool, packing_unit
from systolic.workloads.lm.serve.paged_attention import Pool

SCALE_DTYPE = jnp.float32


def pool_shape(model: ModelConfig, pages: int, page_size: int, kv_cache: str, split: int = 1) -> Pool:
    """The pool's arrays as `jax.ShapeDtypeStruct`s: one (L, pages, page_size, KV * 2 * hd) in the compute dtype
    (a token's row: each head's key and value side by side, head after head: paged_attention.py), or an Int8Pool of
    that row's int8 entries as int32 words (L, pages, page_size, KV * 2 * hd / 4) and float32 scales (L, pages,
    KV * 2, page_size), packed for rows split over `split` devices (int8_pool.py)."""
    _check(kv_cache)
    if model.mla.kv_lora_rank:  # MLA: one row of latent and RoPE key per token (lm/model/mla.py)
        shape, scales = (model.layers, pages, page_size, model.mla.cache_width), 1
    else:
        shape, scales = (model.layers, pages, page_size, model.n_kv_heads * 2 * model.d_head), 2 * model.n_kv_heads
    if kv_cache == "auto":
        return jax.ShapeDtypeStruct(shape, resolve_dtype(model.dtype))
    row = shape[-1]
    if row % (4 * split):
        raise UserError(f"--kv-cache int8 packs four int8 entries a word: a token's row of {row} entries (key/value "
                        f"heads x 2 x head_dim{f', over {split} devices' if split > 1 else ''}) is not a multiple "
                        f"of {4 * split}. Fix: --kv-cache auto, or a head_dim that is even.")
    return Int8Pool(jax.ShapeDtypeStruct((*shape[:-1], row // 4), jnp.int32),
                    jax.ShapeDtypeStruct((*shape[:2], scales, page_size), SCALE_DTYPE), packing_unit(row // split))


def default_page_size(kv_cache: str, platform: str) -> int:
    """Tokens per page when --page-size is not given: 16, or for an int8 pool on a TPU 128 (`INT8_PAGE`: the
    Pallas kernel reads an int8 page and its scales as whole tiles; smaller pages take the plain path)."""
    return kernel_lib.INT8_PAGE if kv_cache == "int8" and platform == "tpu" else 16


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
    """`sharding` for each array of the pool, as a tree of the pool's structure for jit's in/out shardings (an int8
    pool's words split as the row, their scales over the same devices by their head axis, the third); None: wherever
    jax puts it."""
    if sharding is None or not isinstance(shape, Int8Pool):
        return sharding
    scales = sharding
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (4 - len(sharding.spec))
        scales = NamedSharding(sharding.mesh, PartitionSpec(*spec[:2], spec[3], spec[2]))
    return dataclasses.replace(shape, words=sharding, scales=scales)


def heads_split(sharding: jax.sharding.Sharding, row: int) -> int:
    """Devices a pool's rows of `row` entries split over under `sharding` (each holding whole heads)."""
    return row // sharding.shard_shape((1, 1, 1, row))[3]


def _check(kv_cache: str) -> None:
    if kv_cache not in KV_CACHES:
        raise UserError(f"--kv-cache {kv_cache!r} is not a KV cache type. Expected one of {', '.join(KV_CACHES)} "
                        "(auto: the model's compute dtype). Fix: e.g. --kv-cache int8.")
