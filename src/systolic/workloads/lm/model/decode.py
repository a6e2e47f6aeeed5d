"""Sampling from a `Transformer` with a KV cache: pure functions of (graphdef, params), one jit per shape.

`generate` compiles once per (batch, prompt length, max_new_tokens, model); temperature, top-k, top-p, the
key and the vocabulary limit are traced values, so changing them does not recompile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from systolic.errors import UserError
from systolic.workloads.lm.model.rope import longrope_switch_step
from systolic.workloads.lm.model.kv_cache import KVCache
from systolic.workloads.lm.model.transformer import Transformer


def _merge(graphdef: nnx.GraphDef, params) -> Transformer:
    # copy=True: when params is an nnx.State its Variables belong to the trace that made them (jit); reused
    # inside lax.scan's body, the model's nnx.scan/nnx.remat reject them ("different trace level").
    return nnx.merge(graphdef, params, copy=True)


def prefill(graphdef: nnx.GraphDef, params, prompt: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Runs the whole prompt (B, P) at once; returns the last position's logits (B, V) float32 and the cache."""
    logits, cache = _merge(graphdef, params).decode(prompt, cache)  # (B, P, V)
    return logits[:, -1], cache


def decode_step(graphdef: nnx.GraphDef, params, token: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Feeds one token per row (B,); returns the next logits (B, V) float32 and the cache."""
    logits, cache = _merge(graphdef, params).decode(token[:, None], cache)  # (B, 1, V)
    return logits[:, 0], cache


def sample_logits(logits, key, *, temperature, top_k, top_p, vocab_limit) -> jax.Array:
    """Picks one id per row of logits (B, V): argmax when temperature is 0, else a sample restricted to the
    top_k most likely ids (0 = all) and to the smallest set holding top_p of their probability (1 = all).
    Ids >= vocab_limit (padding rows of the embedding) are never chosen."""
    V = logits.shape[-1]
    logits = jnp.where(jnp.arange(V) < vocab_limit, logits, -jnp.inf)  # (B, V)
    greedy = jnp.argmax(logits, axis=-1)  # (B,)
    scaled = logits / jnp.maximum(temperature, 1e-6)  # (B, V)
    ranked = -jnp.sort(-scaled, axis=-1)  # (B, V) descending
    kth = jnp.where(top_k > 0, ranked[:, jnp.clip(top_k - 1, 0, V - 1)], -jnp.inf)  # (B,)
    ranked = jnp.where(ranked >= kth[:, None], ranked, -jnp.inf)
    # Top-p over the top-k distribution (as Hugging Face does): keep ids whose preceding mass is < top_p,
    # which always keeps the most likely one.
    probs = jax.nn.softmax(ranked, axis=-1)  # (B, V)
    kept = jnp.cumsum(probs, axis=-1) - probs < top_p  # (B, V)
    pth = jnp.min(jnp.where(kept, ranked, jnp.inf), axis=-1)  # (B,)
    threshold = jnp.maximum(kth, pth)[:, None]  # (B, 1)
    sampled = jax.random.categorical(key, jnp.where(scaled >= threshold, scaled, -jnp.inf), axis=-1)  # (B,)
    return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)


def generate(
    graphdef: nnx.GraphDef,
    params,
    prompt: jax.Array,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    key: jax.Array | None = None,
    vocab_limit: int | None = None,
) -> jax.Array:
    """Continues each row of prompt int32 (B, P) by max_new_tokens ids; returns them, int32 (B, max_new_tokens).

    temperature 0 is greedy (key unused); otherwise `key` is required. vocab_limit defaults to every row of
    the embedding; pass the tokenizer's vocabulary size so padded ids are never produced.
    """
    model: Transformer = nnx.merge(graphdef, params)
    B, P = prompt.shape
    limit = model.cfg.max_seq_len
    if P < 1:
        raise UserError(
            f"The prompt is empty (shape {tuple(prompt.shape)}); decoding needs at least one token to condition on. "
            "Fix: pass a prompt of at least one token, e.g. the tokenizer's end-of-text id."
        )
    if P + max_new_tokens > limit:
        raise UserError(
            f"Cannot generate {max_new_tokens} tokens after a prompt of {P} tokens: the model attends over at most "
            f"model.max_seq_len={limit} positions, so prompt + new tokens must be <= {limit}. Fix: shorten the prompt "
            f"to at most {max(limit - max_new_tokens, 1)} tokens, lower max_new_tokens to at most {max(limit - P, 0)}, "
            "or train a model with a larger model.max_seq_len."
        )
    if max_new_tokens == 0:
        return jnp.zeros((B, 0), jnp.int32)
    if temperature > 0 and key is None:
        raise ValueError("generate(temperature > 0) samples, so it needs a key: pass key=jax.random.key(seed).")
    key = jax.random.key(0) if key is None else key
    vocab_limit = model.vocab if vocab_limit is None else vocab_limit
    if isinstance(params, nnx.State):  # one compiled program whether params come as a State or a pure dict
        params = nnx.to_pure_dict(params)
    return _generate_jit(
        graphdef, params, jnp.asarray(prompt, jnp.int32), key, jnp.float32(temperature), jnp.int32(top_k),
        jnp.float32(top_p), jnp.int32(vocab_limit), max_new_tokens=max_new_tokens,
    )


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens"))
def _generate_jit(graphdef, params, prompt, key, temperature, top_k, top_p, vocab_limit, *, max_new_tokens):
    sample = functools.partial(sample_logits, temperature=temperature, top_k=top_k, top_p=top_p, vocab_limit=vocab_limit)
    B, P = prompt.shape
    keys = jax.random.split(key, max_new_tokens)
    # The last new token is never fed back, so the cache needs P + max_new_tokens - 1 positions.
    cache = _merge(graphdef, params).init_cache(B, P + max_new_tokens - 1)
    logits, cache = prefill(graphdef, params, prompt, cache)  # (B, V)
    first = sample(logits, keys[0])  # (B,)

    def step(carry, step_key):
        token, cache = carry
        logits, cache = decode_step(graphdef, params, token, cache)
        token = sample(logits, step_key)
        return (token, cache), token

    switch = longrope_switch_step(_merge(graphdef, params).cfg, P, max_new_tokens)
    if switch is None:
        _, rest = jax.lax.scan(step, (first, cache), keys[1:])  # (N-1, B)
        return jnp.concatenate([first[:, None], rest.T], axis=1)  # (B, N)
    # LongRoPE: where the sequence passes the original context, every position turns to the long factors: the whole
    # sequence runs again into a fresh cache, as transformers' Phi-3 generate recomputes its cache there.
    (_, cache), before = jax.lax.scan(step, (first, cache), keys[1:switch])  # (switch-1, B)
    sequence = jnp.concatenate([prompt, first[:, None], before.T], axis=1)  # (B, P + switch)
    fresh = _merge(graphdef, params).init_cache(B, P + max_new_tokens - 1)
    logits, cache = prefill(graphdef, params, sequence, fresh)
    token = sample(logits, keys[switch])  # (B,)
    _, after = jax.lax.scan(step, (token, cache), keys[switch + 1:])  # (N-1-switch, B)
    return jnp.concatenate([first[:, None], before.T, token[:, None], after.T], axis=1)  # (B, N)
