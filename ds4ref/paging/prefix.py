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

A sequence that ends mid-page leaves a **tail**: its last, partial page
and a snapshot at its last fed position, registered under the key of its full pages and the
tail's tokens. So does a prompt that ends mid-page, with a copy of its partial page: a chat's
next turn resends the prompt, but the earlier reply as the client renders it (its thinking
dropped, its text tokenised anew), which need not be the tokens that were generated. A
newcomer whose tokens continue those full pages with the tail's tokens (and at least one
more) maps the full pages, has the backend copy the tail page into a fresh page
of its own (it writes the rest of that page itself), loads the tail's snapshot and feeds the
rest. The tail page itself is never mapped, so it is idle but while a newcomer copies it.

Pages no sequence maps stay cached until the pool needs them: the pool evicts the least
recently used one (the deepest first among equals), and a page's snapshot goes with it.
Tails are held to the same snapshot budget as pages: past it the least recently used
snapshot goes, and a tail whose snapshot goes goes with it.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .pool import PageHandle, PagePool

CACHE_OWNER = "prefix-cache"  # the pool owner of every registered page
SNAPSHOTS_PER_SLOT = 8        # the default bound on snapshots held, per slot


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
    parent: Optional[bytes] = None   # a tail's: the key of the full pages before it

    @property
    def is_tail(self) -> bool:
        return self.parent is not None


@dataclass(frozen=True)
class Match:
    pages: list[CachedPage]          # the prefix's full pages, in order; empty on a miss
    snapshot: Optional[int]          # the state at their end (at the tail's end, with a tail)
    tail: Optional[CachedPage] = None  # a partial page after them, copied into the newcomer's own

    @property
    def tokens(self) -> int:
        return sum(len(p.tokens) for p in self.pages) + (len(self.tail.tokens) if self.tail else 0)

    @property
    def held(self) -> list[CachedPage]:
        """What the admission holds while it maps and copies: the pages and the tail."""
        return self.pages + ([self.tail] if self.tail else [])


