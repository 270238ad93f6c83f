"""The prefix cache: whole pages of KV rows that later requests with the same tokens reuse.

A page covers the positions of `page_tokens` consecutive tokens; once a sequence has fed
every one of them, the page's compressed and indexer rows are final (rows are append-only
and a window's row lands in the page of its last position; page_tokens is a multiple of
every compression ratio). Such a page is registered here under the chain hash of all the
tokens up to its end and becomes the cache's: the sequence keeps mapping it, and so may
any later sequence whose tokens match, read-only. Nothing ever writes into a registered
page, so there is no copy on write.

What is not in pages (the raw window ring, the compressors' partial windows) is taken as a
backend snapshot at chosen page boundaries (SeqEngine decides which); a request resumes at
the deepest matched boundary that has one. The resumed slot holds the very bits the
sequence that made the pages held there, so every later logit is bitwise what computing
the prompt from scratch gives (tests/test_prefix_cache.py).

Pages no sequence maps stay cached until the pool needs them: the pool evicts the least
recently used one (the deepest first among equals), and a page's snapshot goes with it.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .pool import PageHandle, PagePool

CACHE_OWNER = "prefix-cache"  # the pool owner of every registered page


def chain_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a page: its tokens under the key of everything before it."""
    return hashlib.blake2b(parent + np.asarray(tokens, np.int64).tobytes(), digest_size=16).digest()


@dataclass
class CachedPage:
    handle: PageHandle
    key: bytes
    index: int                       # logical page: positions index*T .. (index+1)*T - 1
    tokens: tuple[int, ...]          # compared on a match, so a hash collision never reuses a page
    refs: int = 0                    # live sequences mapping it
    snapshot: Optional[int] = None   # backend state at the page's end, if taken
    last_used: int = 0


@dataclass(frozen=True)
class Match:
    pages: list[CachedPage]          # the prefix's pages, in order; empty on a miss
    snapshot: Optional[int]          # the state at their end

    @property
    def tokens(self) -> int:
        return sum(len(p.tokens) for p in self.pages)


