"""NumpyBackend: the backend protocol over the reference decode step, with paged state.

Storage follows ds4ref.paging.layout: compressed and indexer rows live in a
shared pool of pages addressed through per-slot block tables; the raw window
rings and compressor state are per slot. In official float32 numerics the KV and
indexer rows (rings and pages) are held in the compact lossless format of
ds4ref.paging.compact, encoded when written and decoded when read. A pass runs all
its rows through `Model.step_rows`, the very computation of the unpaged reference
(one token is the pass of one row), through views that read history in logical
order; every product is batch-invariant and every state update runs row by row in
plan order, so a slot's results are bitwise those of running it alone, one row a pass.
"""
from __future__ import annotations

import copy
from typing import Sequence

import numpy as np

from ..backend import (PAGE_TOKENS, PREFILL_ROWS, DraftRequest, StepPlan, StepResult, check_block_table,
                       check_draft_requests, check_kept_rows, check_rows)
from ..paging.compact import (decode_index_rows, decode_kv_rows, encode_index_rows, encode_kv_rows,
                              index_row_bytes, kv_row_bytes)
from ..paging.layout import PageLayout, kv_storage
from .state import ATTN, make_compressors, raw_window, row_kinds


class PagedSeqView:
    """The SeqState interface of one slot, over the backend's pages."""

    def __init__(self, backend: "NumpyBackend", slot: int) -> None:
        self.b, self.slot = backend, slot

    def put_raw(self, il: int, pos: int, row: np.ndarray) -> None:
        ring = self.b.rings[self.slot, il]
        ring[pos % ring.shape[0]] = self.b.encode(ATTN, row, self.slot)

    def raw_rows(self, il: int, pos: int) -> np.ndarray:
        """Raw KV rows of positions max(0, pos-W+1) .. pos, oldest first (a fresh array)."""
        return self.b.decode(ATTN, raw_window(self.b.rings[self.slot, il], pos))

    def compressor(self, il: int, kind: str):
        return self.b.comps[self.slot][(il, kind)]

    def put_row(self, il: int, kind: str, idx: int, row: np.ndarray) -> None:
        ratio = self.b.cfg.ratio(il)
        page, off = self.b.layout.locate(self.b.block_tables[self.slot], ratio, idx)
        self.b.pages[(il, kind)][page, off] = self.b.encode(kind, row, self.slot)

    def get_rows(self, il: int, kind: str, n: int) -> np.ndarray:
        store = self.b.pages[(il, kind)]
        per = store.shape[1]
        table = self.b.block_tables[self.slot][: -(-n // per)]
        return self.b.decode(kind, store[table].reshape(-1, store.shape[-1])[:n])  # fancy index: a fresh copy


class NumpyBackend:
    name = "numpy"

    def __init__(self, model, max_pass_rows: int = PREFILL_ROWS, mtp=None, dspark=None) -> None:
        """The draft module for draft(): dspark (reference/dspark.py) when given, else mtp (the
        model's MTP block, reference/mtp.py); neither: no drafts."""
        self.model, self.cfg, self.dtype, self.mtp = model, model.config, model.dtype, mtp
        self.dspark = dspark
        self.drafter = dspark if dspark is not None else mtp
        # DSpark proposes one block a round: at most block_size drafts (SeqEngine checks k against it)
        self.max_draft_tokens = dspark.config.block_size if dspark is not None else None
        self.max_pass_rows = max_pass_rows
        self.storage = kv_storage("numpy", model.numerics, self.dtype)  # how KV / indexer rows are held
        self.layout: PageLayout | None = None

    def describe(self) -> str:
        return f"NumPy reference ({np.dtype(self.dtype).name}, {self.model.numerics} numerics, {self.storage} KV rows)"

    def configure(self, n_slots: int, n_pages: int, page_tokens: int = PAGE_TOKENS,
                  max_context: int | None = None) -> None:
        cfg, dt = self.cfg, self.dtype
        self.layout = PageLayout(cfg, page_tokens)
        self.n_slots, self.n_pages = n_slots, n_pages
        self.rings = np.zeros((n_slots, cfg.n_layer, cfg.sliding_window, self._width(ATTN)), self._row_dtype)
        self.comps = [make_compressors(cfg, dt) for _ in range(n_slots)]
        self.pages: dict[tuple[int, str], np.ndarray] = {}
        for il, r in enumerate(cfg.compress_ratios):
            for kind in row_kinds(cfg.layer_kind(il)):
                self.pages[(il, kind)] = np.zeros((n_pages, self.layout.rows_per_page(r), self._width(kind)),
                                                  self._row_dtype)
        self.block_tables: list[np.ndarray] = [np.zeros(0, np.int64) for _ in range(n_slots)]
        self.next_pos = np.zeros(n_slots, np.int64)
        self.snapshots: dict[int, tuple] = {}  # id -> (ring, compressors, position)
        self._next_snapshot = 0
        self.draft_states = [self.drafter.new_state() for _ in range(n_slots)] if self.drafter is not None else []
        # slot -> (first position, what the draft module reads of its rows) of the last pass: the
        # final streams (MTP) or the stream means after the tapped layers (DSpark)
        self.hidden: dict[int, tuple[int, np.ndarray]] = {}
        self.last_rows: dict[int, tuple[int, list[int]]] = {}
        self.non_finite: set[int] = set()  # slots of the pass running now whose rows stopped being finite

    # ---- stored rows: the working float, or compact bytes (ds4ref.paging.compact) ------
    @property
    def _row_dtype(self):
        return np.uint8 if self.storage == "compact" else self.dtype

    def _width(self, kind: str) -> int:
        """Last axis of a stored row: dims, or bytes when compact."""
        c = self.cfg
        if self.storage == "compact":
            return kv_row_bytes(c.head_dim, c.n_rot) if kind == ATTN else index_row_bytes(c.indexer_head_dim)
        return c.head_dim if kind == ATTN else c.indexer_head_dim

    def encode(self, kind: str, rows: np.ndarray, slot: int) -> np.ndarray:
        if self.storage != "compact":
            return rows  # a NaN is held as it is, and shows in the slot's logits
        if not np.isfinite(rows).all():
            # The compact grid has no NaN or infinity. The slot's request ends with this pass
            # (StepResult.non_finite); zeros keep its remaining rows of the pass computable.
            self.non_finite.add(slot)
            rows = np.zeros_like(rows)
        return encode_kv_rows(rows, self.cfg.n_rot) if kind == ATTN else encode_index_rows(rows)

    def decode(self, kind: str, stored: np.ndarray) -> np.ndarray:
        if self.storage != "compact":
            return stored
        c = self.cfg
        return (decode_kv_rows(stored, c.head_dim, c.n_rot) if kind == ATTN
                else decode_index_rows(stored, c.indexer_head_dim))

    def reset_slot(self, slot: int) -> None:
        self._check_slot(slot)
        self.rings[slot] = 0
        for c in self.comps[slot].values():
            c.reset()
        self.block_tables[slot] = np.zeros(0, np.int64)  # its pages are zeroed when mapped again
        self.next_pos[slot] = 0
        if self.draft_states:
            self.draft_states[slot] = self.drafter.new_state()

    # ---- snapshots (the prefix cache) ---------------------------------------------
    def save_state(self, slot: int) -> int:
        self._check_slot(slot)
        comps = {k: copy.deepcopy(c) for k, c in self.comps[slot].items()}
        self._next_snapshot += 1
        mtp = self.draft_states[slot].save() if self.draft_states else None  # the draft's window rides along
        self.snapshots[self._next_snapshot] = (self.rings[slot].copy(), comps, int(self.next_pos[slot]), mtp)
        return self._next_snapshot

    def load_state(self, slot: int, snapshot: int, pages: Sequence[int]) -> None:
        self._check_slot(slot)
        ring, comps, position, mtp = self.snapshots[snapshot]
        table = np.asarray(pages, np.int64)
        if self.next_pos[slot] or self.block_tables[slot].size:
            raise ValueError(f"slot {slot} must be reset before it loads a snapshot")
        check_block_table(slot, self.block_tables[slot], table, self.n_pages)
        if table.size * self.layout.page_tokens < position:
            raise ValueError(f"slot {slot}: {table.size} pages do not hold the snapshot's {position} positions")
        self.rings[slot] = ring
        self.comps[slot] = {k: copy.deepcopy(c) for k, c in comps.items()}
        self.block_tables[slot] = table
        self.next_pos[slot] = position
        if mtp is not None:
            self.draft_states[slot].load(mtp)

    def drop_state(self, snapshot: int) -> None:
        del self.snapshots[snapshot]

    def copy_page(self, src: int, dst: int) -> None:
        if not (0 <= src < self.n_pages and 0 <= dst < self.n_pages and src != dst):
            raise ValueError(f"cannot copy page {src} to page {dst} of {self.n_pages}")
        for store in self.pages.values():
            store[dst] = store[src]

    # ---- speculative decoding ---------------------------------------------------------
    def restore_state(self, slot: int, snapshot: int, rows: int = 0) -> int:
        """Back to the snapshot, then the kept rows run again through the same computation
        (their state updates are its row-by-row ones; their results are not wanted)."""
        self._check_slot(slot)
        ring, comps, position, _ = self.snapshots[snapshot]  # the draft's window stays (backend.DraftRequest)
        if position > self.next_pos[slot]:
            raise ValueError(f"slot {slot}: snapshot at {position} is ahead of the slot's state at "
                             f"{int(self.next_pos[slot])}")
        first, tokens = self.last_rows.get(slot, (0, []))
        check_kept_rows(slot, position, rows, range(first, first + len(tokens)))
        self.rings[slot] = ring
        self.comps[slot] = {k: copy.deepcopy(c) for k, c in comps.items()}
        self.next_pos[slot] = position + rows
        if rows:
            view = PagedSeqView(self, slot)
            self.model.step_rows([view] * rows, tokens[:rows], list(range(position, position + rows)),
                                 np.zeros(rows, bool))
        return rows

    def draft(self, requests: Sequence[DraftRequest]) -> list[np.ndarray]:
        """The draft module over each request's rows (all requests' rows in one pass), then its
        drafts: the MTP block's k - 1 chained steps, or DSpark's block (its first k tokens)."""
        if self.drafter is None:
            raise ValueError("this model has no MTP block or DSpark module: no drafts (load one with "
                             "ds4ref.load(mtp=...) or ds4ref.load(dspark=...))")
        self._check_slot(0)  # configured
        check_draft_requests(requests, self.n_slots, self.cfg.vocab_size)
        if self.max_draft_tokens is not None:
            for r in requests:
                if r.k > self.max_draft_tokens:
                    raise ValueError(f"slot {r.slot}: {r.k} drafts asked, DSpark proposes at most "
                                     f"{self.max_draft_tokens} (its block size) a round")
        states, hidden, positions = [], [], []
        for r in requests:
            first, rows = self.hidden.get(r.slot, (0, np.zeros((0,))))
            idx = np.asarray(r.positions, np.int64) - first
            if idx.size == 0 or idx.min() < 0 or idx.max() >= len(rows):
                raise ValueError(f"slot {r.slot}: positions {r.positions} were not rows of the last pass")
            states += [self.draft_states[r.slot]] * idx.size
            hidden.append(rows[idx])
            positions += list(r.positions)
        if not requests:
            return []
        if self.dspark is not None:
            return self._dspark_drafts(requests, states, np.concatenate(hidden), positions)
        return self._mtp_drafts(requests, states, np.concatenate(hidden), positions)

    def _dspark_drafts(self, requests, states, hidden, positions) -> list[np.ndarray]:
        self.dspark.feed(states, hidden, positions)
        drafting = [r for r in requests if r.k]
        out = {}
        if drafting:
            block = self.dspark.draft([self.draft_states[r.slot] for r in drafting],
                                      [r.next_tokens[-1] for r in drafting])
            out = {r.slot: block.tokens[i, :r.k] for i, r in enumerate(drafting)}
        return [np.asarray(out.get(r.slot, ()), np.int32) for r in requests]

    def _mtp_drafts(self, requests, states, hidden, positions) -> list[np.ndarray]:
        """The MTP block over the rows, then k - 1 chained steps per request. The chained steps
        overwrite MTP window entries that later positions still read (the ring is one window
        long), so they run on a copy."""
        tokens = [t for r in requests for t in r.next_tokens]
        logits, out = self.mtp.rows(states, hidden, tokens, positions)
        drafts, ends = [], np.cumsum([len(r.positions) for r in requests]) - 1
        for r, e in zip(requests, ends):
            d = []
            if r.k:
                st = self.draft_states[r.slot]
                kept = st.save()
                lg, h = logits[e], out[e]
                for i in range(r.k):
                    d.append(int(np.argmax(lg)))
                    if i + 1 < r.k:
                        lg, h = self.mtp.step(st, h, d[-1], r.positions[-1] + 1 + i)
                st.load(kept)
            drafts.append(np.asarray(d, np.int32))
        return drafts

    def set_block_table(self, slot: int, pages: Sequence[int]) -> None:
        self._check_slot(slot)
        table = np.asarray(pages, np.int64)
        old = self.block_tables[slot]
        check_block_table(slot, old, table, self.n_pages)
        self._zero_pages(table[old.size:])  # a page from the pool may hold another sequence's rows
        self.block_tables[slot] = table

    def step(self, plan: StepPlan) -> StepResult:
        rows = plan.rows()
        self._check_rows(rows)  # all before any, so a bad plan changes no state
        emit = np.array([r.emit for r in rows], bool)
        views = {r.slot: PagedSeqView(self, r.slot) for r in rows}  # one per slot: a slot's rows share it
        self.non_finite = set()
        # Overflow is reported per slot (StepResult.non_finite), not as NumPy's warnings.
        with np.errstate(over="ignore", invalid="ignore"):
            out = self.model.step_rows([views[r.slot] for r in rows], [r.token for r in rows],
                                       [r.position for r in rows], emit,
                                       hidden=self.dspark is None and self.mtp is not None,
                                       taps=self.dspark.taps if self.dspark is not None else ())
        if self.drafter is not None:
            out, streams = out
            self.hidden = {}
            for i, r in enumerate(rows):
                if r.slot not in self.hidden:
                    n = sum(1 for q in rows if q.slot == r.slot)
                    self.hidden[r.slot] = (r.position, streams[i:i + n])
        self.last_rows = {}  # slot -> (first position, tokens) of its rows in this pass
        for r in rows:
            self.next_pos[r.slot] += 1
            self.last_rows.setdefault(r.slot, (r.position, []))[1].append(r.token)
        argmax = np.full(len(rows), -1, np.int32)
        argmax[emit] = np.argmax(out, axis=-1)
        emitting = [r for r in rows if r.emit]
        self.non_finite |= {r.slot for r, finite in zip(emitting, np.isfinite(out).all(axis=-1)) if not finite}
        emitted = iter(out)
        logits = [next(emitted) if r.emit else None for r in rows]
        return StepResult([lg if r.want_logits else None for lg, r in zip(logits, rows)], argmax,
                          frozenset(self.non_finite))

    # ---- checks ----------------------------------------------------------------
    def _zero_pages(self, pages: np.ndarray) -> None:
        for store in self.pages.values():
            store[pages] = 0

    def _check_slot(self, slot: int) -> None:
        if self.layout is None:
            raise RuntimeError("backend not configured: call configure(n_slots, n_pages) first")
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"slot {slot} out of range 0..{self.n_slots - 1}")

    def _check_rows(self, rows) -> None:
        if self.layout is None:
            raise RuntimeError("backend not configured: call configure(n_slots, n_pages) first")
        check_rows(rows, self.next_pos, [t.size for t in self.block_tables], self.layout.page_tokens,
                   self.cfg.vocab_size, self.max_pass_rows)
