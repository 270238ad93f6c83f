"""GPU twins of ds4ref/reference/ops.py: numpy in, numpy out, the test harness beside the
op-case table (op_cases.py; tests/gpu/test_ops_gpu.py).

Each wrapper has the signature and semantics of its reference twin; uploads and
downloads happen inside, so tests call both and compare. Outputs are poisoned
(f32 NaN, int32 -1) before every launch, so an element a kernel forgot to write
fails the comparison instead of passing as a stale zero."""
from __future__ import annotations

import math

import numpy as np

from ..backend import DECODE_LANES
from ..paging.compact import encode_index_rows, encode_kv_rows
from ..hip.buffers import DeviceBuffer
from ..hip.launch import (
    _blocks, AT_SPLIT, EL_STRIDE, expert_list_ints, expert_tiles_ints, HC_MAX, kernel, ksplit_scratch,
    launch_add_rows, launch_argmax, launch_attention_combine, launch_attention_split, launch_expert_list,
    launch_expert_tiles, launch_hc_pre_finish, launch_matvec, launch_matvec_slices, launch_norm_rope, launch_qat,
    launch_qexperts, launch_qexperts_gemm, launch_qmatvec, launch_quantize_q8, launch_rmsnorm, launch_rmsnorm_q8,
    launch_routed_experts, launch_swiglu_act, matvec_ksplit, PagedLanes, Q8Rows)
from ..hip.device_state import ROW_F32, ROW_KV
from ..hip.layouts import _need, DeviceWeight, pack_qrows, QUANT_WTYPES, weight_cols
from ..hip.runtime import get_runtime, Runtime

I32, F32 = np.int32, np.float32
NAN_BITS = 0x7FC00000


def _rt(rt: Runtime | None) -> Runtime:
    return rt if rt is not None else get_runtime()


def _f32(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=F32)


def poisoned(rt: Runtime, shape, dtype=F32) -> DeviceBuffer:
    """A fresh output buffer filled with NaN (f32) or -1 (int32)."""
    n = int(np.prod(shape, dtype=np.int64))
    buf = rt.malloc(max(n * 4, 4))
    rt.memset32(buf, NAN_BITS if np.dtype(dtype) == F32 else 0xFFFFFFFF, max(n, 1))
    return buf


class _Scope:
    """Frees every buffer made inside a wrapper call."""

    def __init__(self, rt: Runtime):
        self.rt, self.bufs = rt, []

    def up(self, arr) -> DeviceBuffer:
        b = self.rt.upload(arr)
        self.bufs.append(b)
        return b

    def out(self, shape, dtype=F32) -> DeviceBuffer:
        b = poisoned(self.rt, shape, dtype)
        self.bufs.append(b)
        return b

    def get(self, buf, shape, dtype=F32) -> np.ndarray:
        self.rt.synchronize()
        return self.rt.download(buf, shape, dtype)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for b in self.bufs:
            b.free()


def rmsnorm_q8(x, w, eps, rt=None):
    """Twin of rmsnorm then canon.quantize_q8 of its output: (y, codes int8, block scales f32)."""
    rt = _rt(rt)
    x = _f32(np.atleast_2d(x))
    rows, D = x.shape

    def produce(s, q):
        y = s.out(x.shape)
        launch_rmsnorm_q8(rt, s.up(x), None if w is None else s.up(_f32(w)), y, rows, D, eps, q)
        return (s.get(y, x.shape),)
    return _with_q8_rows(rt, rows, D, produce)


def rmsnorm(x, w, eps, rt=None):
    rt = _rt(rt)
    x = _f32(x)
    D = x.shape[-1]
    rows = x.size // D if D else 0
    with _Scope(rt) as s:
        y = s.out(x.shape)
        launch_rmsnorm(rt, s.up(x), None if w is None else s.up(_f32(w)), y, rows, D, eps)
        return s.get(y, x.shape)


def rms0(x, eps, rt=None):
    return rmsnorm(x, None, eps, rt)


