"""Page pool and block tables: bookkeeping invariants, stale handles, admission headroom."""
from __future__ import annotations

import copy

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from ds4ref.paging.blocks import BlockManager
from ds4ref.paging.pool import (PageHandle, PagePool, PoolError, PoolExhausted, StaleHandle,
                                pages_for_tokens, pool_pages)

OWNERS = st.sampled_from(["a", "b", "c"])


def snapshot(pool: PagePool):
    return copy.deepcopy((pool._free, dict(pool._reserved), pool._generation, pool._owner))


class PoolMachine(RuleBasedStateMachine):
    """Random reserve/allocate/free/release against a model of who owns what."""
    handles = Bundle("handles")
    freed = Bundle("freed")

    def __init__(self):
        super().__init__()
        self.pool = PagePool(6, page_tokens=4, order_seed=7)
        self.owned: dict[str, set[PageHandle]] = {"a": set(), "b": set(), "c": set()}
        self.reserved = {"a": 0, "b": 0, "c": 0}

    def failing(self, fn, *args, exc=PoolError):
        before = snapshot(self.pool)
        with pytest.raises(exc):
            fn(*args)
        assert snapshot(self.pool) == before, "a failed operation changed the pool"

    @rule(owner=OWNERS, n=st.integers(0, 7))
    def reserve(self, owner, n):
        if n > self.pool.free_pages:
            self.failing(self.pool.reserve, owner, n, exc=PoolExhausted)
        else:
            self.pool.reserve(owner, n)
            self.reserved[owner] += n

    @rule(owner=OWNERS, n=st.integers(0, 4))
    def unreserve(self, owner, n):
        if n > self.reserved[owner]:
            self.failing(self.pool.unreserve, owner, n)
        else:
            self.pool.unreserve(owner, n)
            self.reserved[owner] -= n

    @rule(target=handles, owner=OWNERS)
    def allocate(self, owner):
        if self.reserved[owner] == 0 and self.pool.free_pages == 0:
            self.failing(self.pool.allocate, owner, exc=PoolExhausted)
            return None
        h = self.pool.allocate(owner)
        self.reserved[owner] = max(0, self.reserved[owner] - 1)
        self.owned[owner].add(h)
        return h

    @rule(target=freed, h=consumes(handles))
    def free(self, h):
        if h is None or not any(h in s for s in self.owned.values()):
            return None
        self.pool.free(h)
        for s in self.owned.values():
            s.discard(h)
        return h

    @rule(h=freed)
    def stale_handle_rejected(self, h):
        if h is not None:
            self.failing(self.pool.free, h, exc=StaleHandle)

    @rule(owner=OWNERS)
    def release(self, owner):
        self.pool.release(owner, list(self.owned[owner]))
        self.owned[owner].clear()
        self.reserved[owner] = 0

    @rule(owner=OWNERS, other=OWNERS)
    def release_with_foreign_page_refused(self, owner, other):
        theirs = [h for h in self.owned[other]]
        if owner != other and theirs:
            self.failing(self.pool.release, owner, list(self.owned[owner]) + theirs[:1])

    @invariant()
    def books_balance(self):
        self.pool.check()
        pages = [h.page for s in self.owned.values() for h in s]
        assert len(pages) == len(set(pages)), "a page is owned twice"
        assert self.pool.used_pages == len(pages)
        assert self.pool.reserved_pages == sum(self.reserved.values())
        assert self.pool.free_pages + self.pool.reserved_pages + self.pool.used_pages == self.pool.n_pages

    def teardown(self):
        for owner in self.owned:
            self.pool.release(owner, list(self.owned[owner]))
        assert self.pool.free_pages == self.pool.n_pages, "pages leaked after every owner left"


TestPool = PoolMachine.TestCase
TestPool.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


