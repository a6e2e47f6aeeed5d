"""The engine's compiled step: the model over one ragged batch of tokens (writing their keys and values into the
paged pool), then one sampled token per row, with its log-probability.

Sampling is `generate`'s (`lm/model/decode.py` `sample_logits`), applied to each row alone with the row's own settings
and key, so a request samples what `generate` samples for it alone: its i-th token is drawn with
`fold_in(PRNGKey(seed), i)`, which is `split(PRNGKey(seed), n)[i]` for any n (threefry's partitionable split,
jax's default), the key `generate` uses for its i-th token. Because a token's key depends only on its request and
its index, batching, preemption and recomputation change no sample.

A detail step (`targets` given: a request asked for the top alternatives or its prompt's log-probabilities) reads
out every token's logits, not only each row's last: each token's log-probability of its target (the prompt's next
token) and its MAX_LOGPROBS most likely ids. It is a separate compiled program, so steps without such a request
pay nothing for it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from systolic.runtime.sharding import Rules, activate
from systolic.workloads.lm.model.decode import sample_logits
from systolic.kernels.paged_attention.metadata import RaggedBatch
from systolic.kernels.paged_attention.paged_kv import PagedKV
from systolic.kernels.paged_attention.pool import Pool

MAX_LOGPROBS = 20  # alternatives a detail step returns per token: OpenAI's top_logprobs limit, vLLM's max_logprobs
MAX_BANNED = 16  # ids a row can keep from being sampled (min_tokens holds back its stop ids)


class RowSampling(NamedTuple):
    """Each row's sampling settings (S rows; padding rows are greedy and ignored)."""

    temperature: jax.Array  # (S,) float32; 0 is greedy
    top_k: jax.Array  # (S,) int32; 0 keeps every id
    top_p: jax.Array  # (S,) float32; 1 keeps every id
    key: jax.Array  # (S, 2) uint32: the request's PRNGKey(seed)
    draw: jax.Array  # (S,) int32: how many tokens the request has sampled before this one
    # (S,) float32: the log-probability's softmax temperature: 1 for the raw model's (serving's), the sampling
    # temperature for the distribution sampled from (SamplingParams.tempered_logprobs: RL's importance ratios)
    logprob_temperature: jax.Array
    banned: jax.Array  # (S, MAX_BANNED) int32: ids the row may not sample now (-1 pads): min_tokens' stop ids


class StepOutput(NamedTuple):
    pool: Pool  # the updated pool
    # (2, M) int32, M the engine's max_seqs (one shape for every bucket): row r's sampled token at [0, r], and at
    # [1, r] its log-probability under softmax(logits / logprob_temperature) (no top-k/p), a float32's bits. One
    # array, so the host reads a step's results in one transfer; the next step reads its tokens on the device.
    sampled: jax.Array
    # Detail steps only (None otherwise), per token slot: the log-probability of its target (T,), and its
    # MAX_LOGPROBS most likely ids (T, K) int32 with theirs (T, K) float32, most likely first.
    target_logprobs: jax.Array | None = None
    top_ids: jax.Array | None = None
    top_logprobs: jax.Array | None = None