def rope_pos(v, cs, pos, inverse=False, rt=None):
    """The backend's RoPE (step_rope_pos): v (L, R, D) rows of L lanes, each lane at position
    pos[l], cos/sin read from the host's table cs (P, half, 2) (canon.rope_cos_sin stacked).
    Twin of ref.rope(v, cos[pos][:, None], sin[pos][:, None], inverse)."""
    rt = _rt(rt)
    v, cs = _f32(v), _f32(cs)
    L, R, D = v.shape
    half = cs.shape[1]
    _need(2 * half <= D, f"rope: {2 * half} rotated dims exceed the row length {D}")
    with _Scope(rt) as s:
        vb = s.up(v)  # in place
        rt.launch(kernel(rt, "step_ops", "step_rope_pos"), (_blocks(L * R * half, 256),), (256,),
                  (vb, s.up(np.asarray(pos, I32)), s.up(cs), I32(L), I32(R), I32(D), I32(half),
                   I32(1 if inverse else 0)))
        return s.get(vb, v.shape)


def norm_rope(x, w, eps, cs, pos, inverse=False, fp8=False, rt=None):
    """Twin of rmsnorm (rms0 without w), then rope_pos, then (fp8) ref.fp8sim with n_rot = 2 * half:
    x (L, R, D) rows of L lanes, lane l at position pos[l], cs the (P, half, 2) table."""
    rt = _rt(rt)
    x, cs = _f32(x), _f32(cs)
    L, R, D = x.shape
    with _Scope(rt) as s:
        y = s.out(x.shape)
        launch_norm_rope(rt, s.up(x), None if w is None else s.up(_f32(w)), y, L, R, D, eps,
                         s.up(np.asarray(pos, I32)), s.up(cs), cs.shape[1], inverse, fp8)
        return s.get(y, x.shape)


