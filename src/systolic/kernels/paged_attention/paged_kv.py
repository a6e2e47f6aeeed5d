"""`PagedKV`: the paged pool as one layer's attention sees it, the op both the model and the serving engine call.
`attend` writes the layer's new keys and values into the pool and attends over the pages, picking for each the
Pallas kernel (kernel.py, kv_write.py) or the plain-JAX reference (reference.py).

On a TPU (`uses_kernel`) the tokens that read pages attend through the kernel over every position up to their own,
this step's included (written to the pages first), and the fresh prompts' tokens after them through the dense chunk
attention; an int8 pool is written by DMA. Everywhere else, and for MLA's latent rows and int8 pools in pages
smaller than 128, the reference runs. Under a mesh each Pallas call runs per device in a shard_map over the heads
(a Pallas kernel is opaque to XLA's partitioner).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax.core import spmd

from systolic.kernels.paged_attention import int8_pool, kv_write, reference
from systolic.kernels.paged_attention import kernel as kernel_lib
from systolic.kernels.paged_attention.int8_pool import Int8Pool
from systolic.kernels.paged_attention.metadata import RaggedBatch
from systolic.kernels.paged_attention.pool import NULL_PAGE, Pool
from systolic.kernels.paged_attention.reference import chunk_attention, first_keys, with_sinks
from systolic.runtime.platform import compile_platform, device_platform
from systolic.runtime.sharding import logical_to_spec


class PagedKV(NamedTuple):
    """The pool handed to one layer's attention (sublayers.py's Attention): `attend` writes the layer's new keys
    and values and attends over the pages."""

    pool: Pool  # (L, pages, page_size, KV * 2 * hd)
    layer: jax.Array | int  # this layer's index into the pool
    batch: RaggedBatch
    page_tokens: int | None = None  # static: only the first this many tokens read pages (None: all)
    # (7, T): kv_write.py's run table, where it writes an int8 pool (`with_write_runs`; None: computed by
    # write_kv, or no DMA writes)
    write_runs: jax.Array | None = None

    def with_write_runs(self) -> PagedKV:
        """This PagedKV with the run table kv_write.py writes its int8 pool along, where it does: every
        layer writes the same slots, so it is computed once a step here, not in each layer (a scanned model's step,
        compiled for a v5e, sorted the slots inside the layers' loop)."""
        pool = self.pool
        # MLA's latent pool has one scale a row (its rows are written by XLA); a key/value pool two a head
        if not isinstance(pool, Int8Pool) or pool.scales.shape[-2] % 2:
            return self
        if not uses_kernel(pool, pool.shape[-1] // pool.scales.shape[-2]):
            return self
        return self._replace(write_runs=kv_write.runs(self.batch.slots, self.batch.num_tokens, pool.shape[2]))

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, *, window: int | jax.Array,
               softcap: float = 0.0, sinks: jax.Array | None = None) -> tuple[jax.Array, PagedKV]:
        """q (T, H, hd), this step's k and v (T, KV, hd) -> (out (T, H, hd), the PagedKV with k and v written)."""
        pool = write_kv(self.pool, self.layer, k, v, self.batch.slots, self.batch.num_tokens, self.write_runs)
        out = ragged_paged_attention(q, k, v, pool, self.layer, self.batch, window=window, softcap=softcap,
                                     sinks=sinks, page_tokens=self.page_tokens)
        return out, self._replace(pool=pool)

    def attend_latent(self, q: jax.Array, rows: jax.Array, *, value_dim: int,
                      scale: float) -> tuple[jax.Array, PagedKV]:
        """MLA's absorbed decode: q (T, H, C) against this step's latent rows (T, C) and the pages' -> (out (T, H,
        value_dim), the PagedKV with the rows written); the keys are the rows, the values their first value_dim
        entries, the logits scaled by `scale`."""
        pool = write_kv(self.pool, self.layer, rows[:, None], None, self.batch.slots)
        out = ragged_paged_attention(q, rows[:, None], None, pool, self.layer, self.batch, scale=scale,
                                     value_dim=value_dim, page_tokens=self.page_tokens)
        return out, self._replace(pool=pool)


def write_kv(pool: Pool, layer: jax.Array | int, k: jax.Array, v: jax.Array | None, slots: jax.Array,
             num_tokens: jax.Array | None = None, runs: jax.Array | None = None) -> Pool:
    """The pool with k and v (T, KV, hd) written at layer `layer`, slots (T,) (an int8 pool: quantized); v None:
    MLA's latent rows k (T, 1, C) alone. `num_tokens`: only the first this many are real (the rest write the null
    page, or nothing where the int8 pool is written by DMA); None: all. `runs`: kv_write.py's run table of these
    slots, where it writes the pool (None: computed here). By DMA (kv_write.py) into an int8 pool the kernel reads,
    else by XLA's scatters (reference.py)."""
    T, _, hd = k.shape
    kv = k if v is None else jnp.concatenate([k, v], axis=-1)  # (T, KV, 2hd): [k | v] per head
    kv = kv.reshape(T, -1)  # (T, KV * 2hd): a token's row
    if isinstance(pool, Int8Pool) and v is not None and uses_kernel(pool, hd):  # XLA's scatters: ~100 ns a token
        words, new = int8_pool.quantize(kv, hd, pool.unit)
        if runs is None:
            runs = kv_write.runs(slots, T if num_tokens is None else num_tokens, pool.shape[2])
        return _kernel_write(pool, layer, words, new, runs)
    return reference.write_scatter(pool, layer, kv, slots, hd)


def _kernel_write(pool: Int8Pool, layer, words: jax.Array, scales: jax.Array, runs: jax.Array) -> Int8Pool:
    """`write_kv` into an int8 pool through kv_write.py along `runs`, in its interpreter off a TPU."""
    local = lambda words_pool, scales_pool, layer, runs, words, scales: kv_write.write(  # noqa: E731
        words_pool, scales_pool, layer, runs, words, scales, interpret=device_platform() != "tpu")
    operands = (pool.words, pool.scales, jnp.asarray(layer, jnp.int32), runs, words, scales)
    P = jax.sharding.PartitionSpec
    pools = lambda heads: (P(None, None, None, heads), P(None, None, heads, None))  # noqa: E731
    return Int8Pool(*_over_heads(local, operands, lambda heads: (*pools(heads), P(), P(), P(None, heads),
                                                                 P(None, heads)), pools), pool.unit)


def _over_heads(local, operands: tuple, in_specs, out_specs):
    """local(*operands); under a mesh, per device in a shard_map over the heads (a Pallas kernel is opaque to XLA's
    partitioner): in_specs and out_specs give the PartitionSpecs from the heads' mesh axis."""
    rules = spmd.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return local(*operands)
    heads = logical_to_spec(("heads",), rules)[0]
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs(heads), out_specs=out_specs(heads),
                         check_vma=False)(*operands)


