"""The paged KV cache's page allocator, on the host: which page of the pool holds which tokens of which sequence.

The pool itself is one device array per engine (kernels/paged_attention/pool.py): for every layer, `pages` pages of
`page_size` positions. The null page (NULL_PAGE) is never handed out: padding tokens write into it and unused
entries of a page table point at it, so every index the compiled step reads is valid. A sequence's page table lists
its pages in order (position p lives in page table[p // page_size] at offset p % page_size); pages are taken as a
sequence grows and given back when it finishes, is cancelled or is preempted.

Prefix caching (vLLM's scheme): a page full of computed tokens is keyed by a hash chain of all tokens up to its end,
so requests that start with the same tokens share their common full pages, with a reference count per page. A page
whose count drops to zero keeps its contents and key, in least-recently-used order, until an allocation evicts it.
Only full pages are shared and they are never written again, so sharing needs no copy-on-write. The chain starts
from the table's `root` (LongRoPE's short or long factors: scheduler.py), so pages of the same tokens computed
differently are never shared. The scheme in full: docs/design-notes.md, this module's section.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib

import numpy as np

from systolic.kernels.paged_attention.pool import NULL_PAGE


def page_hashes(tokens: list[int], page_size: int, parent: bytes = b"", start: int = 0) -> list[bytes]:
    """The chained keys of the full pages of `tokens` from page index `start` on: key i covers tokens
    [0, (i + 1) * page_size). `parent` is the key of page start - 1 (the table's root for the first). A
    cryptographic hash, so that no client can craft a prompt whose pages collide with another client's."""
    keys = []
    for i in range(start, len(tokens) // page_size):
        chunk = np.asarray(tokens[i * page_size:(i + 1) * page_size], np.int64).tobytes()
        parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
        keys.append(parent)
    return keys


@dataclasses.dataclass
class PageTable:
    """One sequence's pages and the keys of its full, registered ones (`keys[i]` belongs to `pages[i]`); `root`: the
    parent of the first page's key (b"" unless the pages' keys and values depend on more than their tokens)."""

    pages: list[int] = dataclasses.field(default_factory=list)
    keys: list[bytes] = dataclasses.field(default_factory=list)
    root: bytes = b""


class PageCache:
    """Allocation, reference counts and the prefix cache of a pool of `pages` pages (the null page reserved)."""

    def __init__(self, pages: int, page_size: int, *, prefix_caching: bool):
        assert pages >= 2, "the null page and at least one usable page"
        self.page_size = page_size
        self.total = pages - 1  # usable pages
        self.prefix_caching = prefix_caching
        # never used or without a key
        self._free: collections.deque[int] = collections.deque(p for p in range(pages) if p != NULL_PAGE)
        self._refs = np.zeros(pages, np.int32)
        self._by_key: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, unreferenced: LRU first

    # QUERIES

    @property
    def used(self) -> int:
        """Pages some sequence holds."""
        return self.total - len(self._free) - len(self._idle)

    @property
    def cached(self) -> int:
        """Pages that hold a cached prefix no sequence uses now (the least recently used evicted first)."""
        return len(self._idle)

    @property
    def available(self) -> int:
        """Pages an allocation can take: the free ones and the idle cached ones."""
        return len(self._free) + len(self._idle)

    def pages_for(self, tokens: int) -> int:
        """Pages that hold `tokens` positions."""
        return -(-tokens // self.page_size)

    # ALLOCATION

    def grow(self, table: PageTable, tokens: int) -> bool:
        """Extends `table` to hold `tokens` positions; False (and `table` unchanged) when the pool cannot."""
        need = self.pages_for(tokens) - len(table.pages)
        if need <= 0:
            return True
        if need > self.available:
            return False
        for _ in range(need):
            table.pages.append(self._take())
        return True

    def _take(self) -> int:
        if self._free:
            page = self._free.popleft()
        else:  # evict the least recently used cached page: its prefix is forgotten
            page, _ = self._idle.popitem(last=False)
            del self._by_key[self._key_of.pop(page)]
        self._refs[page] = 1
        return page

    def release(self, table: PageTable) -> None:
        """Gives back every page of `table` and empties it. Keyed pages stay cached (LRU); the sequence's last pages
        go first in the eviction order, as they are the least likely to be shared."""
        for page in reversed(table.pages):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._key_of:
                    self._idle[page] = None
                else:
                    self._free.append(page)
        table.pages.clear()
        table.keys.clear()

    # PREFIX CACHE

    def forget_prefixes(self) -> None:
        """Drops every cached prefix (the model's weights changed, so their keys and values are stale); only when
        no sequence holds a page."""
        assert self.used == 0, "pages still held by sequences"
        self._free.extend(self._idle)
        self._idle.clear()
        self._by_key.clear()
        self._key_of.clear()

    def match_prefix(self, table: PageTable, tokens: list[int]) -> int:
        """Fills the empty `table` with the cached pages that hold a prefix of `tokens` under its root, at most all
        but the last token (whose logits the step must compute); returns the number of tokens they hold."""
        assert not table.pages
        if not self.prefix_caching:
            return 0
        usable = (len(tokens) - 1) // self.page_size
        for key in page_hashes(tokens[:usable * self.page_size], self.page_size, table.root):
            page = self._by_key.get(key)
            if page is None:
                break
            if self._refs[page] == 0:
                del self._idle[page]
            self._refs[page] += 1
            table.pages.append(page)
            table.keys.append(key)
        return len(table.pages) * self.page_size

    def register(self, table: PageTable, tokens: list[int], computed: int) -> None:
        """Keys the pages of `table` that became full: `computed` of `tokens` now have their keys and values in the
        cache. A key that another page already holds (two requests prefilled the same prompt at once) stays with
        that page; this one remains private and is freed normally."""
        if not self.prefix_caching:
            return
        full = computed // self.page_size
        start = len(table.keys)
        if full <= start:
            return
        parent = table.keys[-1] if table.keys else table.root
        for i, key in enumerate(page_hashes(tokens[:full * self.page_size], self.page_size, parent, start), start):
            page = table.pages[i]
            table.keys.append(key)
            if key not in self._by_key and page not in self._key_of:
                self._by_key[key] = page
                self._key_of[page] = key
