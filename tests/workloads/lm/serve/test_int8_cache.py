"""`--kv-cache int8` (kernels/paged_attention/pool.py): the pool's layout and bytes, the pool size that counts them,
and the model's logits over an int8 pool within a stated tolerance of float's (teacher-forced, so both read the same
context). The engine's tokens on an int8 pool: test_engine.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tiny_serve import PAGE, random_params, tiny_model

from systolic.errors import UserError
from systolic.workloads.lm.model.config import ModelConfig
from systolic.kernels.paged_attention import pool as pool_lib
from systolic.workloads.lm.serve.sizing import pool_pages, pool_row
from systolic.workloads.lm.serve.page_allocator import PageTable
from systolic.kernels.paged_attention.paged_kv import PagedKV
from systolic.workloads.lm.serve.scheduler import Chunk, Sequence, layout

LOGIT_TOLERANCE = 0.05  # max |logit(int8) - logit(float)|; the tiny model's logits have std ~0.55, measured <= 0.021
KL_TOLERANCE = 1e-4  # nats, at every position; measured <= 2e-5


def test_int8_pool_layout_and_bytes():
    """The float pool's rows as int8 entries four to an int32 word and a float32 scale per head's key and value,
    positions minor-most (int8_pool.py); per cached token 2 x layers x kv_heads x (hd + 4) bytes, against 2 x layers
    x kv_heads x hd x 4 in float32 and x 2 in bfloat16. Rows split over devices pack per device."""
    cfg = ModelConfig(d_model=32, layers=3, heads=4, kv_heads=2, dtype="float32")  # head_dim 8
    pool = pool_lib.make_pool(pool_lib.pool_shape(pool_row(cfg), 5, PAGE, "int8"))
    assert pool.words.shape == (3, 5, PAGE, 2 * 16 // 4) and pool.words.dtype == jnp.int32 and not np.any(pool.words)
    assert pool.scales.shape == (3, 5, 2 * 2, PAGE) and pool.scales.dtype == jnp.float32
    assert pool.shape == (3, 5, PAGE, 2 * 16) and pool.unit == 32
    assert pool_lib.pool_shape(pool_row(cfg), 5, PAGE, "int8", split=2).unit == 16
    odd = ModelConfig(d_model=12, layers=1, heads=4, kv_heads=1, dtype="float32")  # head_dim 3: rows of 6
    with pytest.raises(UserError, match="row of 6 entries .* not a multiple of 4. Fix: --kv-cache auto"):
        pool_lib.pool_shape(pool_row(odd), 5, PAGE, "int8")
    assert pool_lib.token_bytes(pool_row(cfg), "auto") == 2 * 3 * 2 * 8 * 4
    assert pool_lib.token_bytes(pool_row(cfg), "int8") == 2 * 3 * 2 * (8 + 4)
    llama_1b = ModelConfig(d_model=2048, layers=16, heads=32, kv_heads=8, dtype="bfloat16")
    assert pool_lib.token_bytes(pool_row(llama_1b), "auto") == 2 * 16 * 8 * 64 * 2  # 32 KiB a token
    assert pool_lib.token_bytes(pool_row(llama_1b), "int8") == 2 * 16 * 8 * (64 + 4)  # 0.53x
    with pytest.raises(UserError, match="--kv-cache 'int4' is not a KV cache type"):
        pool_lib.pool_shape(pool_row(cfg), 5, PAGE, "int4")


def test_pool_size_counts_the_int8_bytes_and_scales():
    cfg = tiny_model()  # 2 layers x 2 key/value heads x 2 (keys, values) x (8 int8 + a float32 scale) = 96 bytes
    pages, line = pool_pages(cfg, 16, kv_memory_gib=1 / 1024, max_seqs=4, device=jax.devices()[0], split=1,
                             kv_cache="int8")
    float_pages, _ = pool_pages(cfg, 16, kv_memory_gib=1 / 1024, max_seqs=4, device=jax.devices()[0], split=1)
    assert pages == 2**20 // (96 * 16) and float_pages == 2**20 // (256 * 16)
    assert line.startswith(f"KV cache: {pages - 1} pages of 16 tokens") and "int8 with float32 scales" in line
    pages, _ = pool_pages(cfg, 16, kv_memory_gib=None, max_seqs=4, device=jax.devices()[0], split=1, kv_cache="int8")
    assert pages == 4 * 2 + 1  # CPU: room for the sequences, whatever a page weighs


def teacher_forced_logits(cfg, tokens: np.ndarray, kv_cache: str, prefill: int = 8) -> np.ndarray:
    """The model's logits (len(tokens) - prefill + 1, V) through the paged pool: the first `prefill` tokens in one
    chunk, then one token a step, each reading the earlier ones from the pages; the same tokens whatever the pool
    stores, so the two pools are compared on the same context."""
    graphdef, params = random_params(cfg)
    pages = -(-len(tokens) // PAGE)
    pool = pool_lib.make_pool(pool_lib.pool_shape(pool_row(cfg), pages + 1, PAGE, kv_cache))
    seq = Sequence("s", tokens.tolist(), len(tokens), 0, table=PageTable(pages=list(range(1, pages + 1))))
    step = jax.jit(lambda p, pool, ids, b: nnx.merge(graphdef, p).decode_paged(ids, PagedKV(pool, 0, b)))
    out = []
    for start, n in [(0, prefill)] + [(p, 1) for p in range(prefill, len(tokens))]:
        ids, batch = layout([Chunk(seq, start, n)], tokens=8, rows=1, page_size=PAGE,
                            pages_per_seq=cfg.max_seq_len // PAGE)
        logits, pool = step(params, pool, ids, batch)  # (1, V)
        out.append(np.asarray(logits[0], np.float64))
    return np.stack(out)


def test_int8_logits_within_tolerance_of_float():
    cfg = tiny_model()
    rng = np.random.default_rng(3)
    for _ in range(3):
        tokens = rng.integers(0, 256, cfg.max_seq_len)
        exact, int8 = teacher_forced_logits(cfg, tokens, "auto"), teacher_forced_logits(cfg, tokens, "int8")
        diff = np.abs(int8 - exact)
        assert 1e-4 < diff.max() <= LOGIT_TOLERANCE
        logp, logq = (x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)
                      for x in (exact, int8))
        assert np.all((np.exp(logp) * (logp - logq)).sum(-1) <= KL_TOLERANCE)



def test_pages_default_to_16_and_an_int8_pool_on_a_tpu_to_the_kernels_128():
    """`systolic serve` without --page-size: 16 tokens a page, but 128 for an int8 pool on a TPU, where the Pallas
    kernel reads an int8 page's scales as whole lane tiles (smaller pages take the plain path there)."""
    from systolic.kernels.paged_attention.kernel import INT8_PAGE

    assert [pool_lib.default_page_size(kv, "cpu") for kv in ("auto", "int8")] == [16, 16]
    assert [pool_lib.default_page_size(kv, "tpu") for kv in ("auto", "int8")] == [16, INT8_PAGE] == [16, 128]
