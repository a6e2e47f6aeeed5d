"""The inference engine: requests in, tokens out, one scheduler step at a time (single-threaded; the server
drives it from one thread).

    engine = InferenceEngine.from_run("runs/lm-tiny")      # prints the KV pool's size
    engine.warmup()                                         # compiles every step size once
    engine.add_request("a", prompt_ids, SamplingParams(max_tokens=32, temperature=0))
    while engine.has_work():
        for event in engine.step():                         # TokenEvents: one per sampled token, then the end
            ...

Each `step` runs one ragged batch (scheduler.py): prefill chunks and decodes of the running requests, laid out in the
paged KV cache (page_allocator.py, kernels/paged_attention/), compiled once per token bucket (step.py). A request ends
with a finish reason: "stop" (an end token or a stop string), "length" (max_tokens) or "cancelled". Greedy outputs are
`generate`'s; so are samples with the same seed, whatever else runs beside them. A request may also ask for the top
alternatives of its tokens and for its prompt's own log-probabilities (logprobs.py).

Mixture-of-experts models run dropless here, whatever their model.moe.capacity_factor: dropping assignments over a
capacity would make a token's output depend on the other requests in its step.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from systolic.config import MAX_SEED
from systolic.data.generation_config import eos_ids
from systolic.data.tokenizer import Tokenizer
from systolic.data.chat import find_chat_template
from systolic.engine import finished
from systolic.engine.fit import compiler_memory
from systolic.errors import UserError
from systolic.kernels.paged_attention.pool import default_page_size, heads_split, make_pool, pool_shape, pool_shardings
from systolic.runtime.platform import compiling_for
from systolic.runtime.sharding import Rules
from systolic.workloads.lm.config import LMConfig
from systolic.workloads.lm.model.config import ModelConfig
from systolic.workloads.lm.loaded_run import load_run
from systolic.workloads.lm.model import quant
from systolic.workloads.lm.model.layers import resolve_dtype
from systolic.workloads.lm.model.lora import base_config
from systolic.workloads.lm.model.rope import longrope_context
from systolic.workloads.lm.serve.detokenize import TextStream
from systolic.workloads.lm.serve.page_allocator import PageCache
from systolic.workloads.lm.serve.logprobs import PromptLogprobs, StepDetail, TokenLogprob, targets
from systolic.workloads.lm.serve.scheduler import (Chunk, Scheduler, Sequence, layout, page_bucket, page_buckets,
                                                    pages_first, token_buckets)
from systolic.workloads.lm.serve.sizing import (check_settings, check_sizes, kv_splits, pool_layout, pool_pages,
                                                 pool_row, tensor_layout, tokens_per_step)
from systolic.workloads.lm.serve.step import MAX_BANNED, MAX_LOGPROBS, RowSampling, StepOutput, make_step
from systolic.workloads.lm.serve.weights import serving_params

INT32_MAX = 2**31 - 1  # the step's integer arrays (top_k, token ids) are int32
WARMUP_THREADS = 8  # step programs compiled at once by `warmup`


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples: `generate`'s settings, plus stop strings (the text ends before the first one) and
    the log-probability of each chosen token. `stop_token_ids`: the ids that end the request (not part of its
    text); None is every eos id the model declares (`data.generation_config.eos_ids`: the tokenizer's end of text
    and the imported model's eos ids; a chat passes its template's `stop_ids`, which include them).
    `tempered_logprobs`: log-probabilities under softmax(logits / temperature), the distribution sampled from before
    top-k and top-p (what GRPO's importance ratios compare, lm/post/rollout.py), instead of the raw model's.
    vLLM's extensions: `top_logprobs` alternatives for each sampled token (with `logprobs`); `prompt_logprobs`, when
    not None, the prompt's own tokens scored with that many alternatives each (max_tokens may then be 0: the prompt
    is scored and nothing sampled); no stop id is sampled before `min_tokens` tokens; `include_stop_str` keeps the
    stop string that ended the text; `skip_special_tokens` False writes special tokens' text."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None  # None: a fresh random seed
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    stop_token_ids: tuple[int, ...] | None = None
    tempered_logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    include_stop_str: bool = False
    skip_special_tokens: bool = True


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """One sampled token of a request, or its end. `text` is the new text (text that may begin a stop string is
    held back until the next tokens decide); `finish_reason` is None while the request runs, then "stop",
    "length" or "cancelled" (a cancelled request's one event has no token). `top`: the most likely ids at the
    token's position (SamplingParams.top_logprobs); `prompt`: the prompt's scored tokens, on a request's first event
    (SamplingParams.prompt_logprobs)."""

    request_id: str
    token_id: int | None
    text: str
    logprob: float | None
    finish_reason: str | None
    top: tuple[tuple[int, float], ...] = ()
    prompt: tuple[TokenLogprob, ...] | None = None


@dataclasses.dataclass
class _Launched:
    """A step on the device whose results the host has not read (InferenceEngine.step)."""

    chunks: list[Chunk]
    pending: list[int | None]  # per row: where in its sequence's tokens the token it samples goes (None: no sample)
    out: StepOutput
    last: np.ndarray  # (S,) each row's last token slot
    detail: bool


@dataclasses.dataclass
class _Request:
    seq: Sequence
    params: SamplingParams
    key: np.ndarray  # (2,) uint32: jax.random.PRNGKey(seed)
    stop_ids: frozenset[int]
    stream: TextStream
    prompt_logprobs: PromptLogprobs | None  # None: not asked for, or already sent


def prng_key_data(seed: int) -> np.ndarray:
    """jax.random.PRNGKey(seed) for 0 <= seed <= MAX_SEED (threefry's key: the seed's high and low 32 bits),
    computed on the host: a jax call per request would dispatch (and first compile) a program."""
    return np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)


def _platform_of(params: Any) -> str:
    """The platform the parameters live on (where jax.device_put puts host arrays: the default device's)."""
    leaf = jax.tree.leaves(params)[0]
    return next(iter(leaf.devices())).platform if isinstance(leaf, jax.Array) else jax.devices()[0].platform


class InferenceEngine:
    """Continuous batching over a paged KV cache of `kv_pages` pages (page 0 reserved) of `page_size` tokens, its
    keys and values in the compute dtype or int8 (`kv_cache`: kernels/paged_attention/pool.py)."""

    def __init__(self, model: ModelConfig, params: Any, tokenizer: Tokenizer, *, kv_pages: int,
                 page_size: int | None = None,
                 max_seqs: int = 16, max_tokens_per_step: int | None = None, prefix_caching: bool = True,
                 mesh: jax.sharding.Mesh | None = None, rules: Rules | None = None, model_name: str = "model",
                 chat_template: Any = None, kv_cache: str = "auto"):
        """`params`: the model's parameters (pure dict), laid out on `mesh` by `rules` when a mesh is given.
        `max_tokens_per_step` None: `tokens_per_step(max_seqs)`. `page_size` None: pool.default_page_size for
        `kv_cache` on the parameters' platform."""
        from systolic.workloads.lm.model.build import model_graphdef, param_shardings

        if max_tokens_per_step is None:
            max_tokens_per_step = tokens_per_step(max_seqs)
        if page_size is None:
            page_size = default_page_size(kv_cache, _platform_of(params))
        check_sizes(kv_pages, page_size, max_seqs, max_tokens_per_step)
        self.max_tokens_per_step = max_tokens_per_step
        self.model_cfg = dataclasses.replace(model, moe=dataclasses.replace(model.moe, capacity_factor=0.0))
        self.vocab = int(params["embed"].shape[0])
        self.tokenizer, self.chat_template, self.model_name = tokenizer, chat_template, model_name
        self.max_context = model.max_seq_len
        self.page_size, self.max_seqs = page_size, max_seqs
        self.pages_per_seq = -(-self.max_context // page_size)
        self.buckets = token_buckets(max_tokens_per_step)
        self.vocab_limit = np.int32(min(tokenizer.vocab_size, self.vocab))
        self.eos_ids = eos_ids(tokenizer)  # where a request without stop_token_ids ends
        # Weights stored quantized (lm/model/quant.py) keep their weight's layout; their scales follow it.
        shardings = None if mesh is None else quant.quantized_shardings(
            param_shardings(self.model_cfg, self.vocab, mesh, rules), params)
        self._dtype = resolve_dtype(model.dtype)
        self.params = serving_params(jax.device_put(params, shardings), self._dtype)  # weights.py: no float32 read
        self._layout = jax.tree.map(lambda x: x.sharding, self.params)  # what set_params puts new weights on
        # The step is traced for its devices' platform (the Pallas attention kernel on a TPU), not this process's
        # default one: an engine on the host's CPU beside a TPU (tests/tpu/test_serve.py) takes the plain path.
        self._platform = _platform_of(self.params)
        home = pool_layout(self.params, mesh, rules)
        row = pool_row(model)  # a token's row, packed per device in an int8 pool
        shape = pool_shape(row, kv_pages, page_size, kv_cache, split=heads_split(home, row.width))
        self.pool = make_pool(shape, home)
        graphdef = model_graphdef(self.model_cfg, self.vocab)
        self._step, self._detail_step = (make_step(graphdef, mesh=mesh, rules=rules, param_shardings=shardings,
                                                   pool_sharding=pool_shardings(shape, home), detail=detail)
                                         for detail in (False, True))
        self.scheduler = Scheduler(PageCache(kv_pages, page_size, prefix_caching=prefix_caching), max_seqs=max_seqs,
                                   max_tokens_per_step=max_tokens_per_step, longrope_context=longrope_context(model))
        self._requests: dict[str, _Request] = {}
        self._cancelled: list[str] = []
        self._arrivals = 0
        self._batch_tokens = 0
        self._seeds = np.random.default_rng()
        self._programs: dict[tuple[int, int, bool], Any] = {}  # warm-up's compiled steps: (tokens, reading, detail)
        self._inflight: _Launched | None = None  # the step launched last, its results not yet read
        # Seconds the host has waited for the device's results since the start: what the host did not hide of the
        # device's time (benchmarks/studies/serve_engine.py's "host" column is the rest of a step's wall time).
        self.waited_s = 0.0
        self._previous = jax.device_put(np.zeros((2, max_seqs), np.int32),  # its outputs (step.py StepOutput)
                                        home if mesh is None else NamedSharding(mesh, P()))

    @classmethod
    def from_run(cls, run_dir: str | Path, *, kv_memory_gib: float | None = None, page_size: int | None = None,
                 max_seqs: int = 16, max_tokens_per_step: int | None = None, prefix_caching: bool = True,
                 mesh_tensor: int = 1, kv_cache: str = "auto", quantize: str | None = None,
                 say: Callable[[str], None] = print) -> InferenceEngine:
        """The engine of the lm run `run_dir` (trained, fine-tuned with LoRA: merged, or imported), its parameters
        split over `mesh_tensor` devices (Megatron tensor parallelism) when > 1. The pool holds `kv_memory_gib` GiB
        (all its devices together), or by default sizing.KV_MEMORY_FRACTION of a device's free memory (on CPU, which
        reports none: room for max_seqs sequences of the full context), its keys and values stored as `kv_cache` says
        (kernels/paged_attention/pool.py: "auto" or "int8"); `say` prints its size. `quantize`: the weights quantized
        after loading, as lm/model/quant.py's scheme of that name (a run written by `systolic quantize` comes
        quantized without it). `max_tokens_per_step` None: `tokens_per_step(max_seqs)`; `page_size` None: 16, or 128
        for an int8 pool on a TPU (pool.default_page_size)."""
        run_dir = Path(run_dir)
        if page_size is None:
            page_size = default_page_size(kv_cache, jax.devices()[0].platform)
        max_tokens_per_step = tokens_per_step(max_seqs) if max_tokens_per_step is None else max_tokens_per_step
        command = "systolic serve"
        model = base_config(finished.read_config(run_dir, LMConfig, command).model)
        check_settings(model, page_size=page_size, max_seqs=max_seqs, max_tokens_per_step=max_tokens_per_step,
                       mesh_tensor=mesh_tensor)
        mesh, rules = tensor_layout(model, mesh_tensor) if mesh_tensor > 1 else (None, None)
        run = load_run(run_dir, command, layout=None if mesh is None else (mesh, rules), quantize=quantize)
        devices = jax.devices()[:1] if mesh is None else list(mesh.devices.flat)
        kv_split = mesh_tensor if kv_splits(model, mesh_tensor) else 1  # tensor_layout's choice
        pages, text = pool_pages(model, page_size, kv_memory_gib=kv_memory_gib, max_seqs=max_seqs,
                                 device=devices[0], split=kv_split, kv_cache=kv_cache)
        say(text)
        return cls(run.cfg.model, run.params, run.tokenizer, kv_pages=pages, page_size=page_size,
                   max_seqs=max_seqs, max_tokens_per_step=max_tokens_per_step, prefix_caching=prefix_caching,
                   mesh=mesh, rules=rules, model_name=run_dir.name, chat_template=find_chat_template(run.tokenizer),
                   kv_cache=kv_cache)

    def set_params(self, params: Any) -> None:
        """Serves new weights (a pure dict shaped as the current ones; laid out as the engine's, so a trainer's
        parameters on the same mesh and rules are used in place, not copied; in a bfloat16 model, cast once to
        it: weights.py), between requests. The prefix cache
        is dropped: keys and values computed with the old weights must not be reused."""
        if self._requests:
            raise ValueError(f"set_params with {len(self._requests)} requests running: their keys and values are of "
                             "the old weights. Fix: let every request finish (or cancel it) first.")
        self._collect()  # a step launched after the last request's end token: rows of ended requests only
        self.params = serving_params(jax.device_put(params, self._layout), self._dtype)
        self.scheduler.cache.forget_prefixes()

    # REQUESTS

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queues a request; a UserError (nothing queued) when the prompt or the settings are out of range."""
        prompt = [int(t) for t in prompt_ids]
        self._check(request_id, prompt, params)
        seed = int(self._seeds.integers(MAX_SEED + 1)) if params.seed is None else params.seed
        stop_ids = self.eos_ids if params.stop_token_ids is None else params.stop_token_ids
        scored = None if params.prompt_logprobs is None else PromptLogprobs(prompt, params.prompt_logprobs)
        seq = Sequence(request_id, prompt, len(prompt), self._arrivals, scores_prompt=scored is not None)
        self._arrivals += 1
        stream = TextStream(self.tokenizer, prompt, params.stop, keep_stop=params.include_stop_str,
                            skip_special_tokens=params.skip_special_tokens)
        self._requests[request_id] = _Request(seq, params, prng_key_data(seed), frozenset(stop_ids), stream, scored)
        self.scheduler.add(seq)

    def cancel(self, request_id: str) -> None:
        """Ends a request now and frees its pages; the next step reports it ("cancelled"). Unknown or finished
        ids are ignored: a client may go away just as its request ends."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            self.scheduler.remove(request.seq)
            self._cancelled.append(request_id)

    def has_work(self) -> bool:
        """Whether a step has anything to do or report."""
        return bool(self._requests or self._cancelled or self._inflight)

    def stats(self) -> dict[str, int]:
        """The engine's state for metrics: KV pages held by requests (used), usable (total) and holding a cached
        prefix no request uses (cached); requests running and waiting; the last step's tokens (batch_size); and
        counts since the start: preemptions, prompt tokens found in the prefix cache."""
        cache = self.scheduler.cache
        return {"kv_pages_used": cache.used, "kv_pages_total": cache.total, "kv_pages_cached": cache.cached,
                "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "batch_size": self._batch_tokens, "preemptions": self.scheduler.preemptions,
                "prefix_hit_tokens": self.scheduler.prefix_hit_tokens}

    # STEPS

    def step(self) -> list[TokenEvent]:
        """One scheduler step: the chunks of prompts and the decodes of every running request, in one batch.
        Returns the events of the step before it (sampled tokens, finished requests) and cancellations.

        The step is launched before the host reads the last one's results, so the host's work for step N (reading
        its tokens, detokenizing, stop strings, scheduling and laying out N + 2) runs while the device computes
        N + 1: a decode reads the token sampled for it in the step before on the device (step.py). A request is
        scheduled as if its pending token did not end it; when that token does (an end token or a stop string),
        the one step computed after it is dropped. A request that reaches max_tokens is not scheduled again. While
        any request wants log-probabilities of alternatives or of its prompt, steps run one at a time (launched and
        read at once): their prompt scores and targets need every token on the host."""
        events = [TokenEvent(rid, None, "", None, "cancelled") for rid in self._cancelled]
        self._cancelled.clear()
        at_once = any(self._wants_alternatives(r) for r in self._requests.values())
        if at_once:
            events += self._collect()
        chunks = pages_first(self.scheduler.schedule())
        self._batch_tokens = sum(c.count for c in chunks)
        launched = None
        if chunks:
            launched = self._launch(chunks, detail=at_once and any(self._wants_detail(c) for c in chunks))
        events += self._collect()  # the step before, while this one runs
        self._inflight = launched
        if at_once:
            events += self._collect()
        return events

    def warmup(self, progress: Callable[[str], None] | None = None) -> int:
        """Compiles the step for every token bucket and count of page-reading tokens, and the detail step
        (log-probabilities) for each bucket (it reads every token's pages), so no request compiles anything. The
        programs are traced one at a time and compiled together on WARMUP_THREADS threads (XLA's compiler releases
        the GIL; on a TPU host one after another took 144 s for llama-1b's 18); each is then run once on an empty
        batch (padding writes only the null page). `progress` hears a line after each program: which of how many,
        and the time so far. -> how many programs."""
        programs = [(size, reading, False) for size in self.buckets for reading in page_buckets(size)]
        programs += [(size, size, True) for size in self.buckets]  # the detail step reads every token's pages
        advice = (f"a smaller --max-tokens-per-step (now {self.max_tokens_per_step:,}) or fewer --max-seqs (now "
                  f"{self.max_seqs:,}), or a smaller KV cache (--kv-memory-gib); `systolic plan lm --serve --target "
                  "...` compiles the step for a TPU beforehand")
        start = time.perf_counter()
        workers = ThreadPoolExecutor(max_workers=WARMUP_THREADS)
        try:
            compiling = [workers.submit(self._lower(*program).compile) for program in programs]
            for i, (program, future) in enumerate(zip(programs, compiling), 1):
                size, reading, detail = program
                with compiler_memory(advice, what=f"The serving step of {size:,} tokens ({reading:,} of them reading "
                                                  f"pages{', with log-probabilities' if detail else ''})"):
                    self._programs[program] = future.result()
                self._inflight = self._launch([], tokens=size, page_tokens=reading, detail=detail)
                self._collect()
                if progress is not None:
                    what = ("with every token's log-probabilities" if detail else
                            f"{reading} cached tokens read a sequence")
                    progress(f"warm-up: step program {i} of {len(programs)} compiled ({size} tokens a step, {what}); "
                             f"{time.perf_counter() - start:.1f} s")
        finally:  # after a program that did not fit, those not yet started are dropped, not compiled
            workers.shutdown(cancel_futures=True)
        return len(programs)

    def _lower(self, size: int, reading: int, detail: bool) -> Any:
        """The step program of `size` token slots, `reading` of them reading pages, lowered (traced) for the
        arguments `_launch` passes it."""
        args, extra = self._inputs([], size, reading, detail)
        with compiling_for(self._platform):
            return (self._detail_step if detail else self._step).lower(*args, reading, *extra)

    def _inputs(self, chunks: list[Chunk], tokens: int, reading: int, detail: bool
                ) -> tuple[tuple, tuple[np.ndarray, ...]]:
        """The step's arguments for the chunks in `tokens` slots, before the static page_tokens (`reading`), and
        after it (the detail step's targets)."""
        ids, batch = layout(chunks, tokens=tokens, rows=min(tokens, self.max_seqs), page_size=self.page_size,
                            pages_per_seq=self.pages_per_seq)
        args = (self.params, self.pool, ids, self._previous, batch,
                self._row_sampling(chunks, batch.kv_lens.shape[0]), self.vocab_limit)
        return args, (targets(chunks, tokens),) if detail else ()

    @staticmethod
    def _wants_alternatives(request: _Request) -> bool:
        """Whether a request needs a detail step: its prompt's log-probabilities, or alternatives of its tokens."""
        return request.prompt_logprobs is not None or (request.params.logprobs and request.params.top_logprobs > 0)

    def _wants_detail(self, chunk: Chunk) -> bool:
        request = self._requests[chunk.seq.request_id]
        return ((chunk.samples and request.params.logprobs and request.params.top_logprobs > 0)
                or (request.prompt_logprobs is not None and request.prompt_logprobs.wants(chunk)))

    def _launch(self, chunks: list[Chunk], tokens: int | None = None, page_tokens: int | None = None, *,
                detail: bool = False) -> _Launched:
        """Launches the chunks (`pages_first` order) in the smallest bucket that holds them, without waiting for
        the device. Each row that samples gets a pending token in its sequence (an id -(row + 1): the next step
        reads it from this one's output), so the scheduler sees it decoding; its sequence is parked once that token
        is its max_tokens-th."""
        n = sum(c.count for c in chunks)
        T = tokens or next(b for b in self.buckets if b >= n)
        # The detail step is compiled for every token reading pages only (one program per bucket, not per reading).
        reading = T if detail else page_tokens or page_bucket(T, sum(c.count for c in chunks if c.start > 0))
        args, extra = self._inputs(chunks, T, reading, detail)
        compiled = self._programs.get((T, reading, detail))  # warmup's, called without the static page_tokens
        if compiled is not None:
            out = compiled(*args, *extra)
        else:
            with compiling_for(self._platform):
                out = (self._detail_step if detail else self._step)(*args, reading, *extra)
        self.pool, self._previous = out.pool, out.sampled
        self.scheduler.advance(chunks)
        pending: list[int | None] = []
        for row, chunk in enumerate(chunks):
            seq = chunk.seq
            if chunk.start + chunk.count != len(seq.tokens):  # a prompt chunk short of its end samples nothing
                pending.append(None)
                continue
            pending.append(len(seq.tokens))
            seq.tokens.append(-(row + 1))
            if seq.generated >= max(self._requests[seq.request_id].params.max_tokens, 1):
                self.scheduler.park(seq)  # ends when this token is read: no step for it after this one
        return _Launched(chunks, pending, out, args[4].last, detail)  # args[4]: the RaggedBatch

    def _collect(self) -> list[TokenEvent]:
        """Reads the launched step's results (one transfer; waits for the device) into its requests' events, and
        forgets it. Rows of requests that ended or were cancelled since are dropped."""
        launched, self._inflight = self._inflight, None
        if launched is None:
            return []
        start = time.perf_counter()
        sampled = np.asarray(launched.out.sampled)  # (2, M): tokens, log-probabilities' bits
        self.waited_s += time.perf_counter() - start
        tokens, logprobs = sampled[0], sampled[1].view(np.float32)
        out = launched.out
        found = StepDetail(np.asarray(out.target_logprobs), np.asarray(out.top_ids),
                           np.asarray(out.top_logprobs)) if launched.detail else None
        events = []
        first_slot = 0
        for row, (chunk, at) in enumerate(zip(launched.chunks, launched.pending)):
            seq = chunk.seq
            request = self._requests.get(seq.request_id)
            slot, first_slot = first_slot, first_slot + chunk.count
            if request is None or request.seq is not seq:
                continue
            if request.prompt_logprobs is not None and found is not None:
                request.prompt_logprobs.record(chunk, slot, found)
            if at is not None:
                seq.tokens[at] = int(tokens[row])
            self.scheduler.cache.register(seq.table, seq.tokens, seq.computed)  # its tokens are all known now
            if at is not None:
                wants_top = request.params.logprobs and request.params.top_logprobs > 0
                top = found.top(launched.last[row], request.params.top_logprobs) if wants_top else ()
                events.append(self._accept(seq, at, float(logprobs[row]), top))
        return events

    def _row_sampling(self, chunks: list[Chunk], rows: int) -> RowSampling:
        """Each row's settings; rows that do not sample this step (and padding rows) are greedy."""
        temperature, top_p = np.zeros(rows, np.float32), np.ones(rows, np.float32)
        top_k, draw = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
        key = np.zeros((rows, 2), np.uint32)
        logprob_temperature = np.ones(rows, np.float32)
        banned = np.full((rows, MAX_BANNED), -1, np.int32)
        for r, chunk in enumerate(chunks):
            if chunk.samples:
                request = self._requests[chunk.seq.request_id]
                p = request.params
                # A top_k past the vocabulary keeps every id, as 0 does (and fits int32 whatever was checked).
                temperature[r], top_k[r], top_p[r] = p.temperature, min(p.top_k, self.vocab), p.top_p
                key[r], draw[r] = request.key, chunk.seq.generated
                if p.tempered_logprobs and p.temperature > 0:
                    logprob_temperature[r] = p.temperature
                if chunk.seq.generated < p.min_tokens:  # too early to end: its stop ids are not sampled
                    stops = sorted(request.stop_ids)
                    banned[r, :len(stops)] = stops
        return RowSampling(temperature, top_k, top_p, key, draw, logprob_temperature, banned)

    def _accept(self, seq: Sequence, at: int, logprob: float, top: tuple[tuple[int, float], ...]) -> TokenEvent:
        """Takes the token sampled at seq.tokens[at] into its request; ends the request on a stop token, a stop
        string or max_tokens (at once for max_tokens=0, whose token is dropped: the request only scores its
        prompt)."""
        request = self._requests[seq.request_id]
        token = seq.tokens[at]
        prompt = None
        if request.prompt_logprobs is not None:  # complete: the prompt was computed to its end before this token
            prompt, request.prompt_logprobs = request.prompt_logprobs.result(), None
            seq.scores_prompt = False  # recomputed after a preemption, it may start after a cached prefix
        if request.params.max_tokens == 0:
            del self._requests[seq.request_id]
            self.scheduler.remove(seq)
            return TokenEvent(seq.request_id, None, "", None, "length", prompt=prompt)
        finish = None
        if token in request.stop_ids:
            text, finish = request.stream.finish(), "stop"
        else:
            text, stopped = request.stream.add(token)
            if stopped:
                finish = "stop"
            elif at + 1 - seq.prompt_len >= request.params.max_tokens:
                text, finish = text + request.stream.finish(), "length"
        if finish is not None:
            del self._requests[seq.request_id]
            self.scheduler.remove(seq)
        logged = request.params.logprobs
        return TokenEvent(seq.request_id, token, text, logprob if logged else None, finish, top if logged else (),
                          prompt)

    def _check(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        """A UserError naming the first thing wrong with a request."""
        n, limit = len(prompt), self.max_context
        problem = None
        if request_id in self._requests:
            problem = f"a request with id {request_id!r} is already running. Fix: give each request its own id"
        elif n == 0:
            problem = ("the prompt is empty; a model needs at least one token to condition on. Fix: send at least one "
                       "token, e.g. the tokenizer's end-of-text id")
        elif any(not 0 <= t < self.vocab for t in prompt):
            bad = next(t for t in prompt if not 0 <= t < self.vocab)
            problem = (f"the prompt holds token id {bad}, outside the model's {self.vocab} ids. Fix: ids in "
                       f"[0, {self.vocab})")
        elif params.max_tokens < (params.prompt_logprobs is None) or n + max(params.max_tokens, 1) > limit:
            problem = (f"a prompt of {n} tokens with max_tokens={params.max_tokens} needs {n + params.max_tokens} "
                       f"positions, but max_tokens must be >= 1 (0 only to score the prompt) and the model attends "
                       f"over at most {limit} (its model.max_seq_len). Fix: max_tokens between 1 and "
                       f"{max(limit - n, 1)}, or a shorter prompt")
        else:
            problem = self._check_sampling(params, n)
        if problem is not None:
            raise UserError(f"Request {request_id!r} was refused: {problem}.")

    def _check_sampling(self, params: SamplingParams, prompt_len: int) -> str | None:
        """What is wrong with the sampling settings, or None. Each value is checked as the step's arrays will hold
        it (RowSampling: float32 and int32): a value that only overflows there would fail the whole batch's step,
        every request in it, not this one alone."""
        with np.errstate(over="ignore", under="ignore"):  # the overflow is the finding, not a warning
            temperature, top_p = np.float32(params.temperature), np.float32(params.top_p)  # 1e39 -> inf, 1e-50 -> 0
        if not (math.isfinite(params.temperature) and np.isfinite(temperature) and params.temperature >= 0
                and 0 <= params.top_k <= INT32_MAX and math.isfinite(params.top_p) and 0 < top_p <= 1):
            return (f"temperature={params.temperature}, top_k={params.top_k}, top_p={params.top_p} are out of range. "
                    f"Fix: 0 <= temperature <= {float(np.finfo(np.float32).max):.3g} (0 is greedy), 0 <= top_k <= "
                    f"{INT32_MAX} (0 keeps every id), 0 < top_p <= 1")
        if params.seed is not None and not 0 <= params.seed <= MAX_SEED:
            return (f"seed={params.seed} is not a usable seed (random keys take 32 bits). Fix: a seed from 0 to "
                    f"2**32 - 1 = {MAX_SEED}")
        if any(not isinstance(s, str) or not s for s in params.stop):
            return f"stop={params.stop!r} holds an empty or non-text stop string. Fix: non-empty strings"
        if any(not 0 <= t < self.vocab for t in params.stop_token_ids or ()):
            return (f"stop_token_ids={params.stop_token_ids} holds an id outside the model's {self.vocab} ids. Fix: ids "
                    f"in [0, {self.vocab})")
        stops = self.eos_ids if params.stop_token_ids is None else params.stop_token_ids
        if params.min_tokens > 0 and len(set(stops)) > MAX_BANNED:
            return (f"min_tokens={params.min_tokens} holds back {len(set(stops))} stop ids, but a step can hold back "
                    f"at most {MAX_BANNED}. Fix: fewer stop_token_ids, or min_tokens=0")
        asked = max(params.top_logprobs, params.prompt_logprobs or 0)
        if not 0 <= asked <= MAX_LOGPROBS or params.min_tokens < 0:
            return (f"top_logprobs={params.top_logprobs}, prompt_logprobs={params.prompt_logprobs} and min_tokens="
                    f"{params.min_tokens} are out of range. Fix: alternatives from 0 to {MAX_LOGPROBS}, min_tokens >= 0")
        cache = self.scheduler.cache
        need = cache.pages_for(prompt_len + max(params.max_tokens, 1) - 1)  # the last token is never fed back
        if need > cache.total:
            return (f"it needs {need} pages of {self.page_size} tokens, but the whole KV cache holds {cache.total}. "
                    "Fix: fewer tokens, or a larger cache (--kv-memory-gib)")
        return None
