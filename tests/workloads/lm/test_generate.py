"""KV-cache decoding against full recomputation, and the sampling controls."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from systolic.errors import UserError
from systolic.workloads.lm.model import decode as gen
from systolic.workloads.lm.model.config import ModelConfig
from systolic.workloads.lm.model.transformer import make_model

VOCAB = 64
LLAMA = ModelConfig(
    family="llama", d_model=32, layers=2, heads=4, kv_heads=2, mlp_dim=64, max_seq_len=24, dtype="float32", scan_layers=True
)
GPT2 = ModelConfig(family="gpt2", d_model=32, layers=2, heads=4, max_seq_len=24, dtype="float32")
PROMPT = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (2, 5)), jnp.int32)
NEW = 8


@functools.cache
def model_of(cfg: ModelConfig, std: float = 0.3):
    """graphdef and random params (pure dict) drawn by NumPy: jax.random under jit compiles slowly on CPU."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: make_model(cfg, VOCAB, 0)), nnx.Param)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: jnp.asarray(rng.normal(0.0, std, x.shape), jnp.float32), nnx.to_pure_dict(abstract))
    return graphdef, params


@functools.partial(jax.jit, static_argnums=0)
def full_logits(graphdef, params, tokens):
    return nnx.merge(graphdef, params)(tokens)


def greedy_by_recompute(graphdef, params, prompt, n):
    """Argmax of a full forward over the growing sequence. The model is causal, so one fixed-length buffer
    (one compile) gives the same logits at position t as the sequence cut at t."""
    B, P = prompt.shape
    seq = np.zeros((B, P + n), np.int32)
    seq[:, :P] = prompt
    for t in range(P, P + n):
        seq[:, t] = np.argmax(full_logits(graphdef, params, jnp.asarray(seq))[:, t - 1], axis=-1)
    return seq[:, P:]


@pytest.mark.parametrize("cfg", [LLAMA, GPT2], ids=["llama-scan", "gpt2-list"])
def test_greedy_kv_cache_matches_recompute(cfg):
    graphdef, params = model_of(cfg)
    tokens = gen.generate(graphdef, params, PROMPT, max_new_tokens=NEW)
    assert tokens.shape == (2, NEW) and tokens.dtype == jnp.int32
    want = greedy_by_recompute(graphdef, params, PROMPT, NEW)
    np.testing.assert_array_equal(tokens, want)
    assert len(np.unique(want)) > 2  # not a degenerate constant continuation


def test_sampling_controls():
    graphdef, params = model_of(LLAMA)
    greedy = gen.generate(graphdef, params, PROMPT, max_new_tokens=NEW)
    compiled = gen._generate_jit._cache_size()
    sample = functools.partial(gen.generate, graphdef, params, PROMPT, max_new_tokens=NEW, temperature=2.0)
    a, b, c = sample(key=jax.random.key(1)), sample(key=jax.random.key(1)), sample(key=jax.random.key(2))
    np.testing.assert_array_equal(a, b)
    state = nnx.state(nnx.merge(graphdef, params), nnx.Param)  # params as an nnx.State, as nnx.split gives them
    np.testing.assert_array_equal(gen.generate(graphdef, state, PROMPT, max_new_tokens=NEW, temperature=2.0, key=jax.random.key(1)), a)
    assert not np.array_equal(a, c)
    np.testing.assert_array_equal(sample(key=jax.random.key(3), top_k=1), greedy)
    np.testing.assert_array_equal(sample(key=jax.random.key(3), top_p=1e-6), greedy)
    # temperature, top_k, top_p and the key are traced: none of the calls above compiled again.
    assert gen._generate_jit._cache_size() == compiled


