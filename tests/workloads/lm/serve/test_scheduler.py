"""The KV cache's bookkeeping (pages, reference counts, the prefix cache and its LRU eviction) and the scheduler's
choices (decodes before prefill chunks, first come first served, the newest preempted), on the host alone."""

import numpy as np

from systolic.kernels.paged_attention.pool import NULL_PAGE
from systolic.workloads.lm.serve.page_allocator import PageCache, PageTable, page_hashes
from systolic.workloads.lm.serve.scheduler import (LONG_ROPE_ROOT, Chunk, Scheduler, Sequence, layout, page_bucket,
                                                    page_buckets, pages_first, token_buckets)


def test_pages_are_taken_and_given_back():
    cache = PageCache(6, 4, prefix_caching=False)
    a, b = PageTable(), PageTable()
    assert cache.grow(a, 9) and len(a.pages) == 3 and NULL_PAGE not in a.pages
    assert cache.grow(a, 12) and len(a.pages) == 3  # still fits
    assert not cache.grow(b, 9) and b.pages == []  # 2 pages left: refused whole, nothing taken
    assert cache.grow(b, 8) and cache.used == 5 and cache.available == 0
    cache.release(a)
    assert a.pages == [] and cache.used == 2 and cache.available == 3


def test_prefix_cache_shares_full_pages_and_evicts_least_recently_used():
    cache = PageCache(8, 4, prefix_caching=True)
    tokens = list(range(10))  # 2 full pages and 2 tokens
    first = PageTable()
    assert cache.match_prefix(first, tokens) == 0
    cache.grow(first, 10)
    cache.register(first, tokens, 10)
    assert first.keys == page_hashes(tokens, 4) and len(first.keys) == 2

    # The same prompt: both full pages are found (all but the last token may be), counted twice, not copied.
    second = PageTable()
    assert cache.match_prefix(second, tokens) == 8 and second.pages == first.pages[:2]
    # A prompt of exactly 8 tokens: its last page is recomputed, for the logits of its last token.
    third = PageTable()
    assert cache.match_prefix(third, tokens[:8]) == 4
    # Another first page: no hit (keys chain over all earlier tokens, not only the page's own).
    assert cache.match_prefix(PageTable(), [99] + tokens[1:]) == 0

    for table in (third, second, first):
        cache.release(table)
    assert cache.used == 0 and cache.cached == 2  # the keyed pages stay, unreferenced
    # Allocation takes never-keyed pages first, then evicts the least recently used cached page.
    other = PageTable()
    cache.grow(other, 4 * 5)
    assert cache.cached == 2
    cache.grow(other, 4 * 6)
    assert cache.cached == 1 and first.pages == []
    assert cache.match_prefix(PageTable(), tokens) == 4  # the first page survived: it was released last


def test_no_prefix_caching_means_no_sharing():
    cache = PageCache(8, 4, prefix_caching=False)
    table = PageTable()
    cache.grow(table, 10)
    cache.register(table, list(range(10)), 10)
    cache.release(table)
    assert cache.cached == 0 and cache.match_prefix(PageTable(), list(range(10))) == 0


def sequence(name: str, prompt: int, arrival: int) -> Sequence:
    return Sequence(name, list(range(prompt)), prompt, arrival)


def test_decodes_go_first_prefills_are_chunked_admission_is_fifo():
    sched = Scheduler(PageCache(64, 4, prefix_caching=False), max_seqs=3, max_tokens_per_step=8)
    long, short, late = sequence("long", 20, 0), sequence("short", 3, 1), sequence("late", 2, 2)
    for seq in (long, short, late):
        sched.add(seq)
    chunks = sched.schedule()
    assert [(c.seq.request_id, c.start, c.count) for c in chunks] == [("long", 0, 8)]
    sched.advance(chunks)
    chunks = sched.schedule()  # the long prompt's next chunk, then the next in line
    assert [(c.seq.request_id, c.start, c.count) for c in chunks] == [("long", 8, 8)]
    sched.advance(chunks)
    chunks = sched.schedule()  # late's 2 tokens do not fit beside them: a prompt one step holds is not split
    assert [(c.seq.request_id, c.start, c.count) for c in chunks] == [("long", 16, 4), ("short", 0, 3)]
    assert [c.samples for c in chunks] == [True, True]
    sched.advance(chunks)
    long.tokens.append(7)
    short.tokens.append(7)
    chunks = sched.schedule()  # both decodes first, then late's whole prompt
    assert [(c.seq.request_id, c.start, c.count) for c in chunks] == [("long", 20, 1), ("short", 3, 1), ("late", 0, 2)]


def test_the_newest_sequence_is_preempted_and_recomputed_with_its_tokens():
    cache = PageCache(6, 4, prefix_caching=False)  # 5 usable pages
    sched = Scheduler(cache, max_seqs=4, max_tokens_per_step=16)
    old, new = sequence("old", 8, 0), sequence("new", 8, 1)
    sched.add(old)
    sched.add(new)
    sched.advance(sched.schedule())  # 2 pages each
    old.tokens += [1]
    new.tokens += [2, 3, 4, 5, 6]  # pretend `new` sampled 5 tokens and fed 4 back: a 4th page is taken
    new.computed = 12
    cache.grow(new.table, 12)
    assert cache.available == 0
    chunks = sched.schedule()  # `old` needs a 3rd page: `new` (the newest) gives its pages back
    assert [c.seq.request_id for c in chunks] == ["old"] and sched.waiting == [new]
    assert new.computed == 0 and new.tokens == list(range(8)) + [2, 3, 4, 5, 6] and new.table.pages == []
    assert sched.preemptions == 1 and new.preemptions == 1
    sched.advance(chunks)
    sched.remove(old)
    chunks = sched.schedule()  # back, as one prompt of all its 13 tokens, whose last samples its 6th token
    assert [(c.seq.request_id, c.start, c.count) for c in chunks] == [("new", 0, 13)] and chunks[0].samples