class PrefixCache:
    def __init__(self, pool: PagePool, drop_snapshot, max_snapshots: int):
        """drop_snapshot(id): frees a backend snapshot. At most max_snapshots are held; past
        that, the least recently used page's snapshot is dropped (the page stays)."""
        if max_snapshots < 1:
            raise ValueError(f"the prefix cache needs room for at least one snapshot, got {max_snapshots}")
        self.pool, self.drop_snapshot, self.max_snapshots = pool, drop_snapshot, max_snapshots
        self._pages: dict[bytes, CachedPage] = {}
        self._by_page: dict[int, CachedPage] = {}
        self._tails: dict[bytes, list[CachedPage]] = {}  # parent key -> the tails after it
        self._idle = 0  # cached pages no sequence maps: what the pool may reclaim
        self._clock = 0
        self.hits = self.misses = self.evictions = self.cached_tokens = self.tail_hits = 0
        pool.reclaimer = self

    # ---- lookup ----------------------------------------------------------------------
    def match(self, tokens: Sequence[int], tails: bool = True) -> Match:
        """The deepest cached state the tokens start with, leaving at least one token to feed
        (its row yields the first new token): a run of cached pages ending at a snapshot, or
        such a run (maybe empty) followed by a tail."""
        T = self.pool.page_tokens
        chain, key = [], b""
        for i in range((len(tokens) - 1) // T):
            block = tuple(int(t) for t in tokens[i * T:(i + 1) * T])
            key = chain_key(key, block)
            page = self._pages.get(key)
            if page is None or page.tokens != block:
                break
            chain.append(page)
        for j in range(len(chain), -1, -1):  # a tail after j pages lies deeper than page j's end
            tail = self._tail_after(chain[j - 1].key if j else b"", tokens, j * T) if tails else None
            if tail is not None:
                return Match(chain[:j], tail.snapshot, tail)
            if j and chain[j - 1].snapshot is not None:
                return Match(chain[:j], chain[j - 1].snapshot)
        return Match([], None)

    def _tail_after(self, parent: bytes, tokens: Sequence[int], start: int) -> Optional[CachedPage]:
        """The longest tail after `parent` that tokens[start:] continue past its end."""
        best = None
        for t in self._tails.get(parent, ()):
            n = len(t.tokens)
            if len(tokens) - start > n and (best is None or n > len(best.tokens)) \
                    and tuple(int(x) for x in tokens[start:start + n]) == t.tokens:
                best = t
        return best

    def record(self, match: Match) -> None:
        """Count an admission's match (a match that could not be admitted is not counted)."""
        self.hits += bool(match.pages)
        self.misses += not match.pages
        self.cached_tokens += match.tokens
        self.tail_hits += match.tail is not None

    def acquire(self, pages: Sequence[CachedPage]) -> None:
        self._clock += 1
        for p in pages:
            self._idle -= p.refs == 0
            p.refs += 1
            p.last_used = self._clock

    def release(self, handles: Sequence[PageHandle]) -> None:
        """A sequence ends: its cached pages are used as of now, all alike, so eviction takes
        its deepest first (a tail before the pages it follows)."""
        self._clock += 1
        for h in handles:
            self.unref(h)
            self._by_handle(h).last_used = self._clock

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
        self._bound_snapshots(page)
        return True

    def has_tail(self, parent: bytes, tokens: Sequence[int]) -> bool:
        block = tuple(int(t) for t in tokens)
        return any(t.tokens == block for t in self._tails.get(parent, ()))

    def register_tail(self, owner, handle: PageHandle, parent: bytes, index: int, tokens: Sequence[int],
                      snapshot: int, mapped: bool = True) -> bool:
        """Page `handle` of `owner` holds the rows of `tokens` (fewer than a page, after the full
        pages keyed `parent`) and `snapshot` the state after them: the cache takes both, owner
        still mapping the page until it releases it (not mapped: a copy nobody maps). False
        (owner keeps both) when an equal tail is cached already."""
        block = tuple(int(t) for t in tokens)
        if not 0 < len(block) < self.pool.page_tokens:
            raise ValueError(f"a tail holds 1..{self.pool.page_tokens - 1} tokens, got {len(block)}")
        if self.has_tail(parent, block):
            return False
        self.pool.transfer(handle, owner, CACHE_OWNER)
        self._clock += 1
        tail = CachedPage(handle, chain_key(parent, block), index, block, refs=int(mapped), snapshot=snapshot,
                          last_used=self._clock, parent=parent)
        self._idle += not mapped
        self._pages[tail.key] = self._by_page[handle.page] = tail
        self._tails.setdefault(parent, []).append(tail)
        self._bound_snapshots(tail)
        return True

    def _bound_snapshots(self, keep: CachedPage) -> None:
        """Drop the least recently used snapshots but `keep`'s past max_snapshots (an idle tail
        goes whole: its page is no use without its state)."""
        older = [p for p in self._pages.values()
                 if p.snapshot is not None and p is not keep and not (p.is_tail and p.refs)]
        while len(older) >= self.max_snapshots:
            oldest = min(older, key=lambda p: (p.last_used, -p.index))
            older.remove(oldest)
            if oldest.is_tail:
                self._drop(oldest)
            else:
                self.drop_snapshot(oldest.snapshot)
                oldest.snapshot = None

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

    @property
    def tails(self) -> int:
        return sum(len(ts) for ts in self._tails.values())

    STATS = ("prefix_hits", "prefix_misses", "prefix_cached_tokens", "prefix_cached_pages", "prefix_evictions",
             "prefix_snapshots", "prefix_tails", "prefix_tail_hits")

    def stats(self) -> dict:
        """prefix_cached_pages counts tails' pages too (every page the cache owns)."""
        return {"prefix_hits": self.hits, "prefix_misses": self.misses, "prefix_cached_tokens": self.cached_tokens,
                "prefix_cached_pages": self.pages, "prefix_evictions": self.evictions,
                "prefix_snapshots": self.snapshots, "prefix_tails": self.tails, "prefix_tail_hits": self.tail_hits}

    def check(self) -> None:
        """Assert the bookkeeping invariants (tests call it with the pool's)."""
        for key, p in self._pages.items():
            assert p.key == key and p.refs >= 0
            assert self.pool.owner_of(p.handle) == CACHE_OWNER, f"cached page {p.handle.page} owned elsewhere"
        assert sorted(self._by_page) == sorted(p.handle.page for p in self._pages.values()), "a page cached twice"
        assert self.snapshots <= self.max_snapshots
        assert self._idle == sum(1 for p in self._pages.values() if p.refs == 0)
        tails = [t for ts in self._tails.values() for t in ts]
        assert sorted(id(t) for t in tails) == sorted(id(p) for p in self._pages.values() if p.is_tail)
        for t in tails:
            assert t.snapshot is not None and 0 < len(t.tokens) < self.pool.page_tokens
            assert t.key == chain_key(t.parent, t.tokens) and t in self._tails[t.parent]

    # ---- helpers ----------------------------------------------------------------------------
    def _drop(self, page: CachedPage) -> None:
        del self._pages[page.key], self._by_page[page.handle.page]
        if page.is_tail:
            self._tails[page.parent].remove(page)
            if not self._tails[page.parent]:
                del self._tails[page.parent]
        self._idle -= 1  # only idle pages are dropped
        if page.snapshot is not None:
            self.drop_snapshot(page.snapshot)
        self.pool.free(page.handle)

    def _by_handle(self, handle: PageHandle) -> CachedPage:
        page = self._by_page.get(handle.page)
        if page is None or page.handle != handle:
            raise AssertionError(f"page {handle.page} is not cached")
        return page