def ragged_paged_attention(q: jax.Array, k: jax.Array, v: jax.Array | None, pool: Pool, layer: jax.Array | int,
                           batch: RaggedBatch, *, window: int | jax.Array = 0, softcap: float = 0.0,
                           sinks: jax.Array | None = None, block_keys: int | None = None,
                           page_tokens: int | None = None, scale: float | None = None,
                           value_dim: int = 0, kernel: bool | None = None) -> jax.Array:
    """Causal attention of each token over its own sequence's positions up to its own (within the last `window`
    positions when > 0; a traced window of 0 is none too), logits soft-capped by `softcap` when > 0: q (T, H, hd),
    this step's k and v (T, KV, hd) -> (T, H, hd), H a multiple of KV (query head h reads key/value head
    h // (H // KV)); with `sinks` (H,) head h's logit sinks[h] joins each softmax's denominator. The positions
    before each sequence's chunk are read from the pool's pages (the reference's `block_keys` at a time, default
    `reference.keys_per_block()`); the chunk's own keys from k and v.
    `page_tokens` (static): only the first this many tokens have positions before their chunk (the scheduler puts
    decodes and continued prompts first, fresh prompts after), so only they read pages: a step that prefills new
    prompts beside a few decodes reads the decodes' pages, not a copy per prompt token. With an int8 pool, the
    chunk's own keys and values are read as the pool stores them too, so a token sees the same keys whether they
    came in its own step or from the pages (chunk sizes, prefix caching and preemption change no output).
    `scale`: on the logits (default 1/sqrt(hd)). `value_dim` > 0: MLA's latent pool (v None), k the rows (T, 1, C),
    the values their first value_dim entries -> (T, H, value_dim). `kernel`: the page-reading tokens attend through
    the Pallas kernel (kernel.py; in its interpreter off a TPU); None: where `uses_kernel` says; else the
    reference (reference.py)."""
    if kernel is None:
        kernel = uses_kernel(pool, q.shape[-1], value_dim)
    if kernel:
        return _kernel_attention(q, k, v, pool, layer, batch, window=window, softcap=softcap, sinks=sinks,
                                 page_tokens=page_tokens, scale=scale)
    return reference.reference_attention(q, k, v, pool, layer, batch, window=window, softcap=softcap, sinks=sinks,
                                         block_keys=block_keys, page_tokens=page_tokens, scale=scale,
                                         value_dim=value_dim)


