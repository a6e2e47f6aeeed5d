"""Attention over a paged KV cache for one engine step: a ragged batch of tokens from many sequences, each
sequence a contiguous chunk (a prefill chunk of its prompt, or the one token of a decode).

The pool is one array for all layers, (L, pages, page_size, KV * 2 * hd) in the compute dtype: a token's row holds
each key/value head's key and value side by side ([k | v]), head after head; or that row in int8 with a float32
scale per key and per value (`--kv-cache int8`, int8_pool.py: its entries packed four to a word, quantized here as
they are written, dequantized as pages are read). A TPU tiles an array's two minor axes by (8 or 16) x 128: a page is then a dense
(page_size, KV * 2hd) block for every head count and width our families use (64, 128, 256), one DMA for the Pallas
kernel. Layouts measured on the v5e: the interleaved (..., 2 * KV, 64) was stored with its pages minor-most and the
compiled step copied the whole donated pool twice a step (2 x 2.1 GB for llama-1b's 4,099 pages); (..., KV, 2hd)
was dense for 8 heads or 1 but relaid out the pool once a step for 2 or 4 heads of 64 (Qwen2.5-0.5B's shape); one
row per token is copied for none of them (tests/plan/test_serve.py checks the compiled program); heads before pages
((L, KV, pages, page_size, 2hd)) was worse: XLA's scatter into it and its gather out of it each copied.
`RaggedBatch` carries what ragged paged attention kernels take (kv_lens, page_indices, cu_q_lens, num_seqs). One
array for the layers lets the compiled step update the pool in place: the layers' scan carries it whole, writes each
layer's new keys and values with a scatter and reads pages (a gather, or the kernel's DMAs), so no layer's pool is
sliced out and copied.

On a TPU (`uses_kernel`) the tokens that read pages attend through the Pallas kernel (kernels/paged_attention.py)
over every position up to their own, this step's included (written to the pages first), and the fresh prompts'
tokens after them through the dense chunk attention below: on the v5e 3.6x faster than the plain path for 256
decoding sequences x 256 positions of llama-1b (benchmarks/paged_attention.py). The plain path is the reference
(tests compare the two, in Pallas's interpreter here and compiled on the chip: tests/tpu/test_paged_attention.py)
and serves MLA, int8 pools in pages smaller than 128 and every other platform.

`ragged_paged_attention` is the plain-JAX formulation that runs on every platform, one online softmax (flash
attention's running max and sum) over two sets of keys:
- this step's own tokens: each token against the earlier tokens of its own chunk, one dense (T, T) score matrix
  masked to the same sequence (a prefill chunk costs a matmul, not a gather per token);
- the positions before each chunk, from the pool: every token gathers its own sequence's pages, a block at a time,
  so memory stays at one block per token whatever the context length; the loop runs only over the blocks some
  token of this step needs (none for a fresh prompt; a sliding window skips the blocks before it).
Multi-head latent attention (model.mla, lm/model/mla.py) keeps one row per token and layer instead, its latent and
RoPE key (L, pages, page_size, kv_lora_rank + qk_rope_head_dim): the one key head of its absorbed queries, whose
values are each row's first kv_lora_rank entries (`value_dim`), read from the same pages.
Logits are soft-capped (Gemma 2's cap * tanh(s / cap)) before the masking when `softcap` > 0; a layer's window may
be a traced value (a scan over stacked layers of both kinds, `model.layer_types`). GPT-OSS's attention sinks (one
logit per query head that joins the softmax's denominator) enter the online softmax last, as one more key whose
value is zero.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax.core import spmd

from systolic.kernels import kv_write
from systolic.kernels import paged_attention as kernel_lib
from systolic.runtime.platform import compile_platform, device_platform
from systolic.runtime.sharding import logical_to_spec
from systolic.workloads.lm.serve import int8_pool
from systolic.workloads.lm.serve.int8_pool import Int8Pool
from systolic.workloads.lm.serve.kv_cache import NULL_PAGE


def keys_per_block() -> int:
    """Keys each token reads per iteration of the online softmax (rounded to whole pages). On XLA:CPU a block that
    stays in cache is worth more iterations: 16 keys ran 16 decodes over 600 positions 2-3x faster than 64 or 128
    (heads of a 256-wide model); an accelerator prefers fewer, larger blocks."""
    return 16 if compile_platform() == "cpu" else 256


# Tokens whose scales one scatter writes into an int8 pool (where XLA writes it: off a TPU, or in pages the kernels
# do not take; on a TPU kernels/kv_write.py writes it by DMA): the TPU compiler wrote 1,024 tokens' columns by copying
# the whole (L, pages, 2 KV, page_size) array into another layout and updating it a layer at a time (llama-1b w8a8
# on the v5e: 270 ms a 1,024-token step). Compiled for a v5e here, a scatter of 768 or fewer was written in place,
# and llama-1b's 1,024-token step with 512 a scatter had no copy (tests/plan/test_serve.py checked it until the
# step's writes went by DMA; it now checks that step with the kernel's writes).
SCALE_WRITES = 512


class RaggedBatch(NamedTuple):
    """Where the T token slots of one step (a bucket; the first `num_tokens` are real) come from and go to; S rows
    (a bucket; the first `num_seqs` are real) are the sequences with a chunk in this step, in token order."""

    positions: jax.Array  # (T,) int32: each token's position in its sequence (padding: 0)
    rows: jax.Array  # (T,) int32: each token's row in [0, S) (padding: 0)
    slots: jax.Array  # (T,) int32: page * page_size + offset where its key and value go (padding: the null page)
    num_tokens: jax.Array  # () int32
    page_table: jax.Array  # (S, pages_per_seq) int32: each row's pages in order (unused entries: the null page)
    kv_lens: jax.Array  # (S,) int32: each row's positions in the cache after this step (padding rows: 0)
    cu_q_lens: jax.Array  # (S + 1,) int32: row r's tokens are [cu_q_lens[r], cu_q_lens[r + 1])
    num_seqs: jax.Array  # (1,) int32
    last: jax.Array  # (S,) int32: the index of each row's last token, whose logits the step samples from
    # (S,) int32: each row's known tokens, prompt and sampled (padding rows: 0): the length LongRoPE picks its factors
    # by (lm/model/rope.py), so every chunk of a prompt rotates as the whole prompt does in one pass
    seq_lens: jax.Array


# The pool: (L, pages, page_size, KV * 2 * hd) in the compute dtype, or an Int8Pool of those rows' int8 entries
# packed in int32 words and float32 scales (L, pages, KV * 2, page_size), one for each head's key and one for its
# value (MLA: rows (L, pages, page_size, C), scales (L, pages, 1, page_size)): int8_pool.py.
Pool = jax.Array | Int8Pool


class PagedKV(NamedTuple):
    """The pool handed to one layer's attention (sublayers.py's Attention): `attend` writes the layer's new keys
    and values and attends over the pages."""

    pool: Pool  # (L, pages, page_size, KV * 2 * hd)
    layer: jax.Array | int  # this layer's index into the pool
    batch: RaggedBatch
    page_tokens: int | None = None  # static: only the first this many tokens read pages (None: all)
    # (7, T): kernels/kv_write.py's run table, where it writes an int8 pool (`with_write_runs`; None: computed by
    # write_kv, or no DMA writes)
    write_runs: jax.Array | None = None

    def with_write_runs(self) -> PagedKV:
        """This PagedKV with the run table kernels/kv_write.py writes its int8 pool along, where it does: every
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
    page, or nothing where the int8 pool is written by DMA); None: all. `runs`: kernels/kv_write.py's run table of
    these slots, where it writes the pool (None: computed here)."""
    T, _, hd = k.shape
    page_size = pool.shape[2]
    kv = k if v is None else jnp.concatenate([k, v], axis=-1)  # (T, KV, 2hd): [k | v] per head
    kv = kv.reshape(T, -1)  # (T, KV * 2hd): a token's row
    page, offset = slots // page_size, slots % page_size
    if isinstance(pool, Int8Pool):  # words (T, KV * 2hd / 4) and scales (T, KV * 2) into their two arrays
        words, new = int8_pool.quantize(kv, hd, pool.unit)
        if v is not None and uses_kernel(pool, hd):  # by DMA (kernels/kv_write.py): XLA's scatters cost ~100 ns a token
            if runs is None:
                runs = kv_write.runs(slots, T if num_tokens is None else num_tokens, page_size)
            return _kernel_write(pool, layer, words, new, runs)
        scales = pool.scales  # (.., KV * 2, ps): each token's a column, SCALE_WRITES tokens a scatter
        for i in range(0, T, SCALE_WRITES):
            part = slice(i, i + SCALE_WRITES)
            scales = scales.at[layer, page[part], :, offset[part]].set(new[part])
        return Int8Pool(pool.words.at[layer, page, offset].set(words), scales, pool.unit)
    return pool.at[layer, page, offset].set(kv.astype(pool.dtype))


def _kernel_write(pool: Int8Pool, layer, words: jax.Array, scales: jax.Array, runs: jax.Array) -> Int8Pool:
    """`write_kv` into an int8 pool through kernels/kv_write.py along `runs`, in its interpreter off a TPU."""
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
    before each sequence's chunk are read from the
    pool's pages, `block_keys` at a time (default `keys_per_block()`); the chunk's own keys from k and v.
    `page_tokens` (static): only the first this many tokens have positions before their chunk (the scheduler puts
    decodes and continued prompts first, fresh prompts after), so only they read pages: a step that prefills new
    prompts beside a few decodes reads the decodes' pages, not a copy per prompt token. With an int8 pool, the
    chunk's own keys and values are read as the pool stores them too, so a token sees the same keys whether they
    came in its own step or from the pages (chunk sizes, prefix caching and preemption change no output).
    `scale`: on the logits (default 1/sqrt(hd)). `value_dim` > 0: MLA's latent pool (v None), k the rows (T, 1, C),
    the values their first value_dim entries -> (T, H, value_dim). `kernel`: the page-reading tokens attend through
    the Pallas kernel (kernels/paged_attention.py; in its interpreter off a TPU); None: where `uses_kernel` says."""
    if kernel is None:
        kernel = uses_kernel(pool, q.shape[-1], value_dim)
    if kernel:
        return _kernel_attention(q, k, v, pool, layer, batch, window=window, softcap=softcap, sinks=sinks,
                                 page_tokens=page_tokens, scale=scale)
    if isinstance(pool, Int8Pool):
        k, v = int8_pool.as_stored(k), None if v is None else int8_pool.as_stored(v)
    if value_dim:
        v = k[..., :value_dim]  # (T, 1, value_dim): after the int8 round trip, as the pages give them back
    T, H, hd = q.shape
    KV = k.shape[1]
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    qg = (q * scale).reshape(T, KV, q.shape[1] // KV, hd)  # (T, KV, G, hd): a group per kv head
    first = _first_keys(batch.positions, window)
    real = jnp.arange(T) < batch.num_tokens
    m, l, acc = _chunk_attention(qg, k, v, batch, first, real, softcap)
    chunk_start = (batch.kv_lens - jnp.diff(batch.cu_q_lens))[batch.rows]  # (T,) positions before: in the pages
    n = T if page_tokens is None else page_tokens
    m_paged, l_paged, acc_paged = _page_attention(qg[:n], pool, layer, batch.page_table[batch.rows[:n]], first[:n],
                                                  chunk_start[:n], real[:n], (m[:n], l[:n], acc[:n]), block_keys,
                                                  softcap, value_dim)
    m, l, acc = m.at[:n].set(m_paged), l.at[:n].set(l_paged), acc.at[:n].set(acc_paged)
    if sinks is not None:
        l, acc = _with_sinks(sinks.reshape(KV, -1), m, l, acc)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]  # (T, KV, G, hd_v); padding tokens may see nothing
    return out.reshape(T, H, v.shape[-1]).astype(q.dtype)


