"""Attention over pages against a float64 NumPy dense reference: one ragged batch that mixes a prefill chunk after
cached positions, a decode, and a prefill from the start, on pages in shuffled order (every chunk crosses page
boundaries), with padding tokens, with and without a sliding window, in one block of keys and in several; the same
over an int8 pool (`--kv-cache int8`), within the bound that its quantization error implies."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from systolic.kernels.paged_attention import int8_pool
from systolic.kernels.paged_attention import paged_kv as pa
from systolic.kernels.paged_attention import pool as pool_lib
from systolic.workloads.lm.serve.page_allocator import PageTable
from systolic.workloads.lm.serve.scheduler import Chunk, Sequence, layout, pages_first

H, KV, HD, PAGE, PAGES, T, S, PER_SEQ = 4, 2, 8, 4, 16, 24, 4, 5
# (tokens cached before this step, tokens in this step): a prefill chunk after 5 cached positions, a decode at
# position 13, a prefill of 9 from position 0.
CHUNKS = ((5, 7), (13, 1), (0, 9))


def make_case(seed: int = 0):
    """A pool holding random keys/values for the cached positions, the step's layout, its q, k, v, and each
    sequence's full keys and values (L=1 layer) for the reference."""
    rng = np.random.default_rng(seed)
    free = list(rng.permutation(np.arange(1, PAGES)))  # shuffled pages, none the null page
    chunks, full_k, full_v = [], [], []
    pool = np.zeros((1, PAGES, PAGE, KV, 2 * HD))
    for i, (cached, n) in enumerate(CHUNKS):
        length = cached + n
        pages = [int(free.pop()) for _ in range(-(-length // PAGE))]
        k, v = rng.normal(size=(length, KV, HD)), rng.normal(size=(length, KV, HD))
        for p in range(cached):  # what earlier steps wrote
            pool[0, pages[p // PAGE], p % PAGE, :, :HD] = k[p]
            pool[0, pages[p // PAGE], p % PAGE, :, HD:] = v[p]
        seq = Sequence(f"s{i}", list(rng.integers(0, 50, length)), length, i, table=PageTable(pages=pages))
        chunks.append(Chunk(seq, cached, n))
        full_k.append(k)
        full_v.append(v)
    _, batch = layout(chunks, tokens=T, rows=S, page_size=PAGE, pages_per_seq=PER_SEQ)
    n_real = sum(n for _, n in CHUNKS)
    q = rng.normal(size=(T, H, HD))
    new_k = np.zeros((T, KV, HD))
    new_v = np.zeros((T, KV, HD))
    t = 0
    for (cached, n), k, v in zip(CHUNKS, full_k, full_v):
        new_k[t:t + n], new_v[t:t + n] = k[cached:], v[cached:]
        t += n
    new_k[n_real:] = rng.normal(size=(T - n_real, KV, HD))  # padding tokens: written to the null page, never read
    new_v[n_real:] = rng.normal(size=(T - n_real, KV, HD))
    return pool.reshape(1, PAGES, PAGE, KV * 2 * HD), batch, q, new_k, new_v, full_k, full_v


def key_rows(full_k, full_v, window: int):
    """For each real token t and head h, in order: (t, h, the keys and values (keys, hd) it attends over, float64):
    its own sequence's positions up to its own, within the window."""
    t = 0
    for (cached, n), k, v in zip(CHUNKS, full_k, full_v):
        for pos in range(cached, cached + n):
            keys = np.arange(pos + 1)
            if window:
                keys = keys[keys > pos - window]
            for h in range(H):
                yield t, h, k[keys, h // (H // KV)], v[keys, h // (H // KV)]
            t += 1


def dense_reference(q, full_k, full_v, window: int) -> np.ndarray:
    """float64 attention of each real token over its own sequence's positions up to its own (within the window)."""
    out = []
    for t, h, k, v in key_rows(full_k, full_v, window):
        s = k @ q[t, h] / np.sqrt(HD)
        p = np.exp(s - s.max())
        out.append(p / p.sum() @ v)
    return np.asarray(out).reshape(-1, H, HD)


@pytest.mark.parametrize("window", [0, 3, 6], ids=["causal", "window-3", "window-6"])
@pytest.mark.parametrize("block_keys, page_tokens, kernel", [(64, None, False), (8, None, False), (8, 8, False),
                                                             (None, None, True), (None, 8, True)],
                         ids=["one-block", "blocks-of-8", "blocks-of-8-pages-for-the-first-8", "kernel",
                              "kernel-for-the-first-8"])
def test_ragged_paged_attention_matches_dense_float64(window, block_keys, page_tokens, kernel):
    """page_tokens=8: only the first 8 tokens (the chunk after cached positions and the decode, which the scheduler
    puts first) read pages; the fresh prompt after them needs none. kernel: the Pallas kernel (in its interpreter
    here) for the tokens that read pages, the dense chunk attention for the rest."""
    pool, batch, q, new_k, new_v, full_k, full_v = make_case()
    assert [c.start for c in pages_first([Chunk(None, s, n) for s, n in CHUNKS])] == [s for s, _ in CHUNKS]
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731

    @jax.jit
    def run(pool, q, k, v, batch):
        pool = pa.write_kv(pool, 0, k, v, batch.slots)
        return pa.ragged_paged_attention(q, k, v, pool, 0, batch, window=window, block_keys=block_keys,
                                         page_tokens=page_tokens, kernel=kernel), pool

    out, written = run(f32(pool), f32(q), f32(new_k), f32(new_v), batch)
    pool, written = pool.reshape(1, PAGES, PAGE, KV, 2 * HD), np.asarray(written).reshape(1, PAGES, PAGE, KV, -1)
    want = dense_reference(q, full_k, full_v, window)
    n = want.shape[0]
    np.testing.assert_allclose(np.asarray(out)[:n], want, atol=2e-5, rtol=2e-5)
    assert np.all(np.isfinite(np.asarray(out)))  # padding tokens too
    # The step's keys and values landed in their pages (each head's row [k | v]), nothing else changed but the
    # null page, where the padding tokens write.
    written = np.asarray(written)
    for (cached, n_new), k, chunk_pages in zip(CHUNKS, full_k, [np.asarray(r) for r in batch.page_table]):
        for p in range(cached + n_new):
            np.testing.assert_allclose(written[0, chunk_pages[p // PAGE], p % PAGE, :, :HD], k[p], rtol=1e-6)
    untouched = [p for p in range(1, PAGES) if p not in np.asarray(batch.page_table)]
    np.testing.assert_array_equal(written[0, untouched], pool[0, untouched])


def test_pool_layout_and_empty_step():
    row = pool_lib.PoolRow(layers=3, width=KV * 2 * HD, scales=2 * KV, dtype=jnp.float32)
    pool = pool_lib.make_pool(pool_lib.pool_shape(row, 5, PAGE, "auto"))
    assert pool.shape == (3, 5, PAGE, KV * 2 * HD) and pool.dtype == jnp.float32 and not np.any(np.asarray(pool))
    _, batch = layout([], tokens=8, rows=4, page_size=PAGE, pages_per_seq=PER_SEQ)  # a warm-up step: all padding
    kv = jnp.ones((8, KV, HD))
    out = jax.jit(lambda q, pool, b: pa.ragged_paged_attention(q, kv, kv, pool, 1, b))(kv.repeat(2, 1), pool, batch)
    assert np.all(np.asarray(out) == 0)


def stored(pool: pool_lib.Pool) -> np.ndarray:
    """An int8 pool's keys and values as it gives them back, in float64: each row's key and value by its own scale."""
    entries = np.asarray(int8_pool.unpack(pool.words, pool.unit), np.float64)  # (.., page_size, row)
    scales = np.swapaxes(np.asarray(pool.scales, np.float64), -1, -2)  # (.., page_size, KV * 2): a row's
    return entries * scales.repeat(entries.shape[-1] // scales.shape[-1], axis=-1)


def quantization_bound(q, full_k, full_v, window: int) -> np.ndarray:
    """For each real token and head, the most its output can move when every cached key and value element moves by
    up to its row's absmax / 255 (symmetric int8, half a step of absmax / 127.5): a score by eps <= |q / sqrt(hd)|_1
    * max absmax(k) / 255, so each softmax weight by a factor within exp(+-2 eps) and the weights' L1 norm by at most
    exp(2 eps) - 1, times the largest |value|; plus the values' own error, max absmax(v) / 255."""
    bound = []
    for t, h, kk, vv in key_rows(full_k, full_v, window):
        dk, dv = np.abs(kk).max(-1) / 255, np.abs(vv).max(-1) / 255  # (keys,) per-element error bounds
        eps = np.abs(q[t, h]).sum() / np.sqrt(HD) * dk.max()
        bound.append(np.expm1(2 * eps) * (np.abs(vv).max() + dv.max()) + dv.max())
    return np.asarray(bound).reshape(-1, H, 1)


@pytest.mark.parametrize("window", [0, 6], ids=["causal", "window-6"])
@pytest.mark.parametrize("block_keys, page_tokens, kernel", [(64, None, False), (8, 8, False), (None, None, True),
                                                             (None, 8, True)],
                         ids=["one-block", "blocks-of-8-pages-for-the-first-8", "kernel", "kernel-for-the-first-8"])
def test_int8_pool_matches_dense_float64_within_its_quantization_bound(window, block_keys, page_tokens, kernel):
    """The pool holds int8 values and a float32 scale per (token, key/value head). Three checks: every stored element
    is within absmax / 255 of its row's true value; attention over what the pool stores (the step's own keys and
    values read as stored too) matches float64 to float32 rounding (2e-5); and against the exact keys and values
    the output is within `quantization_bound` (plus 2e-5), and moved at all. kernel: the Pallas kernel (in its
    interpreter here) reads the int8 pages and their scales for the tokens that read pages."""
    pool, batch, q, new_k, new_v, full_k, full_v = make_case()
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    cached = jax.jit(int8_pool.quantize_pool, static_argnums=1)(f32(pool), HD)  # (1, PAGES, PAGE, KV * 2hd / 4) words, scales
    assert cached.words.dtype == jnp.int32 and cached.words.shape == (1, PAGES, PAGE, KV * 2 * HD // 4)
    assert cached.scales.shape == (1, PAGES, KV * 2, PAGE) and cached.unit == KV * 2 * HD

    @jax.jit
    def run(pool, q, k, v, batch):
        pool = pa.write_kv(pool, 0, k, v, batch.slots)
        return pa.ragged_paged_attention(q, k, v, pool, 0, batch, window=window, block_keys=block_keys,
                                         page_tokens=page_tokens, kernel=kernel), pool

    out, written = run(cached, f32(q), f32(new_k), f32(new_v), batch)
    out = np.asarray(out)
    back = stored(written)[0].reshape(PAGES, PAGE, KV, 2 * HD)
    got_k, got_v = [], []
    for (cached_n, n_new), k, v, pages in zip(CHUNKS, full_k, full_v, [np.asarray(r) for r in batch.page_table]):
        rows = np.stack([back[pages[p // PAGE], p % PAGE] for p in range(cached_n + n_new)])  # (len, KV, 2hd)
        got_k.append(rows[..., :HD])
        got_v.append(rows[..., HD:])
        for exact, read in ((k, got_k[-1]), (v, got_v[-1])):
            # 1e-6: float32's rounding of the value and its scale (the bound is hit: the absmax element saturates)
            assert np.all(np.abs(read - exact) <= np.abs(exact).max(-1, keepdims=True) * (1 / 255 + 1e-6))
    want_stored = dense_reference(q, got_k, got_v, window)
    n = want_stored.shape[0]
    np.testing.assert_allclose(out[:n], want_stored, atol=2e-5, rtol=2e-5)
    assert np.all(np.isfinite(out))
    error = np.abs(out[:n] - dense_reference(q, full_k, full_v, window))
    assert np.all(error <= quantization_bound(q, full_k, full_v, window) + 2e-5)
    assert error.max() > 1e-4  # the int8 path quantized



def dense_kernel(q, pool, layer, page_table, rows, lo, hi, num_tokens, *, null_page, softcap=0.0, sinks=None,
                 **_):
    """The kernel's contract in plain JAX: token i attends over positions [lo[i], hi[i]) of row rows[i]'s pages
    (q already scaled; pool (L, pages, page_size, KV * 2hd), each head's row [k | v]); tokens past num_tokens give 0.
    The case below uses neither soft cap nor sinks."""
    assert not softcap and sinks is None
    n, H, hd = q.shape
    KV = pool.shape[-1] // (2 * hd)
    rows_kv = pool[layer][page_table[rows]].reshape(n, -1, KV, 2 * hd)  # (n, positions, KV, 2hd)
    k = jnp.repeat(rows_kv[..., :hd], H // KV, axis=2)  # (n, positions, H, hd): head h reads kv head h // G
    v = jnp.repeat(rows_kv[..., hd:], H // KV, axis=2)
    pos = jnp.arange(k.shape[1])
    seen = (pos >= lo[:, None]) & (pos < hi[:, None])  # (n, positions)
    s = jnp.where(seen[:, None], jnp.einsum("nhd,nphd->nhp", q, k), -jnp.inf)  # (n, H, positions)
    out = jnp.einsum("nhp,nphd->nhd", jax.nn.softmax(s, axis=-1), v)
    return jnp.where((jnp.arange(n) < num_tokens)[:, None, None], out, 0).astype(q.dtype)


def test_kernel_split_over_heads_equals_one_device(monkeypatch):
    """Under a mesh the kernel runs per device in a shard_map over the heads (a Pallas call is opaque to XLA's
    partitioner): two devices, each with one key/value head's [k | v] rows of the pool and its two query heads, give
    one device's output, and both the float64 reference's. The kernel's place is taken by `dense_kernel`, its
    contract in plain JAX: what is checked here is the split (each device's heads, pool rows and table), while the
    kernel's own numerics are checked above in Pallas's interpreter, on one device. The interpreter over several
    devices synchronises them with barriers that wait forever, which a test suite cannot afford."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from systolic.runtime.sharding import activate

    monkeypatch.setattr(pa.kernel_lib, "paged_attention", dense_kernel)
    pool, batch, q, new_k, new_v, full_k, full_v = make_case()
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731

    def run(pool, q, k, v, batch):
        pool = pa.write_kv(pool, 0, k, v, batch.slots)
        return pa.ragged_paged_attention(q, k, v, pool, 0, batch, window=6, page_tokens=8, kernel=True)

    want = np.asarray(jax.jit(run)(f32(pool), f32(q), f32(new_k), f32(new_v), batch))
    mesh = jax.make_mesh((2,), ("tensor",), devices=jax.devices()[:2])
    with activate(mesh, (("heads", "tensor"), ("kv_heads", "tensor"))):
        heads = NamedSharding(mesh, P(None, "tensor", None))
        args = (jax.device_put(f32(pool), NamedSharding(mesh, P(None, None, None, "tensor"))),
                *(jax.device_put(f32(a), heads) for a in (q, new_k, new_v)))
        got = jax.jit(run)(*args, batch)
    assert got.sharding.spec[1] == "tensor"  # split as it came, not gathered
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-6, rtol=1e-6)
    reference = dense_reference(q, full_k, full_v, window=6)
    np.testing.assert_allclose(want[:reference.shape[0]], reference, atol=2e-5, rtol=2e-5)


def test_which_pools_a_tpu_program_reads_through_the_kernel():
    """In a program for a TPU: a pool of heads 64, 128 or 256 wide in the compute dtype, or in int8 in pages of 128
    tokens (INT8_PAGE: the scales whole lane tiles) of rows packed in units of 512 entries (a lane tile of words); an
    int8 pool in smaller pages or narrower rows reads through the plain path, as MLA's latent rows do. Off a TPU,
    never."""
    from systolic.kernels.paged_attention.kernel import INT8_PAGE
    from systolic.runtime.platform import compiling_for

    floats = jnp.zeros((1, 2, PAGE, 2 * 128), jnp.bfloat16)
    int8 = int8_pool.quantize_pool(jnp.zeros((1, 2, INT8_PAGE, 512)), 64)  # rows of 512: one unit of 128 words
    small = int8_pool.quantize_pool(jnp.zeros((1, 2, INT8_PAGE // 2, 512)), 64)
    narrow = int8_pool.quantize_pool(jnp.zeros((1, 2, INT8_PAGE, 256)), 64)  # 64 words a row: no lane tile
    assert not pa.uses_kernel(floats, 64) and not pa.uses_kernel(int8, 64)
    with compiling_for("tpu"):
        assert [pa.uses_kernel(floats, hd) for hd in (64, 128, 256, 8)] == [True, True, True, False]
        assert [pa.uses_kernel(int8, hd) for hd in (64, 128, 256)] == [True, True, True]
        assert not any(pa.uses_kernel(pool, hd) for hd in (64, 128) for pool in (small, narrow))
        assert not pa.uses_kernel(floats, 128, value_dim=64)
