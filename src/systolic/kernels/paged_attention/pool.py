"""The paged KV pool's layout: one array for all layers, (L, pages, page_size, row), a token's row holding each
key/value head's key and value side by side ([k | v]), head after head (MLA: its one latent row); in the model's
compute dtype (`--kv-cache auto`) or as int8 words and float32 scales (`--kv-cache int8`, int8_pool.py).

Why one row a token: a TPU tiles an array's two minor axes by (8 or 16) x 128, so a page is a dense (page_size, row)
block for every head count and width our families use (64, 128, 256), one DMA for the kernel, and the compiled step
writes the donated pool in place (the layouts measured against it: docs/paged-attention.md). Why one array for the
layers: the layers' scan carries it whole, so no layer's pool is sliced out and copied. Page NULL_PAGE belongs to
no sequence: padding tokens write there and unused page-table entries point at it, so every index is valid.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from systolic.errors import UserError
from systolic.kernels.paged_attention import KV_CACHES
from systolic.kernels.paged_attention.int8_pool import Int8Pool, packing_unit
from systolic.kernels.paged_attention.kernel import INT8_PAGE

NULL_PAGE = 0
SCALE_DTYPE = jnp.float32
DEFAULT_PAGE_SIZE = 16

# The pool: (L, pages, page_size, row) in the compute dtype, or an Int8Pool of those rows' int8 entries packed in
# int32 words and float32 scales (L, pages, scales a row, page_size).
Pool = jax.Array | Int8Pool


@dataclasses.dataclass(frozen=True)
class PoolRow:
    """What the pool holds a token and layer: `width` entries (key/value heads x 2 x head_dim, or MLA's latent and
    RoPE key), `scales` scale columns of them in an int8 pool (two a key/value head, one for a latent row), in
    `dtype` (the compute dtype), for `layers` layers."""

    layers: int
    width: int
    scales: int
    dtype: Any


def pool_shape(row: PoolRow, pages: int, page_size: int, kv_cache: str, split: int = 1) -> Pool:
    """The pool's arrays as `jax.ShapeDtypeStruct`s: one (L, pages, page_size, width) in the compute dtype, or an
    Int8Pool of the rows' int8 entries as int32 words (L, pages, page_size, width / 4) and float32 scales (L, pages,
    scales, page_size), packed for rows split over `split` devices (int8_pool.py)."""
    check_kv_cache(kv_cache)
    shape = (row.layers, pages, page_size, row.width)
    if kv_cache == "auto":
        return jax.ShapeDtypeStruct(shape, row.dtype)
    if row.width % (4 * split):
        raise UserError(f"--kv-cache int8 packs four int8 entries a word: a token's row of {row.width} entries (key/"
                        f"value heads x 2 x head_dim{f', over {split} devices' if split > 1 else ''}) is not a "
                        f"multiple of {4 * split}. Fix: --kv-cache auto, or a head_dim that is even.")
    return Int8Pool(jax.ShapeDtypeStruct((*shape[:-1], row.width // 4), jnp.int32),
                    jax.ShapeDtypeStruct((*shape[:2], row.scales, page_size), SCALE_DTYPE),
                    packing_unit(row.width // split))


def token_bytes(row: PoolRow, kv_cache: str) -> int:
    """Bytes one cached token takes in the pool, all layers, keys and values (and their scales) together."""
    one = pool_shape(row, 1, 1, kv_cache)
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(one))


def default_page_size(kv_cache: str, platform: str) -> int:
    """Tokens per page when --page-size is not given: 16, or for an int8 pool on a TPU INT8_PAGE (the kernel reads
    an int8 page and its scales as whole tiles; smaller pages take the plain path)."""
    return INT8_PAGE if kv_cache == "int8" and platform == "tpu" else DEFAULT_PAGE_SIZE


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


def heads_split(sharding: jax.sharding.Sharding, width: int) -> int:
    """Devices a pool's rows of `width` entries split over under `sharding` (each holding whole heads)."""
    return width // sharding.shard_shape((1, 1, 1, width))[3]


def check_kv_cache(kv_cache: str) -> None:
    if kv_cache not in KV_CACHES:
        raise UserError(f"--kv-cache {kv_cache!r} is not a KV cache type. Expected one of {', '.join(KV_CACHES)} "
                        "(auto: the model's compute dtype). Fix: e.g. --kv-cache int8.")
