"""A fixed pool of KV pages, handed out by index.

The pool only counts; it never touches tensor memory (the backend owns that,
addressed by the page indices). Three kinds of page:

  used      owned by a sequence, mapped in its block table, or by the prefix cache
  reserved  promised to a sequence, not yet taken; nobody else may take it
  free      neither: what newcomers and top-ups may claim

free + reserved + used == n_pages at all times (an idle cached page, below, counted once). With a prefix cache (paging/prefix.py) as
the pool's `reclaimer`, the cached pages no sequence maps count as free too: allocate()
has the cache evict one when no page is unowned. Every failing call raises
before changing anything, so a caller can try and fall back.

A handle is (page, generation). Freeing a page bumps its generation, so a
handle kept past its free (a stale block-table entry) is rejected instead of
silently freeing some other sequence's page.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Hashable, Optional

import numpy as np

from ..backend import PAGE_TOKENS


class PoolError(RuntimeError):
    """A page-pool operation that was refused; the pool is unchanged."""


class PoolExhausted(PoolError):
    """Not enough free pages for the request."""


class StaleHandle(PoolError):
    """A handle whose page was freed (and maybe reused) since it was issued."""


@dataclass(frozen=True)
class PageHandle:
    page: int
    generation: int


def pages_for_tokens(n_tokens: int, page_tokens: int = PAGE_TOKENS) -> int:
    return -(-max(n_tokens, 0) // page_tokens)


def pool_pages(n_slots: int, max_context: int, kv_pool_tokens: Optional[int] = None,
               page_tokens: int = PAGE_TOKENS) -> int:
    """Pool size: kv_pool_tokens rounded up to whole pages, else every slot can hold a full context."""
    if kv_pool_tokens is not None:
        if kv_pool_tokens < 1:
            raise ValueError(f"kv_pool_tokens must be >= 1, got {kv_pool_tokens}")
        return pages_for_tokens(kv_pool_tokens, page_tokens)
    return n_slots * pages_for_tokens(max_context, page_tokens)


class PagePool:
    def __init__(self, n_pages: int, page_tokens: int = PAGE_TOKENS, order_seed: Optional[int] = None):
        if n_pages < 1:
            raise ValueError(f"a page pool needs at least one page, got {n_pages}")
        self.n_pages = n_pages
        self.page_tokens = page_tokens
        self._generation = [0] * n_pages
        self._owner: list[Optional[Hashable]] = [None] * n_pages
        # Popped from the end. A seed shuffles the hand-out order so tests see
        # scattered physical pages, as a long-running server would.
        order = list(range(n_pages - 1, -1, -1))
        if order_seed is not None:
            np.random.default_rng(order_seed).shuffle(order)
        self._free = order
        self._reserved: dict[Hashable, int] = defaultdict(int)
        self.reclaimer = None  # .evictable() -> int, .evict_one(): a prefix cache's idle pages

    # ---- counts ----------------------------------------------------------
    @property
    def reserved_pages(self) -> int:
        return sum(self._reserved.values())

    @property
    def free_pages(self) -> int:
        """Pages anyone may claim: unowned (or cached and idle) and not promised to a sequence."""
        return len(self._free) + self._evictable() - self.reserved_pages

    @property
    def used_pages(self) -> int:
        return self.n_pages - len(self._free)

    def reservation(self, owner: Hashable) -> int:
        return self._reserved.get(owner, 0)

    def owner_of(self, handle: PageHandle) -> Hashable:
        self._check_live(handle)
        return self._owner[handle.page]

    # ---- reservations ------------------------------------------------------
    def reserve(self, owner: Hashable, n: int) -> None:
        if n < 0:
            raise ValueError(f"cannot reserve {n} pages")
        if n > self.free_pages:
            raise PoolExhausted(f"{owner!r} asked to reserve {n} pages, {self.free_pages} free")
        if n:
            self._reserved[owner] += n

    def unreserve(self, owner: Hashable, n: Optional[int] = None) -> int:
        """Drop n (default all) of owner's reserved pages; returns how many were dropped."""
        have = self._reserved.get(owner, 0)
        n = have if n is None else n
        if not 0 <= n <= have:
            raise PoolError(f"{owner!r} holds {have} reserved pages, cannot drop {n}")
        self._set_reserved(owner, have - n)
        return n

    # ---- pages ---------------------------------------------------------------
    def allocate(self, owner: Hashable) -> PageHandle:
        """One page for owner, from its reservation if it has one, else from the free pages."""
        from_reservation = self._reserved.get(owner, 0) > 0
        if not from_reservation and self.free_pages < 1:
            raise PoolExhausted(f"{owner!r} needs a page: none free "
                                f"({self.used_pages} used, {self.reserved_pages} reserved)")
        if not self._free:
            self.reclaimer.evict_one()  # free_pages counted its idle pages, so it has one
        page = self._free.pop()
        if from_reservation:
            self._set_reserved(owner, self._reserved[owner] - 1)
        self._owner[page] = owner
        return PageHandle(page, self._generation[page])

    def free(self, handle: PageHandle) -> None:
        self._check_live(handle)
        self._generation[handle.page] += 1
        self._owner[handle.page] = None
        self._free.append(handle.page)

    def transfer(self, handle: PageHandle, owner: Hashable, new_owner: Hashable) -> None:
        """Hand owner's page to new_owner (the handle stays valid)."""
        if self.owner_of(handle) != owner:
            raise PoolError(f"page {handle.page} belongs to {self._owner[handle.page]!r}, not {owner!r}")
        self._owner[handle.page] = new_owner

    def release(self, owner: Hashable, handles: list[PageHandle]) -> None:
        """Free all of owner's pages and drop its reservation (all checked first)."""
        for h in handles:
            if self.owner_of(h) != owner:
                raise PoolError(f"page {h.page} belongs to {self._owner[h.page]!r}, not {owner!r}")
        if len({h.page for h in handles}) != len(handles):
            raise PoolError(f"{owner!r} listed a page twice")
        for h in handles:
            self.free(h)
        self.unreserve(owner)

    # ---- helpers -------------------------------------------------------------
    def _evictable(self) -> int:
        return self.reclaimer.evictable() if self.reclaimer is not None else 0

    def _set_reserved(self, owner: Hashable, n: int) -> None:
        if n:
            self._reserved[owner] = n
        else:
            self._reserved.pop(owner, None)

    def _check_live(self, handle: PageHandle) -> None:
        if not 0 <= handle.page < self.n_pages:
            raise PoolError(f"page {handle.page} is outside the pool of {self.n_pages}")
        if self._owner[handle.page] is None or self._generation[handle.page] != handle.generation:
            raise StaleHandle(f"stale handle {handle}: page {handle.page} is at generation "
                              f"{self._generation[handle.page]}, "
                              f"{'free' if self._owner[handle.page] is None else 'reused'}")

    def check(self) -> None:
        """Assert the bookkeeping invariants (tests call this after every operation)."""
        owned = [p for p, o in enumerate(self._owner) if o is not None]
        assert len(set(self._free)) == len(self._free), "a page is on the free list twice"
        assert not set(owned) & set(self._free), "an owned page is on the free list"
        assert len(owned) + len(self._free) == self.n_pages, "a page is neither owned nor free"
        assert all(v > 0 for v in self._reserved.values()), "an empty reservation was kept"
        assert self.free_pages >= 0, "more pages reserved than are free"
        # an idle cached page is both used (owned by the cache) and free (claimable): count it once
        assert self.free_pages + self.reserved_pages + self.used_pages - self._evictable() == self.n_pages
