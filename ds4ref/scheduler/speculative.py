"""Speculative decoding's pieces outside the pass: who drafts, and when a sequence stops.

A drafter turns the engine's DraftRequests (backend.py) into draft tokens. `BackendDrafter`
is the real one: the backend's MTP block. `OracleDrafter` replays a known continuation,
right at each position with a given probability, so benchmarks and tests choose the
acceptance rate. Acceptance never looks at where drafts come from (docs/scheduler.md).

`Acceptance` is a sequence's record of its rounds and the auto-off rule: over the last
`window` drafts proposed, an acceptance rate below `min_rate` turns speculation off for the
sequence, for good. The default comes from the cost model in docs/scheduler.md
("Speculative decoding"): a round of k drafts at acceptance a yields (1 - a^(k+1)) / (1 - a)
tokens and costs 1 + k (r + m) passes' worth, r being an extra row's cost and m an MTP step's,
both relative to a pass; below the break-even rate speculation only costs.
"""
from __future__ import annotations

from collections import deque
from typing import Mapping, Protocol, Sequence

import numpy as np

from ..backend import DraftRequest

MIN_RATE = 0.3  # auto-off below this acceptance (break-even of docs/scheduler.md's cost model, rounded up)
WINDOW = 16     # drafts proposed over which the rate is judged


class Drafter(Protocol):
    def draft(self, requests: Sequence[DraftRequest], seqs: Mapping) -> list[np.ndarray]:
        """Per request int32[k] drafts; seqs maps a slot to its engine Seq (for oracles)."""


class BackendDrafter:
    """The backend's own MTP drafts."""

    def __init__(self, backend) -> None:
        self.backend = backend

    def draft(self, requests: Sequence[DraftRequest], seqs: Mapping) -> list[np.ndarray]:
        return self.backend.draft(requests) if requests else []


class OracleDrafter:
    """Drafts the true continuation of each request (truths: req_id -> its tokens without
    speculation); each draft is right with probability `rate` (a function of seed, request and
    position, so a run repeats), otherwise the next token id (always wrong)."""

    def __init__(self, truths: Mapping[int, Sequence[int]], rate: float, vocab_size: int, seed: int = 0) -> None:
        self.truths, self.rate, self.vocab, self.seed = truths, rate, vocab_size, seed

    def draft(self, requests: Sequence[DraftRequest], seqs: Mapping) -> list[np.ndarray]:
        out = []
        for r in requests:
            s = seqs[r.slot]
            truth = self.truths.get(s.request.req_id, ())
            first = r.positions[-1] + 2 - s.prompt_len  # index in the output of the first draft
            d = []
            for g in range(first, first + r.k):
                t = int(truth[g]) if 0 <= g < len(truth) else 0
                right = np.random.default_rng([self.seed, s.request.req_id, g]).random() < self.rate
                d.append(t if right else (t + 1) % self.vocab)
            out.append(np.asarray(d, np.int32))
        return out


class Acceptance:
    """A sequence's drafts proposed and accepted, and whether it still speculates."""

    def __init__(self, min_rate: float = MIN_RATE, window: int = WINDOW) -> None:
        self.min_rate, self.window = min_rate, window
        self.proposed = self.accepted = 0
        self.on = True
        self._recent: deque[tuple[int, int]] = deque()  # (proposed, accepted) per round

    def record(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self._recent.append((proposed, accepted))
        while sum(p for p, _ in self._recent) - self._recent[0][0] >= self.window:
            self._recent.popleft()
        p = sum(p for p, _ in self._recent)
        if p >= self.window and sum(a for _, a in self._recent) < self.min_rate * p:
            self.on = False
