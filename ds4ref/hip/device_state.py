"""Decode state of every slot in device memory, laid out as NumpyBackend lays it out.

Paged (ds4ref.paging.layout): compressed KV rows of each compressed layer and the
indexer rows of each ratio-4 layer live in pages `(n_pages, page_tokens / ratio,
row bytes)` per (layer, kind), addressed through per-slot block tables (int32
`(n_slots, max_pages)` on the device). Per slot, not paged: the raw window rings
`(n_slots, n_layer, window, row bytes)` and the compressor state per (layer, kind):
current window `(n_slots, ratio, coff * width)` kv and score, and for ratio 4 the
previous window's lane A `(n_slots, 4, width)` kv and score (-inf = none yet).
Stored rows (rings and pages) are float32, or in official numerics the compact
lossless form of docs/paging.md (`compact=True`): 712 instead of 2048 bytes a Flash
KV row, 68 instead of 512 an indexer row.

The host side of a pass (which lane holds which row, what each lane may see) is
computed by the pure functions at the top, which the CPU tests check directly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..backend import DECODE_LANES, check_block_table
from ..paging.layout import PageLayout, index_row_nbytes, kv_row_nbytes
from ..gguf.config import ATTN, CSA, INDEX, row_kinds
from . import buffers
from .runtime import GpuError

# kernels/step_state.hip's row formats
ROW_F32, ROW_KV, ROW_IX = 0, 1, 2

NEG_INF_BITS = 0xFF800000
# Per-lane int32 fields written before every replay (rows of one (lanes,) array each).
# hsrc is the head's: entry e is the lane of the e-th row that emits (-1 past them), so
# the head runs on the emitting rows gathered to the front.
LANE_FIELDS = ("slot", "pos", "tok", "pstart", "flane", "last", "hsrc")


# ---------------------------------------------------------------------------
# Pure host-side logic: plan -> lanes
# ---------------------------------------------------------------------------


def lane_order(slots: Sequence[int]) -> list[int]:
    """Plan rows reordered so each slot's rows sit on consecutive lanes.

    The kernels find the lane of a slot's position q as flane + (q - pstart), so a
    slot's rows must be contiguous; a plan may interleave slots. Slots keep the order
    of their first row, rows of a slot keep plan order (= position order).
    """
    first: dict[int, int] = {}
    for i, s in enumerate(slots):
        first.setdefault(int(s), i)
    return sorted(range(len(slots)), key=lambda i: (first[int(slots[i])], i))


def lane_fields(rows, ratios: Sequence[int], n_lanes: int = DECODE_LANES) -> np.ndarray:
    """int32 (len(LANE_FIELDS) + len(ratios), n_lanes) for rows already in lane order.

    Padding lanes: slot -1, position 0, token 0, nothing visible. The last rows are
    the visible compressed-row counts (pos + 1) // ratio, one per ratio in `ratios`.
    """
    out = np.zeros((len(LANE_FIELDS) + len(ratios), n_lanes), np.int32)
    f = {name: out[i] for i, name in enumerate(LANE_FIELDS)}
    f["slot"][:] = -1
    f["hsrc"][:] = -1
    f["flane"][:] = np.arange(n_lanes)
    emitting = [lane for lane, r in enumerate(rows) if r.emit]
    f["hsrc"][: len(emitting)] = emitting
    first: dict[int, tuple[int, int]] = {}
    last: dict[int, int] = {}
    for lane, r in enumerate(rows):
        first.setdefault(r.slot, (lane, r.position))
        last[r.slot] = r.position
    for lane, r in enumerate(rows):
        f["slot"][lane], f["pos"][lane], f["tok"][lane] = r.slot, r.position, r.token
        f["flane"][lane], f["pstart"][lane] = first[r.slot]
        f["last"][lane] = last[r.slot]
        for k, ratio in enumerate(ratios):
            out[len(LANE_FIELDS) + k, lane] = (r.position + 1) // ratio
    return out


def lane_context(cfg, n_pages: int, page_tokens: int, max_context: int | None = None) -> int:
    """The most positions one slot can hold: the server's context limit (SeqEngine.max_context;
    None: the model's), within the model's context and the whole pool. Every size that grows
    with the keys a row can see (block tables, RoPE rows, indexer scores, attention slices)
    is sized by it, not by the model's context."""
    context = cfg.context_length if max_context is None else min(int(max_context), cfg.context_length)
    return max(1, min(context, n_pages * page_tokens))