def test_ids_past_vocab_limit_never_sampled():
    graphdef, params = model_of(GPT2)
    limit = 48
    # Make the padded ids win every time unless masked: the final LayerNorm outputs its bias e_0 at every
    # position, and the head maps e_0 to logit 100 for ids >= limit.
    e0 = jnp.zeros(32).at[0].set(1.0)
    params = {
        **params,
        "final_norm": {"scale": jnp.zeros(32), "bias": e0},
        "lm_head": params["lm_head"].at[0, limit:].set(100.0),
    }
    assert np.all(np.asarray(gen.generate(graphdef, params, PROMPT, max_new_tokens=NEW)) >= limit)
    for temperature in (0.0, 1.0):
        tokens = gen.generate(
            graphdef, params, PROMPT, max_new_tokens=NEW, temperature=temperature, key=jax.random.key(0), vocab_limit=limit
        )
        assert np.all(np.asarray(tokens) < limit)


def test_top_k_and_top_p_keep_the_right_ids():
    logits = jnp.log(jnp.asarray([[0.05, 0.5, 0.15, 0.3]]))
    keys = jax.random.split(jax.random.key(0), 512)

    @jax.jit
    def draws(top_k, top_p):
        pick = lambda key: gen.sample_logits(logits, key, temperature=1.0, top_k=top_k, top_p=top_p, vocab_limit=4)
        return jax.vmap(pick)(keys)[:, 0]

    assert set(np.unique(draws(0, 1.0)).tolist()) == {0, 1, 2, 3}
    assert set(np.unique(draws(3, 1.0)).tolist()) == {1, 2, 3}
    assert set(np.unique(draws(0, 0.7)).tolist()) == {1, 3}  # 0.5 + 0.3 reaches 0.7
    assert set(np.unique(draws(2, 0.5)).tolist()) == {1}  # top-p over the top-k mass: 0.5 / 0.8 >= 0.5


def test_too_long_raises_user_error():
    graphdef, params = model_of(LLAMA)
    with pytest.raises(UserError, match="max_seq_len=24"):
        gen.generate(graphdef, params, jnp.zeros((1, 20), jnp.int32), max_new_tokens=5)
    assert gen.generate(graphdef, params, PROMPT, max_new_tokens=0).shape == (2, 0)


def test_prefill_then_steps_match_full_forward():
    cfg = dataclasses.replace(LLAMA, scan_layers=False)
    graphdef, params = model_of(cfg)
    seq = jnp.concatenate([PROMPT, PROMPT[:, :3]], axis=1)  # (2, 8)
    cache = nnx.merge(graphdef, params).init_cache(2, 8)

    @jax.jit
    def run(params, cache):
        last, cache = gen.prefill(graphdef, params, seq[:, :5], cache)
        steps = []
        for t in range(5, 8):
            logits, cache = gen.decode_step(graphdef, params, seq[:, t], cache)
            steps.append(logits)
        return last, jnp.stack(steps, axis=1), cache.length

    last, steps, length = run(params, cache)
    full = full_logits(graphdef, params, seq)
    np.testing.assert_allclose(last, full[:, 4], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(steps, full[:, 5:8], atol=1e-5, rtol=1e-5)
    assert int(length) == 8


def test_the_sample_after_training_is_prompted_with_the_opening_of_held_out_text():
    """No sample.prompt: the first line of the first held-out document, cut at a space (a model of prose is not
    asked to continue `def `)."""
    from systolic.data.tokenizer import ByteTokenizer
    from systolic.workloads.lm.generate import opening

    tok = ByteTokenizer()
    docs = ["\n  The blackbird starts before the light, and by the time the kettle boils\nsecond line", "other"]
    ids = np.concatenate([np.append(tok.encode(d), tok.eot_id) for d in docs])
    assert opening(ids, tok) == "The blackbird starts before the light,"
    assert opening(ids, tok, max_chars=200) == "The blackbird starts before the light, and by the time the kettle boils"
    assert opening(np.array([tok.eot_id]), tok) == ""
    assert opening(ids, tok, max_tokens=18) == "The blackbird s"  # what the model's context leaves the prompt