class PrefixCache:
    def __init__(self, pool: PagePool, drop_snapshot, max_snapshots: int):
        """drop_snapshot(id): frees a backend snapshot. At most max_snapshots are held; past
        that, the least recently used page's snapshot is dropped (the page stays)."""
        if max_snapshots < 1:
            raise ValueError(f"the prefix cache needs room for at least one snapshot, got {max_snapshots}")
        self.pool, self.drop_snapshot, self.max_snapshots = pool, drop_snapshot, max_snapshots
        self._pages: dict[bytes, CachedPage] = {}
        self._by_page: dict[int, CachedPage] = {}
        self._idle = 0  # cached pages no sequence maps: what the pool may reclaim
        self._clock = 0
        self.hits = self.misses = self.evictions = self.cached_tokens = 0
        pool.reclaimer = self

    # ---- lookup ----------------------------------------------------------------------
    def match(self, tokens: Sequence[int]) -> Match:
        """The longest run of cached pages the tokens start with that ends at a snapshot,
        leaving at least one token to feed (its row yields the first new token)."""
        T = self.pool.page_tokens
        chain, key = [], b""
        for i in range((len(tokens) - 1) // T):
            block = tuple(int(t) for t in tokens[i * T:(i + 1) * T])
            key = chain_key(key, block)
            page = self._pages.get(key)
            if page is None or page.tokens != block:
                break
            chain.append(page)
        while chain and chain[-1].snapshot is None:
            chain.pop()
        return Match(chain, chain[-1].snapshot if chain else None)

    def record(self, match: Match) -> None:
        """Count an admission's match (a match that could not be admitted is not counted)."""
        self.hits += bool(match.pages)
        self.misses += not match.pages
        self.cached_tokens += match.tokens

    def acquire(self, pages: Sequence[CachedPage]) -> None:
        self._clock += 1
        for p in pages:
            self._idle -= p.refs == 0
            p.refs += 1
            p.last_used = self._clock

    def unref(self, handle: PageHandle) -> None:
        page = self._by_handle(handle)
        if page.refs < 1:
            raise AssertionError(f"page {handle.page} released more often than mapped")
        page.refs -= 1
        self._idle += page.refs == 0

    # ---- registration ------------------------------------------------------------------
    def register(self, owner, handle: PageHandle, parent: bytes, index: int, tokens: Sequence[int]) -> bytes:
        """Page `handle` of `owner` now holds the final rows of `tokens` (page `index`, after
        the pages keyed `parent`): the cache takes it over, owner still mapping it. When an
        equal page is cached already, owner keeps its own and the cached one is the shared
        one. Returns the page's key."""
        block = tuple(int(t) for t in tokens)
        key = chain_key(parent, block)
        if key not in self._pages:
            self.pool.transfer(handle, owner, CACHE_OWNER)
            self._clock += 1
            self._pages[key] = self._by_page[handle.page] = CachedPage(handle, key, index, block, refs=1,
                                                                       last_used=self._clock)
        return key

    def owns(self, handle: PageHandle) -> bool:
        return self.pool.owner_of(handle) == CACHE_OWNER

    def has_snapshot(self, key: bytes) -> bool:
        page = self._pages.get(key)
        return page is not None and page.snapshot is not None

    def attach_snapshot(self, key: bytes, snapshot: int) -> bool:
        """Keep `snapshot` (the state at the end of page `key`), dropping the least recently
        used other one past max_snapshots; False (and the caller drops it) when that page is
        not cached or already has one."""
        page = self._pages.get(key)
        if page is None or page.snapshot is not None:
            return False
        page.snapshot = snapshot
        older = [p for p in self._pages.values() if p.snapshot is not None and p is not page]
        while len(older) >= self.max_snapshots:  # the new one stays
            oldest = min(older, key=lambda p: (p.last_used, -p.index))
            self.drop_snapshot(oldest.snapshot)
            oldest.snapshot = None
            older.remove(oldest)
        return True

    # ---- the pool's reclaimer ------------------------------------------------------------
    def evictable(self) -> int:
        return self._idle

    def evict_one(self) -> None:
        """Give the pool back the least recently used page nobody maps (deepest first)."""
        idle = [p for p in self._pages.values() if p.refs == 0]
        if not idle:
            raise AssertionError("the pool asked for a page the cache cannot give")
        page = min(idle, key=lambda p: (p.last_used, -p.index))
        self._drop(page)
        self.evictions += 1

    def clear(self) -> None:
        """Drop every page nobody maps (and its snapshot)."""
        for page in [p for p in self._pages.values() if p.refs == 0]:
            self._drop(page)

    # ---- views ------------------------------------------------------------------------------
    @property
    def pages(self) -> int:
        return len(self._pages)

    @property
    def snapshots(self) -> int:
        return sum(1 for p in self._pages.values() if p.snapshot is not None)

    STATS = ("prefix_hits", "prefix_misses", "prefix_cached_tokens", "prefix_cached_pages", "prefix_evictions",
             "prefix_snapshots")

    def stats(self) -> dict:
        return {"prefix_hits": self.hits, "prefix_misses": self.misses, "prefix_cached_tokens": self.cached_tokens,
                "prefix_cached_pages": self.pages, "prefix_evictions": self.evictions,
                "prefix_snapshots": self.snapshots}

    def check(self) -> None:
        """Assert the bookkeeping invariants (tests call it with the pool's)."""
        for key, p in self._pages.items():
            assert p.key == key and p.refs >= 0
            assert self.pool.owner_of(p.handle) == CACHE_OWNER, f"cached page {p.handle.page} owned elsewhere"
        assert sorted(self._by_page) == sorted(p.handle.page for p in self._pages.values()), "a page cached twice"
        assert self.snapshots <= self.max_snapshots
        assert self._idle == sum(1 for p in self._pages.values() if p.refs == 0)

    # ---- helpers ----------------------------------------------------------------------------
    def _drop(self, page: CachedPage) -> None:
        del self._pages[page.key], self._by_page[page.handle.page]
        self._idle -= 1  # only idle pages are dropped
        if page.snapshot is not None:
            self.drop_snapshot(page.snapshot)
        self.pool.free(page.handle)

    def _by_handle(self, handle: PageHandle) -> CachedPage:
        page = self._by_page.get(handle.page)
        if page is None or page.handle != handle:
            raise AssertionError(f"page {handle.page} is not cached")
        return page
