"""Per-layer pieces shared by the decode step and the prefill: weight lookup,
RoPE tables, the projections in front of attention, the MoE block and the head."""
from __future__ import annotations

import math

import numpy as np

from ..gguf.config import DS4Config
from ..numerics.tables import Tables
from . import ops, tap

NUMERICS = ("official", "plain")


def product_weight(weights, name: str, numerics: str, e: int | None = None):
    """A weight as its products take it (expert e of a 3-D tensor when given): in official
    float32 numerics a tensor stored block-quantised gives its QuantCodes (the exact integer
    path, canon.qlinear); everything else, plain numerics and float64 included, its floats."""
    if numerics == "official" and weights.dtype == np.float32:
        qc = weights.codes(name) if e is None else weights.expert_codes(name, e)
        if qc is not None:
            return qc
    return weights.get(name) if e is None else weights.expert(name, e)


class LayerWeights:
    """`blk.{il}.` tensors of one layer, fetched by suffix: lw[suffix] the floats, lw.matrix
    and lw.expert the operands of products in these numerics (product_weight)."""

    def __init__(self, weights, il: int, numerics: str, prefix: str | None = None) -> None:
        self.w, self.numerics = weights, numerics
        self.prefix = f"blk.{il}." if prefix is None else prefix

    def __getitem__(self, suffix: str) -> np.ndarray:
        return self.w.get(self.prefix + suffix)

    def matrix(self, suffix: str):
        return product_weight(self.w, self.prefix + suffix, self.numerics)

    def expert(self, suffix: str, e: int):
        return product_weight(self.w, self.prefix + suffix, self.numerics, int(e))


def hc(lw: LayerWeights, part: str, cfg: DS4Config, streams: np.ndarray):
    tap.put(lw.prefix, "hc_attn_in" if part == "attn" else "hc_attn_out", streams)
    u, post, comb = ops.hc_pre(streams, lw.matrix(f"hc_{part}_fn.weight"), lw[f"hc_{part}_base.weight"],
                               lw[f"hc_{part}_scale.weight"], cfg.rms_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)
    tap.put(lw.prefix, f"hc_{part}_pre", u)
    return u, post, comb


def project_qkv(lw: LayerWeights, cfg: DS4Config, u: np.ndarray):
    """u (N, d) -> a (normed input), qr (q residual), q (N, H, D) unroped, kv (N, D) unroped."""
    eps = cfg.rms_eps
    a = ops.rmsnorm(u, lw["attn_norm.weight"], eps)
    qr = ops.rmsnorm(ops.linear(a, lw.matrix("attn_q_a.weight")), lw["attn_q_a_norm.weight"], eps)
    q = ops.linear(qr, lw.matrix("attn_q_b.weight")).reshape(u.shape[0], cfg.n_head, cfg.head_dim)
    q = ops.rms0(q, eps)
    kv = ops.rmsnorm(ops.linear(a, lw.matrix("attn_kv.weight")), lw["attn_kv_a_norm.weight"], eps)
    tap.put(lw.prefix, "attn_norm", a)
    tap.put(lw.prefix, "qr", qr)
    return a, qr, q, kv


def indexer_query(lw: LayerWeights, cfg: DS4Config, tables: Tables, numerics: str,
                  a: np.ndarray, qr: np.ndarray, cos: np.ndarray, sin: np.ndarray, pos=None):
    """Indexer query heads (N, Hi, Di), roped at the query position (then Hadamard + FP4
    in official numerics), and per-head weights (N, Hi) scaled by 1/sqrt(Hi*Di).
    pos: the rows' positions, for the tap."""
    n = a.shape[0]
    qi = ops.linear(qr, lw.matrix("indexer.attn_q_b.weight")).reshape(n, cfg.indexer_heads, cfg.indexer_head_dim)
    qi = ops.rope(qi, cos[:, None, :], sin[:, None, :])
    tap.put(lw.prefix, "idx_q", qi, pos)
    if numerics == "official":
        qi = ops.qat(qi, tables.hadamard)
    scale = a.dtype.type(1.0 / math.sqrt(cfg.indexer_heads * cfg.indexer_head_dim))
    wts = ops.linear(a, lw.matrix("indexer.proj.weight")) * scale
    tap.put(lw.prefix, "idx_weights", wts, pos)
    return qi, wts


def finish_compressed_row(lw: LayerWeights, prefix: str, pooled: np.ndarray, first_pos,
                          tables: Tables, numerics: str, cfg: DS4Config, hadamard_kind: bool) -> np.ndarray:
    """Pooled window (N, D) -> stored row: norm, RoPE at the window's first position,
    then FP8 (attention rows) or Hadamard + FP4 (indexer rows) in official numerics."""
    row = ops.rmsnorm(pooled, lw[f"{prefix}_norm.weight"], cfg.rms_eps)
    cos, sin = ops.rope_cos_sin(tables.omega_compress, first_pos, row.dtype)
    row = ops.rope(row, cos, sin)
    tap.put(lw.prefix, "idx_comp_row" if hadamard_kind else "attn_comp_row", row, first_pos)
    if numerics == "official":
        row = ops.qat(row, tables.hadamard) if hadamard_kind else ops.fp8sim(row, cfg.n_rot)
    return row


