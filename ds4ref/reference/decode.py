"""One token through every layer, reading and updating a sequence's decode state.

This is the exact per-row computation: the unpaged reference, the paged
NumpyBackend and (as the yardstick) the HIP backend all compute this.
"""
from __future__ import annotations

import numpy as np

from . import ops
from .layers import (LayerWeights, Tables, attention_output, embed, ffn_block, finish_compressed_row, hc, head,
                     indexer_query, project_qkv)
from .state import ATTN, INDEX


def compressor_step(lw: LayerWeights, kind: str, state, il: int, a: np.ndarray, pos: int,
                    tables: Tables, numerics: str, cfg) -> None:
    """Feed token `pos` to the layer's compressor; at a window's last token, pool it
    and append one compressed row (spec §3.4 ratio 4, §3.5 ratio 128)."""
    prefix = "attn_compressor" if kind == ATTN else "indexer_compressor"
    st = state.compressor(il, kind)
    ratio, d = st.ratio, st.width
    st.cur_kv[pos % ratio] = ops.linear(a, lw[f"{prefix}_kv.weight"])[0]
    st.cur_score[pos % ratio] = ops.linear(a, lw[f"{prefix}_gate.weight"])[0] + lw[f"{prefix}_ape.weight"][pos % ratio]
    if (pos + 1) % ratio:
        return
    if ratio == 4:  # candidates: previous window's lane A, this window's lane B
        kv = np.concatenate([st.prev_kv, st.cur_kv[:, d:]])
        score = np.concatenate([st.prev_score, st.cur_score[:, d:]])
        st.prev_kv[:] = st.cur_kv[:, :d]
        st.prev_score[:] = st.cur_score[:, :d]
    else:
        kv, score = st.cur_kv, st.cur_score
    w = pos // ratio
    row = finish_compressed_row(lw, prefix, ops.pool_window(kv, score)[None], w * ratio,
                                tables, numerics, cfg, hadamard_kind=(kind == INDEX))
    state.put_row(il, kind, w, row[0])


def visible_compressed(lw, cfg, tables, numerics, state, il, a, qr, cos, sin, pos) -> np.ndarray:
    """Compressed rows the query at `pos` attends to, in index order."""
    ratio = cfg.ratio(il)
    n = (pos + 1) // ratio
    rows = state.get_rows(il, ATTN, n)
    if ratio != 4 or n <= cfg.indexer_top_k:
        return rows
    qi, wts = indexer_query(lw, cfg, tables, numerics, a, qr, cos, sin)
    scores = ops.indexer_scores(qi[0], wts[0], state.get_rows(il, INDEX, n))
    return rows[ops.topk_lower_index(scores, cfg.indexer_top_k)]


def raw_window(ring: np.ndarray, pos: int) -> np.ndarray:
    """Rows of positions max(0, pos-W+1) .. pos, oldest first (fresh copy)."""
    w = ring.shape[0]
    positions = np.arange(max(0, pos - w + 1), pos + 1)
    return ring[positions % w]


def attention_block(lw, cfg, tables, numerics, state, il, streams, pos):
    ratio = cfg.ratio(il)
    u, post, comb = hc(lw, "attn", cfg, streams)
    a, qr, q, kv = project_qkv(lw, cfg, u)
    cos, sin = ops.rope_cos_sin(tables.omega(ratio), np.array([pos]), u.dtype)
    q = ops.rope(q, cos[:, None, :], sin[:, None, :])
    kv = ops.rope(kv, cos, sin)
    if numerics == "official":
        kv = ops.fp8sim(kv, cfg.n_rot)
    ring = state.raw_ring(il)
    ring[pos % ring.shape[0]] = kv[0]
    keys = raw_window(ring, pos)
    if ratio:
        compressor_step(lw, ATTN, state, il, a, pos, tables, numerics, cfg)
        if ratio == 4:
            compressor_step(lw, INDEX, state, il, a, pos, tables, numerics, cfg)
        keys = np.concatenate([keys, visible_compressed(lw, cfg, tables, numerics, state, il,
                                                        a, qr, cos, sin, pos)])
    o = ops.attention_with_sinks(q[0], keys, lw["attn_sinks.weight"])[None]
    return ops.hc_post(streams, attention_output(lw, cfg, o, cos, sin), post, comb)


def decode_step(weights, tables: Tables, numerics: str, state, token: int, pos: int,
                want_logits: bool = True) -> np.ndarray | None:
    """Advance `state` by one token at position `pos`; return its logits (vocab,)."""
    cfg = weights.config
    streams = embed(weights, [token], cfg)
    for il in range(cfg.n_layer):
        lw = LayerWeights(weights, il)
        streams = attention_block(lw, cfg, tables, numerics, state, il, streams, pos)
        streams = ffn_block(lw, cfg, il, streams, [token])
    return head(weights, cfg, streams)[0] if want_logits else None
