"""A pass of rows through every layer, reading and updating their sequences' decode state.

A row is one token at one position of one sequence (its state); rows of one sequence are
consecutive positions, in pass order. Every weight's product runs once for all the rows of
the pass: the canonical arithmetic fixes each output element's order whatever the batch,
so a row's bits never depend on the rows beside it. What a row reads from or writes to its
sequence's state runs row by row in pass order (raw window, compressor, compressed and
indexer rows, the attention over what is visible), so row p + 1 of a sequence sees what
row p wrote, exactly as when fed one pass at a time. One token is the pass of one row.

This is the exact computation: the unpaged reference, the paged NumpyBackend and
(as the yardstick) the HIP backend all compute it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..gguf.config import CSA
from ..numerics.tables import Tables
from . import ops, tap
from .layers import (LayerWeights, attention_output, embed, ffn_block, finish_compressed_row, hc, head,
                     indexer_query, project_qkv)
from .state import ATTN, INDEX, row_kinds


@dataclass
class Rows:
    """The rows of a pass: row i feeds tokens[i] at positions[i] to states[i]."""
    states: Sequence
    tokens: np.ndarray
    positions: np.ndarray

    @classmethod
    def of(cls, states, tokens, positions) -> "Rows":
        return cls(list(states), np.asarray(tokens, np.int64), np.asarray(positions, np.int64))

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, i: slice) -> "Rows":
        return Rows(self.states[i], self.tokens[i], self.positions[i])

    def runs(self) -> list[tuple[int, int]]:
        """(start, stop) of each run of consecutive rows of one sequence."""
        cuts = [i for i in range(1, len(self)) if self.states[i] is not self.states[i - 1]]
        return list(zip([0] + cuts, cuts + [len(self)]))


def raw_keys(rows: Rows, il: int, kv: np.ndarray) -> list[np.ndarray]:
    """Each row stores its KV row in its sequence's raw window, then reads the window that ends
    at it (row by row: a later row of the same sequence sees the earlier ones)."""
    keys = []
    for st, pos, row in zip(rows.states, rows.positions, kv):
        st.put_raw(il, int(pos), row)
        keys.append(st.raw_rows(il, int(pos)))
    return keys


def compressor_feed(st, pos: int, kv: np.ndarray, score: np.ndarray):
    """One token into a compressor state; at a window's last token, return the window's pooling
    candidates (kv, score), fresh arrays, and start the next window. None otherwise."""
    ratio, d = st.ratio, st.width
    st.cur_kv[pos % ratio] = kv
    st.cur_score[pos % ratio] = score
    if (pos + 1) % ratio:
        return None
    if ratio == CSA:  # candidates: previous window's lane A, this window's lane B
        kv = np.concatenate([st.prev_kv, st.cur_kv[:, d:]])
        score = np.concatenate([st.prev_score, st.cur_score[:, d:]])
        st.prev_kv[:] = st.cur_kv[:, :d]
        st.prev_score[:] = st.cur_score[:, :d]
        return kv, score
    return st.cur_kv.copy(), st.cur_score.copy()


def compress(lw: LayerWeights, kind: str, rows: Rows, il: int, a: np.ndarray, tables: Tables, numerics: str,
             cfg) -> None:
    """Feed every row to its sequence's compressor of this kind, in pass order; each window a row
    completes becomes one compressed row (spec §3.4 ratio 4, §3.5 ratio 128). A row sees the
    compressed rows of windows that end at or before it, so all of them can be stored first."""
    prefix = "attn_compressor" if kind == ATTN else "indexer_compressor"
    ratio = cfg.ratio(il)
    kv = ops.linear(a, lw.matrix(f"{prefix}_kv.weight"))
    score = ops.linear(a, lw.matrix(f"{prefix}_gate.weight")) + lw[f"{prefix}_ape.weight"][rows.positions % ratio]
    tap.put(lw.prefix, "attn_comp_kv" if kind == ATTN else "idx_comp_kv", kv)
    tap.put(lw.prefix, "attn_comp_score" if kind == ATTN else "idx_comp_score", score)
    done = []
    for i, (st, pos) in enumerate(zip(rows.states, rows.positions)):
        window = compressor_feed(st.compressor(il, kind), int(pos), kv[i], score[i])
        if window is not None:
            done.append((st, int(pos) // ratio, *window))
    if not done:
        return
    pooled = ops.pool_window(np.stack([d[2] for d in done]), np.stack([d[3] for d in done]))
    first = np.array([d[1] * ratio for d in done])
    out = finish_compressed_row(lw, prefix, pooled, first, tables, numerics, cfg, hadamard_kind=(kind == INDEX))
    for (st, w, _, _), row in zip(done, out):
        st.put_row(il, kind, w, row)


def history(rows: Rows, il: int, n: np.ndarray) -> list[np.ndarray]:
    """Per row, the first n[i] compressed rows of its sequence: read once per run of
    consecutive rows of one sequence (n grows along a run), then sliced."""
    out = []
    for start, stop in rows.runs():
        every = rows.states[start].get_rows(il, ATTN, int(n[stop - 1]))
        out += [every[:n[i]] for i in range(start, stop)]
    return out


def visible_compressed(lw, cfg, tables, numerics, rows: Rows, il, a, qr, cos, sin) -> list[np.ndarray]:
    """Per row, the compressed rows its query attends to, in index order: all of them, or on a
    ratio-4 layer past top_k rows, the ones the indexer picks."""
    ratio, top_k = cfg.ratio(il), cfg.indexer_top_k
    n = (rows.positions + 1) // ratio
    out = history(rows, il, n)
    pick = np.nonzero(n > top_k)[0] if ratio == CSA else []
    if len(pick) == 0:
        return out
    at = rows.positions[pick] if tap.on() else None  # the picking rows' keys, for the tap only
    qi, wts = indexer_query(lw, cfg, tables, numerics, a[pick], qr[pick], cos[pick], sin[pick], at)
    for start, stop in rows.runs():
        j = np.nonzero((pick >= start) & (pick < stop))[0]  # this run's picking rows, in qi
        if len(j):
            keys = rows.states[start].get_rows(il, INDEX, int(n[stop - 1]))
            topk = ops.indexer_topk(qi[j], wts[j], keys, n[pick[j]], top_k)
            if tap.on():
                tap.put(lw.prefix, "idx_score", ops.indexer_score_table(qi[j], wts[j], keys, n[pick[j]]), at[j])
                tap.put(lw.prefix, "idx_topk", topk, at[j])
            for i, chosen in zip(pick[j], topk):
                out[i] = out[i][chosen]
    return out


def attention_block(lw, cfg, tables, numerics, rows: Rows, il, streams):
    """The projections for all rows, then each row's state update and attention, in pass order,
    then the output projection for all rows."""
    ratio = cfg.ratio(il)
    u, post, comb = hc(lw, "attn", cfg, streams)
    a, qr, q, kv = project_qkv(lw, cfg, u)
    cos, sin = ops.rope_cos_sin(tables.omega(ratio), rows.positions, u.dtype)
    q = ops.rope(q, cos[:, None, :], sin[:, None, :])
    kv = ops.rope(kv, cos, sin)
    tap.put(lw.prefix, "q", q)
    tap.put(lw.prefix, "kv", kv)
    if numerics == "official":
        kv = ops.fp8sim(kv, cfg.n_rot)
    keys = raw_keys(rows, il, kv)
    if cfg.layer_kind(il).compressed:
        for kind in row_kinds(cfg.layer_kind(il)):
            compress(lw, kind, rows, il, a, tables, numerics, cfg)
        comp = visible_compressed(lw, cfg, tables, numerics, rows, il, a, qr, cos, sin)
        keys = [[k, c] for k, c in zip(keys, comp)]
    else:
        keys = [[k] for k in keys]
    o = ops.attention_rows(q, keys, lw["attn_sinks.weight"])
    return ops.hc_post(streams, attention_output(lw, cfg, o, cos, sin), post, comb)


def decode_rows(weights, tables: Tables, numerics: str, rows: Rows, emit: np.ndarray | None = None,
                hidden: bool = False, taps: Sequence[int] = ()):
    """Advance every row's state by its token; the logits (rows flagged in emit, vocab),
    emit defaulting to every row. float64 (plain NumPy, not batch-invariant) runs row by row.
    hidden: also return every row's final streams (N, hc, d), the head's input, which the
    MTP block takes (reference/mtp.py). taps: also return, per row, the mean of the streams
    after each of these layers, concatenated (N, len(taps) * d), which DSpark takes
    (reference/dspark.py). Returned as (logits, [streams], [tapped])."""
    cfg = weights.config
    emit = np.ones(len(rows), bool) if emit is None else np.asarray(emit, bool)
    if len(rows) == 0:
        out = [np.zeros((0, cfg.vocab_size), weights.dtype)]
        out += [np.zeros((0, cfg.hc_mult, cfg.n_embd), weights.dtype)] if hidden else []
        out += [np.zeros((0, len(taps) * cfg.n_embd), weights.dtype)] if taps else []
        return tuple(out) if len(out) > 1 else out[0]
    if not ops.batch_invariant(weights.dtype) and len(rows) > 1:
        parts = [decode_rows(weights, tables, numerics, rows[i:i + 1], emit[i:i + 1], hidden, taps)
                 for i in range(len(rows))]
        if hidden or taps:
            return tuple(np.concatenate([p[j] for p in parts]) for j in range(len(parts[0])))
        return np.concatenate(parts)
    if tap.on():
        tap.begin(rows.positions, rows.tokens, rows.positions[emit])
    streams = embed(weights, rows.tokens, cfg)
    tapped = {}
    for il in range(cfg.n_layer):
        lw = LayerWeights(weights, il, numerics)
        streams = block(lw, cfg, tables, numerics, rows, il, streams)
        if il in taps:
            tapped[il] = ops.stream_mean(streams)
    logits = head(weights, cfg, numerics, streams[emit]) if emit.any() else np.zeros((0, cfg.vocab_size),
                                                                                    weights.dtype)
    out = [logits] + ([streams] if hidden else []) + ([np.concatenate([tapped[t] for t in taps], axis=1)]
                                                      if taps else [])
    return tuple(out) if len(out) > 1 else logits


def block(lw: LayerWeights, cfg, tables: Tables, numerics: str, rows: Rows, il: int, streams):
    """One layer (attention, then FFN) on the rows' streams."""
    streams = attention_block(lw, cfg, tables, numerics, rows, il, streams)
    return ffn_block(lw, cfg, il, streams, rows.tokens)


def decode_step(weights, tables: Tables, numerics: str, state, token: int, pos: int,
                want_logits: bool = True) -> np.ndarray | None:
    """Advance `state` by one token at position `pos`; return its logits (vocab,)."""
    out = decode_rows(weights, tables, numerics, Rows.of([state], [token], [pos]), np.array([want_logits]))
    return out[0] if want_logits else None
