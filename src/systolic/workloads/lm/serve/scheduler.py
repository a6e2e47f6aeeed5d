"""Continuous batching: which tokens of which sequences run in the next engine step, and their layout.

Every step is one ragged batch of at most `max_tokens_per_step` tokens from at most `max_seqs` sequences. A
sequence is its known tokens (prompt, then the tokens sampled so far) and how many of them have their keys and
values in the cache (`computed`); a step computes the next chunk of the rest, so a long prompt's prefill shares its
steps with the running decodes instead of stalling them. A step's budget goes first to one token for each decoding
sequence, then to the next chunk of each prefilling one (oldest first), then to new sequences from the waiting
queue (first come first served, each starting after its longest cached prefix) while rows, tokens and pages last.

When the pool has no page for a running sequence's chunk, the newest running sequence is preempted: its pages are
given back and it returns to the front of the queue to be recomputed as one longer prompt, its sampled tokens kept,
so no request is dropped and none is answered twice. A LongRoPE (Phi-3) sequence that passes the original context
is sent back the same way, to be recomputed with the long factors as transformers' Phi-3 `generate` does.

The compiled step has one shape per token bucket (`token_buckets`): T tokens padded to the next bucket, and
S = min(T, max_seqs) rows, so a fixed set of programs serves every mix of requests. Preemption and the LongRoPE
regime in full: docs/design-notes.md, this module's section.
"""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

from systolic.kernels.paged_attention.pool import NULL_PAGE
from systolic.workloads.lm.serve.page_allocator import PageCache, PageTable
from systolic.kernels.paged_attention.metadata import RaggedBatch

SMALLEST_BUCKET = 8  # the fewest token slots a step has: tinier steps cost the same on every platform
MID_BUCKET_FROM = 512  # steps this large compile a page-reading bucket of half their slots (`page_buckets`)
LONG_ROPE_ROOT = b"longrope-long"  # the prefix-cache key root of pages rotated by LongRoPE's long factors


def token_buckets(max_tokens_per_step: int) -> tuple[int, ...]:
    """The step sizes that are compiled: powers of two from SMALLEST_BUCKET, and max_tokens_per_step itself."""
    sizes = []
    size = min(SMALLEST_BUCKET, max_tokens_per_step)
    while size < max_tokens_per_step:
        sizes.append(size)
        size *= 2
    return (*sizes, max_tokens_per_step)