class AdmissionMachine(RuleBasedStateMachine):
    """Sequences admitted, grown row by row and retired through a BlockManager.

    Property: admission never takes the page a live sequence needs for its next
    row: right after any admission, every live sequence can run its next row
    at the same time."""

    def __init__(self):
        super().__init__()
        self.pool = PagePool(6, page_tokens=4, order_seed=3)
        self.blocks = BlockManager(self.pool, n_slots=4)
        self.pos: dict[int, int] = {}     # positions run per live slot
        self.life: dict[int, int] = {}
        self.prompt: dict[int, int] = {}
        self.order: list[int] = []        # admission order

    def next_page_shortfall(self) -> int:
        """Pages live sequences would have to take from the free pool to hold the page
        after the one they are filling (the rolling decode headroom)."""
        short = 0
        for s in self.pos:
            next_page = min(pages_for_tokens(max(self.pos[s], self.prompt[s]), 4) + 1,
                            pages_for_tokens(self.life[s], 4))
            short += max(0, next_page - len(self.blocks.table(s)) - self.pool.reservation(s))
        return short

    def next_row_cost(self) -> int:
        return sum(max(0, self.blocks.missing_pages(s, self.pos[s] + 1) - self.pool.reservation(s))
                   for s in self.pos if self.pos[s] < self.life[s])

    @rule(prompt=st.integers(1, 14), extra=st.integers(1, 20))
    def admit(self, prompt, extra):
        free_slots = sorted(set(range(4)) - set(self.pos))
        if not free_slots:
            return
        life = prompt + extra - 1
        if not self.blocks.fits_idle_pool(prompt, life):
            return
        if not self.blocks.can_admit(prompt, life):
            before = snapshot(self.pool)
            with pytest.raises(PoolExhausted):
                self.blocks.admit(free_slots[0], prompt, life)
            assert snapshot(self.pool) == before
            return
        shortfall_before = self.next_page_shortfall()
        slot = free_slots[0]
        self.blocks.admit(slot, prompt, life)
        self.pos[slot], self.life[slot], self.prompt[slot] = 0, life, prompt
        self.order.append(slot)
        assert self.next_row_cost() <= self.pool.free_pages, "an admission starved a live sequence"
        assert self.next_page_shortfall() == shortfall_before, "the newcomer is short of its own pages"
        assert shortfall_before <= self.pool.free_pages, "an admission took a live sequence's next page"
        # the newcomer's whole prompt is already paid for
        assert self.blocks.missing_pages(free_slots[0], prompt) <= self.pool.reservation(free_slots[0])

    @precondition(lambda self: self.pos)
    @rule(data=st.data(), n=st.integers(1, 9))
    def run_rows(self, data, n):
        slot = data.draw(st.sampled_from(sorted(self.pos)))
        for _ in range(n):
            if self.pos[slot] >= self.life[slot] or not self.blocks.can_map(slot, self.pos[slot] + 1):
                return  # finished, or stalled until a page frees up
            self.blocks.map(slot, self.pos[slot] + 1)
            self.pos[slot] += 1

    @rule()
    def top_up(self):
        self.blocks.top_up(self.order)

    @precondition(lambda self: self.pos)
    @rule(data=st.data())
    def retire(self, data):
        slot = data.draw(st.sampled_from(sorted(self.pos)))
        self.blocks.release(slot)
        del self.pos[slot], self.life[slot], self.prompt[slot]
        self.order.remove(slot)

    @invariant()
    def tables_cover_and_are_disjoint(self):
        self.pool.check()
        seen = set()
        for slot, n in self.pos.items():
            t = self.blocks.table(slot)
            assert len(t) >= pages_for_tokens(n, 4), "a run row has no page"
            assert not seen & set(t), "two slots map one physical page"
            seen |= set(t)

    def teardown(self):
        for slot in list(self.pos):
            self.blocks.release(slot)
        assert self.pool.free_pages == self.pool.n_pages


TestAdmission = AdmissionMachine.TestCase
TestAdmission.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_sizing_rounds_up_to_whole_pages():
    assert pool_pages(4, 1000, kv_pool_tokens=129, page_tokens=128) == 2
    assert pool_pages(4, 1000, kv_pool_tokens=128, page_tokens=128) == 1
    assert pool_pages(3, 300, page_tokens=128) == 3 * 3  # default: a full context per slot
    with pytest.raises(ValueError):
        pool_pages(1, 10, kv_pool_tokens=0)


def test_shuffled_pool_hands_out_scattered_pages():
    pool = PagePool(16, page_tokens=4, order_seed=1)
    got = [pool.allocate("x").page for _ in range(16)]
    assert sorted(got) == list(range(16)) and got != sorted(got) and got != sorted(got, reverse=True)


def test_reserved_pages_are_not_free_to_others():
    pool = PagePool(3, page_tokens=4)
    pool.reserve("a", 2)
    assert pool.free_pages == 1
    pool.allocate("b")
    with pytest.raises(PoolExhausted):
        pool.allocate("b")
    pool.allocate("a"), pool.allocate("a")  # a's promise holds although nothing is free
    assert pool.reservation("a") == 0 and pool.used_pages == 3


def test_prompt_plus_one_page_is_the_idle_limit():
    blocks = BlockManager(PagePool(3, page_tokens=4), n_slots=2)
    assert blocks.fits_idle_pool(8, 100)       # 2 prompt pages + 1
    assert not blocks.fits_idle_pool(9, 100)   # 3 + 1 > 3
    assert blocks.fits_idle_pool(9, 9)         # can never grow past its prompt: no spare needed


def test_newcomer_waits_while_a_decoder_is_owed_its_next_page():
    pool = PagePool(6, page_tokens=4)
    blocks = BlockManager(pool, n_slots=2)
    blocks.admit(0, 4, 20)   # 1 prompt page + 1 spare
    blocks.map(0, 5)         # decoded into its spare: it is owed the page after
    assert blocks.debt(0) == 1 and pool.free_pages == 4
    assert not blocks.can_admit(12, 20)  # 3 pages + 1 spare would fit only by taking slot 0's page
    with pytest.raises(PoolExhausted):
        blocks.admit(1, 12, 20)
    assert blocks.can_admit(8, 20)       # 2 + 1 leaves slot 0 its page
