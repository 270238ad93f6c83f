"""HashBackend: a strict stand-in for a model, for testing the scheduler and server.

A row's logits are a pseudo-random vector seeded by the whole token history of
its sequence (positions 0..p), so they depend on nothing else: not the slot,
not the batch, not how prompt rows were grouped into passes. The history is
written into, and read back out of, physical pages through the block table,
so a page mapped late, shared between slots or left over from a previous
occupant changes the answer (or trips an assertion) instead of going unseen.

It also enforces the protocol: rows of a slot at consecutive positions that
continue the slot's history, tables that only grow, and pages shared between slots
(the prefix cache's) read-only: a row may not write into a page another slot maps.
Like a real backend it keeps state outside the pages (`carry`, the CRC of the slot's
tokens so far, standing in for the raw window and the compressors): snapshots save and
load it, and every row checks it against the history read through the pages, so a
snapshot loaded over the wrong pages trips an assertion.

Drafts (speculative decoding) stand in for the MTP block's: the greedy continuation of the
history, each token replaced by the next id when a hash of its history falls outside
`draft_accuracy` percent, so tests choose the acceptance. `draft` checks its requests as the
protocol states them: each slot's positions continue where its drafter stopped and were rows of
the last pass, the tokens after them are that history's.
"""
from __future__ import annotations

import zlib
from typing import Sequence

import numpy as np

from ..backend import (PAGE_TOKENS, PREFILL_ROWS, DraftRequest, StepPlan, StepResult, check_block_table,
                       check_draft_requests, check_kept_rows, check_rows)


class ProtocolError(AssertionError):
    """The engine broke the backend protocol."""


