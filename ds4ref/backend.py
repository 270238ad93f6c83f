"""The one boundary between the engine and compute: the backend protocol.

A backend owns the physical storage for every slot's paged decode state and
executes one gathered pass of at most `max_pass_rows` rows (the backend's largest
capacity; PREFILL_ROWS unless it says otherwise). A row is one token position
of one slot. Every decoding slot contributes one row; a prompt may contribute
a chunk of consecutive positions as several rows of the same pass, beside
other prompts' chunks (chunked prefill), and those rows see their earlier
rows' KV, compressor emissions and indexer rows exactly as if they had been
fed one pass at a time.

Plans are capacity-padded (unused row slots marked invalid) to the smallest
of DECODE_LANES and max_pass_rows that holds them, so a decode-only pass keeps the
16-lane shape. The padding is only a host convention: a device backend reads
plan.rows() and picks its own captured graph (capacity bucket) for that many
rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

DECODE_LANES = 16    # the most decoding sequences one pass serves (the 16-lane gathered pass)
PREFILL_ROWS = 256   # the default max_pass_rows: the most rows of one pass, decode rows plus prompt chunks
PAGE_TOKENS = 128


def capacity(n_rows: int, max_pass_rows: int) -> int:
    """Row slots a plan of n_rows is padded to under a backend of max_pass_rows: DECODE_LANES when
    that holds it, else max_pass_rows."""
    if n_rows > max_pass_rows:
        raise ValueError(f"a pass holds at most {max_pass_rows} rows, got {n_rows}")
    return min(DECODE_LANES, max_pass_rows) if n_rows <= DECODE_LANES else max_pass_rows


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
    """A gathered pass, padded to `capacity(n_rows, max_pass_rows)` row slots.

    Rows of one slot must be consecutive positions in increasing order; the
    backend processes them in that order.
    """
    slots: np.ndarray        # int32[capacity]; -1 marks a padding row
    positions: np.ndarray    # int32[capacity]
    tokens: np.ndarray       # int32[capacity]
    want_logits: np.ndarray  # bool[capacity]
    emit: np.ndarray         # bool[capacity]

    @property
    def n_rows(self) -> int:
        return int((self.slots >= 0).sum())

    def rows(self) -> list[Row]:
        return [Row(int(s), int(p), int(t), bool(w), bool(e))
                for s, p, t, w, e in zip(self.slots, self.positions, self.tokens, self.want_logits, self.emit)
                if s >= 0]

    @classmethod
    def from_rows(cls, rows: Sequence[Row], max_pass_rows: int = PREFILL_ROWS) -> "StepPlan":
        """The plan of rows for a backend whose passes hold at most max_pass_rows rows."""
        n = capacity(len(rows), max_pass_rows)
        last: dict[int, int] = {}
        for r in rows:
            if r.want_logits and not r.emit:
                raise ValueError(f"row of slot {r.slot} at {r.position} wants logits but does not emit")
            if r.slot in last and r.position != last[r.slot] + 1:
                raise ValueError(f"rows of slot {r.slot} are not consecutive positions: "
                                 f"{last[r.slot]} then {r.position}")
            last[r.slot] = r.position
        slots = np.full(n, -1, np.int32)
        pos = np.zeros(n, np.int32)
        tok = np.zeros(n, np.int32)
        want = np.zeros(n, bool)
        emit = np.zeros(n, bool)
        for i, r in enumerate(rows):
            slots[i], pos[i], tok[i], want[i], emit[i] = r.slot, r.position, r.token, r.want_logits, r.emit
        return cls(slots, pos, tok, want, emit)


@dataclass
class StepResult:
    """Per planned row (in plan order, padding excluded), and the slots whose rows went wrong."""
    logits: list[np.ndarray | None]  # vocab-sized logits where wanted, else None
    argmax: np.ndarray               # int32[n_rows]; lower index wins ties; -1 where the row does not emit
    # Slots whose rows of this pass computed a NaN or an infinity (finite weights can still
    # overflow): an emitting row's logits, or a row of state the backend's storage cannot hold.
    # Their logits and argmax mean nothing; every other slot's results are as if they were
    # alone, since no row's arithmetic reads another slot's values.
    non_finite: frozenset[int] = frozenset()


@dataclass(frozen=True)
class DraftRequest:
    """Feed the MTP block (docs/mtp.md) one slot's rows of the last pass, then draft.

    positions: consecutive positions that the slot's rows held in the last step(), from the
    first one not yet fed to the MTP block; next_tokens[i] is the token at positions[i] + 1
    (a prompt token, or the token just chosen for the last row). The MTP block runs once over
    these rows (the main model's final streams of those rows, kept by the backend from that
    step, with the embedding of next_tokens), writing its own window state at each position
    exactly as if they had come one at a time. Then k - 1 further single-row MTP steps follow
    from its own output streams and each draft, at positions[-1] + 1, + 2, ...

    The chained steps must leave the MTP state as the fed rows left it (run them on a copy of
    the window, or put back the rows they overwrite): the window is a ring one window long, so
    a chained step at q + i overwrites the row of q + i - W, which the next fed positions still
    read. The MTP state is then always the one computed from the main model's streams, and
    restore_state leaves it alone (the engine never feeds a position to the MTP block twice).
    save_state / load_state carry it: a slot loaded from the prefix cache drafts from the MTP
    window of the positions it skips.
    k = 0 only feeds the state (intermediate prompt chunks)."""
    slot: int
    positions: tuple[int, ...]
    next_tokens: tuple[int, ...]
    k: int


@runtime_checkable
class Backend(Protocol):
    name: str
    max_pass_rows: int  # the most rows one pass may hold (the largest capacity)

    def configure(self, n_slots: int, n_pages: int, page_tokens: int = PAGE_TOKENS,
                  max_context: int | None = None) -> None:
        """Allocate storage for n_slots slots and a pool of n_pages pages, for slots of up to
        max_context positions (the engine's context limit; None: the model's). A backend may size
        what grows with a row's keys by it and refuse a row at a position past it."""

    def reset_slot(self, slot: int) -> None:
        """Zero the slot's own state and unmap its pages (on admit and on retire). The pages'
        rows are left as they are: the prefix cache may share them; a page is zeroed when it
        is next mapped fresh."""

    def set_block_table(self, slot: int, pages: Sequence[int]) -> None:
        """Physical page ids holding the slot's logical pages 0, 1, 2, ..."""

    def step(self, plan: StepPlan) -> StepResult:
        """Run one gathered pass. A slot whose values stop being finite is reported in
        StepResult.non_finite, never raised: the pass goes on for the other slots."""

    # The prefix cache (paging/prefix.py) needs these three; a backend without them serves
    # with the cache off.
    def save_state(self, slot: int) -> int:
        """Snapshot the slot's state that is not in pages (raw window ring, compressors'
        partial windows) and its position; returns the snapshot's id."""

    def load_state(self, slot: int, snapshot: int, pages: Sequence[int]) -> None:
        """A freshly reset slot takes the snapshot's state and position, with `pages` (holding
        the rows of the positions before it, shared read-only) as the start of its block
        table: mapped as they are, not zeroed."""

    def drop_state(self, snapshot: int) -> None:
        """Free a snapshot."""

    # The prefix cache's tails (partial last pages) need this one too.
    def copy_page(self, src: int, dst: int) -> None:
        """Page dst's rows (every layer and kind) become page src's; dst is mapped by no slot
        yet (load_state maps it next, as it is)."""

    # Speculative decoding (docs/scheduler.md) needs these two and an MTP block; a backend
    # without them serves without speculation.
    def restore_state(self, slot: int, snapshot: int, rows: int = 0) -> int:
        """The slot takes back the snapshot's state and position, keeping its block table, then
        the state its first `rows` rows of the last step() left: that step is the first since
        the snapshot, and its rows of this slot start at the snapshot's position. Returns the
        rows kept, `rows` or 0 (a backend that can only go back to the snapshot; the engine then
        feeds them again). Rows that passes after the snapshot wrote past the kept position stay
        in the pages and are rewritten before any row reads them (a row reads only positions
        before its own)."""

    def draft(self, requests: Sequence[DraftRequest]) -> list[np.ndarray]:
        """Per request, int32[k] draft tokens: each the MTP logits' argmax (lower index wins
        ties). Called after a step() and before the next, for rows of that step."""


