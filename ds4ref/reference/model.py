"""The exact NumPy reference model: score (whole sequence) and generate (streamed decode)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..gguf.config import DS4Config
from ..numerics.tables import Tables
from .decode import Rows, decode_rows, decode_step
from .layers import NUMERICS
from .ops import batch_invariant
from .prefill import prefill_logits
from .state import SeqState


class InputError(ValueError):
    """Token ids or lengths a model cannot take."""


def check_tokens(cfg: DS4Config, token_ids: Sequence[int], what: str = "prompt") -> np.ndarray:
    ids = np.asarray(token_ids)
    if ids.ndim != 1:
        raise InputError(f"{what} must be a flat sequence of token ids, got shape {ids.shape}")
    if ids.size == 0:
        raise InputError(f"{what} is empty: at least one token id is needed")
    if not np.issubdtype(ids.dtype, np.integer):
        raise InputError(f"{what} must hold integer token ids, got {ids.dtype}")
    bad = ids[(ids < 0) | (ids >= cfg.vocab_size)]
    if bad.size:
        raise InputError(f"{what} has token id {int(bad[0])} out of range 0..{cfg.vocab_size - 1}")
    return ids.astype(np.int64)


SCORE_CHUNK = 512  # rows of one sequence per pass of score()


class Model:
    """DS4 forward over a Weights object.

    numerics: "official" applies the FP8 KV and Hadamard+FP4 indexer round-trips
    (antirez/ds4, lucebox); "plain" applies neither (transformers). The dtype is
    the weights' dtype (float32 default, float64 for goldens).
    """

    def __init__(self, weights, numerics: str = "official") -> None:
        if numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
        self.weights, self.numerics = weights, numerics
        self.config: DS4Config = weights.config
        weights.check_hash_routes()  # at load, for every backend built over this model
        if numerics == "official":
            self.config.check_official_numerics()
        self.dtype = weights.dtype
        self.tables = Tables.build(self.config, self.dtype)

    def new_state(self) -> SeqState:
        return SeqState(self.config, self.dtype)

    def step(self, state, token: int, pos: int, want_logits: bool = True) -> np.ndarray | None:
        """One token through the decode state: the pass of one row."""
        return decode_step(self.weights, self.tables, self.numerics, state, int(token), int(pos), want_logits)

    def step_rows(self, states, tokens, positions, emit=None, hidden: bool = False, taps=()):
        """One pass of rows (row i: tokens[i] at positions[i] into states[i]; a sequence's rows
        consecutive, in order); logits of the rows flagged in emit (default all), in row order.
        hidden: (logits, every row's final streams), the MTP block's input (reference/mtp.py);
        taps: (logits, [streams], the stream means after these layers), DSpark's (reference/dspark.py)."""
        return decode_rows(self.weights, self.tables, self.numerics, Rows.of(states, tokens, positions), emit,
                           hidden, tuple(taps))

    def score(self, token_ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits (T, vocab) at every position.

        float32: the sequence's rows in passes of SCORE_CHUNK through a fresh decode state,
        the decode step's very computation (so bitwise the streamed decode's). float64: the
        whole-sequence forward of prefill.py, all at once."""
        ids = check_tokens(self.config, token_ids)
        self._check_length(len(ids))
        if not batch_invariant(self.dtype):
            return prefill_logits(self.weights, self.tables, self.numerics, ids)
        st, logits = self.new_state(), []
        for p in range(0, len(ids), SCORE_CHUNK):
            chunk = ids[p:p + SCORE_CHUNK]
            logits.append(self.step_rows([st] * len(chunk), chunk, p + np.arange(len(chunk))))
        return np.concatenate(logits)

    def decode_logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """The same logits as score(), fed one token at a time through a SeqState."""
        ids = check_tokens(self.config, token_ids)
        self._check_length(len(ids))
        st = self.new_state()
        return np.stack([self.step(st, t, p) for p, t in enumerate(ids)])

    def generate(self, token_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = ()) -> list[int]:
        """Greedy continuation (lower id wins ties); returns only the new tokens, without the stop token."""
        ids = check_tokens(self.config, token_ids)
        if max_new_tokens < 0:
            raise InputError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        self._check_length(len(ids) + max_new_tokens - 1)
        st = self.new_state()
        for p, t in enumerate(ids[:-1]):
            self.step(st, t, p, want_logits=False)
        out: list[int] = []
        tok, pos = int(ids[-1]), len(ids) - 1
        while len(out) < max_new_tokens:
            tok = int(np.argmax(self.step(st, tok, pos)))
            if tok in stop_ids:  # like the engine and OpenAI's API: the stop token is not returned
                break
            out.append(tok)
            pos += 1
        return out

    def _check_length(self, n: int) -> None:
        if n > self.config.context_length:
            raise InputError(f"{n} positions exceed the model's context length {self.config.context_length}")
