"""DS4 primitives, each a pure function named from the paper (spec §3, §4).

Two arithmetics, chosen by the inputs' dtype:
* float32 is the canonical arithmetic (canon.py, docs/exactness.md): fixed
  reduction orders and exp/log1p built from IEEE operations, the very function
  the HIP kernels compute, bit for bit;
* float64 is plain NumPy maths, the oracle for golden files and the
  transformers differential.
Functions take a leading batch axis where it is cheap to do so, so the per-token
decode step and the whole-sequence prefill share them.
"""
from __future__ import annotations

import math

import numpy as np

from ..numerics import canon
from ..numerics.grids import e2m1_round, e4m3_round, pow2_ceil_log2
from ..numerics.tables import hadamard, rope_omega  # noqa: F401 - the primitives' names (tests, docs)

NEG_INF = -np.inf


def _canonical(x: np.ndarray) -> bool:
    return np.asarray(x).dtype == np.float32


def batch_invariant(x) -> bool:
    """Does every row of a batched op get the bits it gets alone? The canonical float32
    arithmetic does by construction (every output's order is fixed); float64 is plain NumPy,
    whose BLAS products choose their kernels, and so their sums, by shape."""
    return (x.dtype if isinstance(x, np.ndarray) else np.dtype(x)) == np.float32


def linear(x: np.ndarray, w, split: bool = True) -> np.ndarray:
    """x @ w.T (split=False for routed experts; see canon.linear). w is floats, or in the
    canonical arithmetic a canon.QuantCodes (layers.product_weight), which takes canon.qlinear."""
    if _canonical(x):
        return canon.linear(x, w, split)
    return x @ w.T

# ---------------------------------------------------------------------------
# Norms and activations
# ---------------------------------------------------------------------------


def rms0(x: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) over the last axis (no weight)."""
    if _canonical(x):
        return canon.rms0(x, eps)
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(ms + x.dtype.type(eps))


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return w * rms0(x, eps)


def sigmoid(x: np.ndarray) -> np.ndarray:
    if _canonical(x):
        return canon.sigmoid(x)
    return 1.0 / (1.0 + np.exp(-x))


def silu(x: np.ndarray) -> np.ndarray:
    if _canonical(x):
        return canon.silu(x)
    return x * sigmoid(x)


def softplus(x: np.ndarray) -> np.ndarray:
    if _canonical(x):
        return canon.softplus(x)
    return np.logaddexp(x.dtype.type(0), x)


# ---------------------------------------------------------------------------
# RoPE on the tail dims (interleaved pairs), plain and YaRN tables (§4)
# ---------------------------------------------------------------------------


def rope_cos_sin(omega: np.ndarray, pos: np.ndarray | int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin of theta = pos * omega, formed in the working dtype (float32: f32(p)*f32(omega))."""
    if np.dtype(dtype) == np.float32:
        return canon.rope_cos_sin(omega, pos)
    p = np.asarray(pos, dtype=dtype)[..., None]
    theta = p * omega.astype(dtype)
    return np.cos(theta), np.sin(theta)


def rope(v: np.ndarray, cos: np.ndarray, sin: np.ndarray, inverse: bool = False) -> np.ndarray:
    """Rotate the last 2*len(cos) dims of v in interleaved pairs (a, a+1).

    cos/sin broadcast against v[..., tail_pairs]; inverse rotates by -theta.
    """
    n_rot = 2 * cos.shape[-1]
    out = v.copy()
    a = v[..., -n_rot::2]
    b = v[..., -n_rot + 1::2]
    s = -sin if inverse else sin
    out[..., -n_rot::2] = a * cos - b * s
    out[..., -n_rot + 1::2] = a * s + b * cos
    return out


# ---------------------------------------------------------------------------
# `official` numerics: FP8 E4M3 round-trip of KV rows, Hadamard + FP4 E2M1 of
# indexer vectors (§3.0). Exact in any float dtype: only power-of-two scaling
# and round-half-to-even on the mantissa grid.
# ---------------------------------------------------------------------------