# ---- the protocol's checks, shared by every backend ------------------------------------------
def check_kept_rows(slot: int, position: int, rows: int, ran: range) -> None:
    """restore_state's `rows`: the slot's rows of the last step (positions `ran`) must start at
    the snapshot's position and hold that many."""
    if rows < 0 or (rows and (ran.start != position or len(ran) < rows)):
        raise ValueError(f"slot {slot}: cannot keep {rows} rows from position {position}: its rows of the "
                         f"last step ran positions {ran.start}..{ran.stop - 1}")


def check_rows(rows, next_pos: Sequence[int], table_sizes: Sequence[int], page_tokens: int, vocab: int,
               max_pass_rows: int = DECODE_LANES) -> None:
    """A pass's rows against the slots' state: at most max_pass_rows rows, slots in range, each slot's
    rows at consecutive positions from where its state is (in order, once each), every position
    on a mapped page, token ids in the vocabulary. Raises ValueError before any state changes."""
    if len(rows) > max_pass_rows:
        raise ValueError(f"a pass holds at most {max_pass_rows} rows, got {len(rows)}")
    n_slots = len(next_pos)
    expect: dict[int, int] = {}
    for r in rows:
        if not 0 <= r.slot < n_slots:
            raise ValueError(f"slot {r.slot} out of range 0..{n_slots - 1}")
        at = expect.get(r.slot, int(next_pos[r.slot]))
        if r.position != at:
            raise ValueError(f"slot {r.slot}: row at position {r.position}, but the slot's state is at "
                             f"{at} (rows must arrive in order, once each)")
        expect[r.slot] = at + 1
        needed = r.position // page_tokens + 1
        if needed > table_sizes[r.slot]:
            raise ValueError(f"slot {r.slot}: position {r.position} needs {needed} mapped pages, "
                             f"block table has {table_sizes[r.slot]}")
        if not 0 <= r.token < vocab:
            raise ValueError(f"slot {r.slot}: token id {r.token} out of range 0..{vocab - 1}")


