"""The Pallas paged attention kernel (kernels/paged_attention/kernel.py) compiled by Mosaic on the chip
against the plain-JAX path (reference.py) compiled by XLA on the same chip, for one ragged step:
decodes after 300 and 511 cached positions (several 256-key blocks), a continued prompt of 40 tokens after 17, a
fresh prompt of 33, padding tokens; pages shuffled over the pool; head widths 64, 128 and 256; a sliding window,
a soft cap and attention sinks; a pool in the compute dtype and an int8 one (`--kv-cache int8`: the kernel reads
the int8 pages and their scales). float32 at 'highest' matmul precision agrees to float32 rounding; bfloat16 to its
rounding of the softmax weights and the output (the plain path rounds the dequantized keys and values to it too)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from systolic.kernels.paged_attention import kernel as kernel_lib
from systolic.kernels.paged_attention import int8_pool
from systolic.kernels.paged_attention import paged_kv as pa
from systolic.workloads.lm.serve.page_allocator import PageTable
from systolic.workloads.lm.serve.scheduler import Chunk, Sequence, layout

pytestmark = pytest.mark.tpu

PAGE = 16
CHUNKS = ((300, 1), (17, 40), (511, 1), (0, 33))  # (cached positions, this step's tokens), pages-first order
T, S, PER_SEQ = 96, 6, 40


def case(H: int, KV: int, hd: int, dtype, seed: int = 0, page: int = PAGE):
    """The pool (2 layers) in pages of `page` tokens with random keys and values, the step's batch as the scheduler
    lays it out (pages shuffled), and the step's q, k, v and sinks."""
    rng = np.random.default_rng(seed)
    lengths = [c + n for c, n in CHUNKS]
    pages = 1 + sum(-(-n // page) for n in lengths)
    free = list(rng.permutation(np.arange(1, pages)))
    chunks = []
    for i, ((cached, n), length) in enumerate(zip(CHUNKS, lengths)):
        table = PageTable(pages=[int(free.pop()) for _ in range(-(-length // page))])
        chunks.append(Chunk(Sequence(f"s{i}", list(rng.integers(0, 50, length)), length, i, table=table), cached, n))
    _, batch = layout(chunks, tokens=T, rows=S, page_size=page, pages_per_seq=PER_SEQ)
    pool = jnp.asarray(rng.normal(size=(2, pages, page, KV * 2 * hd)), dtype)
    q, k, v = (jnp.asarray(rng.normal(size=(T, h, hd)), dtype) for h in (H, KV, KV))
    sinks = jnp.asarray(rng.normal(size=H), jnp.float32)
    return pool, batch, q, k, v, sinks


VARIANTS = pytest.mark.parametrize("window, softcap, sinks, page_tokens", [(0, 0.0, False, None),
                                                                          (100, 0.0, False, 48), (0, 30.0, True, 48)],
                                   ids=["causal", "window-100-pages-for-48", "softcap-sinks-pages-for-48"])


@pytest.mark.parametrize("H, KV, hd", [(8, 2, 64), (32, 8, 64), (8, 4, 128), (4, 1, 256)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@VARIANTS
def test_kernel_equals_the_plain_path_on_the_chip(H, KV, hd, dtype, window, softcap, sinks, page_tokens):
    check(H, KV, hd, dtype, window, softcap, sinks, page_tokens, int8=False)


@pytest.mark.parametrize("H, KV, hd", [(32, 8, 64), (32, 8, 128), (4, 1, 256)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@VARIANTS
def test_kernel_over_an_int8_pool_equals_the_plain_path_on_the_chip(H, KV, hd, dtype, window, softcap, sinks,
                                                                    page_tokens):
    check(H, KV, hd, dtype, window, softcap, sinks, page_tokens, int8=True)


def check(H, KV, hd, dtype, window, softcap, sinks, page_tokens, *, int8: bool):
    # An int8 pool in the kernel's pages of INT8_PAGE (128) tokens: the decodes after 300 and 511 read 3 and 4.
    pool, batch, q, k, v, sink = case(H, KV, hd, jnp.dtype(dtype), page=kernel_lib.INT8_PAGE if int8 else PAGE)
    if int8:
        pool = jax.jit(int8_pool.quantize_pool, static_argnums=1)(pool, hd)

    def run(kernel):
        @jax.jit
        def f(pool, q, k, v):
            pool = pa.write_kv(pool, 1, k, v, batch.slots)
            return pa.ragged_paged_attention(q, k, v, pool, 1, batch, window=window, softcap=softcap,
                                             sinks=sink if sinks else None, page_tokens=page_tokens, kernel=kernel)

        with jax.default_matmul_precision("highest"):
            return np.asarray(f(pool, q, k, v), np.float32)

    assert jax.devices()[0].platform == "tpu"
    plain, kernel = run(False), run(True)
    real = int(batch.num_tokens)
    tol = 2e-5 if dtype == "float32" else 3e-2
    np.testing.assert_allclose(kernel[:real], plain[:real], atol=tol, rtol=tol)
    assert np.all(kernel[real:] == 0)  # padding tokens


def test_int8_writes_by_dma_equal_the_scatters_on_the_chip():
    """kernels/kv_write.py compiled by Mosaic (the step's int8 writes on a TPU) against XLA's scatters on the same
    chip, for the step above (decodes, a continued and a fresh prompt, padding) and for 300 decodes, each in a page
    of its own (three groups of runs): the pool equal to the last bit."""
    from systolic.kernels.paged_attention import kv_write

    assert jax.devices()[0].platform == "tpu"
    rng = np.random.default_rng(1)
    page = kernel_lib.INT8_PAGE
    pool, batch, _, k, v, _ = case(32, 8, 64, jnp.bfloat16, page=page)
    pool = jax.jit(int8_pool.quantize_pool, static_argnums=1)(pool, 64)
    big = (jnp.asarray(rng.integers(-2**31, 2**31 - 1, (2, 301, page, 256)), jnp.int32),
           jnp.asarray(rng.random((2, 301, 16, page)), jnp.float32))
    decodes = jnp.asarray((rng.permutation(300) + 1) * page + rng.integers(0, page, 300), jnp.int32)
    for (words_pool, scales_pool), slots, real in (((pool.words, pool.scales), batch.slots, batch.num_tokens),
                                                   (big, decodes, 300)):
        n = slots.shape[0]
        kv = jnp.concatenate([jnp.resize(k, (n, *k.shape[1:])), jnp.resize(v, (n, *v.shape[1:]))], -1).reshape(n, -1)
        words, scales = int8_pool.quantize(kv, 64, pool.unit)
        table = kv_write.runs(slots, real, page)
        got = jax.jit(kv_write.write)(words_pool, scales_pool, 1, table, words, scales)
        at = (slots[:real] // page, slots[:real] % page)
        want = (words_pool.at[1, at[0], at[1]].set(words[:real]), scales_pool.at[1, at[0], :, at[1]].set(scales[:real]))
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