def test_a_longrope_sequence_is_recomputed_with_the_long_factors_past_the_original_context():
    """LongRoPE with an original context of 8: the step that would feed a sequence's 9th token sends it back to be
    computed again as one prompt of its 9 tokens (not a preemption), and its long-rotated pages are keyed apart from
    the short-rotated ones of the same tokens."""
    cache = PageCache(16, 4, prefix_caching=True)
    sched = Scheduler(cache, max_seqs=4, max_tokens_per_step=16, longrope_context=8)
    seq = sequence("a", 6, 0)
    sched.add(seq)
    for count in (6, 1, 1):  # the prompt, then the 7th and 8th tokens: short factors
        chunks = sched.schedule()
        assert [(c.start, c.count) for c in chunks] == [(seq.computed, count)] and seq.table.root == b""
        sched.advance(chunks)
        seq.tokens.append(100 + seq.computed)
    short_pages = list(seq.table.pages[:2])  # tokens 0-7, keyed under the short root
    chunks = sched.schedule()  # 9 tokens: all of them again, none found in the cache
    assert [(c.seq, c.start, c.count, c.samples) for c in chunks] == [(seq, 0, 9, True)]
    assert seq.table.root == LONG_ROPE_ROOT and sched.preemptions == 0 and sched.prefix_hit_tokens == 0
    assert not set(seq.table.pages) & set(short_pages)
    _, batch = layout(chunks, tokens=16, rows=4, page_size=4, pages_per_seq=4)
    np.testing.assert_array_equal(batch.seq_lens, [9, 0, 0, 0])
    sched.advance(chunks)
    long_pages = list(seq.table.pages[:2])
    sched.remove(seq)
    # Each regime finds its own pages: a short prompt of those tokens the short ones, a long one the long ones.
    short, long = sequence("short", 0, 1), sequence("long", 0, 2)
    short.tokens, long.tokens = seq.tokens[:8], seq.tokens[:8] + [1, 2, 3]
    sched.add(short)
    sched.add(long)
    chunks = sched.schedule()
    assert [(c.seq, c.start) for c in chunks] == [(short, 4), (long, 8)]
    assert short.table.pages[:1] == short_pages[:1] and long.table.pages[:2] == long_pages
    # A chunk of a long prompt rotates as the whole prompt: by its 11 tokens, not the 8 computed after it.
    _, batch = layout([Chunk(long, 0, 8)], tokens=8, rows=1, page_size=4, pages_per_seq=4)
    np.testing.assert_array_equal((batch.kv_lens, batch.seq_lens), ([8], [11]))


def test_layout_of_a_ragged_step():
    cache = PageCache(16, 4, prefix_caching=False)
    a, b = sequence("a", 6, 0), sequence("b", 1, 1)
    for seq, n in ((a, 6), (b, 1)):
        cache.grow(seq.table, n)
    a.computed = 3
    ids, batch = layout([Chunk(a, 3, 3), Chunk(b, 0, 1)], tokens=8, rows=4, page_size=4, pages_per_seq=3)
    np.testing.assert_array_equal(ids, [3, 4, 5, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch.positions, [3, 4, 5, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch.rows, [0, 0, 0, 1, 0, 0, 0, 0])
    pa, pb = a.table.pages, b.table.pages
    np.testing.assert_array_equal(batch.slots, [pa[0] * 4 + 3, pa[1] * 4, pa[1] * 4 + 1, pb[0] * 4, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch.page_table, [[*pa, 0], [pb[0], 0, 0], [0, 0, 0], [0, 0, 0]])
    np.testing.assert_array_equal(batch.kv_lens, [6, 1, 0, 0])
    np.testing.assert_array_equal(batch.seq_lens, [6, 1, 0, 0])
    np.testing.assert_array_equal(batch.cu_q_lens, [0, 3, 4, 4, 4])
    np.testing.assert_array_equal(batch.last, [2, 3, 0, 0])
    assert int(batch.num_tokens) == 4 and batch.num_seqs.tolist() == [2]


def test_token_buckets():
    assert token_buckets(256) == (8, 16, 32, 64, 128, 256)
    assert token_buckets(100) == (8, 16, 32, 64, 100)
    assert token_buckets(4) == (4,)


def test_page_buckets_and_the_rows_that_read_pages_first():
    assert page_buckets(256) == (16, 64, 256) and page_buckets(8) == (8,) and page_buckets(96) == (24, 96)
    # 256 decodes beside a continued prompt in a 1,024-token step: half its slots read pages, not all of them
    assert page_buckets(1024) == (64, 256, 512, 1024) and page_bucket(1024, 256 + 122) == 512
    assert [page_bucket(256, n) for n in (0, 16, 17, 64, 65, 256)] == [16, 16, 64, 64, 256, 256]
    a, b, c = (Sequence(name, list(range(8)), 4, i) for i, name in enumerate("abc"))
    order = pages_first([Chunk(a, 0, 4), Chunk(b, 5, 1), Chunk(c, 2, 3)])
    assert [ch.seq.request_id for ch in order] == ["b", "c", "a"]  # positions before them first, arrival order kept
