"""Attention over a paged KV cache for one engine step: a ragged batch of tokens from many sequences, each
sequence a contiguous chunk (a prefill chunk of its prompt, or the one token of a decode).

The pool is one array for all layers, (L, pages, page_size, KV, 2 * hd) in the compute dtype, each key/value
head's row its key and its value side by side ([k | v]), or that array in int8 with a float32 scale per key and per
value (`--kv-cache int8`, kv_pool.py: a `qwix.QArray`, quantized here as it is written, dequantized as pages are
read). Side by side, a row is 128 lanes or more for every head width our families use (64, 128, 256). A TPU tiles an
array's two minor axes by (8 or 16) x 128; it stored the former interleaved layout (..., 2 * KV, 64) with its pages
minor-most instead, and the compiled step copied the whole donated pool twice a step, into the layers' loop and back
(2 x 2.1 GB for llama-1b's 4,099 pages; tests/plan/test_serve.py checks the compiled program). With 8 key/value heads
or more the (KV, 2 * hd) tile is dense; with 1 (Gemma) the 512-lane rows were not copied either; with 2 or 4 heads of
64 (Qwen2.5-0.5B's shape) the compiled step still relays the whole pool out once a step for its gather (seen in the
compiled program, not yet fixed). Heads before pages ((L, KV, pages, page_size, 2 * hd): a page's 16 tokens x 128
lanes, dense for any head count) was tried and is worse: XLA's scatter into it and its gather out of it each copied.
`RaggedBatch` carries what ragged paged attention kernels take (kv_lens, page_indices, cu_q_lens, num_seqs). One
array for the layers lets the compiled step update the pool in place: the layers' scan carries it whole, writes each
layer's new keys and values with a scatter and reads pages with a gather, so no layer's pool is sliced out and
copied.

`ragged_paged_attention` is the plain-JAX formulation that runs on every platform, one online softmax (flash
attention's running max and sum) over two sets of keys:
- this step's own tokens: each token against the earlier tokens of its own chunk, one dense (T, T) score matrix
  masked to the same sequence (a prefill chunk costs a matmul, not a gather per token);
- the positions before each chunk, from the pool: every token gathers its own sequence's pages, a block at a time,
  so memory stays at one block per token whatever the context length; the loop runs only over the blocks some
  token of this step needs (none for a fresh prompt; a sliding window skips the blocks before it).
Multi-head latent attention (model.mla, lm/model/mla.py) keeps one row per token and layer instead, its latent and
RoPE key (L, pages, page_size, 1, kv_lora_rank + qk_rope_head_dim): the one key head of its absorbed queries, whose
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
import qwix

from systolic.runtime.platform import compile_platform
from systolic.workloads.lm.serve.kv_cache import NULL_PAGE


def keys_per_block() -> int:
    """Keys each token reads per iteration of the online softmax (rounded to whole pages). On XLA:CPU a block that
    stays in cache is worth more iterations: 16 keys ran 16 decodes over 600 positions 2-3x faster than 64 or 128
    (heads of a 256-wide model); an accelerator prefers fewer, larger blocks."""
    return 16 if compile_platform() == "cpu" else 256


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


# The pool: (L, pages, page_size, KV, 2 * hd) in the compute dtype, or a QArray of int8 values of that shape and
# float32 scales (L, pages, page_size, KV, 2), one for the key and one for the value (MLA: (L, pages, page_size, 1, C)
# and scales (..., 1)).
Pool = jax.Array | qwix.QArray


def quantize_kv(x: jax.Array, width: int | None = None) -> qwix.QArray:
    """x (..., W) -> int8 values (..., W) and one float32 scale per `width` entries (default W) of each row, (...,
    W / width): symmetric absmax over each head's vector (Qwix's), each element within scale / 2 = absmax / 255 of
    its value. A pool row [k | v] takes width=hd: a scale for the key and one for the value. In float32 whatever x's
    dtype: bfloat16's 8-bit mantissa would round x / scale once more before the rounding to an integer."""
    width = width or x.shape[-1]
    return qwix.quantize(x.astype(jnp.float32), jnp.int8, channelwise_axes=tuple(range(x.ndim - 1)),
                         tiled_axes={x.ndim - 1: width})


def as_stored(x: jax.Array) -> jax.Array:
    """x (..., hd) as an int8 pool gives it back (quantized and dequantized), in x's dtype."""
    return qwix.dequantize(quantize_kv(x)).astype(x.dtype)


class PagedKV(NamedTuple):
    """The pool handed to one layer's attention (transformer.py's hook): `attend` writes the layer's new keys
    and values and attends over the pages."""

    pool: Pool  # (L, pages, page_size, KV, 2 * hd)
    layer: jax.Array | int  # this layer's index into the pool
    batch: RaggedBatch
    page_tokens: int | None = None  # static: only the first this many tokens read pages (None: all)

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, *, window: int | jax.Array,
               softcap: float = 0.0, sinks: jax.Array | None = None) -> tuple[jax.Array, PagedKV]:
        """q (T, H, hd), this step's k and v (T, KV, hd) -> (out (T, H, hd), the PagedKV with k and v written)."""
        pool = write_kv(self.pool, self.layer, k, v, self.batch.slots)
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