def attention_output(lw: LayerWeights, cfg: DS4Config, o: np.ndarray, cos, sin) -> np.ndarray:
    """Remove the absolute rotation V's tail carries, then the grouped output projection."""
    tap.put(lw.prefix, "attn_o", o)
    o = ops.rope(o, cos[:, None, :], sin[:, None, :], inverse=True)
    out = ops.grouped_output(o, lw.matrix("attn_output_a.weight"), lw.matrix("attn_output_b.weight"), cfg.o_groups)
    tap.put(lw.prefix, "attn_out", out)
    return out


def moe(lw: LayerWeights, cfg: DS4Config, il: int, x: np.ndarray, tokens) -> np.ndarray:
    """The FFN of N rows x (N, d): routed experts (hash or learned routing) plus the shared expert.

    Rows that chose an expert go through it together; each row then adds its experts' outputs
    in ascending id order from +0, then the shared expert's, so its sum is the one it has alone.
    float64 (plain NumPy) runs row by row: a BLAS product's bits depend on its number of rows."""
    if not ops.batch_invariant(x):
        return np.concatenate([_moe(lw, cfg, il, x[i:i + 1], tokens[i:i + 1]) for i in range(x.shape[0])])
    return _moe(lw, cfg, il, x, tokens)


def _moe(lw: LayerWeights, cfg: DS4Config, il: int, x: np.ndarray, tokens) -> np.ndarray:
    hash_ids = lw["ffn_gate_tid2eid.weight"][np.asarray(tokens)] if cfg.is_hash_layer(il) else None
    bias = None if hash_ids is not None else lw["exp_probs_b.bias"]
    logits = ops.linear(x, lw.matrix("ffn_gate_inp.weight"))
    ids, w = ops.route_rows(logits, cfg.n_expert_used, bias, hash_ids, cfg.expert_weights_scale,
                            cfg.expert_weights_norm)
    down = routed_experts(lw, cfg.swiglu_clamp[il], x, ids)
    y = np.zeros_like(x)
    for j in range(ids.shape[1]):
        y = y + w[:, j, None] * down[:, j]
    tap.put(lw.prefix, "router_logits", logits)
    if tap.on():  # what the choice ranks, as route_rows forms it
        tap.put(lw.prefix, "router_scores", np.sqrt(ops.softplus(logits)) + (0 if bias is None else bias))
    tap.put(lw.prefix, "router_ids", ids)
    tap.put(lw.prefix, "router_weights", w)
    tap.put(lw.prefix, "expert_down", down)
    tap.put(lw.prefix, "ffn_moe", y)
    if cfg.n_expert_shared:
        shared = ops.swiglu(x, lw.matrix("ffn_gate_shexp.weight"), lw.matrix("ffn_up_shexp.weight"),
                            lw.matrix("ffn_down_shexp.weight"), cfg.swiglu_clamp[il])
        tap.put(lw.prefix, "ffn_shexp", shared)
        y = y + shared
    tap.put(lw.prefix, "ffn_out", y)
    return y


def routed_experts(lw: LayerWeights, clamp: float, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """down[n, j] = expert ids[n, j] applied to x[n]: each chosen expert once, on all its rows."""
    down = np.empty(ids.shape + x.shape[-1:], x.dtype)
    for e in np.unique(ids):
        rows, slot = np.nonzero(ids == e)
        down[rows, slot] = ops.swiglu(x[rows], lw.expert("ffn_gate_exps.weight", e), lw.expert("ffn_up_exps.weight", e),
                                      lw.expert("ffn_down_exps.weight", e), clamp, split=False)
    return down


def ffn_block(lw: LayerWeights, cfg: DS4Config, il: int, streams: np.ndarray, tokens) -> np.ndarray:
    u, post, comb = hc(lw, "ffn", cfg, streams)
    x = ops.rmsnorm(u, lw["ffn_norm.weight"], cfg.rms_eps)
    tap.put(lw.prefix, "ffn_norm", x)
    out = ops.hc_post(streams, moe(lw, cfg, il, x, tokens), post, comb)
    tap.put(lw.prefix, "hc_ffn_out", out)
    return out


def embed(weights, tokens, cfg: DS4Config) -> np.ndarray:
    """Token rows copied into every hyper-connection stream: (N, hc, d)."""
    e = weights.get("token_embd.weight")[np.asarray(tokens)]
    return np.repeat(e[:, None, :], cfg.hc_mult, axis=1)


def head(weights, cfg: DS4Config, numerics: str, streams: np.ndarray, mix=None) -> np.ndarray:
    """Logits of the streams: HC head mix, final norm, output projection. `mix` (the MTP's):
    another block's (fn, base, scale, norm) weights in front of the same output projection."""
    if mix is None:
        mix = (product_weight(weights, "output_hc_fn.weight", numerics), weights.get("output_hc_base.weight"),
               weights.get("output_hc_scale.weight"), weights.get("output_norm.weight"))
    fn, base, scale, norm = mix
    x = ops.hc_head(streams, fn, base, scale, cfg.rms_eps, cfg.hc_eps)
    tap.put("output.", "hc_head", x)
    x = ops.rmsnorm(x, norm, cfg.rms_eps)
    tap.put("output.", "norm", x)
    logits = ops.linear(x, product_weight(weights, "output.weight", numerics))
    tap.put("output.", "logits", logits)
    return logits