def page_buckets(tokens: int) -> tuple[int, ...]:
    """How many of a `tokens`-slot step's tokens may read pages, as compiled: tokens, tokens / 4, tokens / 16, ...
    down to SMALLEST_BUCKET. A step uses the smallest that holds its decodes and continued prompts (`layout` puts
    them first), so new prompts prefilled beside a few decodes do not each gather the decodes' pages. Steps of
    MID_BUCKET_FROM slots or more also compile tokens / 2 in place of their smallest: 256 decodes beside a continued
    prompt read pages in 512 slots of a 1,024-token step, not all 1,024 (the Pallas kernel's cost is a block per
    token, fresh prompt tokens' included: 16.4 of a 31.0 ms step of llama-1b on the v5e)."""
    sizes = [tokens]
    while sizes[-1] % 4 == 0 and sizes[-1] // 4 >= SMALLEST_BUCKET:
        sizes.append(sizes[-1] // 4)
    if tokens >= MID_BUCKET_FROM and tokens % 2 == 0:
        sizes = [tokens, tokens // 2, *sizes[1:-1]]
    return tuple(sorted(sizes))


def page_bucket(tokens: int, reading: int) -> int:
    """The compiled count of page-reading tokens for `reading` such tokens in a step of `tokens` slots."""
    return next(b for b in page_buckets(tokens) if b >= reading)


def pages_first(chunks: list[Chunk]) -> list[Chunk]:
    """The chunks with positions before them in the cache (decodes, continued prompts, prompts that start after a
    cached prefix) first, then prompts that start at position 0: the order of a step's rows."""
    return sorted(chunks, key=lambda c: c.start == 0)


@dataclasses.dataclass(eq=False)
class Sequence:
    """One request's tokens and its place in the cache."""

    request_id: str
    tokens: list[int]  # prompt, then the sampled tokens
    prompt_len: int
    arrival: int  # the order of add_request: the largest is the newest
    computed: int = 0  # tokens[:computed] have their keys and values in the cache
    table: PageTable = dataclasses.field(default_factory=PageTable)
    preemptions: int = 0
    scores_prompt: bool = False  # every prompt token's logits are wanted: never start after a cached prefix

    @property
    def remaining(self) -> int:
        """Known tokens not yet computed: 1 while decoding."""
        return len(self.tokens) - self.computed

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Tokens [start, start + count) of `seq` run in this step; its last token's logits are sampled when
    `samples` (the chunk ends at the last known token)."""

    seq: Sequence
    start: int
    count: int

    @property
    def samples(self) -> bool:
        return self.start + self.count == len(self.seq.tokens)


class Scheduler:
    """The waiting queue and the running sequences, over the pages of `cache`. `longrope_context`: LongRoPE's
    original context, past which a sequence rotates by the long factors (0: the model has one rotation)."""

    def __init__(self, cache: PageCache, *, max_seqs: int, max_tokens_per_step: int, longrope_context: int = 0):
        self.cache = cache
        self.max_seqs = max_seqs
        self.max_tokens_per_step = max_tokens_per_step
        self.longrope_context = longrope_context
        self.waiting: list[Sequence] = []  # by arrival
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.prefix_hit_tokens = 0

    def add(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=lambda s: s.arrival)

    def remove(self, seq: Sequence) -> None:
        """Drops a finished or cancelled sequence and gives its pages back."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.cache.release(seq.table)

    def schedule(self) -> list[Chunk]:
        """The next step's chunks (possibly none), pages allocated for them; preempts when pages run out."""
        for seq in [s for s in self.running if s.table.root != self._root(s)]:
            self._requeue(seq)  # past LongRoPE's original context: recomputed with the long factors
        planned: dict[int, Chunk] = {}  # by arrival
        decoding = [s for s in self.running if s.remaining == 1]
        prefilling = [s for s in self.running if s.remaining > 1]
        # Counted as they change, not summed per sequence: a step of 256 decodes summed its plan 256 times.
        used, preempted, running = 0, self.preemptions, set(map(id, self.running))
        for seq in decoding + prefilling:
            budget = self.max_tokens_per_step - used
            if budget == 0:
                break
            if id(seq) not in running:  # preempted for an older sequence's pages
                continue
            count = min(seq.remaining, budget)
            if self._fit(seq, seq.computed + count, planned):
                planned[seq.arrival] = Chunk(seq, seq.computed, count)
                used += count
            if self.preemptions != preempted:  # victims left the plan and the running set
                used, preempted = sum(c.count for c in planned.values()), self.preemptions
                running = set(map(id, self.running))
        chunks = list(planned.values())
        self._admit(chunks)
        return chunks

    def _fit(self, seq: Sequence, tokens: int, planned: dict[int, Chunk]) -> bool:
        """Grows seq's pages to `tokens` positions, preempting the newest running sequences until they fit;
        False when seq itself was the newest and is preempted."""
        while not self.cache.grow(seq.table, tokens):
            victim = max(self.running, key=lambda s: s.arrival)
            self._preempt(victim)
            planned.pop(victim.arrival, None)
            if victim is seq:
                return False
        return True

    def _root(self, seq: Sequence) -> bytes:
        """What seq's keys and values depend on besides its tokens, as its pages' key root: LongRoPE's long factors
        once it holds more tokens than the original context."""
        return LONG_ROPE_ROOT if 0 < self.longrope_context < len(seq.tokens) else b""

    def _requeue(self, seq: Sequence) -> None:
        """Sends a running sequence back to the queue, its pages given back, to be computed again as one prompt of
        all its tokens."""
        self.running.remove(seq)
        self.cache.release(seq.table)
        seq.computed = 0
        self.add(seq)

    def _preempt(self, seq: Sequence) -> None:
        self._requeue(seq)
        seq.preemptions += 1
        self.preemptions += 1

    def _admit(self, chunks: list[Chunk]) -> None:
        """Moves waiting sequences to running, first come first served, while rows, tokens and pages last."""
        budget = self.max_tokens_per_step - sum(c.count for c in chunks)
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            seq = self.waiting[0]
            seq.table.root = self._root(seq)
            hit = 0 if seq.scores_prompt else self.cache.match_prefix(seq.table, seq.tokens)
            count = min(len(seq.tokens) - hit, budget)
            if count < len(seq.tokens) - hit <= self.max_tokens_per_step:
                # A prompt that one step holds waits for a step with room for all of it: a prompt split over two steps
                # has its second chunk read the first's keys from the pages, a gather per token
                # (kernels/paged_attention/paged_kv.py). On a v5e (llama-1b, 64 in flight) the 256-token steps in
                # which every token read pages took 24.5 ms against 5.2 ms for a decode step; not splitting: 5,566 ->
                # 8,279 tok/s.
                self.cache.release(seq.table)
                return
            if not self.cache.grow(seq.table, hit + count):
                self.cache.release(seq.table)  # the matched pages go back to the cache
                return
            self.waiting.pop(0)
            self.running.append(seq)
            seq.computed = hit
            self.prefix_hit_tokens += hit
            chunks.append(Chunk(seq, hit, count))
            budget -= count

    def advance(self, chunks: list[Chunk]) -> None:
        """Records that the step ran: the chunks' tokens are computed, and their pages that became full are
        keyed in the prefix cache, up to the first pending token (a negative id: the engine's token sampled by a
        step whose results it has not read; it keys the rest with `cache.register` once they are known)."""
        for chunk in chunks:
            seq = chunk.seq
            seq.computed = chunk.start + chunk.count
            known = seq.computed - (seq.tokens[seq.computed - 1] < 0)  # only a decode's input may be pending
            self.cache.register(seq.table, seq.tokens, known)

    def park(self, seq: Sequence) -> None:
        """Schedules a running sequence no more, its pages kept: it ends when its last step's token is read
        (`remove` then gives the pages back)."""
        if seq in self.running:
            self.running.remove(seq)


def layout(chunks: list[Chunk], *, tokens: int, rows: int, page_size: int, pages_per_seq: int
           ) -> tuple[np.ndarray, RaggedBatch]:
    """The chunks laid out in `tokens` token slots and `rows` rows (a bucket), one contiguous run of tokens per row
    in the chunks' order: (token ids (T,) int32, the batch as host arrays). Padding tokens write into the null
    page. Built in Python lists, then one conversion per array: a step of 256 decodes is 256 rows of one token,
    where numpy's per-call cost was most of the layout."""
    ids, positions, token_rows, slots, kv_lens, seq_lens, counts = [], [], [], [], [], [], []
    page_table = np.full((rows, pages_per_seq), NULL_PAGE, np.int32)
    for r, chunk in enumerate(chunks):
        seq, start, n = chunk.seq, chunk.start, chunk.count
        pages = seq.table.pages
        span = range(start, start + n)
        ids += seq.tokens[start:start + n]
        positions += span
        token_rows += [r] * n
        slots += [pages[p // page_size] * page_size + p % page_size for p in span]
        page_table[r, :len(pages)] = pages
        kv_lens.append(start + n)
        seq_lens.append(len(seq.tokens))
        counts.append(n)
    t, s = len(ids), len(chunks)

    def padded(values: list[int], size: int, fill: int = 0) -> np.ndarray:
        out = np.full(size, fill, np.int32)
        out[:len(values)] = values
        return out

    cu = np.cumsum(counts, dtype=np.int32)  # (s,)
    cu_q_lens = padded([0, *cu.tolist()], rows + 1, t)  # padding rows: empty runs at the end
    return padded(ids, tokens), RaggedBatch(
        padded(positions, tokens), padded(token_rows, tokens), padded(slots, tokens, NULL_PAGE * page_size),
        np.int32(t), page_table, padded(kv_lens, rows), cu_q_lens, np.array([s], np.int32), padded(cu - 1, rows),
        padded(seq_lens, rows))