def qat(v, h, rt=None):
    """Twin of ref.qat: v @ h.T summed in index order, then E2M1 blocks of 32."""
    rt = _rt(rt)
    v, h = _f32(v), _f32(h)
    n = v.shape[-1]
    _need(h.shape == (n, n), f"qat: h is {h.shape}, expected ({n}, {n})")
    with _Scope(rt) as s:
        out = s.out(v.shape)
        launch_qat(rt, s.up(v), s.up(np.ascontiguousarray(h.T)), out, v.size // n, n)
        return s.get(out, v.shape)


def matvec(w, x, wtype=None, rt=None):
    """x (L, K) or (K,) -> x @ W.T, every lane in one launch (lane groups of 16)."""
    rt = _rt(rt)
    x = _f32(x)
    squeeze = x.ndim == 1
    x2 = x.reshape(-1, x.shape[-1])
    dw = DeviceWeight.upload(rt, w, wtype)
    part = ksplit_scratch(rt, dw, max(1, x2.shape[0]))
    try:
        _need(x2.shape[1] == dw.cols, f"matvec: x has {x2.shape[1]} columns, W has {dw.cols}")
        outs = []
        chunk = max(1, x2.shape[0])
        for c0 in range(0, x2.shape[0], chunk):
            xc = x2[c0:c0 + chunk]
            with _Scope(rt) as s:
                y = s.out((xc.shape[0], dw.rows))
                launch_matvec(rt, dw, s.up(xc), y, xc.shape[0], part=part)
                outs.append(s.get(y, (xc.shape[0], dw.rows)))
    finally:
        dw.buf.free()
        if part is not None:
            part.free()
    y = np.concatenate(outs, axis=0) if outs else np.zeros((0, dw.rows), F32)
    return y[0] if squeeze else y


def grouped_output(o, wo_a, wo_b, groups, wtype_a=None, wtype_b=None, rt=None):
    """o (N, H, D) -> (N, d), as reference grouped_output; both projections on the matvec kernel."""
    rt = _rt(rt)
    o = _f32(o)
    n = o.shape[0]
    og = o.reshape(n, -1)
    kin = og.shape[1] // groups
    da = DeviceWeight.upload(rt, wo_a, wtype_a)
    db = DeviceWeight.upload(rt, wo_b, wtype_b)
    try:
        _need(da.cols == kin, f"grouped_output: wo_a has {da.cols} columns, each group has {kin} inputs")
        _need(da.rows % groups == 0, f"grouped_output: wo_a rows {da.rows} not divisible by {groups} groups")
        _need(db.cols == da.rows, f"grouped_output: wo_b has {db.cols} columns, expected {da.rows}")
        outs = []
        for c0 in range(0, n, DECODE_LANES):
            oc = og[c0:c0 + DECODE_LANES]
            L = oc.shape[0]
            with _Scope(rt) as s:
                z = s.out((L, da.rows))
                y = s.out((L, db.rows))
                launch_matvec(rt, da, s.up(oc), z, L, groups=groups, ldx=og.shape[1], xg=kin, ldy=da.rows)
                launch_matvec(rt, db, z, y, L)
                outs.append(s.get(y, (L, db.rows)))
    finally:
        da.buf.free()
        db.buf.free()
    return np.concatenate(outs, axis=0)


def hc_pre(streams, fn, base, scale, rms_eps, hc_eps, iters, rt=None):
    rt = _rt(rt)
    streams = _f32(streams)
    n, hc, d = streams.shape
    _need(hc <= HC_MAX, f"hc_pre: hc_mult {hc} exceeds the kernel limit {HC_MAX}")
    mixn = 2 * hc + hc * hc
    fw = DeviceWeight.upload(rt, _f32(fn))
    _need(fw.rows == mixn and fw.cols == hc * d, f"hc_pre: fn is {fn.shape}, expected ({mixn}, {hc * d})")
    part = ksplit_scratch(rt, fw, n)
    try:
        with _Scope(rt) as s:
            sb = s.up(streams)
            mix, slices = None, None
            if part is not None:  # the projection's slices, added by the finish (as HipBackend runs it)
                slices = (part, launch_matvec_slices(rt, fw, sb, part, n))
            else:
                mix = s.out((n, mixn))
                launch_matvec(rt, fw, sb, mix, n)  # the projection f @ fn.T
            u, post, comb = s.out((n, d)), s.out((n, hc)), s.out((n, hc, hc))
            launch_hc_pre_finish(rt, sb, mix, s.up(_f32(base)), s.up(_f32(scale)), hc, d, rms_eps, hc_eps, iters,
                                 u, post, comb, n, slices=slices)
            return s.get(u, (n, d)), s.get(post, (n, hc)), s.get(comb, (n, hc, hc))
    finally:
        fw.buf.free()
        if part is not None:
            part.free()


def add_rows(a, b, rt=None):
    """Twin of a + b[:, None]: a (L, hc, d), b (L, d)."""
    rt = _rt(rt)
    a, b = _f32(a), _f32(b)
    L, hc, d = a.shape
    with _Scope(rt) as s:
        out = s.out((L, hc, d))
        launch_add_rows(rt, s.up(a), s.up(b), out, L, hc, d)
        return s.get(out, (L, hc, d))


def stream_mean(streams, rt=None):
    """Twin of ops.stream_mean: streams (L, hc, d) -> (L, d), DSpark's taps (step_stream_mean),
    written at an offset of rows twice as wide (the taps' layout; the other half stays poisoned)."""
    rt = _rt(rt)
    x = _f32(streams)
    L, hc, d = x.shape
    with _Scope(rt) as s:
        out = s.out((L, 2 * d))
        rt.launch(kernel(rt, "step_ops", "step_stream_mean"), (L,), (256,),
                  (s.up(x), s.up(np.zeros(L, np.int32)), np.int32(hc), np.int32(d), out, np.int32(2 * d),
                   np.int32(d)))
        return s.get(out, (L, 2 * d))[:, d:]


def markov_gather(stored, wtype: str, tok, rt=None):
    """Twin of DSpark's Markov input rows: stored (V, d) as make_weight stores it in `wtype`,
    tok (R,) ids, a token out of range reading row 0 (step_markov_gather)."""
    from ..hip.device_weights import WTYPE_CODE
    rt = _rt(rt)
    tok = np.asarray(tok, np.int32)
    V = int(stored.shape[0])
    d = int(stored.shape[1]) if wtype != "q8_0" else int(stored.shape[1]) // 34 * 32
    R = tok.size
    with _Scope(rt) as s:
        e = s.out((R, d))
        rt.launch(kernel(rt, "step_ops", "step_markov_gather"), (R,), (256,),
                  (s.up(np.ascontiguousarray(stored)), np.int32(WTYPE_CODE[wtype]), np.int32(d), np.int32(V),
                   s.up(np.zeros(R, np.int32)), s.up(tok), e))
        return s.get(e, (R, d))


def markov_add(base, mk, i: int, rt=None):
    """Twin of base[:, i] + mk: base (R, B, V) a block's logits, mk (R, V) (step_markov_add)."""
    rt = _rt(rt)
    base, mk = _f32(base), _f32(mk)
    R, B, V = base.shape
    with _Scope(rt) as s:
        out = s.out((R, V))
        rt.launch(kernel(rt, "step_ops", "step_markov_add"), (_blocks(R * V, 256),), (256,),
                  (s.up(base), s.up(mk), s.up(np.zeros(R, np.int32)), np.int32(B), np.int32(i), np.int32(R),
                   np.int32(V), out))
        return s.get(out, (R, V))


def hc_post(streams, y, post, comb, rt=None):
    rt = _rt(rt)
    streams = _f32(streams)
    n, hc, d = streams.shape
    with _Scope(rt) as s:
        out = s.out((n, hc, d))
        rt.launch(kernel(rt, "hc", "ds4_hc_post"), (_blocks(n * hc * d, 256),), (256,),
                  (s.up(streams), s.up(_f32(y)), s.up(_f32(post)), s.up(_f32(comb)), out,
                   I32(n), I32(hc), I32(d)))
        return s.get(out, (n, hc, d))


def _stored(rows, kind: int, n_rot: int) -> np.ndarray:
    """Rows (..., D) float32 as the state stores them: float32, or the compact lossless form."""
    rows = _f32(rows)
    if kind == ROW_F32:
        return rows
    return encode_kv_rows(rows, n_rot) if kind == ROW_KV else encode_index_rows(rows)


def attention_paged(q, pass_kv, ring, store, sel, ksel, lanes: PagedLanes, sinks, kind=ROW_F32, n_rot=0,
                    rope=None, q8=False, rt=None):
    """The backend's attention (step_attention_split + step_attention_combine): q (L, H, D); this
    pass's KV rows pass_kv (L, D); the window ring (slots, W, D); the compressed rows (pages,
    per, D) or None; sel (L, ksel) the indexer's rows (ascending, -1 padded) or None = all
    visible rows. Each lane attends to its raw positions max(0, pos-W+1)..pos (the pass's rows
    from pstart on, the ring's before), then its compressed rows -> (L, H, D); padding lanes 0.
    The combine's epilogue: rope, a (P, half, 2) table, inverse-rotates each head's last 2 * half
    dims at the lane's position; q8 also returns the rows' int8 codes and block scales."""
    rt = _rt(rt)
    q, sinks = _f32(q), _f32(sinks)
    L, H, D = q.shape
    ring = _f32(ring)
    W = ring.shape[1]
    ring_raw = _stored(ring, kind, n_rot).reshape(ring.shape[0], -1)
    ncomp = [0 if lanes.slot[l] < 0 or store is None else
             (min(lanes.nvis[l], ksel) if sel is not None else lanes.nvis[l]) for l in range(L)]
    raw = [0 if lanes.slot[l] < 0 else lanes.pos[l] - max(0, lanes.pos[l] - W + 1) + 1 for l in range(L)]
    nz = max(1, _blocks(max(r + c for r, c in zip(raw, ncomp)), AT_SPLIT))
    with _Scope(rt) as s:
        st = None if store is None else s.up(_stored(store, kind, n_rot))
        sl = None if sel is None else s.up(np.asarray(sel, I32))
        lane = {k: s.up(np.asarray(getattr(lanes, k), I32)) for k in ("slot", "pos", "pstart", "flane", "nvis")}
        m, den, acc, out = s.out((L, H, nz)), s.out((L, H, nz)), s.out((L, H, nz, D)), s.out((L, H, D))
        btab = s.up(np.asarray(lanes.btab, I32))
        launch_attention_split(rt, H, L, nz,
                               (s.up(q), s.up(_f32(pass_kv)), s.up(ring_raw), np.int64(ring_raw.shape[1] * ring_raw.itemsize),
                                st, I32(kind), I32(n_rot), btab, I32(lanes.btab.shape[1]), I32(lanes.per), sl, I32(ksel),
                                lane["slot"], lane["pos"], lane["pstart"], lane["flane"], lane["nvis"], I32(H), I32(D), I32(W),
                                F32(1.0 / math.sqrt(D)), m, den, acc))
        qr = Q8Rows.alloc(rt, L * H * D) if q8 else None
        try:
            launch_attention_combine(rt, m, den, acc, s.up(sinks), lane["slot"], lane["pos"], st, lane["nvis"], sl,
                                     ksel, W, H, D, nz, out, L, None if rope is None else s.up(_f32(rope)),
                                     0 if rope is None else np.shape(rope)[1], qr)
            o = s.get(out, (L, H, D))
            return (o, *qr.get(rt, L, H * D)) if q8 else o
        finally:
            if qr is not None:
                qr.free()


def indexer_paged(qi, wraw, scale, store, lanes: PagedLanes, ncap, kind=ROW_F32, rt=None):
    """The backend's indexer scores (step_indexer_paged): qi (L, Hi, Di), per-head weights wraw
    (L, Hi) scaled on the device, the slot's index rows (pages, per, Di) -> (L, ncap): score of
    row n < nvis[l]. The kernel leaves the entries beyond (and a padding lane's) as they were:
    here -inf, written before it runs, so a write past nvis shows."""
    rt = _rt(rt)
    qi = _f32(qi)
    L, Hi, Di = qi.shape
    with _Scope(rt) as s:
        out = s.out((L, ncap))
        rt.memset32(out, 0xFF800000, L * ncap)
        rt.launch(kernel(rt, "step_state", "step_indexer_paged"), (min(_blocks(ncap, 8), 128), L), (256,),
                  (s.up(qi), s.up(_f32(wraw)), F32(scale), s.up(_stored(store, kind, 0)), I32(kind),
                   s.up(np.asarray(lanes.btab, I32)), I32(lanes.btab.shape[1]), I32(lanes.per),
                   s.up(np.asarray(lanes.slot, I32)), s.up(np.asarray(lanes.nvis, I32)), out, I32(Hi), I32(Di),
                   I32(ncap)))
        return s.get(out, (L, ncap))


# ---------------------------------------------------------------------------
# Compressor pooling, indexer, top-k
# ---------------------------------------------------------------------------


def pool_window(kv, score, rt=None):
    rt = _rt(rt)
    kv, score = _f32(kv), _f32(score)
    _need(kv.shape == score.shape, f"pool_window: kv {kv.shape} and score {score.shape} differ")
    C, D = kv.shape[-2:]
    R = kv.size // (C * D) if C * D else 0
    shape = kv.shape[:-2] + (D,)
    with _Scope(rt) as s:
        out = s.out(shape)
        rt.launch(kernel(rt, "pool", "ds4_pool_window"), (_blocks(D, 32), R), (256,),
                  (s.up(kv), s.up(score), out, I32(R), I32(C), I32(D)))
        return s.get(out, shape)


def topk_batched(scores, n_valid, k, rt=None):
    """(L, ncap) scores -> (L, k) int32 ascending indices; k >= n_valid gives 0..n-1 then -1."""
    rt = _rt(rt)
    scores = _f32(scores)
    L, ncap = scores.shape
    with _Scope(rt) as s:
        out = s.out((L, k), I32)
        rt.launch(kernel(rt, "indexer", "ds4_topk"), (max(L, 1),), (512,),
                  (s.up(scores), s.up(np.asarray(n_valid, I32)), I32(ncap), I32(k), out))
        return s.get(out, (L, k), I32)


def topk_lower_index(scores, k, rt=None):
    n = scores.shape[-1]
    if k >= n:
        return np.arange(n)
    return topk_batched(scores[None], [n], k, rt)[0].astype(np.int64)


# ---------------------------------------------------------------------------
# MoE: router, SwiGLU, argmax
# ---------------------------------------------------------------------------

RT_MAXE, RT_MAXK = 1024, 32


def route_batched(logits, n_used, bias, hash_ids, scale, normalise, rt=None):
    """logits (L, E) -> ids (L, k) int32 ascending, weights (L, k)."""
    rt = _rt(rt)
    logits = _f32(logits)
    L, E = logits.shape
    k = n_used if hash_ids is None else np.asarray(hash_ids).shape[-1]
    _need(E <= RT_MAXE and k <= RT_MAXK, f"route: {E} experts / {k} used exceed {RT_MAXE} / {RT_MAXK}")
    with _Scope(rt) as s:
        ids, w = s.out((L, k), I32), s.out((L, k))
        hb = None if hash_ids is None else s.up(np.asarray(hash_ids, I32).reshape(L, k))
        bb = None if bias is None else s.up(_f32(bias))
        rt.launch(kernel(rt, "moe", "ds4_route"), (max(L, 1),), (256,),
                  (s.up(logits), bb, hb, I32(E), I32(k), F32(scale), I32(1 if normalise else 0), ids, w))
        return s.get(ids, (L, k), I32), s.get(w, (L, k))


def route(logits, n_used, bias, hash_ids, scale, normalise, rt=None):
    hb = None if hash_ids is None else np.asarray(hash_ids)[None]
    ids, w = route_batched(_f32(logits)[None], n_used, bias, hb, scale, normalise, rt)
    return ids[0].astype(np.int64), w[0]


def swiglu(x, w1, w3, w2, clamp, wtype=None, rt=None):
    """Clamped SwiGLU expert for x (K,) or (L, K): three matvecs and one activation kernel."""
    rt = _rt(rt)
    x = _f32(x)
    squeeze = x.ndim == 1
    x2 = x.reshape(-1, x.shape[-1])
    ws = [DeviceWeight.upload(rt, w, wtype) for w in (w1, w3, w2)]
    try:
        F = ws[0].rows
        outs = []
        for c0 in range(0, x2.shape[0], DECODE_LANES):
            xc = x2[c0:c0 + DECODE_LANES]
            L = xc.shape[0]
            with _Scope(rt) as s:
                xb = s.up(xc)
                g, u, h, y = s.out((L, F)), s.out((L, F)), s.out((L, F)), s.out((L, ws[2].rows))
                launch_matvec(rt, ws[0], xb, g, L)
                launch_matvec(rt, ws[1], xb, u, L)
                launch_swiglu_act(rt, g, u, h, L * F, clamp)
                launch_matvec(rt, ws[2], h, y, L)
                outs.append(s.get(y, (L, ws[2].rows)))
    finally:
        for w in ws:
            w.buf.free()
    y = np.concatenate(outs, axis=0)
    return y[0] if squeeze else y


def swiglu_act_q8(g, u, clamp, rt=None):
    """Twin of the activation then canon.quantize_q8 of h: (h, codes int8, block scales f32)."""
    rt = _rt(rt)
    g, u = _f32(np.atleast_2d(g)), _f32(np.atleast_2d(u))
    rows, W = g.shape

    def produce(s, q):
        h = s.out(g.shape)
        launch_swiglu_act(rt, s.up(g), s.up(u), h, rows * W, clamp, q)
        return (s.get(h, g.shape),)
    return _with_q8_rows(rt, rows, W, produce)


def expert_list(ids, slots, n_expert: int, rt=None) -> np.ndarray:
    """step_expert_list's entries for routing ids (L, kk) and lane slots (L,) (-1: a padding
    lane), as rows (expert, pair count, lt_0 .., -1 past the count) of EL_STRIDE int32s, then
    rows of -1 up to the list's capacity."""
    rt = _rt(rt)
    ids, slots = np.ascontiguousarray(ids, np.int32), np.ascontiguousarray(slots, np.int32)
    L, kk = ids.shape
    n_ints = expert_list_ints(n_expert, kk, L)
    with _Scope(rt) as s:
        elist = s.out((n_ints,), I32)
        launch_expert_list(rt, s.up(ids), s.up(slots), L, kk, n_expert, elist)
        out = s.get(elist, (n_ints,), I32)
    rows = np.full(((n_ints - 1) // EL_STRIDE, EL_STRIDE), -1, np.int32)
    for u, row in enumerate(out[1:1 + int(out[0]) * EL_STRIDE].reshape(-1, EL_STRIDE)):
        rows[u, :2 + row[1]] = row[:2 + row[1]]  # the slots past an entry's pairs hold whatever the buffer held
    return rows


def expert_tiles(ids, slots, n_expert: int, rt=None) -> np.ndarray:
    """step_expert_tiles' row tiles of step_expert_list's entries for routing ids (L, kk) and lane
    slots (L,): rows (first entry, pair count), then rows of -1 up to the most tiles a pass can have."""
    rt = _rt(rt)
    ids, slots = np.ascontiguousarray(ids, np.int32), np.ascontiguousarray(slots, np.int32)
    L, kk = ids.shape
    n_ints = expert_tiles_ints(n_expert, kk, L)
    with _Scope(rt) as s:
        elist, tiles = s.out((expert_list_ints(n_expert, kk, L),), I32), s.out((n_ints,), I32)
        launch_expert_list(rt, s.up(ids), s.up(slots), L, kk, n_expert, elist)
        launch_expert_tiles(rt, elist, tiles)
        out = s.get(tiles, (n_ints,), I32)
    rows = np.full(((n_ints - 1) // 2, 2), -1, np.int32)
    n = int(out[0])
    rows[:n] = out[1:1 + 2 * n].reshape(-1, 2)
    return rows


def _padded_expert_inputs(x: np.ndarray, ids: np.ndarray, K: int):
    """(P, inputs, slots, ids) of L lanes padded like a decode pass to P = max(L, 16) lanes:
    padding lanes carry slot -1, zero inputs and expert 0."""
    L, kk = ids.shape
    P = max(L, DECODE_LANES)
    xs = np.zeros((P, kk, K) if x.ndim == 3 else (P, K), F32)
    xs[:L] = x
    slots = np.full(P, -1, np.int32)
    slots[:L] = np.arange(L)
    idp = np.zeros((P, kk), np.int32)
    idp[:L] = ids
    return P, xs, slots, idp


def routed_experts(w, wtype: str, x, ids, rt=None, rows_per_warp: int | None = None):
    """The backend's routed-expert kernels: w (E, N, row bytes or K), x (L, K) or (L, kk, K) (one
    input per choice), ids (L, kk) -> y (L, kk, N) = W[ids[l, t]] @ x, every lane valid. Any L:
    past 16 lanes an expert chosen by many lanes takes several work entries (a prompt pass)."""
    rt = _rt(rt)
    x, ids = _f32(x), np.ascontiguousarray(ids, np.int32)
    L, kk = ids.shape
    _need(L >= 1, "routed_experts: no lanes")
    E, N = w.shape[0], w.shape[1]
    K = weight_cols(w, wtype)
    per_choice = x.ndim == 3
    P, xs, slots, idp = _padded_expert_inputs(x, ids, K)
    r = rows_per_warp or (2 if N >= 16 else 1)
    with _Scope(rt) as s:
        y = s.out((P, kk, N))
        elist = s.out((expert_list_ints(E, kk, P),), I32)
        launch_expert_list(rt, s.up(idp), s.up(slots), P, kk, E, elist)
        launch_routed_experts(rt, s.up(np.ascontiguousarray(w)), wtype, r, s.up(xs), 1 if per_choice else 0,
                              elist, y, N, K, kk)
        return s.get(y, (P, kk, N))[:L]


def argmax(logits, rt=None):
    """(L, V) -> (L,) int32, lower index wins ties; NON_FINITE_ROW for a row with a NaN or an infinity."""
    rt = _rt(rt)
    x = _f32(logits)
    squeeze = x.ndim == 1
    x2 = x.reshape(-1, x.shape[-1])
    L, V = x2.shape
    with _Scope(rt) as s:
        out = s.out((L,), I32)
        launch_argmax(rt, s.up(x2), out, L, V)
        r = s.get(out, (L,), I32)
    return r[0] if squeeze else r


def qmatvec(raw, wtype: str, x, rt=None, gemm: bool = True, max_blocks: int = 0):
    """Twin of canon.qlinear: raw GGUF rows (N, row bytes), x (L, K) -> (L, N); the backend's
    kernel for L rows, or without gemm the decode kernel for any L (max_blocks: launch_qmatvec's)."""
    rt = _rt(rt)
    x = _f32(np.atleast_2d(x))
    L, K = x.shape
    packed = pack_qrows(wtype, raw)
    dw = DeviceWeight(rt.upload(packed), wtype, packed.shape[0], weight_cols(raw, wtype), packed=True)
    q = Q8Rows.alloc(rt, L * K)
    try:
        _need(K == dw.cols, f"qmatvec: x has {K} columns, W has {dw.cols}")
        with _Scope(rt) as s:
            y = s.out((L, dw.rows))
            launch_quantize_q8(rt, s.up(x), q, L, K)
            launch_qmatvec(rt, dw, q, y, L, gemm=gemm, max_blocks=max_blocks)
            return s.get(y, (L, dw.rows))
    finally:
        dw.buf.free()
        q.free()


def joint_matvec(ws, x, wtype: str, rt=None):
    """The backend's one launch for matrices of one shape that read the same x (_mv_joint): ws a
    list of G weights (float values, or GGUF rows for the quantised types), x (L, K) -> G
    outputs (L, N), each written apart from the others (gs past the lanes' rows). Twin of
    [linear(x, w) for w in ws] (canon.qlinear's for the quantised types)."""
    rt = _rt(rt)
    x = _f32(np.atleast_2d(x))
    L, K = x.shape
    G = len(ws)
    quant = wtype in QUANT_WTYPES
    rows = np.concatenate([np.asarray(w) for w in ws], axis=0)
    dw = (DeviceWeight(rt.upload(pack_qrows(wtype, rows)), wtype, rows.shape[0], weight_cols(rows, wtype), packed=True)
          if quant else DeviceWeight.upload(rt, rows, wtype))
    N = dw.rows // G
    _need(K == dw.cols, f"joint_matvec: x has {K} columns, W has {dw.cols}")
    _need(not matvec_ksplit(N, K), f"joint_matvec: {N} x {K} is K-split, so it runs alone")
    q = Q8Rows.alloc(rt, L * K) if quant else None
    try:
        with _Scope(rt) as s:
            y = s.out((G, L, N))  # output g at g * L * N
            if quant:
                launch_quantize_q8(rt, s.up(x), q, L, K)
                launch_qmatvec(rt, dw, q, y, L, groups=G, ldy=N, gs=L * N)
            else:
                launch_matvec(rt, dw, s.up(x), y, L, groups=G, ldy=N, gs=L * N)
            return tuple(s.get(y, (G, L, N)))
    finally:
        dw.buf.free()
        if q is not None:
            q.free()


def quantize_q8(x, rt=None):
    """Twin of canon.quantize_q8: x (rows, K) -> (codes int8, block scales f32)."""
    rt = _rt(rt)
    x = _f32(np.atleast_2d(x))
    rows, K = x.shape

    def produce(s, q):
        launch_quantize_q8(rt, s.up(x), q, rows, K)
        return ()
    return _with_q8_rows(rt, rows, K, produce)


def _with_q8_rows(rt, rows: int, W: int, produce) -> tuple:
    """produce(scope, q) over fresh int8 rows q (rows x W): its host outputs, then q's codes and
    block scales (the twins of the kernels that quantise what they make)."""
    q = Q8Rows.alloc(rt, rows * W)
    try:
        with _Scope(rt) as s:
            return (*produce(s, q), *q.get(rt, rows, W))
    finally:
        q.free()


def qrouted_experts(raw, wtype: str, x, ids, rt=None, gemm: bool = False):
    """The backend's quantised routed experts: raw (E, N, row bytes) GGUF blocks, x (L, K) or
    (L, kk, K) (one input per choice), ids (L, kk) -> (L, kk, N), each expert product canon.qlinear's.
    gemm: the grouped GEMM of prompt passes (step_expert_tiles, ds4_qexperts_gemm_*) at any L, in
    place of the dp4a walk (ds4_qexperts_*)."""
    rt = _rt(rt)
    x, ids = _f32(x), np.ascontiguousarray(ids, np.int32)
    L, kk = ids.shape
    E, N = raw.shape[0], raw.shape[1]
    K = weight_cols(raw, wtype)
    per_choice = x.ndim == 3
    P, xs, slots, idp = _padded_expert_inputs(x, ids, K)
    packed = pack_qrows(wtype, np.ascontiguousarray(raw, np.uint8).reshape(E * N, -1)).reshape(E, N, -1)
    rows = P * (kk if per_choice else 1)
    q = Q8Rows.alloc(rt, rows * K)
    try:
        with _Scope(rt) as s:
            y = s.out((P, kk, N))
            elist = s.out((expert_list_ints(E, kk, P),), I32)
            launch_expert_list(rt, s.up(idp), s.up(slots), P, kk, E, elist)
            launch_quantize_q8(rt, s.up(xs), q, rows, K)
            if gemm:
                tiles = s.out((expert_tiles_ints(E, kk, P),), I32)
                launch_expert_tiles(rt, elist, tiles)
                launch_qexperts_gemm(rt, s.up(packed), wtype, q, 1 if per_choice else 0, elist, tiles, y, N, K, kk,
                                     P, E)
            else:
                launch_qexperts(rt, s.up(packed), wtype, q, 1 if per_choice else 0, elist, y, N, K, kk)
            return s.get(y, (P, kk, N))[:L]
    finally:
        q.free()