def write_kv(pool: Pool, layer: jax.Array | int, k: jax.Array, v: jax.Array | None, slots: jax.Array) -> Pool:
    """The pool with k and v (T, KV, hd) written at layer `layer`, slots (T,) (an int8 pool: quantized); v None:
    MLA's latent rows k (T, 1, C) alone."""
    hd = k.shape[-1]
    page_size = pool.shape[2]
    kv = k if v is None else jnp.concatenate([k, v], axis=-1)  # (T, KV, 2hd): [k | v] per head
    where = (layer, slots // page_size, slots % page_size)
    if isinstance(pool, qwix.QArray):  # values (T, KV, 2hd) int8 and scales (T, KV, 2) into their two arrays
        return jax.tree.map(lambda stored, new: stored.at[where].set(new), pool, quantize_kv(kv, hd))
    return pool.at[where].set(kv.astype(pool.dtype))


def ragged_paged_attention(q: jax.Array, k: jax.Array, v: jax.Array | None, pool: Pool, layer: jax.Array | int,
                           batch: RaggedBatch, *, window: int | jax.Array = 0, softcap: float = 0.0,
                           sinks: jax.Array | None = None, block_keys: int | None = None,
                           page_tokens: int | None = None, scale: float | None = None,
                           value_dim: int = 0) -> jax.Array:
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
    the values their first value_dim entries -> (T, H, value_dim)."""
    if isinstance(pool, qwix.QArray):
        k, v = as_stored(k), None if v is None else as_stored(v)
    if value_dim:
        v = k[..., :value_dim]  # (T, 1, value_dim): after the int8 round trip, as the pages give them back
    T, H, hd = q.shape
    KV = k.shape[1]
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    qg = (q * scale).reshape(T, KV, q.shape[1] // KV, hd)  # (T, KV, G, hd): a group per kv head
    pos = batch.positions  # (T,)
    if isinstance(window, int):
        first = jnp.maximum(pos - window + 1, 0) if window else jnp.zeros_like(pos)  # (T,) each token's first key
    else:
        first = jnp.where(window > 0, jnp.maximum(pos - window + 1, 0), 0)  # (T,)
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


def _with_sinks(sinks: jax.Array, m: jax.Array, l: jax.Array, acc: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The online softmax's (l, acc) after one more key per head, of logit sinks (KV, G) and value zero: the sum
    gains exp(sink), rescaled with acc to the larger of the running max m (T, KV, G) and the sink."""
    sinks = sinks.astype(jnp.float32)[None]  # (1, KV, G)
    m_new = jnp.maximum(m, sinks)  # (T, KV, G): finite, even for a padding token that saw no key
    scale = jnp.exp(m - m_new)  # (T, KV, G); exp(-inf) = 0 where no key was seen
    return l * scale + jnp.exp(sinks - m_new), acc * scale[..., None]


def _chunk_attention(qg, k, v, batch: RaggedBatch, first, real, softcap):
    """The online softmax's state (m, l, acc) after the keys of this step's own tokens: every token against the
    earlier tokens of its own chunk, dense, as one (T, T) score matrix per head (a prefill chunk's keys are the bulk
    of its context; the pages would give each token its own copy of them)."""
    pos, rows = batch.positions, batch.rows
    s = _capped(jnp.einsum("tkgd,skd->tkgs", qg, k, preferred_element_type=jnp.float32), softcap)  # (T, KV, G, T)
    visible = ((rows[:, None] == rows[None]) & (pos[None] <= pos[:, None]) & (pos[None] >= first[:, None])
               & real[None])  # (T, T): same sequence, causal, in the window; padding tokens are no keys
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
    L, P, page_size, row_heads, width = pool.shape
    block_pages = max(1, (block_keys or keys_per_block()) // page_size)
    B = block_pages * page_size  # keys per block
    # Pages of all layers as rows of one axis: a gather of whole rows by `take` is a copy per page, where indexing
    # the 5-D pool by (layer, page) was ten times slower on XLA:CPU. Only unsharded axes merge (the head axis may
    # be split over the mesh).
    pages = jax.tree.map(lambda a: a.reshape(L * P, page_size, row_heads, a.shape[-1]), pool)  # int8: and scales
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
    """Pages (N, page_size, KV, 2hd) by ids (T, bp) -> (T, bp, page_size, KV, 2hd); an int8 pool's pages with their
    scales, dequantized into `dtype` (the compute dtype: the score and value matmuls run in it, as for a float
    pool)."""
    if isinstance(pages, qwix.QArray):
        return qwix.dequantize(jax.tree.map(lambda a: jnp.take(a, ids, axis=0), pages)).astype(dtype)
    return jnp.take(pages, ids, axis=0)