def _first_keys(pos: jax.Array, window: int | jax.Array) -> jax.Array:
    """Each token's first visible position (T,): within the last `window` positions when > 0 (a traced window of 0
    is none too)."""
    if isinstance(window, int):
        return jnp.maximum(pos - window + 1, 0) if window else jnp.zeros_like(pos)
    return jnp.where(window > 0, jnp.maximum(pos - window + 1, 0), 0)


def uses_kernel(pool: Pool, head_dim: int, value_dim: int = 0) -> bool:
    """Whether attention over `pool` takes the Pallas kernel: in a program for a TPU, over a pool whose [k | v] rows
    are whole 128-lane tiles (head_dim 64, 128, 256), in the compute dtype or int8 (int8_pool.py) in pages of a
    multiple of 128 tokens packed in units of 512 entries (kernels/paged_attention.py: INT8_PAGE, the scales whole
    lane tiles, a unit a lane tile of words; kv_pool's default_page_size on a TPU). MLA's latent rows take the plain
    path (the kernel does not split a latent row yet), as do heads split over a mesh where key/value heads are not
    (fewer of them than devices: the kernel reads whole groups), and int8 pools in smaller pages: in pages of 16
    their scales were relaid out for every call of the kernel (llama-1b, w8a8, 64 in flight on the v5e: 36.5 ms a
    step, against 4.47 over bfloat16 pages)."""
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
    pos, first = batch.positions, _first_keys(batch.positions, window)
    n = T if page_tokens is None else page_tokens
    paged = _kernel_call(qs[:n], pool, layer, batch.page_table, batch.rows[:n], first[:n], pos[:n] + 1,
                         batch.num_tokens, softcap, sinks)
    if n == T:
        return paged
    real = jnp.arange(T) < batch.num_tokens
    m, l, acc = _chunk_attention(qs[n:].reshape(T - n, KV, H // KV, hd), k, v, batch, first, real, softcap,
                                 queries=n)
    if sinks is not None:
        l, acc = _with_sinks(sinks.reshape(KV, -1), m, l, acc)
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


def _with_sinks(sinks: jax.Array, m: jax.Array, l: jax.Array, acc: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The online softmax's (l, acc) after one more key per head, of logit sinks (KV, G) and value zero: the sum
    gains exp(sink), rescaled with acc to the larger of the running max m (T, KV, G) and the sink."""
    sinks = sinks.astype(jnp.float32)[None]  # (1, KV, G)
    m_new = jnp.maximum(m, sinks)  # (T, KV, G): finite, even for a padding token that saw no key
    scale = jnp.exp(m - m_new)  # (T, KV, G); exp(-inf) = 0 where no key was seen
    return l * scale + jnp.exp(sinks - m_new), acc * scale[..., None]


def _chunk_attention(qg, k, v, batch: RaggedBatch, first, real, softcap, queries: int = 0):
    """The online softmax's state (m, l, acc) after the keys of this step's own tokens: every token against the
    earlier tokens of its own chunk, dense, as one (T, T) score matrix per head (a prefill chunk's keys are the bulk
    of its context; the pages would give each token its own copy of them). qg: the queries of tokens [queries, T)
    (default all), against all T keys."""
    pos, rows = batch.positions, batch.rows
    q_pos, q_rows, first = pos[queries:], rows[queries:], first[queries:]
    s = _capped(jnp.einsum("tkgd,skd->tkgs", qg, k, preferred_element_type=jnp.float32), softcap)  # (Tq, KV, G, T)
    visible = ((q_rows[:, None] == rows[None]) & (pos[None] <= q_pos[:, None]) & (pos[None] >= first[:, None])
               & real[None])  # (Tq, T): same sequence, causal, in the window; padding tokens are no keys
    s = jnp.where(visible[:, None, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1)  # (T, KV, G): -inf only for padding tokens, which see nothing
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)[..., None])  # (T, KV, G, T); hidden keys give exactly 0
    acc = jnp.einsum("tkgs,skd->tkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)  # (T, KV, G, hd)
    return m, jnp.sum(p, axis=-1), acc


def _page_attention(qg, pool, layer, tables, first, end, real, carry, block_keys, softcap, value_dim):
    """Continues the online softmax `carry` over each token's keys at positions [first, end) in its sequence's
    pages (`tables` (T, pages_per_seq): each token's sequence's page table), a block at a time, over the blocks some
    token of this step needs. value_dim > 0: MLA's rows, keys and (their first value_dim entries) values."""
    T, KV, G, hd = qg.shape
    L, P, page_size, row = pool.shape
    row_heads = 1 if value_dim else KV  # a token's row: KV heads' [k | v], or MLA's one latent row
    width = row // row_heads
    block_pages = max(1, (block_keys or keys_per_block()) // page_size)
    B = block_pages * page_size  # keys per block
    # Pages of all layers as rows of one axis: a gather of whole rows by `take` is a copy per page, where indexing
    # the 5-D pool by (layer, page) was ten times slower on XLA:CPU. Only unsharded axes merge (the head axis may
    # be split over the mesh).
    pages = jax.tree.map(lambda a: a.reshape(L * P, *a.shape[2:]), pool)  # int8: and scales
    null = layer * P + NULL_PAGE  # this layer's null page
    tables = tables + layer * P  # (T, pages_per_seq)
    blocks = -(-tables.shape[1] // block_pages)
    tables = jnp.pad(tables, ((0, 0), (0, blocks * block_pages - tables.shape[1])), constant_values=null)
    lo = jnp.min(jnp.where(real, first // B, blocks))
    hi = jnp.max(jnp.where(real, (end + B - 1) // B, 0))

    def block(j, carry):
        m, l, acc = carry  # (T, KV, G), (T, KV, G), (T, KV, G, hd) float32
        ids = jax.lax.dynamic_slice_in_dim(tables, j * block_pages, block_pages, axis=1)  # (T, bp)
        # A token with no key in this block reads the null page instead of its own: one page that stays in cache,
        # where the step's shorter sequences would each fetch pages from memory only to mask them.
        needed = real & (j * B < end) & ((j + 1) * B > first)  # (T,)
        ids = jnp.where(needed[:, None], ids, null)
        kv = _gather(pages, ids, qg.dtype).reshape(T, B, row_heads, width)  # (T, B, KV, 2hd), MLA: (T, B, 1, C)
        k, v = (kv, kv[..., :value_dim]) if value_dim else (kv[..., :hd], kv[..., hd:])  # (T, B, KV, hd) each
        s = _capped(jnp.einsum("tkgd,tskd->tkgs", qg, k, preferred_element_type=jnp.float32), softcap)  # (T, KV, G, B)
        keys = j * B + jnp.arange(B)  # (B,) key positions
        visible = (keys[None] < end[:, None]) & (keys[None] >= first[:, None])  # (T, B)
        s = jnp.where(visible[:, None, None], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))  # (T, KV, G)
        # -inf while a token has seen no key (padding): subtract 0 then, so no inf - inf appears.
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])  # (T, KV, G, B); hidden keys give exactly 0
        scale = jnp.exp(m - m_safe)  # (T, KV, G): rescales what the earlier keys summed
        l = l * scale + jnp.sum(p, axis=-1)
        acc = acc * scale[..., None] + jnp.einsum("tkgs,tskd->tkgd", p.astype(v.dtype), v,
                                                  preferred_element_type=jnp.float32)
        return m_new, l, acc

    return jax.lax.fori_loop(lo, hi, block, carry)


def _capped(scores: jax.Array, softcap: float) -> jax.Array:
    """Scaled float32 logits, soft-capped to (-softcap, softcap) when softcap > 0."""
    return softcap * jnp.tanh(scores / softcap) if softcap else scores


def _gather(pages: Pool, ids: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Pages (N, page_size, KV * 2hd) by ids (T, bp) -> (T, bp, page_size, KV * 2hd); an int8 pool's pages with their
    scales, dequantized into `dtype` (the compute dtype: the score and value matmuls run in it, as for a float
    pool)."""
    if isinstance(pages, Int8Pool):  # scales (N, KV * 2, page_size): each position's as its row's, (.., KV * 2)
        scales = jnp.swapaxes(jnp.take(pages.scales, ids, axis=0), -1, -2)
        return int8_pool.dequantize(jnp.take(pages.words, ids, axis=0), scales, pages.unit).astype(dtype)
    return jnp.take(pages, ids, axis=0)
