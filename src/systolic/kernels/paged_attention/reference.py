"""The plain-JAX formulation of paged attention and of the pool's writes: the kernels' reference (tests compare
them, in Pallas's interpreter here and compiled on the chip), and the path on every other platform and for what
the kernels do not take (MLA's latent rows, int8 pools in pages smaller than 128, a bfloat16 pool's writes).

`reference_attention` is one online softmax (flash attention's running max and sum) over two sets of keys:
- this step's own tokens: each token against the earlier tokens of its own chunk, one dense (T, T) score matrix
  masked to the same sequence (a prefill chunk costs a matmul, not a gather per token);
- the positions before each chunk, from the pool: every token gathers its own sequence's pages, a block at a time,
  so memory stays at one block per token whatever the context length; the loop runs only over the blocks some
  token of this step needs (none for a fresh prompt; a sliding window skips the blocks before it).
MLA's pool holds one latent row a token and layer: the one key head of its absorbed queries, whose values are each
row's first `value_dim` entries. Logits are soft-capped (Gemma 2) before the mask; a layer's window may be traced
(a scan over layers of both kinds); attention sinks (GPT-OSS) join the softmax's denominator last.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from systolic.kernels.paged_attention import int8_pool
from systolic.kernels.paged_attention.int8_pool import Int8Pool
from systolic.kernels.paged_attention.metadata import RaggedBatch
from systolic.kernels.paged_attention.pool import NULL_PAGE, Pool
from systolic.kernels.paged_attention.tuned_block_sizes import (REFERENCE_KEYS_DEFAULT, REFERENCE_KEYS_PER_BLOCK,
                                                                SCALE_WRITES)
from systolic.runtime.platform import compile_platform


def keys_per_block() -> int:
    """Keys each token reads per iteration of the online softmax (rounded to whole pages), by the platform the
    program is compiled for (tuned_block_sizes.py)."""
    return REFERENCE_KEYS_PER_BLOCK.get(compile_platform(), REFERENCE_KEYS_DEFAULT)


def write_scatter(pool: Pool, layer: jax.Array | int, rows: jax.Array, slots: jax.Array, head_dim: int) -> Pool:
    """The pool with a step's rows (T, row) written at layer `layer`, slots (T,) (page * page_size + offset), by
    XLA's scatters; an int8 pool's rows quantized (a scale per `head_dim` entries), their scales SCALE_WRITES tokens
    a scatter (tuned_block_sizes.py)."""
    page_size = pool.shape[2]
    page, offset = slots // page_size, slots % page_size
    if isinstance(pool, Int8Pool):  # words (T, row / 4) and scales (T, row / head_dim) into their two arrays
        words, new = int8_pool.quantize(rows, head_dim, pool.unit)
        scales = pool.scales  # (.., row / head_dim, ps): each token's a column
        for i in range(0, rows.shape[0], SCALE_WRITES):
            part = slice(i, i + SCALE_WRITES)
            scales = scales.at[layer, page[part], :, offset[part]].set(new[part])
        return Int8Pool(pool.words.at[layer, page, offset].set(words), scales, pool.unit)
    return pool.at[layer, page, offset].set(rows.astype(pool.dtype))


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array | None, pool: Pool, layer: jax.Array | int,
                        batch: RaggedBatch, *, window: int | jax.Array = 0, softcap: float = 0.0,
                        sinks: jax.Array | None = None, block_keys: int | None = None,
                        page_tokens: int | None = None, scale: float | None = None,
                        value_dim: int = 0) -> jax.Array:
    """paged_kv.ragged_paged_attention's plain path (its docstring has the arguments): the pages read
    `block_keys` at a time (default `keys_per_block()`)."""
    if isinstance(pool, Int8Pool):
        k, v = int8_pool.as_stored(k), None if v is None else int8_pool.as_stored(v)
    if value_dim:
        v = k[..., :value_dim]  # (T, 1, value_dim): after the int8 round trip, as the pages give them back
    T, H, hd = q.shape
    KV = k.shape[1]
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    qg = (q * scale).reshape(T, KV, q.shape[1] // KV, hd)  # (T, KV, G, hd): a group per kv head
    first = first_keys(batch.positions, window)
    real = jnp.arange(T) < batch.num_tokens
    m, l, acc = chunk_attention(qg, k, v, batch, first, real, softcap)
    chunk_start = (batch.kv_lens - jnp.diff(batch.cu_q_lens))[batch.rows]  # (T,) positions before: in the pages
    n = T if page_tokens is None else page_tokens
    m_paged, l_paged, acc_paged = _page_attention(qg[:n], pool, layer, batch.page_table[batch.rows[:n]], first[:n],
                                                  chunk_start[:n], real[:n], (m[:n], l[:n], acc[:n]), block_keys,
                                                  softcap, value_dim)
    m, l, acc = m.at[:n].set(m_paged), l.at[:n].set(l_paged), acc.at[:n].set(acc_paged)
    if sinks is not None:
        l, acc = with_sinks(sinks.reshape(KV, -1), m, l, acc)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]  # (T, KV, G, hd_v); padding tokens may see nothing
    return out.reshape(T, H, v.shape[-1]).astype(q.dtype)


def first_keys(pos: jax.Array, window: int | jax.Array) -> jax.Array:
    """Each token's first visible position (T,): within the last `window` positions when > 0 (a traced window of 0
    is none too)."""
    if isinstance(window, int):
        return jnp.maximum(pos - window + 1, 0) if window else jnp.zeros_like(pos)
    return jnp.where(window > 0, jnp.maximum(pos - window + 1, 0), 0)


def with_sinks(sinks: jax.Array, m: jax.Array, l: jax.Array, acc: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The online softmax's (l, acc) after one more key per head, of logit sinks (KV, G) and value zero: the sum
    gains exp(sink), rescaled with acc to the larger of the running max m (T, KV, G) and the sink."""
    sinks = sinks.astype(jnp.float32)[None]  # (1, KV, G)
    m_new = jnp.maximum(m, sinks)  # (T, KV, G): finite, even for a padding token that saw no key
    scale = jnp.exp(m - m_new)  # (T, KV, G); exp(-inf) = 0 where no key was seen
    return l * scale + jnp.exp(sinks - m_new), acc * scale[..., None]


def chunk_attention(qg, k, v, batch: RaggedBatch, first, real, softcap, queries: int = 0):
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
