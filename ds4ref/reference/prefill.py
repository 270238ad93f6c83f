"""Whole-sequence forward (teacher-forced logits at every position).

Written independently of the streamed decode step — masks instead of state —
so that `score(ids)` equal to token-by-token decoding is a real check
(spec §3.6, §3.8: prefill and streamed decode compute the same function).
"""
from __future__ import annotations

import numpy as np

from ..gguf.config import CSA
from ..numerics.tables import Tables
from . import ops, tap
from .layers import (LayerWeights, attention_output, embed, ffn_block, finish_compressed_row, hc, head,
                     indexer_query, project_qkv)


def window_candidates(c: np.ndarray, g: np.ndarray, ratio: int, width: int):
    """All complete windows' pooling candidates: kv, score (n_windows, C, width)."""
    n_w = c.shape[0] // ratio
    c = c[: n_w * ratio].reshape(n_w, ratio, c.shape[-1])
    g = g[: n_w * ratio].reshape(n_w, ratio, g.shape[-1])
    if ratio != CSA:
        return c, g
    prev_c = np.concatenate([np.zeros_like(c[:1, :, :width]), c[:-1, :, :width]])
    prev_g = np.concatenate([np.full_like(g[:1, :, :width], -np.inf), g[:-1, :, :width]])
    return (np.concatenate([prev_c, c[:, :, width:]], axis=1),
            np.concatenate([prev_g, g[:, :, width:]], axis=1))


def compressed_rows(lw, cfg, tables, numerics, a, ratio, prefix, width, hadamard_kind):
    """Every complete window's compressed row (n_windows, width)."""
    t = a.shape[0]
    c = ops.linear(a, lw.matrix(f"{prefix}_kv.weight"))
    g = ops.linear(a, lw.matrix(f"{prefix}_gate.weight")) + lw[f"{prefix}_ape.weight"][np.arange(t) % ratio]
    kind = "idx" if hadamard_kind else "attn"
    tap.put(lw.prefix, f"{kind}_comp_kv", c)
    tap.put(lw.prefix, f"{kind}_comp_score", g)
    kv, score = window_candidates(c, g, ratio, width)
    if kv.shape[0] == 0:
        return np.zeros((0, width), a.dtype)
    first = np.arange(kv.shape[0]) * ratio
    return finish_compressed_row(lw, prefix, ops.pool_window(kv, score), first, tables, numerics, cfg,
                                 hadamard_kind)


def compressed_mask(cfg, tables, numerics, lw, il, a, qr, cos, sin) -> tuple[np.ndarray, np.ndarray]:
    """Compressed rows of layer il and the (T, n) mask of which each query sees."""
    t, ratio = a.shape[0], cfg.ratio(il)
    rows = compressed_rows(lw, cfg, tables, numerics, a, ratio, "attn_compressor", cfg.head_dim, False)
    n_visible = (np.arange(t) + 1) // ratio
    mask = np.arange(rows.shape[0])[None, :] < n_visible[:, None]
    if ratio == CSA and rows.shape[0] > cfg.indexer_top_k:
        keys = compressed_rows(lw, cfg, tables, numerics, a, 4, "indexer_compressor",
                               cfg.indexer_head_dim, True)
        qi, wts = indexer_query(lw, cfg, tables, numerics, a, qr, cos, sin, np.arange(t))
        for i in np.nonzero(n_visible > cfg.indexer_top_k)[0]:
            n = n_visible[i]
            scores = ops.indexer_scores(qi[i], wts[i], keys[:n])
            chosen = ops.topk_lower_index(scores, cfg.indexer_top_k)
            mask[i] = False
            mask[i, chosen] = True
            if tap.on():
                at = np.array([i])
                tap.put(lw.prefix, "idx_score", scores[None], at)
                tap.put(lw.prefix, "idx_topk", chosen[None], at)
    return rows, mask


def attention_block(lw, cfg, tables, numerics, il, streams):
    t, ratio = streams.shape[0], cfg.ratio(il)
    u, post, comb = hc(lw, "attn", cfg, streams)
    a, qr, q, kv = project_qkv(lw, cfg, u)
    cos, sin = ops.rope_cos_sin(tables.omega(ratio), np.arange(t), u.dtype)
    q = ops.rope(q, cos[:, None, :], sin[:, None, :])
    kv = ops.rope(kv, cos, sin)
    tap.put(lw.prefix, "q", q)
    tap.put(lw.prefix, "kv", kv)
    if numerics == "official":
        kv = ops.fp8sim(kv, cfg.n_rot)
    pos = np.arange(t)
    keys = kv
    mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - cfg.sliding_window)
    if cfg.layer_kind(il).compressed:
        rows, cmask = compressed_mask(cfg, tables, numerics, lw, il, a, qr, cos, sin)
        keys = np.concatenate([kv, rows])
        mask = np.concatenate([mask, cmask], axis=1)
    o = np.stack([ops.attention_with_sinks(q[i], keys, lw["attn_sinks.weight"], mask[i]) for i in range(t)])
    return ops.hc_post(streams, attention_output(lw, cfg, o, cos, sin), post, comb)


def prefill_logits(weights, tables: Tables, numerics: str, tokens) -> np.ndarray:
    """Logits (T, vocab) for every position of `tokens`, all at once."""
    cfg = weights.config
    tap.begin(np.arange(len(tokens)), np.asarray(tokens), np.arange(len(tokens)))
    streams = embed(weights, tokens, cfg)
    for il in range(cfg.n_layer):
        lw = LayerWeights(weights, il, numerics)
        streams = attention_block(lw, cfg, tables, numerics, il, streams)
        streams = ffn_block(lw, cfg, il, streams, tokens)
    return head(weights, cfg, numerics, streams)