class HashBackend:
    name = "hash"

    def __init__(self, vocab_size: int = 32, max_pass_rows: int = PREFILL_ROWS, draft_accuracy: int = 70):
        self.vocab_size, self.max_pass_rows, self.draft_accuracy = vocab_size, max_pass_rows, draft_accuracy
        self.passes: list[StepPlan] = []  # every plan seen, for tests to inspect

    def configure(self, n_slots: int, n_pages: int, page_tokens: int = PAGE_TOKENS,
                  max_context: int | None = None) -> None:
        self.n_slots, self.n_pages, self.page_tokens = n_slots, n_pages, page_tokens
        self.memory = np.full((n_pages, page_tokens), -1, np.int64)  # token id per (page, offset)
        self.tables: list[list[int]] = [[] for _ in range(n_slots)]
        self.length = [0] * n_slots  # positions written per slot
        self.carry = [0] * n_slots   # CRC of each slot's tokens so far
        self.snapshots: dict[int, tuple[int, int]] = {}  # id -> (length, carry)
        self._next_snapshot = 0
        self.drafted = [0] * n_slots  # positions fed to the drafter per slot
        self.last_rows: dict[int, range] = {}  # positions each slot ran in the last pass

    def reset_slot(self, slot: int) -> None:
        self.tables[slot] = []
        self.length[slot] = 0
        self.carry[slot] = 0
        self.drafted[slot] = 0

    def save_state(self, slot: int) -> int:
        self._next_snapshot += 1
        self.snapshots[self._next_snapshot] = (self.length[slot], self.carry[slot])
        return self._next_snapshot

    def load_state(self, slot: int, snapshot: int, pages: Sequence[int]) -> None:
        if self.length[slot] or self.tables[slot]:
            raise ProtocolError(f"slot {slot} loads a snapshot without a reset")
        self.length[slot], self.carry[slot] = self.snapshots[snapshot]
        self.tables[slot] = [int(p) for p in pages]
        if self._crc(self.history(slot)) != self.carry[slot]:
            raise ProtocolError(f"slot {slot}: the snapshot's state does not match the history in its pages")
        self.drafted[slot] = self.length[slot]

    def restore_state(self, slot: int, snapshot: int, rows: int = 0) -> int:
        length, carry = self.snapshots[snapshot]
        if length > self.length[slot]:
            raise ProtocolError(f"slot {slot} restores a snapshot at {length}, ahead of its state at "
                                f"{self.length[slot]}")
        try:
            check_kept_rows(slot, length, rows, self.last_rows.get(slot, range(0)))
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None
        self.length[slot], self.carry[slot] = length, carry
        if self._crc(self.history(slot)) != carry:
            raise ProtocolError(f"slot {slot}: the snapshot's state does not match the history in its pages")
        self.length[slot] += rows  # the kept rows' tokens are in the pages, as they were written
        self.carry[slot] = self._crc(self.history(slot))
        return rows

    def draft(self, requests: Sequence[DraftRequest]) -> list[np.ndarray]:
        try:
            check_draft_requests(requests, self.n_slots, self.vocab_size)
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None
        out = []
        for r in requests:
            ran = self.last_rows.get(r.slot, range(0))
            if r.positions[0] != self.drafted[r.slot] or r.positions[0] not in ran or r.positions[-1] not in ran:
                raise ProtocolError(f"slot {r.slot}: draft request {r} does not continue its drafter at "
                                    f"{self.drafted[r.slot]} over rows {ran} of the last pass")
            pos = np.arange(r.positions[-1] + 1)
            pages = np.asarray(self.tables[r.slot], np.int64)[pos // self.page_tokens]
            hist = list(self.memory[pages, pos % self.page_tokens])
            if hist[r.positions[0] + 1:] != list(r.next_tokens[:-1]):
                raise ProtocolError(f"slot {r.slot}: next_tokens {r.next_tokens} disagree with the rows written")
            hist.append(r.next_tokens[-1])
            self.drafted[r.slot] = r.positions[-1] + 1
            d = []
            for _ in range(r.k):
                seed = self._crc(hist)
                t = int(np.argmax(self._logits(seed)))
                d.append(t if seed % 100 < self.draft_accuracy else (t + 1) % self.vocab_size)
                hist.append(d[-1])
            out.append(np.asarray(d, np.int32))
        return out

    def drop_state(self, snapshot: int) -> None:
        del self.snapshots[snapshot]

    def copy_page(self, src: int, dst: int) -> None:
        mapped = [slot for slot, t in enumerate(self.tables) if dst in t]
        if mapped or src == dst:
            raise ProtocolError(f"page {src} copied onto page {dst}, which slots {mapped} map")
        self.memory[dst] = self.memory[src]

    def set_block_table(self, slot: int, pages: Sequence[int]) -> None:
        pages = [int(p) for p in pages]
        try:
            check_block_table(slot, self.tables[slot], pages, self.n_pages)
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None
        for other, t in enumerate(self.tables):  # the engine's own rule: only cached pages are shared
            shared = set(t) & set(pages[len(self.tables[slot]):])
            if other != slot and shared:
                raise ProtocolError(f"slot {slot} maps pages {sorted(shared)} of slot {other} as new pages")
        self.tables[slot] = pages

    def history(self, slot: int) -> np.ndarray:
        pos = np.arange(self.length[slot])
        pages = np.asarray(self.tables[slot], np.int64)[pos // self.page_tokens]
        return self.memory[pages, pos % self.page_tokens]

    def logits_for(self, history: np.ndarray) -> np.ndarray:
        return self._logits(self._crc(history))

    def _logits(self, seed: int) -> np.ndarray:
        return np.random.default_rng(seed).standard_normal(self.vocab_size).astype(np.float32)

    @staticmethod
    def _crc(history) -> int:
        return zlib.crc32(np.asarray(history, np.int64).tobytes())

    def step(self, plan: StepPlan) -> StepResult:
        rows = plan.rows()
        try:
            check_rows(rows, self.length, [len(t) for t in self.tables], self.page_tokens, self.vocab_size,
                       self.max_pass_rows)
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None
        self.passes.append(plan)
        self.last_rows = {}
        for r in rows:
            self.last_rows[r.slot] = range(self.last_rows.get(r.slot, range(r.position, r.position)).start,
                                           r.position + 1)
        logits, argmax = [], []
        for r in rows:
            if self._crc(self.history(r.slot)) != self.carry[r.slot]:
                raise ProtocolError(f"slot {r.slot}: its state no longer matches the history in its pages")
            self._write(r.slot, r.position, r.token)
            # the CRC of the history through this row, by extending the state's (crc32 chains)
            self.carry[r.slot] = zlib.crc32(np.asarray([r.token], np.int64).tobytes(), self.carry[r.slot])
            lg = self._logits(self.carry[r.slot])
            logits.append(lg if r.want_logits else None)
            argmax.append(int(np.argmax(lg)) if r.emit else -1)
        return StepResult(logits, np.asarray(argmax, np.int32))

    def _write(self, slot: int, position: int, token: int) -> None:
        page = self.tables[slot][position // self.page_tokens]
        for other, t in enumerate(self.tables):
            if other != slot and page in t:
                raise ProtocolError(f"slot {slot} writes position {position} into page {page}, "
                                    f"which slot {other} maps")
        self.memory[page, position % self.page_tokens] = token
        self.length[slot] += 1


def reference_tokens(prompt: Sequence[int], n: int, vocab_size: int = 32) -> list[int]:
    """Greedy continuation straight from the hash, with no engine at all: the ground truth."""
    b = HashBackend(vocab_size)
    hist, out = list(prompt), []
    for _ in range(n):
        out.append(int(np.argmax(b.logits_for(np.asarray(hist)))))
        hist.append(out[-1])
    return out