def check_block_table(slot: int, old: Sequence[int], new: Sequence[int], n_pages: int) -> None:
    """A slot's new block table: page ids in range, and the old table as its prefix (a table
    only grows; a page holding rows never moves). Raises ValueError."""
    new = np.asarray(new, np.int64).reshape(-1)
    if new.size and (new.min() < 0 or new.max() >= n_pages):
        raise ValueError(f"slot {slot}: page id out of range 0..{n_pages - 1} in block table")
    old = np.asarray(old, np.int64).reshape(-1)
    if new.size < old.size or not np.array_equal(new[: old.size], old):
        raise ValueError(f"slot {slot}: block table may only grow; existing pages cannot move")


def check_draft_requests(requests, n_slots: int, vocab: int) -> None:
    """A draft() call's requests: one per slot, slots in range, positions consecutive and as
    many as next_tokens, token ids in the vocabulary, k >= 0. Raises ValueError before any
    state changes (whether the positions were rows of the last step is the backend's to say)."""
    seen: set[int] = set()
    for q in requests:
        if not 0 <= q.slot < n_slots:
            raise ValueError(f"draft: slot {q.slot} out of range 0..{n_slots - 1}")
        if q.slot in seen:
            raise ValueError(f"draft: two requests for slot {q.slot}")
        seen.add(q.slot)
        pos = [int(p) for p in q.positions]
        if not pos or len(pos) != len(q.next_tokens):
            raise ValueError(f"draft: slot {q.slot} has {len(pos)} positions and {len(q.next_tokens)} next tokens")
        if q.k < 0:
            raise ValueError(f"draft: slot {q.slot} asks for k = {q.k} drafts")
        if pos != list(range(pos[0], pos[0] + len(pos))):
            raise ValueError(f"draft: slot {q.slot}'s positions are not consecutive: {pos}")
        for t in q.next_tokens:
            if not 0 <= int(t) < vocab:
                raise ValueError(f"draft: slot {q.slot}: token id {int(t)} out of range 0..{vocab - 1}")
