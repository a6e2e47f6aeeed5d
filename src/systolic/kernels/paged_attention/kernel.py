"""The Pallas TPU kernel of paged attention: each token of a serving step reads its own sequence's keys and values
from the pool's pages, positions [lo, hi), straight into VMEM, and keeps flash attention's online softmax there.
Its reference is reference.py (the plain-JAX path); paged_kv.py picks one or the other.

Why our own and not JAX's `ragged_paged_attention`: JAX 0.10.2's takes interleaved heads (pages, page_size, 2 x KV,
hd) and asserts on head_dim 64 (llama-1b's), its rows half a TPU tile. Our pool's row is one token's every head,
[k | v] per head side by side (pool.py): a page is one dense (page_size, KV x 2hd) block and one DMA.

The design (as tpu-inference's and JAX's kernels): a grid step takes `tokens_per_block` tokens; a token's keys come
`block_keys` at a time, one DMA a page (its id from the page table in SMEM), double-buffered across tokens and grid
steps. A key/value head's G query heads are one matrix; heads of 64 go `fused_heads` at a time, their queries
block-diagonal against the heads' [k | v] tiles side by side, so each matmul fills the MXU. Positions are masked by
[lo, hi) (causal, sliding window); pages past a sequence's end are the null page. Soft-capped logits (Gemma 2) and
attention sinks (GPT-OSS) are taken; an int8 pool's words are unpacked in VMEM and its scales applied to the scores
and the softmax weights. Block sizes: tuned_block_sizes.py. Measurements and what was tried: docs/paged-attention.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from systolic.kernels.paged_attention.tuned_block_sizes import blocks_for

LANES = 128
SUBLANES = 8
# An int8 pool's pages hold a multiple of this many tokens for the kernel: a page's (2 KV, page_size) scales are
# then whole lane tiles, DMA'd into their place in a block's (2 KV, B).
INT8_PAGE = 128
NAME = "systolic_paged_attention"  # the pallas_call's, in the compiled HLO (the serving plan looks for it)


def padded_group(group: int, kv_heads: int, split: bool, fused_heads: int) -> int:
    """Query rows a key/value head takes: its G query heads, rounded up so that each matmul's rows are whole float32
    tiles (8 rows): a head's own (split), or `fused_heads` heads' together (heads of 64), where llama-1b's 4 a head
    stay 4 (every row a matmul streams costs MXU time on the step's critical path)."""
    if split:
        return -(-group // SUBLANES) * SUBLANES
    sizes = {min(fused_heads, kv_heads), kv_heads % fused_heads or fused_heads}
    rows = group
    while any(f * rows % SUBLANES for f in sizes):
        rows += 1
    return rows


def splits_kv(head_dim: int) -> bool:
    """Whether a head's k and v are whole lane tiles of the row, each read by the MXU once (head_dim a multiple of
    128); else the head's [k | v] tile meets it twice, against [q | 0] (head_dim 64)."""
    return head_dim % LANES == 0


def pages_per_block(page_size: int, pages_per_seq: int, block_keys: int) -> int:
    """Pages a token reads per DMA'd block: a block is whole (pages past the token's keys come from the null page),
    so a sequence of any length up to `block_keys` costs one block a layer."""
    return max(1, min(block_keys // page_size, pages_per_seq))


def paged_attention(q: jax.Array, pool: jax.Array, layer: jax.Array | int, page_table: jax.Array, rows: jax.Array,
                    lo: jax.Array, hi: jax.Array, num_tokens: jax.Array, *, null_page: int, softcap: float = 0.0,
                    sinks: jax.Array | None = None, scales: jax.Array | None = None, unit: int = 0,
                    block_keys: int | None = None, tokens_per_block: int | None = None,
                    interpret: bool = False) -> jax.Array:
    """Attention of n tokens over their sequences' pages: q (n, H, hd), already scaled; pool (L, pages, page_size,
    KV * 2hd), each head's row [k | v]; page_table (S, pages_per_seq); rows, lo, hi (n,) int32: token i reads
    positions [lo[i], hi[i]) of row rows[i]'s pages; only the first num_tokens () tokens are real (the rest give 0).
    sinks (H,) float32 or None. `scales` (L, pages, KV * 2, page_size) float32: the pool is int8 (`--kv-cache int8`,
    int8_pool.py), (L, pages, page_size, KV * 2hd / 4) int32 words packing each `unit` entries of a row (512 on
    a TPU) four to a word, position p's key and value of head h scaled by scales[.., 2h, p] and [.., 2h + 1, p];
    page_size a multiple of INT8_PAGE. -> (n, H, hd) in q's dtype.
    `block_keys`, `tokens_per_block`: default the chip's (tuned_block_sizes.py).
    `interpret`: run in Pallas's TPU interpreter (off a TPU, for tests)."""
    n, H, hd = q.shape
    tuned = blocks_for(hd)
    block_keys = block_keys or tuned.block_keys
    tokens_per_block = tokens_per_block or tuned.tokens_per_block
    L, P, page_size, width = pool.shape
    quantized = scales is not None
    if quantized:
        width *= 4  # entries a row, four a word
        if (page_size % INT8_PAGE or unit % (4 * LANES)) and not interpret:
            raise ValueError(f"An int8 pool in pages of {page_size} packed in units of {unit}: the kernel reads pages "
                             f"of a multiple of {INT8_PAGE} tokens (its scales whole lane tiles) packed in units of "
                             f"{4 * LANES} (a lane tile of words). Fix: --page-size {INT8_PAGE}, key/value heads x "
                             f"2 x head_dim a multiple of {4 * LANES} on each device.")
    KV = width // (2 * hd)
    G = H // KV
    split = splits_kv(hd)
    Gp = padded_group(G, KV, split, tuned.fused_heads)
    Lq = hd if split else 2 * hd  # lanes of a query and of an output row
    pages_per_seq = page_table.shape[1]
    block_pages = pages_per_block(page_size, pages_per_seq, block_keys)
    TQ = min(tokens_per_block, n)
    n_pad = -(-n // TQ) * TQ
    # (n, KV * Gp, Lq): each head's G query rows padded to Gp; pad rows are zero and never read back.
    qp = jnp.zeros((n_pad, KV, Gp, Lq), q.dtype).at[:n, :, :G, :hd].set(q.reshape(n, KV, G, hd))
    qp = qp.reshape(n_pad, KV * Gp, Lq)
    pad = lambda a: jnp.pad(a.astype(jnp.int32), (0, n_pad - n))  # noqa: E731
    sink_rows = jnp.zeros((KV, Gp), jnp.float32)
    if sinks is not None:
        sink_rows = sink_rows.at[:, :G].set(sinks.astype(jnp.float32).reshape(KV, G))
    sink_rows = jnp.broadcast_to(sink_rows.reshape(KV * Gp, 1), (KV * Gp, LANES))
    meta = jnp.stack([jnp.asarray(layer, jnp.int32), jnp.minimum(jnp.asarray(num_tokens, jnp.int32), n)])
    kernel = functools.partial(_kernel, split=split, kv_heads=KV, rows=Gp, head_dim=hd, fused_heads=tuned.fused_heads,
                               softcap=softcap, has_sinks=sinks is not None, null_page=null_page,
                               unit=unit if quantized else 0)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    # A block's pages one after another, (B, width); an int8 pool's scales beside them as (2 KV, B), each page's
    # (2 KV, page_size) whole lane tiles of it.
    values = pltpu.VMEM((2, block_pages * page_size, pool.shape[-1]), pool.dtype)
    scale_buffer = [pltpu.VMEM((2, 2 * KV, block_pages * page_size), jnp.float32)] if quantized else []
    block = pl.BlockSpec((TQ, KV * Gp, Lq), lambda g, *_: (g, 0, 0))
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(n_pad // TQ,),
            in_specs=[block, pl.BlockSpec((KV * Gp, LANES), lambda g, *_: (0, 0)), hbm, *[hbm] * quantized],
            out_specs=block,
            scratch_shapes=[
                values,  # the double buffer of pages
                *scale_buffer,
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.SMEM((1,), jnp.int32),  # which buffer holds the block being computed
            ]),
        # The grid runs in order: a step prefetches the next one's first pages.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",), disable_bounds_checks=True),
        out_shape=jax.ShapeDtypeStruct((n_pad, KV * Gp, Lq), q.dtype),
        interpret=pltpu.InterpretParams() if interpret else False,
        name=NAME,
    )(meta, page_table.astype(jnp.int32), pad(rows), pad(lo), pad(hi), qp, sink_rows, pool,
      *([scales] if quantized else []))
    out = out[:n].reshape(n, KV, Gp, Lq)[:, :, :G]
    return (out if split else out[..., hd:]).reshape(n, H, hd)  # padded: [p.k | p.v]


def _kernel(meta_ref, tables_ref, rows_ref, lo_ref, hi_ref,  # scalar prefetch, in SMEM
            q_ref, sinks_ref, pool_ref,  # (TQ, KV * Gp, Lq), (KV * Gp, 128), (L, P, page_size, row) in HBM
            *refs,  # [the scales (L, P, KV * 2, page_size) in HBM,] out, buf, [scale buffer,] sems, slot
            split: bool, kv_heads: int, rows: int, head_dim: int, fused_heads: int, softcap: float, has_sinks: bool,
            null_page: int, unit: int):
    quantized = unit > 0
    if quantized:
        scales_ref, out_ref, buf, sbuf, sems, slot_ref = refs
    else:
        (out_ref, buf, sems, slot_ref), scales_ref, sbuf = refs, None, None
    TQ, _, Lq = q_ref.shape
    page_size = pool_ref.shape[2]
    B = buf.shape[1]  # keys per block
    block_pages = B // page_size
    pages_per_seq = tables_ref.shape[1]
    layer, n_real = meta_ref[0], meta_ref[1]
    KV_rows = kv_heads * rows
    base = pl.program_id(0) * TQ
    compute = q_ref.dtype  # an int8 page's entries are converted to it (exactly: |v| <= 127)
    # bfloat16 operands take the MXU's one pass whatever jax.default_matmul_precision says (Mosaic refuses a
    # float32 contract precision for them); float32 ones follow it.
    precision = lax.Precision.DEFAULT if compute == jnp.bfloat16 else None

    def copies(t, b, slot):
        """The DMAs of token t's block b of pages into buffer `slot` (pages past its keys: the null page)."""
        out = []
        for j in range(block_pages):
            i = b * block_pages + j
            page = jnp.where((i < pages_per_seq) & (i * page_size < hi_ref[t]),
                             tables_ref[rows_ref[t], jnp.minimum(i, pages_per_seq - 1)], null_page)
            into = pl.ds(j * page_size, page_size)
            out.append(pltpu.make_async_copy(pool_ref.at[layer, page], buf.at[slot, into], sems.at[slot]))
            if quantized:
                out.append(pltpu.make_async_copy(scales_ref.at[layer, page], sbuf.at[slot, :, into], sems.at[slot]))
        return out

    def start(t, b, slot):
        for c in copies(t, b, slot):
            c.start()

    # lax.div truncates (positions are >= 0): `//` lowers through sign, which asks the local device's TPU kind
    # and so cannot be compiled for a TPU from a CPU host.
    def first(t):
        return lax.div(lo_ref[t], B)

    def end(t):
        return lax.div(hi_ref[t] + B - 1, B)

    @pl.when((pl.program_id(0) == 0) & (n_real > 0))
    def _():
        slot_ref[0] = 0
        start(0, first(0), 0)

    def token(i, carry):
        t = base + i

        @pl.when(t < n_real)
        def _():
            # float32: the rows of each matmul (a head's Gp, or fused_heads heads' F * Gp) are whole float32
            # tiles, where bfloat16's are 16 rows.
            q = q_ref[i].astype(jnp.float32)  # (KV * Gp, Lq)
            lo, hi = lo_ref[t], hi_ref[t]
            # (first head, heads, what meets the MXU as their queries), built once a token: each head's rows
            # (split), or for fused_heads heads of 64 at a time the block-diagonal (F * Gp, F * 128) of their [q | 0].
            groups = []
            for g in range(0, kv_heads, 1 if split else fused_heads):
                f = 1 if split else min(fused_heads, kv_heads - g)
                rows_g = q[g * rows:(g + f) * rows]
                groups.append((g, f, (rows_g if split else _block_diagonal(rows_g, f, rows)).astype(compute)))

            def block(b, state):
                # The online softmax's state is the loop's carry (KV * Gp, 128) x 2 and (KV * Gp, Lq), float32.
                slot = slot_ref[0]
                last = b + 1 >= end(t)

                @pl.when(~last)
                def _():
                    start(t, b + 1, 1 - slot)

                @pl.when(last & (t + 1 < n_real))
                def _():
                    start(t + 1, first(t + 1), 1 - slot)

                for c in copies(t, b, slot):
                    c.wait()
                keys = b * B + lax.broadcasted_iota(jnp.int32, (1, B), 1)
                visible = (keys >= lo) & (keys < hi)  # (1, B)
                pages, k_scale, v_scale = buf.at[slot], None, None  # a ref: each group loads its own lanes
                if quantized:
                    # (B, width) in the compute dtype; the scales go on the scores and the softmax weights, (R, B),
                    # not on the (B, width) values.
                    pages = _unpacked(buf[slot], unit).astype(jnp.float32).astype(compute)  # (B, row)
                    s_cols = sbuf[slot]  # (2 KV, B)
                    # Each head's key and value scales broadcast over its query rows, (KV_rows, B): a sublane
                    # broadcast each (a one-hot matmul at HIGHEST precision took six MXU passes and their pops).
                    spread = lambda c: jnp.concatenate(  # noqa: E731
                        [jnp.broadcast_to(s_cols[2 * h + c:2 * h + c + 1], (rows, B)) for h in range(kv_heads)])
                    k_scale, v_scale = spread(0), jnp.where(visible, spread(1), 0.0)
                parts = []
                for g, f, qg in groups:
                    span = slice(g * rows, (g + f) * rows)
                    if split:
                        kt, vt = pages[:, 2 * g * head_dim:(2 * g + 1) * head_dim], \
                            pages[:, (2 * g + 1) * head_dim:(2 * g + 2) * head_dim]  # (B, hd) each
                        pick = None
                    else:  # the group's [k | v] tiles side by side, (B, f * 128), for both products
                        kt = vt = pages[:, g * Lq:(g + f) * Lq]
                        pick = functools.partial(_diagonal, heads=f, rows=rows, width=Lq)
                    scale = None if k_scale is None else (k_scale[span], v_scale[span])
                    parts.append(_online_step(qg, kt, vt, visible, tuple(x[span] for x in state), softcap=softcap,
                                              precision=precision, pick=pick, scale=scale))
                slot_ref[0] = 1 - slot
                return tuple(jnp.concatenate(x, axis=0) if len(x) > 1 else x[0] for x in zip(*parts))

            init = (jnp.full((KV_rows, LANES), -jnp.inf, jnp.float32), jnp.zeros((KV_rows, LANES), jnp.float32),
                    jnp.zeros((KV_rows, Lq), jnp.float32))
            m, l, acc = lax.fori_loop(first(t), end(t), block, init)
            if has_sinks:  # one more key per head, logit sinks[h], value zero
                sink = sinks_ref[...]
                m_fin = jnp.maximum(m, sink)
                scale = jnp.exp(m - m_fin)
                l, acc = l * scale + jnp.exp(sink - m_fin), acc * _lanes(scale, Lq)
            out_ref[i] = (acc / _lanes(jnp.where(l > 0, l, 1.0), Lq)).astype(out_ref.dtype)

        @pl.when(t >= n_real)
        def _():
            out_ref[i] = jnp.zeros(out_ref.shape[1:], out_ref.dtype)

        return carry

    lax.fori_loop(0, TQ, token, 0)


def _online_step(q, kt, vt, visible, state, *, softcap: float, precision, pick, scale=None):
    """One block of keys into the online softmax of R query rows: q (R, K) against kt (B, K) -> scores (R, B), soft-
    capped and masked by `visible` (1, B); then p (R, B) times vt (B, W), reduced by `pick` to the rows' own (R, Lq)
    (the fused heads' diagonal blocks; None: all of it). `scale`: an int8 block's (key, value) scales as each row
    takes them, (R, B) each (zero where not visible), on the scores and on the weights that meet the values.
    state: m, l (R, 128) lane-replicated, acc (R, Lq) -> the same, updated."""
    m_prev, l_prev, acc_prev = state
    s = lax.dot_general(q, kt, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32)  # (R, B)
    if scale is not None:
        s = s * scale[0]
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(visible, s, -jnp.inf)
    m_cur = jnp.max(s, axis=1, keepdims=True)  # (R, 1); -inf: no key of this block
    seen = m_cur > -jnp.inf
    p = jnp.exp(s - jnp.where(seen, m_cur, 0.0))  # (R, B); hidden keys exactly 0
    weights = p if scale is None else p * scale[1]
    pv = jnp.dot(weights.astype(vt.dtype), vt, precision=precision, preferred_element_type=jnp.float32)  # (R, W)
    if pick is not None:
        pv = pick(pv)
    m_next = jnp.maximum(m_prev, m_cur)
    safe = jnp.where(m_next > -jnp.inf, m_next, 0.0)
    alpha = jnp.exp(m_prev - safe)  # (R, 128): 0 while nothing was seen
    beta = jnp.where(seen, jnp.exp(m_cur - safe), 0.0)  # (R, 128)
    Lq = acc_prev.shape[1]
    return (m_next, alpha * l_prev + beta * jnp.sum(p, axis=1, keepdims=True),
            _lanes(alpha, Lq) * acc_prev + _lanes(beta, Lq) * pv)


def _unpacked(words: jax.Array, unit: int) -> jax.Array:
    """(B, row / 4) int32 words -> their entries (B, row) int32 (int8_pool.py's packing): each unit's unit / 4
    words give its four quarters, byte k of each word by two shifts (the second arithmetic: the byte's sign)."""
    n = unit // 4
    quarters = []
    for u in range(0, words.shape[1], n):
        w = words[:, u:u + n]
        quarters += [lax.shift_right_arithmetic(lax.shift_left(w, 24 - 8 * k) if k < 3 else w, 24) for k in range(4)]
    return jnp.concatenate(quarters, axis=1)


def _block_diagonal(q: jax.Array, heads: int, rows: int) -> jax.Array:
    """(heads * rows, W) query rows -> (heads * rows, heads * W): head h's rows in lanes [h * W, (h + 1) * W),
    zeros elsewhere, so that one matmul against `heads` [k | v] tiles side by side gives every head's scores."""
    R, W = q.shape
    lane_head = lax.broadcasted_iota(jnp.int32, (R, heads * W), 1) // W
    row_head = lax.broadcasted_iota(jnp.int32, (R, heads * W), 0) // rows
    return jnp.where(lane_head == row_head, jnp.concatenate([q] * heads, axis=1), 0.0)


def _diagonal(o: jax.Array, *, heads: int, rows: int, width: int) -> jax.Array:
    """(heads * rows, heads * width) -> (heads * rows, width): each head's rows from its own lanes (selects over
    whole tiles: a head's rows need not be whole sublane tiles)."""
    row_head = lax.broadcasted_iota(jnp.int32, (o.shape[0], width), 0) // rows
    out = o[:, :width]
    for h in range(1, heads):
        out = jnp.where(row_head == h, o[:, h * width:(h + 1) * width], out)
    return out


def _lanes(x: jax.Array, width: int) -> jax.Array:
    """(rows, 128) lane-replicated -> (rows, width): copies of the tile side by side when width is a multiple of 128
    (the TPU's case), else lane 0 broadcast (narrow test heads, in the interpreter)."""
    if width % LANES:
        return jnp.broadcast_to(x[:, :1], (x.shape[0], width))
    return x if width == LANES else jnp.concatenate([x] * (width // LANES), axis=1)
