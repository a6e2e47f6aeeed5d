"""A Pallas TPU kernel that writes one layer of a step's keys and values into an int8 KV pool (`--kv-cache int8`,
int8_pool.py) in place, by DMA. Its reference is reference.py's `write_scatter` (XLA's two scatters: the path off a
TPU, and for bfloat16 pools); paged_kv.py picks one or the other.

Why: XLA's scatters on the v5e cost ~100 ns an update whatever its size, one update a token, layer and array
(docs/paged-attention.md). Here each token's row of int32 words is one DMA from the new rows to its page (HBM to
HBM), all in flight at once; the scales go by runs, consecutive tokens writing consecutive slots of one page (a
decode a run of one, a prompt's chunk a run a page; `runs`, computed once a step): a run's (2 KV, page_size) tile of
scales is read into VMEM, its columns set there and the tile written back (a DMA moves whole 128-lane rows of
32-bit words, never one column). Runs are taken RUN_GROUP at a time. A page is written by one run a step (the
scheduler gives a sequence's chunk consecutive slots, and two sequences never write one page), so no tile is read
before another run's write of it lands.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LANES = 128
RUN_GROUP = 128  # runs whose scale tiles are in VMEM at once: (128, 2 KV, page_size) float32, 1 MiB for llama-1b
NAME = "systolic_kv_write"


def runs(slots: jax.Array, num_tokens: jax.Array, page_size: int) -> jax.Array:
    """(T,) slots (page * page_size + offset) of which the first num_tokens are real -> (7, T) int32: each run's first
    token, length, page and offset in rows 0-3 (runs in token order; entries past the last run are zero), the
    number of runs and of real tokens at [4, 0] and [4, 1], each token's page and offset in rows 5-6 -> (7, T).
    A run is a maximal stretch of real tokens writing consecutive slots of one page."""
    T = slots.shape[0]
    i = jnp.arange(T, dtype=jnp.int32)
    slots = slots.astype(jnp.int32)
    page, offset = slots // page_size, slots % page_size
    real = i < num_tokens
    before = jnp.roll(slots, 1)
    fresh = real & ((i == 0) | (page != before // page_size) | (offset != before % page_size + 1))
    # Run starts first, in token order: one sort of the tokens keyed by (not a start, index).
    key = jnp.where(fresh, i, T + i)
    key, run_page, run_offset = lax.sort((key, page, offset), num_keys=1)
    count, num_tokens = jnp.sum(fresh.astype(jnp.int32)), jnp.asarray(num_tokens, jnp.int32)
    live = i < count
    starts = jnp.where(live, key, 0)
    following = jnp.where(i + 1 < count, jnp.roll(key, -1), num_tokens)
    counts = jnp.zeros_like(i).at[0].set(count).at[1].set(num_tokens)
    return jnp.stack([starts, jnp.where(live, following - starts, 0), jnp.where(live, run_page, 0),
                      jnp.where(live, run_offset, 0), counts, page, offset])


def write(words: jax.Array, scales: jax.Array, layer: jax.Array | int, run_table: jax.Array, new_words: jax.Array,
          new_scales: jax.Array, *, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """The pool (words (L, pages, page_size, W) int32, scales (L, pages, 2 KV, page_size) float32) with layer
    `layer`'s slots written: token t's row new_words[t] (T, W) and its scales new_scales[t] (T, 2 KV), along
    `run_table` (`runs`). Both pool arrays are updated in place (donate them). `interpret`: Pallas's TPU interpreter
    (off a TPU, for tests)."""
    T = new_words.shape[0]
    page_size = words.shape[2]
    S = scales.shape[2]
    if page_size % LANES:
        raise ValueError(f"kv_write takes pages of a multiple of {LANES} tokens (a page's scales whole lane tiles), "
                         f"not {page_size}: serve an int8 pool with --page-size {LANES}")
    # (2 KV, T + page_size + 128): the new scales token-minor, padded so that a run's 128-aligned window of
    # page_size + 128 lanes never runs past the end.
    window = page_size + LANES
    cols = jnp.zeros((S, -(-T // LANES) * LANES + window), jnp.float32).at[:, :T].set(
        new_scales.astype(jnp.float32).T)
    layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    groups = min(RUN_GROUP, T)
    return pl.pallas_call(
        _kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(1,),
            in_specs=[hbm, pl.BlockSpec(cols.shape, lambda g, *_: (0, 0)), hbm, hbm],
            out_specs=[hbm, hbm],
            scratch_shapes=[pltpu.VMEM((groups, S, page_size), jnp.float32), pltpu.SemaphoreType.DMA((3,))]),
        out_shape=(jax.ShapeDtypeStruct(words.shape, words.dtype), jax.ShapeDtypeStruct(scales.shape, scales.dtype)),
        input_output_aliases={4: 0, 5: 1},
        # the page ids are slots of real tokens (the null page for none of them): the DMAs stay in bounds
        compiler_params=pltpu.CompilerParams(has_side_effects=True, disable_bounds_checks=True),
        interpret=pltpu.InterpretParams() if interpret else False,
        name=NAME,
    )(layer, run_table, new_words, cols, words, scales)


def _kernel(layer_ref, table,  # scalar prefetch: (1,) the layer; (7, T) the run table (`runs`)
            new_words, cols,  # (T, W) int32 in HBM; (2 KV, T') float32 in VMEM
            words_in, scales_in, words, scales,  # the pool (aliased: the outputs are the inputs)
            tiles, sems):  # (G, 2 KV, page_size) float32; DMA semaphores: tiles in, tiles out, rows
    layer, count, tokens = layer_ref[0], table[4, 0], table[4, 1]
    G, S, page_size = tiles.shape
    window = page_size + LANES
    lanes = lax.broadcasted_iota(jnp.int32, (S, page_size), 1)

    def tile_copy(r, j, out: bool):
        page_tile = scales.at[layer, table[2, r]]
        return (pltpu.make_async_copy(tiles.at[j], page_tile, sems.at[1]) if out
                else pltpu.make_async_copy(page_tile, tiles.at[j], sems.at[0]))

    def row_copy(t):
        """Token t's row: one DMA (a DMA of several rows must start at a multiple of 8 in both arrays)."""
        return pltpu.make_async_copy(new_words.at[pl.ds(t, 1)], words.at[layer, table[5, t], pl.ds(table[6, t], 1)],
                                     sems.at[2])

    def each(copy, action: str):
        """A loop body that starts or waits for copy(i)."""
        def body(i, c):
            getattr(copy(i), action)()
            return c
        return body

    def group(g, carry):
        base = g * G
        n = jnp.minimum(G, count - base)

        def merge(j, c):
            r = base + j
            first, length, offset = table[0, r], table[1, r], table[3, r]
            # lax.div / lax.rem (operands >= 0): `//` lowers through sign, which asks the local device's TPU kind
            # and so cannot be compiled for a TPU from a CPU host
            aligned = pl.multiple_of(lax.div(first, LANES) * LANES, LANES)
            near = cols[:, pl.ds(aligned, window)]  # (2 KV, page_size + 128): the run's scales among them
            # into place: lane offset + k holds the run's k-th token's scales
            placed = pltpu.roll(near, lax.rem(offset - (first - aligned) + window, window), 1)[:, :page_size]
            tiles[j] = jnp.where((lanes >= offset) & (lanes < offset + length), placed, tiles[j])
            return c

        tile_in = lambda j: tile_copy(base + j, j, False)  # noqa: E731
        tile_out = lambda j: tile_copy(base + j, j, True)  # noqa: E731
        for body in (each(tile_in, "start"), each(tile_in, "wait"), merge, each(tile_out, "start"),
                     each(tile_out, "wait")):
            lax.fori_loop(0, n, body, 0)
        return carry

    lax.fori_loop(0, tokens, each(row_copy, "start"), 0)  # the rows' DMAs in flight while the scales are merged
    lax.fori_loop(0, lax.div(count + G - 1, G), group, 0)
    lax.fori_loop(0, tokens, each(row_copy, "wait"), 0)