def max_pages_per_slot(n_pages: int, page_tokens: int, context_length: int) -> int:
    """Block-table width: a slot never maps more pages than its context needs."""
    return max(1, min(n_pages, -(-context_length // page_tokens)))


# ---------------------------------------------------------------------------
# Device storage
# ---------------------------------------------------------------------------


@dataclass
class CompState:
    ratio: int
    width: int
    cur_kv: object
    cur_sc: object
    prev_kv: object = None
    prev_sc: object = None


def row_bytes(cfg, kind: str, compact: bool) -> int:
    """Bytes of one stored KV (ATTN) or indexer (INDEX) row (sizes: paging.layout)."""
    storage = "compact" if compact else "f32"
    return kv_row_nbytes(cfg, storage) if kind == ATTN else index_row_nbytes(cfg, storage)


def row_format(kind: str, compact: bool) -> int:
    return ROW_F32 if not compact else ROW_KV if kind == ATTN else ROW_IX


class DeviceState:
    """All slots' state on the device plus the host mirrors the checks need."""

    def __init__(self, rt, cfg, n_slots: int, n_pages: int, page_tokens: int, ratios: Sequence[int],
                 compact: bool = False, n_lanes: int = DECODE_LANES, max_context: int | None = None):
        self.rt, self.cfg, self.compact = rt, cfg, compact
        self.layout = PageLayout(cfg, page_tokens)
        self.n_slots, self.n_pages, self.page_tokens = n_slots, n_pages, page_tokens
        self.context = lane_context(cfg, n_pages, page_tokens, max_context)  # positions a slot can hold
        self.maxp = max_pages_per_slot(n_pages, page_tokens, self.context)
        self.ratios = tuple(ratios)  # the ratios whose nvis rows the lanes carry
        self._bufs = []
        self.row_bytes = {kind: row_bytes(cfg, kind, compact) for kind in (ATTN, INDEX)}
        self.ring_slot_bytes = cfg.n_layer * cfg.sliding_window * self.row_bytes[ATTN]
        self.rings = self._zeros(n_slots * self.ring_slot_bytes // 4)
        self.comps: dict[tuple[int, str], CompState] = {}
        self.pages: dict[tuple[int, str], object] = {}
        for il, r in enumerate(cfg.compress_ratios):
            for kind in row_kinds(cfg.layer_kind(il)):
                width, coff = cfg.head_dim if kind == ATTN else cfg.indexer_head_dim, cfg.layer_kind(il).lanes
                cs = CompState(r, width, self._zeros(n_slots * r * coff * width),
                               self._zeros(n_slots * r * coff * width))
                if r == CSA:
                    cs.prev_kv = self._zeros(n_slots * 4 * width)
                    cs.prev_sc = self._fill(n_slots * 4 * width, NEG_INF_BITS)
                self.comps[(il, kind)] = cs
                self.pages[(il, kind)] = self._zeros(n_pages * self.layout.rows_per_page(r) *
                                                     self.row_bytes[kind] // 4)
        self.btab = self._zeros(n_slots * self.maxp)
        self.n_lanes = n_lanes  # the largest pass; every program reads the first lanes it has
        self.lanes = self._zeros((len(LANE_FIELDS) + len(self.ratios)) * n_lanes)
        self.tables: list[np.ndarray] = [np.zeros(0, np.int64) for _ in range(n_slots)]
        self.next_pos = np.zeros(n_slots, np.int64)
        self.snapshots: dict[int, tuple[object, int]] = {}  # id -> (device copy of the slot's state, position)
        self._next_snapshot = 0
        # Speculation takes a snapshot every round: up to n_slots dropped copies are kept for the
        # next saves (one stream orders a reuse after the copies queued from it, so no sync is
        # needed), and each save or restore is one step_slot_copy launch over the regions' table.
        self._spare: list[object] = []
        regions = self._regions()
        self.snapshot_bytes = sum(nb for _, nb in regions)
        starts = np.cumsum([0] + [nb for _, nb in regions[:-1]])
        self._region_table = rt.upload(np.asarray([(buf.ptr, nb, at) for (buf, nb), at in zip(regions, starts)],
                                                  np.int64))
        self._bufs.append(self._region_table)
        self._copy_grid = (max(1, min(1024, -(-max(nb for _, nb in regions) // (4 * 256)))), len(regions))
        rt.synchronize()

    @staticmethod
    def bytes_needed(cfg, n_slots: int, n_pages: int, page_tokens: int, compact: bool = False,
                     max_context: int | None = None) -> int:
        layout = PageLayout(cfg, page_tokens)
        maxp = max_pages_per_slot(n_pages, page_tokens, lane_context(cfg, n_pages, page_tokens, max_context))
        storage = "compact" if compact else "f32"
        return n_pages * layout.page_bytes(storage) + n_slots * (layout.slot_bytes(storage) + 4 * maxp)

    # ---- allocation helpers ----------------------------------------------------
    def _fill(self, n: int, bits: int):
        buf = self.rt.malloc(max(4 * n, 4))
        self.rt.memset32(buf, bits, max(n, 1))
        self._bufs.append(buf)
        return buf

    def _zeros(self, n: int):
        return self._fill(n, 0)

    def free(self) -> None:
        self.rt.synchronize()
        for b in self._bufs + [buf for buf, _ in self.snapshots.values()] + self._spare:
            b.free()
        self._bufs, self.snapshots, self._spare = [], {}, []

    # ---- views the program needs ---------------------------------------------------
    def lane(self, name: str):
        """Device view of one per-lane field (int32[n_lanes])."""
        return self._field(LANE_FIELDS.index(name))

    def nvis(self, ratio: int):
        return self._field(len(LANE_FIELDS) + self.ratios.index(ratio))

    def _field(self, i: int):
        return buffers.view(self.lanes, i * self.n_lanes * 4, self.n_lanes * 4)

    def ring_layer(self, il: int):
        at = il * self.cfg.sliding_window * self.row_bytes[ATTN]
        return buffers.view(self.rings, at, self.rings.nbytes - at)

    def row_format(self, kind: str) -> int:
        return row_format(kind, self.compact)

    # ---- protocol operations -------------------------------------------------------
    def check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"slot {slot} out of range 0..{self.n_slots - 1}")

    def reset_slot(self, slot: int) -> None:
        self.check_slot(slot)
        rt = self.rt
        rt.memset32(buffers.view(self.rings, slot * self.ring_slot_bytes, self.ring_slot_bytes), 0,
                    self.ring_slot_bytes // 4)
        for cs in self.comps.values():
            coff = 2 if cs.ratio == CSA else 1
            n = cs.ratio * coff * cs.width
            for buf in (cs.cur_kv, cs.cur_sc):
                rt.memset32(buffers.view(buf, slot * n * 4, n * 4), 0, n)
            if cs.ratio == CSA:
                m = 4 * cs.width
                rt.memset32(buffers.view(cs.prev_kv, slot * m * 4, m * 4), 0, m)
                rt.memset32(buffers.view(cs.prev_sc, slot * m * 4, m * 4), NEG_INF_BITS, m)
        self.tables[slot] = np.zeros(0, np.int64)  # its pages are zeroed when mapped again
        self.next_pos[slot] = 0
        self._upload_table(slot)

    # ---- snapshots (the prefix cache, speculation's rounds) ------------------------------
    def _regions(self) -> list[tuple[object, int]]:
        """(buffer, bytes a slot) of each piece of state that is not in pages; slot s's part of
        a buffer starts at s times its bytes a slot."""
        out = [(self.rings, self.ring_slot_bytes)]
        for cs in self.comps.values():
            n = 4 * cs.ratio * (2 if cs.ratio == CSA else 1) * cs.width
            out += [(cs.cur_kv, n), (cs.cur_sc, n)]
            if cs.ratio == CSA:
                m = 4 * 4 * cs.width
                out += [(cs.prev_kv, m), (cs.prev_sc, m)]
        return out

    def save_state(self, slot: int) -> int:
        self.check_slot(slot)
        try:
            copy = self._spare.pop() if self._spare else self.rt.malloc(self.snapshot_bytes)
        except GpuError as exc:  # the engine serves on without this snapshot
            raise MemoryError(f"no device memory for a {self.snapshot_bytes}-byte snapshot: {exc}") from exc
        self._copy(slot, copy, to_snapshot=True)
        self._next_snapshot += 1
        self.snapshots[self._next_snapshot] = (copy, int(self.next_pos[slot]))
        return self._next_snapshot

    def load_state(self, slot: int, snapshot: int, pages: Sequence[int]) -> None:
        self.check_slot(slot)
        copy, position = self.snapshots[snapshot]
        table = np.asarray(pages, np.int64).reshape(-1)
        if self.next_pos[slot] or self.tables[slot].size:
            raise ValueError(f"slot {slot} must be reset before it loads a snapshot")
        check_block_table(slot, self.tables[slot], table, self.n_pages)
        if table.size * self.page_tokens < position or table.size > self.maxp:
            raise ValueError(f"slot {slot}: {table.size} pages do not hold the snapshot's {position} positions")
        self._copy(slot, copy, to_snapshot=False)
        self.tables[slot], self.next_pos[slot] = table, position
        self._upload_table(slot)

    def restore_state(self, slot: int, snapshot: int) -> None:
        """The slot takes back the snapshot's state and position and keeps its block table (which
        only grew since, so it still holds the snapshot's positions)."""
        self.check_slot(slot)
        copy, position = self.snapshots[snapshot]
        if self.tables[slot].size * self.page_tokens < position:
            raise ValueError(f"slot {slot}: its {self.tables[slot].size} pages do not hold the snapshot's "
                             f"{position} positions (not this slot's snapshot?)")
        self._copy(slot, copy, to_snapshot=False)
        self.next_pos[slot] = position

    def _copy(self, slot: int, copy, to_snapshot: bool) -> None:
        kernel = self.rt.compile_file("step_state.hip").kernel("step_slot_copy")
        self.rt.launch(kernel, self._copy_grid, (256,),
                       (self._region_table, np.int32(slot), copy, np.int32(to_snapshot)))

    def drop_state(self, snapshot: int) -> None:
        copy, _ = self.snapshots.pop(snapshot)
        if len(self._spare) < self.n_slots:  # a round's snapshot a slot; the cache's beyond are freed
            self._spare.append(copy)
            return
        self.rt.synchronize()  # a copy from it may still be queued
        copy.free()

    def copy_page(self, src: int, dst: int) -> None:
        """Device-to-device: page dst of every page store becomes page src's."""
        if not (0 <= src < self.n_pages and 0 <= dst < self.n_pages and src != dst):
            raise ValueError(f"cannot copy page {src} to page {dst} of {self.n_pages}")
        for (il, kind), buf in self.pages.items():
            n = self.layout.rows_per_page(self.cfg.compress_ratios[il]) * self.row_bytes[kind]
            self.rt.d2d(buffers.view(buf, dst * n, n), buffers.view(buf, src * n, n), n)

    def set_block_table(self, slot: int, pages: Sequence[int]) -> None:
        self.check_slot(slot)
        table = np.asarray(pages, np.int64).reshape(-1)
        check_block_table(slot, self.tables[slot], table, self.n_pages)
        if table.size > self.maxp:
            raise ValueError(f"slot {slot}: {table.size} pages exceed the per-slot capacity {self.maxp} "
                             f"(context {self.context} tokens)")
        old = self.tables[slot]
        self._zero_pages(table[old.size:])  # a pooled page may hold another sequence's rows
        self.tables[slot] = table
        self._upload_table(slot)

    def write_lanes(self, fields: np.ndarray) -> None:
        self.rt.h2d(self.lanes, np.ascontiguousarray(fields, np.int32))

    # ---- internals ------------------------------------------------------------------
    def _upload_table(self, slot: int) -> None:
        row = np.zeros(self.maxp, np.int32)
        t = self.tables[slot]
        row[: t.size] = t
        self.rt.h2d(buffers.view(self.btab, slot * self.maxp * 4, self.maxp * 4), row)

    def _zero_pages(self, pages: np.ndarray) -> None:
        for (il, kind), buf in self.pages.items():
            ratio = self.cfg.compress_ratios[il]
            n = self.layout.rows_per_page(ratio) * self.row_bytes[kind]
            for p in np.asarray(pages, np.int64):
                self.rt.memset32(buffers.view(buf, int(p) * n, n), 0, n // 4)
