"""Block tables and admission arithmetic on top of a PagePool.

Each live slot owns a block table: logical page i (token positions
i*page_tokens .. (i+1)*page_tokens-1) -> physical page handle. Physical pages
come from wherever the pool hands them out; nothing assumes they are adjacent.

Reservations keep the promises that make admission safe:

  * a newcomer reserves its whole prompt plus one page, so its prompt rows can
    always run and its first generated token has somewhere to go;
  * every live sequence wants one spare page beyond the one it is filling
    (rolling decode headroom). A sequence missing its spare has a "debt" of one
    page, and a newcomer is admitted only if the free pages cover its own
    reservation AND every live sequence's debt. So admitting never takes the
    page a live decoder needs next.

Both are capped by the pages the sequence can ever use (prompt + output cap).

A sequence resumed from the prefix cache starts its table with the cache's pages
(`shared`): they hold its first positions already, count toward its table, and are
given back to the cache, not the pool, when it ends.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .pool import PageHandle, PagePool, PoolExhausted, pages_for_tokens


@dataclass
class SlotPages:
    prompt_tokens: int
    lifetime_tokens: int      # positions this sequence can ever feed
    positions: int = 0        # positions mapped so far (rows up to here may run)
    table: list[PageHandle] = field(default_factory=list)


class BlockManager:
    def __init__(self, pool: PagePool, n_slots: int, cache=None):
        self.pool = pool
        self.n_slots = n_slots
        self.cache = cache  # paging.prefix.PrefixCache, or None
        self._slots: dict[int, SlotPages] = {}

    def pages_for(self, n_tokens: int) -> int:
        return pages_for_tokens(n_tokens, self.pool.page_tokens)

    # ---- admission -------------------------------------------------------------
    def first_reservation(self, prompt_tokens: int, lifetime_tokens: int, shared: int = 0) -> int:
        """Pages a newcomer reserves: its prompt's and one more (capped by its lifetime), less
        the `shared` pages the prefix cache maps for it."""
        return min(self.pages_for(prompt_tokens) + 1, self.pages_for(lifetime_tokens)) - shared

    def fits_idle_pool(self, prompt_tokens: int, lifetime_tokens: int) -> bool:
        return self.first_reservation(prompt_tokens, lifetime_tokens) <= self.pool.n_pages

    def debt(self, slot: int) -> int:
        """Pages slot wants (current page + one spare) beyond what it holds or has reserved."""
        s = self._slots[slot]
        want = min(self.pages_for(max(s.positions, s.prompt_tokens)) + 1, self.pages_for(s.lifetime_tokens))
        return max(0, want - len(s.table) - self.pool.reservation(slot))

    def total_debt(self) -> int:
        return sum(self.debt(slot) for slot in self._slots)

    def can_admit(self, prompt_tokens: int, lifetime_tokens: int, shared: int = 0) -> bool:
        need = self.first_reservation(prompt_tokens, lifetime_tokens, shared)
        return need + self.total_debt() <= self.pool.free_pages

    def admit(self, slot: int, prompt_tokens: int, lifetime_tokens: int,
              shared: Sequence[PageHandle] = ()) -> None:
        """A newcomer in slot; `shared`: the cache's pages holding its first positions (the
        caller has acquired them, so they are not counted free)."""
        if slot in self._slots:
            raise ValueError(f"slot {slot} is already live")
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"slot {slot} is outside 0..{self.n_slots - 1}")
        if not 1 <= prompt_tokens <= lifetime_tokens:
            raise ValueError(f"need 1 <= prompt ({prompt_tokens}) <= lifetime ({lifetime_tokens})")
        if len(shared) * self.pool.page_tokens >= prompt_tokens:
            raise ValueError(f"slot {slot}: {len(shared)} shared pages leave none of its {prompt_tokens} "
                             f"prompt tokens to feed")
        need = self.first_reservation(prompt_tokens, lifetime_tokens, len(shared))
        if not self.can_admit(prompt_tokens, lifetime_tokens, len(shared)):
            raise PoolExhausted(f"slot {slot}: {need} pages + {self.total_debt()} owed to live sequences > "
                                f"{self.pool.free_pages} free")
        self.pool.reserve(slot, need)
        self._slots[slot] = SlotPages(prompt_tokens, lifetime_tokens, len(shared) * self.pool.page_tokens,
                                      list(shared))

    # ---- growth ------------------------------------------------------------------
    def missing_pages(self, slot: int, positions: int) -> int:
        """Pages slot must still map before rows at positions < `positions` can run."""
        s = self._slots[slot]
        if positions > s.lifetime_tokens:
            raise ValueError(f"slot {slot}: position {positions - 1} is past its lifetime "
                             f"of {s.lifetime_tokens} positions")
        return max(0, self.pages_for(positions) - len(s.table))

    def can_map(self, slot: int, positions: int) -> bool:
        missing = self.missing_pages(slot, positions)
        return missing <= self.pool.reservation(slot) + self.pool.free_pages

    def map(self, slot: int, positions: int) -> bool:
        """Grow slot's table to cover positions < `positions`; True if it grew."""
        missing = self.missing_pages(slot, positions)
        if not self.can_map(slot, positions):
            raise PoolExhausted(f"slot {slot} needs {missing} more pages; "
                                f"{self.pool.reservation(slot)} reserved, {self.pool.free_pages} free")
        s = self._slots[slot]
        for _ in range(missing):
            s.table.append(self.pool.allocate(slot))
        s.positions = max(s.positions, positions)
        return missing > 0

    def top_up(self, slots_oldest_first) -> None:
        """Give each slot's missing spare back from the free pages, oldest first."""
        for slot in slots_oldest_first:
            n = min(self.debt(slot), self.pool.free_pages)
            if n:
                self.pool.reserve(slot, n)

    # ---- views / retirement ------------------------------------------------------
    def table(self, slot: int) -> list[int]:
        return [h.page for h in self._slots[slot].table]

    def handles(self, slot: int) -> list[PageHandle]:
        return list(self._slots[slot].table)

    def live(self) -> list[int]:
        return list(self._slots)

    def release(self, slot: int) -> None:
        """Give slot's pages back: its own to the pool, the cached ones to the cache."""
        s = self._slots[slot]
        cached = [h for h in s.table if self.cache is not None and self.cache.owns(h)]
        self.pool.release(slot, [h for h in s.table if h not in set(cached)])
        if cached:
            self.cache.release(cached)
        del self._slots[slot]
