"""The one boundary between the engine and compute: the backend protocol.

A backend owns the physical storage for every slot's paged decode state and
executes one gathered pass of at most MAX_ROWS rows. A row is one token
position of one slot. Every decoding slot contributes one row; a prompt may
contribute several consecutive positions as several rows of the same pass,
and those rows see their earlier rows' KV, compressor emissions and indexer
rows exactly as if they had been fed one pass at a time.

Shapes are capacity-padded (always MAX_ROWS row slots, unused ones marked
invalid) so a device backend can capture one graph and replay it whatever the
number of live rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

MAX_ROWS = 16
PAGE_TOKENS = 128


@dataclass(frozen=True)
class Row:
    """One token position of one slot.

    emit: the row produces the slot's next token, so the head runs and its
    argmax comes back (intermediate prompt rows skip the head: for Flash the
    output matrix is the largest single weight read). want_logits: the full
    logits come back too (sampling, penalties, logprobs); implies emit.
    """
    slot: int
    position: int
    token: int
    want_logits: bool = True
    emit: bool = True


@dataclass(frozen=True)
class StepPlan:
    """A gathered pass, padded to MAX_ROWS rows.

    Rows of one slot must be consecutive positions in increasing order; the
    backend processes them in that order.
    """
    slots: np.ndarray        # int32[MAX_ROWS]; -1 marks a padding row
    positions: np.ndarray    # int32[MAX_ROWS]
    tokens: np.ndarray       # int32[MAX_ROWS]
    want_logits: np.ndarray  # bool[MAX_ROWS]
    emit: np.ndarray         # bool[MAX_ROWS]

    @property
    def n_rows(self) -> int:
        return int((self.slots >= 0).sum())

    def rows(self) -> list[Row]:
        return [Row(int(s), int(p), int(t), bool(w), bool(e))
                for s, p, t, w, e in zip(self.slots, self.positions, self.tokens, self.want_logits, self.emit)
                if s >= 0]

    @classmethod
    def from_rows(cls, rows: Sequence[Row], max_rows: int = MAX_ROWS) -> "StepPlan":
        if len(rows) > max_rows:
            raise ValueError(f"a pass holds at most {max_rows} rows, got {len(rows)}")
        last: dict[int, int] = {}
        for r in rows:
            if r.want_logits and not r.emit:
                raise ValueError(f"row of slot {r.slot} at {r.position} wants logits but does not emit")
            if r.slot in last and r.position != last[r.slot] + 1:
                raise ValueError(f"rows of slot {r.slot} are not consecutive positions: "
                                 f"{last[r.slot]} then {r.position}")
            last[r.slot] = r.position
        slots = np.full(max_rows, -1, np.int32)
        pos = np.zeros(max_rows, np.int32)
        tok = np.zeros(max_rows, np.int32)
        want = np.zeros(max_rows, bool)
        emit = np.zeros(max_rows, bool)
        for i, r in enumerate(rows):
            slots[i], pos[i], tok[i], want[i], emit[i] = r.slot, r.position, r.token, r.want_logits, r.emit
        return cls(slots, pos, tok, want, emit)


@dataclass
class StepResult:
    """Per planned row (in plan order, padding excluded)."""
    logits: list[np.ndarray | None]  # vocab-sized logits where wanted, else None
    argmax: np.ndarray               # int32[n_rows]; lower index wins ties; -1 where the row does not emit


@runtime_checkable
class Backend(Protocol):
    name: str
    max_rows: int

    def configure(self, n_slots: int, n_pages: int, page_tokens: int = PAGE_TOKENS) -> None:
        """Allocate storage for n_slots slots and a pool of n_pages pages."""

    def reset_slot(self, slot: int) -> None:
        """Zero every piece of the slot's state (on admit and on retire)."""

    def set_block_table(self, slot: int, pages: Sequence[int]) -> None:
        """Physical page ids holding the slot's logical pages 0, 1, 2, ..."""

    def step(self, plan: StepPlan) -> StepResult:
        """Run one gathered pass."""