def engine_step(graphdef: nnx.GraphDef, params: Any, pool: Pool, tokens: jax.Array, previous: jax.Array,
                batch: RaggedBatch, sampling: RowSampling, vocab_limit: jax.Array, page_tokens: int | None = None,
                targets: jax.Array | None = None) -> StepOutput:
    """tokens (T,) laid out by `batch` -> the next token of each row. A token id -(r + 1) is row r's token sampled by
    the step before, read from that step's `previous` (2, M) `StepOutput.sampled` on the device: the engine launches a
    step before the host has read the last one's tokens (engine.py). Ids >= vocab_limit (the embedding's padding rows)
    are never sampled. `page_tokens` (static): the first tokens that read pages (kernels/paged_attention/paged_kv.py).
    `targets` (T,) int32: each token's next token, for a detail step (see above)."""
    model = nnx.merge(graphdef, params)
    tokens = jnp.where(tokens >= 0, tokens, previous[0, jnp.maximum(-tokens - 1, 0)])  # (T,)
    every = targets is not None
    logits, pool = model.decode_paged(tokens, PagedKV(pool, 0, batch, page_tokens).with_write_runs(),
                                      every_token=every)
    token_logits, logits = (logits, logits[batch.last]) if every else (None, logits)  # (T, V), (S, V) float32
    keys = jax.vmap(jax.random.fold_in)(sampling.key, sampling.draw)  # (S, 2)

    def sample_row(row_logits, key, temperature, top_k, top_p):
        return sample_logits(row_logits[None], key, temperature=temperature, top_k=top_k, top_p=top_p,
                             vocab_limit=vocab_limit)[0]

    V = logits.shape[-1]
    vocab = jnp.arange(V)  # (V,)
    in_vocab = vocab < vocab_limit  # (V,)
    limited = jnp.where(in_vocab, logits, -jnp.inf)  # (S, V)

    def banned_out(source):
        """source (S, V) with each row's banned ids at -inf: they leave the sampled distribution only (the reported
        log-probabilities stay the model's). A mask compared in place (MAX_BANNED compares an element, fused into
        what reads it), not a scattered copy of the logits: each whole-vocabulary float32 pass is 68 MB at 65 rows
        of gemma3-1b's 262,144 ids, 83 us at a v5e's 819 GB/s."""
        banned = functools.reduce(jnp.logical_or, [vocab == sampling.banned[:, b:b + 1]
                                                   for b in range(sampling.banned.shape[1])])  # (S, V)
        return jnp.where(banned, -jnp.inf, source)

    def greedy():
        """The argmax; over the mask only in a step where some row bans an id (min_tokens' stop ids): its compares
        took 0.18 ms of gemma3-1b's 6.8 ms step at 64 rows on the v5e when no row banned any. (Sampling keeps the
        mask: its sort of the vocabulary costs more. The step compiled for a v5e from this host, gemma3-1b at 64
        rows: 12.0-13.0 s, against 15.7-17.0 with the mask before the branches.)"""
        argmax = lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32)  # noqa: E731
        return jax.lax.cond(jnp.any(sampling.banned >= 0), lambda: argmax(banned_out(limited)),
                            lambda: argmax(limited))

    # An all-greedy step skips sampling's sort of the vocabulary (the same ids: greedy rows take the argmax).
    ids = jax.lax.cond(jnp.all(sampling.temperature == 0), greedy,
                       lambda: jax.vmap(sample_row)(banned_out(logits), keys, sampling.temperature, sampling.top_k,
                                                    sampling.top_p))  # (S,)
    # The chosen id's log_softmax(limited / logprob_temperature), as jax.nn.log_softmax computes it, without its
    # (S, V) result: the row's max and sum of exponentials are two reductions, the id's logit one gather. x / 1.0
    # is x exactly, so serving's raw log-probabilities are unchanged by the division.
    scaled = limited / sampling.logprob_temperature[:, None]  # (S, V), fused into the reductions
    top = jnp.max(scaled, axis=-1, keepdims=True)  # (S, 1)
    total = jnp.sum(jnp.exp(scaled - jax.lax.stop_gradient(top)), axis=-1)  # (S,)
    picked = jnp.take_along_axis(limited, ids[:, None], axis=-1)[:, 0] / sampling.logprob_temperature  # (S,)
    chosen = (picked - top[:, 0]) - jnp.log(total)  # (S,)
    sampled = jnp.zeros_like(previous).at[:, :ids.shape[0]].set(
        jnp.stack([ids, jax.lax.bitcast_convert_type(chosen, jnp.int32)]))  # (2, M)
    if not every:
        return StepOutput(pool, sampled)
    # Every token's distribution at its row's log-probability temperature.
    per_token = sampling.logprob_temperature[batch.rows][:, None]  # (T, 1)
    token_logp = jax.nn.log_softmax(jnp.where(in_vocab, token_logits, -jnp.inf) / per_token, axis=-1)  # (T, V)
    target = jnp.take_along_axis(token_logp, targets[:, None], axis=-1)[:, 0]  # (T,)
    top_logprobs, top_ids = jax.lax.top_k(token_logp, MAX_LOGPROBS)  # (T, K) each
    return StepOutput(pool, sampled, target, top_ids.astype(jnp.int32), top_logprobs)


# One compiled step per model (and shape) for every engine of a process: the jitted closures by graphdef. Not
# jit's static_argnums: that hashes the graphdef on every call, which cost more than the step itself (10-20 ms on
# XLA:CPU for a 4-layer model).
_STEPS: dict[nnx.GraphDef, Callable[..., StepOutput]] = {}


def make_step(graphdef: nnx.GraphDef, *, mesh: jax.sharding.Mesh | None, rules: Rules | None,
              param_shardings: Any, pool_sharding: Any, detail: bool = False) -> Callable[..., StepOutput]:
    """`engine_step` compiled for this model and layout: f(params, pool, tokens, previous, batch, sampling,
    vocab_limit, page_tokens), page_tokens static; with `detail`, f(..., page_tokens, targets), the detail step;
    f.lower(...) as jit's. The pool is donated (updated in place); `pool_sharding`: a sharding for each of its arrays
    (kernels/paged_attention/pool.py). On a mesh, the shardings in and out are fixed, so no call after the first of a
    shape compiles again, and the batch arrives replicated."""
    if mesh is None:  # one compiled program per model and shape, shared by every engine of this process
        # (A detail call passes one argument more: jit traces it as its own program.)
        if graphdef not in _STEPS:
            _STEPS[graphdef] = jax.jit(functools.partial(engine_step, graphdef), donate_argnums=1, static_argnums=7)
        return _STEPS[graphdef]
    return _OnMesh(jit_step(graphdef, mesh=mesh, param_shardings=param_shardings, pool_sharding=pool_sharding,
                            detail=detail), mesh, rules)


class _OnMesh:
    """A jitted step traced inside `activate(mesh, rules)`: the layers' logical axis names resolve to the mesh while
    tracing. Called as the jitted function, or `lower`ed (the engine's warm-up compiles the programs together)."""

    def __init__(self, jitted: Any, mesh: jax.sharding.Mesh, rules: Rules | None):
        self._jitted, self._mesh, self._rules = jitted, mesh, rules

    def __call__(self, *args):
        with activate(self._mesh, self._rules):
            return self._jitted(*args)

    def lower(self, *args):
        with activate(self._mesh, self._rules):
            return self._jitted.lower(*args)


def jit_step(graphdef: nnx.GraphDef, *, mesh: jax.sharding.Mesh, param_shardings: Any,
             pool_sharding: jax.sharding.Sharding, detail: bool = False) -> Any:
    """`engine_step` jitted on a mesh, its shardings in and out fixed (the batch replicated, the pool donated): what
    `make_step` runs and `systolic plan lm --serve` lowers; trace it inside `activate(mesh, rules)`. With `detail`,
    the detail step (it takes the targets after page_tokens)."""
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    extra = (replicated,) * detail  # the targets
    out = StepOutput(pool_sharding, replicated, *(replicated,) * (3 * detail))
    return jax.jit(functools.partial(engine_step, graphdef), donate_argnums=1, static_argnums=7,
                   in_shardings=(param_shardings, pool_sharding, replicated, replicated, replicated, replicated,
                                 replicated, *extra), out_shardings=out)
