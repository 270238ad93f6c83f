"""Per-sequence decode state (spec §7.1), as an explicit object.

What persists between tokens, per layer:
  raw window       ring of `sliding_window` KV rows, row for position p at p % window
  compressor       partial window (and, for ratio 4, the previous window's lane A)
  compressed rows  append-only; ratio-4 layers also keep indexer rows
The decode step reads and writes state only through the methods below (put_raw /
raw_rows, compressor, put_row / get_rows), so the unpaged SeqState here and the
paged view in numpy_backend.py run the very same code and give bitwise-identical
results, whatever either stores underneath.
"""
from __future__ import annotations

import numpy as np

from ..gguf.config import ATTN, CSA, INDEX, DS4Config, LayerKind, row_kinds  # noqa: F401 - the state's row kinds

class CompressorState:
    """Softmax-pooling compressor state of one layer (kind attn or index).

    cur_kv/cur_score hold the current window's tokens (ratio x coff*D, score
    already includes the position bias). For ratio 4, prev_kv/prev_score hold the
    previous window's lane A (4 x D); -inf scores mean "no previous window".
    """

    def __init__(self, ratio: int, width: int, dtype) -> None:
        coff = LayerKind(ratio).lanes
        self.ratio, self.width = ratio, width
        self.cur_kv = np.zeros((ratio, coff * width), dtype)
        self.cur_score = np.zeros((ratio, coff * width), dtype)
        if ratio == CSA:
            self.prev_kv = np.zeros((4, width), dtype)
            self.prev_score = np.full((4, width), -np.inf, dtype)

    def reset(self) -> None:
        self.cur_kv[:] = 0
        self.cur_score[:] = 0
        if self.ratio == CSA:
            self.prev_kv[:] = 0
            self.prev_score[:] = -np.inf


def make_compressors(cfg: DS4Config, dtype) -> dict[tuple[int, str], CompressorState]:
    comps = {}
    width = {ATTN: cfg.head_dim, INDEX: cfg.indexer_head_dim}
    for il, r in enumerate(cfg.compress_ratios):
        for kind in row_kinds(cfg.layer_kind(il)):
            comps[(il, kind)] = CompressorState(r, width[kind], dtype)
    return comps


def raw_window(ring: np.ndarray, pos: int) -> np.ndarray:
    """Rows of positions max(0, pos-W+1) .. pos of a ring of W rows, oldest first (fresh copy)."""
    w = ring.shape[0]
    if pos < w:
        return ring[:pos + 1].copy()
    cut = (pos + 1) % w  # the oldest row
    return np.concatenate([ring[cut:], ring[:cut]])


class SeqState:
    """Unpaged decode state of one sequence: compressed rows in growable arrays."""

    def __init__(self, cfg: DS4Config, dtype=np.float32) -> None:
        self.cfg, self.dtype = cfg, dtype
        self.rings = np.zeros((cfg.n_layer, cfg.sliding_window, cfg.head_dim), dtype)
        self.comps = make_compressors(cfg, dtype)
        self._rows: dict[tuple[int, str], np.ndarray] = {}
        self._count: dict[tuple[int, str], int] = {}
        self.position = 0  # next position to feed

    def put_raw(self, il: int, pos: int, row: np.ndarray) -> None:
        """Store the KV row of position `pos` in layer il's raw window."""
        self.rings[il, pos % self.rings.shape[1]] = row

    def raw_rows(self, il: int, pos: int) -> np.ndarray:
        """Raw KV rows of positions max(0, pos-W+1) .. pos, oldest first (a fresh array)."""
        return raw_window(self.rings[il], pos)

    def compressor(self, il: int, kind: str) -> CompressorState:
        return self.comps[(il, kind)]

    def put_row(self, il: int, kind: str, idx: int, row: np.ndarray) -> None:
        key = (il, kind)
        buf = self._rows.get(key)
        if buf is None or idx >= buf.shape[0]:
            grown = np.zeros((max(16, 2 * (idx + 1)), row.shape[-1]), self.dtype)
            if buf is not None:
                grown[: buf.shape[0]] = buf
            self._rows[key] = buf = grown
        if idx != self._count.get(key, 0):
            raise IndexError(f"compressed rows are append-only: layer {il} {kind} expected row "
                             f"{self._count.get(key, 0)}, got {idx}")
        buf[idx] = row
        self._count[key] = idx + 1

    def get_rows(self, il: int, kind: str, n: int) -> np.ndarray:
        """The first n rows, a fresh contiguous copy in logical order."""
        if n == 0:
            width = self.cfg.head_dim if kind == ATTN else self.cfg.indexer_head_dim
            return np.zeros((0, width), self.dtype)
        return self._rows[(il, kind)][:n].copy()
