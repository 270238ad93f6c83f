"""Where each piece of a sequence's decode state lives.

Paged (grows with the sequence, 128 token positions per page):
  ratio-4 layers:   page_tokens/4 compressed KV rows and as many indexer rows per page
  ratio-128 layers: page_tokens/128 compressed KV rows per page (one for 128-token pages)
Per slot, not paged (fixed size):
  the raw sliding window, a ring of `sliding_window` rows per layer
  the compressor partial-window and overlap state per compressed layer
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import DS4Config


@dataclass(frozen=True)
class PageLayout:
    cfg: DS4Config
    page_tokens: int = 128

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

    # ---- sizes (elements), used by memory estimates ------------------------
    def page_elements(self) -> int:
        """Elements one page holds across all layers."""
        c = self.cfg
        n = 0
        for r in c.compress_ratios:
            if r == 4:
                n += self.rows_per_page(4) * (c.head_dim + c.indexer_head_dim)
            elif r:
                n += self.rows_per_page(r) * c.head_dim
        return n

    def slot_elements(self) -> int:
        """Fixed per-slot elements: raw ring plus compressor state (kv and score)."""
        c = self.cfg
        n = c.n_layer * c.sliding_window * c.head_dim
        for r in c.compress_ratios:
            if r == 4:
                # previous window lane A + current window, kv and score, 2*D wide
                n += 2 * (2 * 4) * (2 * c.head_dim)
                # the indexer compressor: same at 2 * indexer_head_dim wide (the upstream
                # estimate counted only 1 * index_dim here)
                n += 2 * (2 * 4) * (2 * c.indexer_head_dim)
            elif r:
                n += 2 * r * c.head_dim
        return n
