"""Where each piece of a sequence's decode state lives.

Paged (grows with the sequence, 128 token positions per page):
  CSA layers (ratio 4):   page_tokens/4 compressed KV rows and as many indexer rows per page
  HCA layers (ratio 128): page_tokens/128 compressed KV rows per page (one for 128-token pages)
Per slot, not paged (fixed size):
  the raw sliding window, a ring of `sliding_window` rows per layer
  the compressor partial-window and overlap state per compressed layer
Sizes in bytes are given for each way a backend may hold the KV and indexer rows
(STORAGES): as the working float, or compact (ds4ref/paging/compact.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backend import PAGE_TOKENS
from ..settings import getenv
from ..gguf.config import CSA, DS4Config
from .compact import index_row_bytes, kv_row_bytes


@dataclass(frozen=True)
class PageLayout:
    cfg: DS4Config
    page_tokens: int = PAGE_TOKENS

    def __post_init__(self) -> None:
        for r in set(self.cfg.compress_ratios) - {0}:
            if self.page_tokens % r:
                raise ValueError(f"page size {self.page_tokens} is not a multiple of compress ratio {r}")

    def rows_per_page(self, ratio: int) -> int:
        return self.page_tokens // ratio

    def locate(self, block_table, ratio: int, row: int) -> tuple[int, int]:
        """(physical page, offset) of compressed row `row` of a ratio-`ratio` layer."""
        per = self.rows_per_page(ratio)
        logical = row // per
        if logical >= len(block_table):
            raise IndexError(f"compressed row {row} (ratio {ratio}) needs logical page {logical}, "
                             f"block table has {len(block_table)}")
        return int(block_table[logical]), row % per

    def pages_for_tokens(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_tokens)

    # ---- sizes, used by the memory plan and the backends' checks -------------
    def page_rows(self) -> tuple[int, int]:
        """(KV rows, indexer rows) one page holds across all layers."""
        kv = ix = 0
        for r in self.cfg.compress_ratios:
            if r:
                kv += self.rows_per_page(r)
            if r == CSA:
                ix += self.rows_per_page(r)
        return kv, ix

    def ring_rows(self) -> int:
        """Raw window rows per slot, all layers."""
        return self.cfg.n_layer * self.cfg.sliding_window

    def compressor_elements(self) -> int:
        """Per-slot compressor state elements (kv and score), in DS4C's layout: an upper
        bound on what the backends allocate (they keep 4 previous rows at 1x width, not 2x)."""
        c, n = self.cfg, 0
        for r in c.compress_ratios:
            if r == CSA:
                # previous window lane A + current window, kv and score, 2*D wide
                n += 2 * (2 * 4) * (2 * c.head_dim)
                # the indexer compressor: same at 2 * indexer_head_dim wide (the upstream
                # estimate counted only 1 * index_dim here)
                n += 2 * (2 * 4) * (2 * c.indexer_head_dim)
            elif r:
                n += 2 * r * c.head_dim
        return n

    def page_elements(self) -> int:
        """Elements one page holds across all layers."""
        kv, ix = self.page_rows()
        return kv * self.cfg.head_dim + ix * self.cfg.indexer_head_dim

    def slot_elements(self) -> int:
        """Fixed per-slot elements: raw ring plus compressor state (kv and score)."""
        return self.ring_rows() * self.cfg.head_dim + self.compressor_elements()

    def page_bytes(self, storage: str) -> int:
        """Bytes one page holds across all layers, KV rows stored as `storage` (STORAGES)."""
        kv, ix = self.page_rows()
        return kv * kv_row_nbytes(self.cfg, storage) + ix * index_row_nbytes(self.cfg, storage)

    def slot_bytes(self, storage: str) -> int:
        """Fixed per-slot bytes: the raw ring in `storage`, the compressor state in the
        working float (compact rows leave it float32: it is not on any grid)."""
        return (self.ring_rows() * kv_row_nbytes(self.cfg, storage)
                + self.compressor_elements() * STATE_ITEMSIZE[storage])


# How stored KV / indexer rows are held: as the working float, or compact (compact.py).
STORAGES = ("f32", "f64", "compact")
STATE_ITEMSIZE = {"f32": 4, "f64": 8, "compact": 4}


def kv_storage(backend: str, numerics: str, dtype="float32") -> str:
    """How `backend` ("numpy" or "hip") holds stored KV and indexer rows: the one rule the
    backends and the memory plan share. Official float32 rows are FP8/FP4 grid values, so they
    are held compactly, exactly; DS4REF_COMPACT_KV=0 keeps them float32 on the GPU. float64
    (the numpy backend's differential role) keeps float64 rows; the hip backend works in float32."""
    if backend != "numpy":
        dtype = "float32"
    if np.dtype(dtype) != np.float32:
        return "f64"
    if numerics != "official" or (backend == "hip" and getenv("DS4REF_COMPACT_KV") == "0"):
        return "f32"
    return "compact"


def kv_row_nbytes(cfg: DS4Config, storage: str) -> int:
    if storage == "compact":
        return kv_row_bytes(cfg.head_dim, cfg.n_rot)
    return cfg.head_dim * STATE_ITEMSIZE[storage]


def index_row_nbytes(cfg: DS4Config, storage: str) -> int:
    if storage == "compact":
        return index_row_bytes(cfg.indexer_head_dim)
    return cfg.indexer_head_dim * STATE_ITEMSIZE[storage]