def uses_kernel(pool: Pool, head_dim: int, value_dim: int = 0) -> bool:
    """Whether attention over `pool` takes the Pallas kernel: in a program for a TPU, over a pool whose [k | v] rows
    are whole 128-lane tiles (head_dim 64, 128, 256), in the compute dtype or int8 (int8_pool.py) in pages of a
    multiple of INT8_PAGE tokens packed in units of 512 entries (the scales whole lane tiles, a unit a lane tile of
    words; pool.default_page_size on a TPU). MLA's latent rows take the plain path (the kernel does not split a
    latent row yet), as do heads split over a mesh where key/value heads are not (fewer of them than devices: the
    kernel reads whole groups), and int8 pools in smaller pages (their scales relaid out for every call: 8x slower
    on the v5e, docs/paged-attention.md)."""
    rules = spmd.get_logical_axis_rules()
    split_alike = not rules or logical_to_spec(("heads",), rules) == logical_to_spec(("kv_heads",), rules)
    pages = not isinstance(pool, Int8Pool) or (pool.shape[2] % kernel_lib.INT8_PAGE == 0
                                               and pool.unit == int8_pool.UNIT)
    tiles = (2 * head_dim) % kernel_lib.LANES == 0
    return compile_platform() == "tpu" and not value_dim and tiles and pages and split_alike


def _kernel_attention(q, k, v, pool, layer, batch: RaggedBatch, *, window, softcap, sinks, page_tokens, scale):
    """`ragged_paged_attention` with the first `page_tokens` tokens (those that read pages) attending through the
    Pallas kernel over every position up to their own, this step's included (`write_kv` put them in the pages
    first); the tokens after them (fresh prompts, which have no pages) through the dense chunk attention."""
    T, H, hd = q.shape
    KV = k.shape[1]
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    qs = (q * scale).astype(q.dtype)
    if isinstance(pool, Int8Pool):  # the fresh prompts' own keys and values as the pages would give them back
        k, v = int8_pool.as_stored(k), int8_pool.as_stored(v)
    pos, first = batch.positions, first_keys(batch.positions, window)
    n = T if page_tokens is None else page_tokens
    paged = _kernel_call(qs[:n], pool, layer, batch.page_table, batch.rows[:n], first[:n], pos[:n] + 1,
                         batch.num_tokens, softcap, sinks)
    if n == T:
        return paged
    real = jnp.arange(T) < batch.num_tokens
    m, l, acc = chunk_attention(qs[n:].reshape(T - n, KV, H // KV, hd), k, v, batch, first, real, softcap,
                                 queries=n)
    if sinks is not None:
        l, acc = with_sinks(sinks.reshape(KV, -1), m, l, acc)
    rest = (acc / jnp.where(l > 0, l, 1.0)[..., None]).reshape(T - n, H, hd).astype(q.dtype)
    return jnp.concatenate([paged, rest])


def _kernel_call(q, pool, layer, page_table, rows, lo, hi, num_tokens, softcap, sinks):
    """The kernel on q (n, H, hd), in its interpreter off a TPU; under a mesh per device (`_over_heads`), each
    device's pool rows holding its whole heads."""
    values, scales, unit = (pool.words, pool.scales, pool.unit) if isinstance(pool, Int8Pool) else (pool, None, 0)
    local = lambda q, pool, layer, table, rows, lo, hi, num, sinks, scales: kernel_lib.paged_attention(  # noqa: E731
        q, pool, layer, table, rows, lo, hi, num, null_page=NULL_PAGE, softcap=softcap, sinks=sinks, scales=scales,
        unit=unit, interpret=device_platform() != "tpu")
    operands = (q, values, jnp.asarray(layer, jnp.int32), page_table, rows, lo, hi, num_tokens, sinks, scales)
    P = jax.sharding.PartitionSpec

    def in_specs(heads):
        return (P(None, heads, None), P(None, None, None, heads), P(), P(), P(), P(), P(), P(),
                None if sinks is None else P(heads), None if scales is None else P(None, None, heads, None))

    return _over_heads(local, operands, in_specs, lambda heads: P(None, heads, None))