def _block_quant(v: np.ndarray, block: int, qmax: float, floor: float, rnd) -> np.ndarray:
    shp = v.shape
    blk = v.reshape(*shp[:-1], shp[-1] // block, block)
    amax = np.maximum(np.max(np.abs(blk), axis=-1, keepdims=True), v.dtype.type(floor))
    s = pow2_ceil_log2(amax / v.dtype.type(qmax))
    q = rnd(np.clip(blk / s, -qmax, qmax)) * s
    return q.reshape(shp)


def fp8sim(v: np.ndarray, n_rot: int) -> np.ndarray:
    """FP8 E4M3 round-trip of a KV row in blocks of 64 over the non-RoPE dims."""
    out = v.copy()
    nope = v.shape[-1] - n_rot
    out[..., :nope] = _block_quant(v[..., :nope], 64, 448.0, 1e-4, e4m3_round)
    return out


def qat(v: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Indexer quantisation-aware path: Hadamard rotation, then FP4 E2M1 in blocks of 32."""
    r = canon.hadamard_rotate(v, h) if _canonical(v) else v @ h.T
    return _block_quant(r, 32, 6.0, 7.052966104933725e-38, e2m1_round)


# ---------------------------------------------------------------------------
# Hyper-connections (mHC): pre with Sinkhorn, post, head (§3.2, §3.9, §3.11)
# ---------------------------------------------------------------------------


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


def _hc_mix(streams: np.ndarray, fn: np.ndarray, rms_eps: float) -> np.ndarray:
    """Mixing logits: fn applied to the RMS-normalised flattened (stream-major) streams."""
    n, hc, d = streams.shape
    f = streams.reshape(n, hc * d)
    r = 1.0 / np.sqrt(np.mean(f * f, axis=-1, keepdims=True) + f.dtype.type(rms_eps))
    return (f @ fn.T) * r


def hc_pre(streams: np.ndarray, fn: np.ndarray, base: np.ndarray, scale: np.ndarray,
           rms_eps: float, hc_eps: float, iters: int):
    """streams (N, hc, d) -> block input u (N, d), post (N, hc), comb (N, hc, hc).

    comb[i, j] mixes old stream i into new stream j; the softmax runs over j.
    """
    if _canonical(streams):
        return canon.hc_pre(streams, fn, base, scale, rms_eps, hc_eps, iters)
    n, hc, d = streams.shape
    m = _hc_mix(streams, fn, rms_eps)
    pre = sigmoid(m[:, :hc] * scale[0] + base[:hc]) + m.dtype.type(hc_eps)
    post = 2.0 * sigmoid(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    logits = m[:, 2 * hc:] * scale[2] + base[2 * hc:]
    comb = softmax(logits.reshape(n, hc, hc), axis=-1) + m.dtype.type(hc_eps)
    comb = canon.sinkhorn(comb, iters, hc_eps)
    u = np.einsum("nk,nkd->nd", pre, streams)
    return u, post, comb


def hc_post(streams: np.ndarray, y: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
    """S'[j] = post_j * y + sum_i comb[i, j] * S[i]."""
    if _canonical(streams):
        return canon.hc_post(streams, y, post, comb)
    return post[:, :, None] * y[:, None, :] + np.einsum("nij,nid->njd", comb, streams)


def hc_head(streams: np.ndarray, fn: np.ndarray, base: np.ndarray, scale: np.ndarray,
            rms_eps: float, hc_eps: float) -> np.ndarray:
    if _canonical(streams):
        return canon.hc_head(streams, fn, base, scale, rms_eps, hc_eps)
    m = _hc_mix(streams, fn, rms_eps)
    pre = sigmoid(m * scale[0] + base) + m.dtype.type(hc_eps)
    return np.einsum("nk,nkd->nd", pre, streams)


def stream_mean(streams: np.ndarray) -> np.ndarray:
    """(N, hc, d) -> (N, d): the mean of the hyper-connection streams, summed in stream order
    from +0 then divided by hc (what DSpark reads of its target's layers)."""
    if _canonical(streams):
        return canon.seqsum(streams[:, k] for k in range(streams.shape[1])) / np.float32(streams.shape[1])
    return streams.mean(axis=1)


# ---------------------------------------------------------------------------
# Attention with sinks, grouped output projection (§3.3)
# ---------------------------------------------------------------------------


def attention_with_sinks(q: np.ndarray, keys: np.ndarray, sinks: np.ndarray,
                         mask: np.ndarray | None = None) -> np.ndarray:
    """q (..., H, D), keys (..., N, D) shared K=V rows, sinks (H,) -> (..., H, D).

    The sink logit adds only to the softmax denominator. mask (..., N) True = visible.
    """
    if _canonical(q):
        return _attention_canonical(q, keys, sinks, mask)
    scale = q.dtype.type(1.0 / math.sqrt(q.shape[-1]))
    z = (q @ np.swapaxes(keys, -1, -2)) * scale  # (..., H, N)
    if mask is not None:
        z = np.where(mask[..., None, :], z, NEG_INF)
    sink = np.broadcast_to(sinks[:, None], z.shape[:-1] + (1,))
    mx = np.maximum(np.max(z, axis=-1, keepdims=True), sink) if z.shape[-1] else sink
    e = np.exp(z - mx)
    den = np.exp(sink - mx) + np.sum(e, axis=-1, keepdims=True)
    return (e @ keys) / den


def _attention_canonical(q, keys, sinks, mask):
    """Canonical attention attends to the visible rows only, in their order."""
    if q.ndim == 2:
        return canon.attention_with_sinks(q, keys if mask is None else keys[mask], sinks)
    ks = np.broadcast_to(keys, q.shape[:-2] + keys.shape[-2:])
    ms = None if mask is None else np.broadcast_to(mask, q.shape[:-2] + mask.shape[-1:])
    return np.stack([_attention_canonical(q[i], ks[i], sinks, None if ms is None else ms[i])
                     for i in range(q.shape[0])])


def attention_rows(q: np.ndarray, keys: list, sinks: np.ndarray) -> np.ndarray:
    """q (R, H, D); keys[r] a list of arrays whose concatenation is row r's visible K=V rows
    in their fixed order -> (R, H, D)."""
    if _canonical(q):
        return canon.attention_rows(q, keys, sinks)
    return np.stack([attention_with_sinks(q[r], np.concatenate(keys[r]), sinks) for r in range(q.shape[0])])


def grouped_output(o: np.ndarray, wo_a, wo_b, groups: int) -> np.ndarray:
    """o (N, H, D) -> (N, d): group g projects its heads' concatenation with rows g of wo_a
    (floats, or canon.QuantCodes in the canonical arithmetic)."""
    n = o.shape[0]
    og = o.reshape(n, groups, -1)                      # (N, G, H/G*D)
    if _canonical(o):
        rank = wo_a.shape[0] // groups
        rows = wo_a.rows if isinstance(wo_a, canon.QuantCodes) else lambda a, b: wo_a[a:b]
        z = np.concatenate([canon.linear(og[:, g], rows(g * rank, (g + 1) * rank), split=False)
                            for g in range(groups)], axis=-1)
        return canon.linear(z, wo_b)
    a = wo_a.reshape(groups, -1, og.shape[-1])         # (G, rank, H/G*D)
    z = np.einsum("gri,ngi->ngr", a, og).reshape(n, -1)
    return z @ wo_b.T


# ---------------------------------------------------------------------------
# Compressor pooling (§3.4, §3.5), lightning indexer (§3.7), top-k
# ---------------------------------------------------------------------------


def pool_window(kv: np.ndarray, score: np.ndarray) -> np.ndarray:
    """Per-channel softmax pooling over candidates: kv, score (..., C, D) -> (..., D).

    Candidates with score -inf carry weight 0; if all are -inf the row is 0.
    """
    if _canonical(kv):
        return canon.pool_window(kv, score)
    mx = np.max(score, axis=-2, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    e = np.exp(score - mx)
    den = np.sum(e, axis=-2)
    num = np.sum(e * kv, axis=-2)
    return np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)


def indexer_scores(qi: np.ndarray, wts: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """qi (Hi, Di), wts (Hi,) already scaled, keys (n, Di) -> (n,) = sum_h w_h relu(q_h . k)."""
    if _canonical(qi):
        return canon.indexer_scores(qi, wts, keys)
    dots = keys @ qi.T  # (n, Hi)
    return np.maximum(dots, 0) @ wts


def indexer_topk(qi: np.ndarray, wts: np.ndarray, keys: np.ndarray, counts: np.ndarray, k: int) -> np.ndarray:
    """Rows the indexer keeps for each of m queries (qi (m, Hi, Di), wts (m, Hi)): the k best of
    the first counts[r] (> k) keys, ties to the lower index, ascending -> (m, k)."""
    if _canonical(qi):
        # NaN past counts[r] sorts after every real score (NaN included, ties by index), so
        # each row's first k are those of its own first counts[r] scores
        return topk_rows(canon.indexer_scores_rows(qi, wts, keys, counts), k)
    return np.stack([topk_lower_index(indexer_scores(qi[r], wts[r], keys[:counts[r]]), k)
                     for r in range(qi.shape[0])])


def indexer_score_table(qi: np.ndarray, wts: np.ndarray, keys: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The scores indexer_topk chooses from: (m, max counts), -inf past counts[r] (the tap's)."""
    counts = np.asarray(counts)
    if _canonical(qi):
        out = canon.indexer_scores_rows(qi, wts, keys, counts)
    else:
        out = np.zeros((qi.shape[0], keys.shape[0]), qi.dtype)
        for r in range(qi.shape[0]):
            out[r, :counts[r]] = indexer_scores(qi[r], wts[r], keys[:counts[r]])
    out = out[:, :counts.max()]
    out[np.arange(out.shape[1])[None, :] >= counts[:, None]] = NEG_INF
    return out


def topk_lower_index(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k highest scores, ties broken by the lower index, returned ascending."""
    n = scores.shape[-1]
    if k >= n:
        return np.arange(n)
    order = np.lexsort((np.arange(n), -scores))  # primary: score desc, then index asc
    return np.sort(order[:k])


# ---------------------------------------------------------------------------
# MoE: router, experts (§3.10)
# ---------------------------------------------------------------------------


def route(logits: np.ndarray, n_used: int, bias: np.ndarray | None, hash_ids: np.ndarray | None,
          scale: float, normalise: bool) -> tuple[np.ndarray, np.ndarray]:
    """Router for one token: sqrt-softplus scores, selection (bias only for choosing,
    or the token's hash ids), normalised and scaled weights. Returns (ids, weights),
    ids ascending so the expert sum has one fixed order."""
    ids, w = route_rows(logits[None], n_used, bias, None if hash_ids is None else np.asarray(hash_ids)[None],
                        scale, normalise)
    return ids[0], w[0]


def route_rows(logits: np.ndarray, n_used: int, bias: np.ndarray | None, hash_ids: np.ndarray | None,
               scale: float, normalise: bool) -> tuple[np.ndarray, np.ndarray]:
    """`route` for R tokens at once: logits (R, E), hash_ids (R, n_used) or None ->
    ids, weights (R, n_used), each row exactly as routed alone."""
    s = np.sqrt(softplus(logits))
    if hash_ids is not None:
        ids = np.sort(np.asarray(hash_ids, dtype=np.int64), axis=-1)
    else:
        ids = topk_rows(s + bias, n_used)
    w = np.take_along_axis(s, ids, axis=-1)
    if normalise:
        w = w / (canon.seqsum(w[:, i:i + 1] for i in range(w.shape[1])) if _canonical(w)
                 else np.sum(w, axis=-1, keepdims=True))
    return ids, w * s.dtype.type(scale)


def topk_rows(scores: np.ndarray, k: int) -> np.ndarray:
    """topk_lower_index of every row of scores (R, n): (R, min(k, n)), ascending per row."""
    r, n = scores.shape
    if k >= n:
        return np.broadcast_to(np.arange(n), (r, n)).copy()
    order = np.argsort(-scores, axis=-1, kind="stable")  # score desc; a stable sort keeps ties by index
    return np.sort(order[:, :k], axis=-1)


def swiglu(x: np.ndarray, w1: np.ndarray, w3: np.ndarray, w2: np.ndarray, clamp: float,
           split: bool = True) -> np.ndarray:
    """Clamped SwiGLU expert: gate <= clamp, up in [-clamp, clamp]. split=False for routed
    experts (see canon.linear)."""
    if _canonical(x):
        return canon.swiglu(x, w1, w3, w2, clamp, split)
    g = np.minimum(linear(x, w1, split), clamp)
    v = np.clip(linear(x, w3, split), -clamp, clamp)
    return linear(silu(g) * v, w2, split)
