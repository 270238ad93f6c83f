"""The op-case table: every GPU op the backend runs, with its reference twin, shapes and timings.

Like llama.cpp's test-backend-ops, one table drives two modes:

* test mode (tests/gpu/test_ops_gpu.py, `pytest -m gpu`): for each case, hypothesis draws a
  seed, a row count (a decode pass: 1-16 lanes; a prompt pass: up to 256 rows; a whole pass: up
  to launch.LARGEST_PASS rows, for the kernels that take a pass in one block) and one value
  of each of the case's parameters; `make` builds the inputs, and the ds4ref.harness.twins wrapper of the launcher
  and its ds4ref.reference twin must agree bit for bit (`compare`);
* perf mode (`python -m ds4ref.harness.op_cases --out FILE`, or benchmarks/ops_gpu.py): each
  case's `perf` times the device-level launches at DS4 Flash sizes against the
  memory-bandwidth floor.

A case: name; the kernels it runs (a test checks the table covers every kernel the
backend launches); `gpu` (a wrapper of ds4ref/harness/twins.py: numpy in, numpy out) and `ref` (the
reference twin, or a small adapter when the reference spells the op differently); `params`
(name -> the values drawn from); `rows` (which row counts: "decode", "prompt", "pass" or "one" for
an op without lanes); `make(seed, rows, **params)` -> (gpu args, ref args[, gpu keywords]), or
None to reject the draw; `compare` ("bits": equal float32 bits, NaN included; "bits, any NaN": NaN
where the reference has NaN, whatever its payload, and equal bits elsewhere — for ops whose
arithmetic makes NaNs, as IEEE-754 leaves a made NaN's payload to the hardware: x86 passes an
operand's on, NVIDIA returns its canonical NaN; "equal": np.array_equal);
`perf(bench, L)` or None.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..backend import DECODE_LANES
from ..hip import launch as K
from ..hip import layouts
from ..hip.device_state import ROW_F32, ROW_IX, ROW_KV
from ..hip.runtime import get_runtime
from ..numerics import canon
from ..reference import ops as ref
from . import twins as g

F32, I32 = np.float32, np.int32
LANE_ROWS = (17, 40, 129, 256)  # prompt-pass row counts beside 1..16: lane groups, partial groups
# whole passes past 1,024 rows, step_expert_list's chunk of lanes at Flash's 256 experts, up to the largest
PASS_ROWS = (1025, 2048, K.LARGEST_PASS)
QUANTS = ("q2_k", "q4_k", "iq2_xxs", "mxfp4")


@dataclass(frozen=True)
class OpCase:
    name: str
    kernels: tuple[str, ...]
    gpu: Callable[..., Any]
    ref: Callable[..., Any]
    make: Callable[..., Any]
    params: dict[str, Any] = field(default_factory=dict)
    rows: str = "decode"
    compare: str = "bits"
    perf: Callable[..., None] | None = None


# ---- inputs ------------------------------------------------------------------------------

def rnd(seed, *shape, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(F32)


def make_weight(seed, n, k, wtype):
    """(what the kernel reads, its exact float32 value) for a random (n, k) weight."""
    w = rnd(seed, n, k, scale=1.0 / math.sqrt(k))
    if wtype == "f32":
        return w, w
    if wtype == "f16":
        w16 = w.astype(np.float16)
        return w16, w16.astype(F32)
    if wtype == "bf16":
        b = layouts.f32_to_bf16_bits(w)
        return b, layouts.bf16_bits_to_f32(b)
    if wtype == "q8_0":
        raw = layouts.quantize_q8_0(w)
        return raw, layouts.dequantize_q8_0(raw)
    from ..gguf.tiny import random_blocks
    raw = random_blocks(np.random.default_rng(seed), wtype.upper(), (n, k), 1.0 / math.sqrt(k)).data
    return raw, layouts.dequantize(raw, wtype)


def canon_qlinear(x, raw, wtype):
    from ..gguf.quant_codes import quant_codes
    return canon.qlinear(x, quant_codes(wtype.upper(), raw))


def paged_lanes(rng, L, W, ratio, per, history) -> K.PagedLanes:
    """A pass of L lanes over a small paged state: slots own runs of consecutive lanes at
    consecutive positions (a prompt's rows, or one decode row), padding lanes (slot -1) after
    them; each slot's pages are a random permutation, its pass starting at a position below `history`."""
    n_pad = int(rng.integers(0, max(1, L // 4) + 1)) if L > 1 else 0
    counts, left = [], L - n_pad
    while left:
        c = int(rng.integers(1, left + 1)) if rng.random() < 0.5 else 1
        counts.append(c)
        left -= c
    slots = len(counts)
    start = rng.integers(0, history, slots)
    maxp = int((start.max() + L) // ratio // per + 1)
    btab = rng.permutation(slots * maxp).reshape(slots, maxp).astype(I32)
    slot, pos, pstart, flane = (np.full(L, -1, I32) for _ in range(4))
    lane = 0
    for s, c in enumerate(counts):
        for i in range(c):
            slot[lane + i], pos[lane + i], pstart[lane + i], flane[lane + i] = s, start[s] + i, start[s], lane
        lane += c
    pos[slot < 0] = 0
    nvis = np.where(slot >= 0, (pos + 1) // ratio, 0).astype(I32)
    return K.PagedLanes(slot, pos, pstart, flane, nvis, btab, per)


def paged_keys(lanes: K.PagedLanes, l, pass_kv, ring, store, sel):
    """The keys lane l attends to, in the canonical order: its raw positions oldest first (this
    pass's rows from pstart on, the ring's before), then its visible compressed rows."""
    s, p, W = lanes.slot[l], lanes.pos[l], ring.shape[1]
    raw = [pass_kv[lanes.flane[l] + q - lanes.pstart[l]] if q >= lanes.pstart[l] else ring[s, q % W]
           for q in range(max(0, p - W + 1), p + 1)]
    rows = []
    if store is not None:
        n = lanes.nvis[l]
        idx = range(n) if sel is None else sel[l][:min(n, sel.shape[1])]
        rows = [store[lanes.btab[s, r // lanes.per], r % lanes.per] for r in idx]
    return np.array(raw + rows, F32).reshape(-1, ring.shape[2])


def ref_attention_paged(q, pass_kv, ring, store, sel, ksel, lanes, sinks, kind=0, n_rot=0, rope=None, q8=False):
    out = np.zeros(q.shape, F32)
    for l in range(q.shape[0]):
        if lanes.slot[l] >= 0:
            out[l] = ref.attention_with_sinks(q[l], paged_keys(lanes, l, pass_kv, ring, store, sel), sinks)
        if rope is not None:  # the backend's inverse RoPE of the output, padding lanes' zeros too
            cs = rope[lanes.pos[l]]
            out[l] = ref.rope(out[l], cs[:, 0], cs[:, 1], inverse=True)
    return (out, *canon.quantize_q8(out.reshape(len(out), -1))) if q8 else out


def ref_indexer_paged(qi, wraw, scale, store, lanes, ncap, kind=0):
    out = np.full((qi.shape[0], ncap), -np.inf, F32)
    for l in range(qi.shape[0]):
        if lanes.slot[l] >= 0 and lanes.nvis[l]:
            s, n = lanes.slot[l], lanes.nvis[l]
            keys = np.array([store[lanes.btab[s, r // lanes.per], r % lanes.per] for r in range(n)], F32)
            out[l, :n] = ref.indexer_scores(qi[l], wraw[l] * F32(scale), keys)
    return out


def _compact_rows(rows, kind, n_rot):
    """Random rows the compact form stores exactly: fp8sim rows (KV), qat rows (indexer)."""
    if kind == ROW_KV:
        return ref.fp8sim(rows, n_rot)
    if kind == ROW_IX:
        return ref.qat(rows, ref.hadamard(rows.shape[-1], F32))
    return rows


def make_attention(seed, L, H, D, W, store, kind, span=1, epilogue="none"):
    """epilogue: what the combine adds to the output ("rope": the inverse RoPE, "rope+q8": and
    its int8 rows)."""
    n_rot = 64 if kind == ROW_KV else 0
    if kind == ROW_KV and (D - n_rot) % 64:
        return None
    rng = np.random.default_rng(seed)
    ratio, per = (4, 8) if store == "selected" else (128, 2) if store == "all" else (4, 8)
    # the ring wraps, pages fill; span 40 gives an unselected store's lanes several slices of keys
    lanes = paged_lanes(rng, L, W, ratio, per, span * (3 * W + 2 * ratio * per))
    q = rnd(seed, L, H, D, scale=0.2)
    pass_kv = _compact_rows(rnd(seed + 1, L, D), kind, n_rot)  # the pass's rows, as official numerics store them
    ring = _compact_rows(rnd(seed + 2, lanes.btab.shape[0], W, D), kind, n_rot)
    pages = None if store == "none" else _compact_rows(rnd(seed + 3, lanes.btab.size, per, D), kind, n_rot)
    sel, ksel = None, 0
    if store == "selected":
        ksel = int(rng.integers(1, 9))
        sel = np.full((L, ksel), -1, I32)
        for l in range(L):
            n = lanes.nvis[l]
            pick = np.arange(n) if n <= ksel else np.sort(rng.choice(n, ksel, replace=False))
            sel[l, :len(pick)] = pick
    sinks = rnd(seed + 4, H)
    rope = None
    if epilogue != "none":
        r = n_rot or 16
        cos, sin = ref.rope_cos_sin(ref.rope_omega(r, 10000.0, (16.0, 65536, 32.0, 1.0)),
                                    np.arange(max(lanes.pos) + 1), F32)
        rope = np.stack([cos, sin], axis=-1)
    args = (q, pass_kv, ring, pages, sel, ksel, lanes, sinks, kind, n_rot, rope, epilogue == "rope+q8")
    return args, args


def make_indexer(seed, L, Hi, Di, kind):
    rng = np.random.default_rng(seed)
    per = 16
    lanes = paged_lanes(rng, L, 1, 4, per, 2400)  # up to ~600 visible index rows
    qi, wraw = rnd(seed, L, Hi, Di), rnd(seed + 1, L, Hi)
    store = _compact_rows(rnd(seed + 2, lanes.btab.size, per, Di), kind, 0)
    ncap = int(max(lanes.nvis.max(), 1) + rng.integers(0, 40))
    args = (qi, wraw, 1.0 / math.sqrt(Hi * Di), store, lanes, ncap, kind)
    return args, args


def make_rope(seed, rows, heads, nope, n_rot, inverse):
    v = rnd(seed, rows, heads, nope + n_rot)
    pos = np.random.default_rng(seed).integers(0, 1 << 20, rows)
    cos, sin = ref.rope_cos_sin(ref.rope_omega(n_rot, 10000.0, (16.0, 65536, 32.0, 1.0)), pos, F32)
    # the device reads the table by position: here row i of the table is lane i's position
    table = np.stack([cos, sin], axis=-1)
    return (v, table, np.arange(rows), inverse), (v, cos[:, None, :], sin[:, None, :], inverse)


def make_norm_rope(seed, rows, heads, nope, n_rot, wscale, inverse, fp8):
    """rmsnorm's rows then make_rope's table and positions (fp8: the non-RoPE dims in blocks of 64).
    The weight's scale (0: rms0, no weight) spreads the FP8 blocks' scales over their range."""
    (v, table, pos, _), (_, cos, sin, _) = make_rope(seed, rows, heads, nope, n_rot, inverse)
    x = v * F32(3.0)
    w = rnd(seed + 1, nope + n_rot, scale=wscale) if wscale else None
    return (x, w, 1e-6, table, pos, inverse, fp8), (x, w, 1e-6, cos, sin, inverse, fp8)


def ref_norm_rope(x, w, eps, cos, sin, inverse, fp8):
    y = ref.rmsnorm(x, w, eps) if w is not None else ref.rms0(x, eps)
    y = ref.rope(y, cos, sin, inverse)
    return ref.fp8sim(y, 2 * cos.shape[-1]) if fp8 else y


def make_topk(seed, L, ncap, k, n_levels):
    rng = np.random.default_rng(seed)
    if n_levels:  # scores from few distinct values: many exact ties
        scores = rng.integers(0, n_levels, (L, ncap)).astype(F32) * F32(0.25) - F32(3.0)
    else:
        scores = rng.standard_normal((L, ncap)).astype(F32)
    scores[rng.random((L, ncap)) < 0.05] = -np.inf
    nvalid = rng.integers(0, ncap + 1, L).astype(I32)
    return (scores, nvalid, k), (scores, nvalid, k)


def ref_topk(scores, nvalid, k):
    out = np.full((len(scores), k), -1, I32)
    for l in range(len(scores)):
        want = ref.topk_lower_index(scores[l, :nvalid[l]], k)
        out[l, :len(want)] = want
    return out


def make_experts(seed, L, E, kk, shape, down, wtype, weight=make_weight):
    if kk > E:
        return None
    N, K = shape
    rng = np.random.default_rng(seed)
    mats = [weight(seed + 10 * e, N, K, wtype) for e in range(E)]
    ids = np.stack([np.sort(rng.choice(E, kk, replace=False)) for _ in range(L)]).astype(I32)
    x = rnd(seed + 1, L, kk, K) if down else rnd(seed + 1, L, K)
    return (np.stack([m[0] for m in mats]), wtype, x, ids), (mats, wtype, x, ids)


def ref_experts(mats, wtype, x, ids, product=lambda xi, m, wtype: ref.linear(xi, m[1], split=False)):
    L, kk = ids.shape
    return np.stack([np.stack([product(x[l, t] if x.ndim == 3 else x[l], mats[ids[l, t]], wtype)
                               for t in range(kk)]) for l in range(L)])


def ref_qexperts(mats, wtype, x, ids):
    """ref_experts with canon.qlinear's product, each expert's pairs in one call: an output depends
    on its own input row only (docs/exactness.md §2a), and a whole pass's pairs stay quick."""
    L, kk = ids.shape
    y = np.full((L, kk, mats[0][0].shape[0]), np.nan, F32)
    for e in np.unique(ids):
        ls, ts = np.nonzero(ids == e)
        y[ls, ts] = canon_qlinear(x[ls, ts] if x.ndim == 3 else x[ls], mats[e][0], wtype)
    return y


def _quant_weight(seed, n, k, wtype):
    raw = make_weight(seed, n, k, wtype)[0]
    return raw, raw


def make_quantize(seed, rows, kb, scale, special):
    x = rnd(seed, rows, 32 * kb, scale=scale)
    if special != "none":  # a whole block of zeros, or one non-finite value in a block
        x[0, 32:64] = 0.0 if special == "zero" else x[0, 32:64]
        if special in ("inf", "nan") and x.shape[1] > 40:
            x[0, 40] = np.inf if special == "inf" else np.nan
    return (x,), (x,)


def make_rmsnorm_q8(seed, rows, D, weighted, scale):
    args = (rnd(seed, rows, D, scale=scale), rnd(seed + 1, D) if weighted else None, 1e-6)
    return args, args


def ref_rmsnorm_q8(x, w, eps):
    y = ref.rmsnorm(x, w, eps) if w is not None else ref.rms0(x, eps)
    return (y, *canon.quantize_q8(y))


def make_swiglu_act_q8(seed, rows, kb, clamp, special):
    gate, up = rnd(seed, rows, 32 * kb, scale=4.0), rnd(seed + 1, rows, 32 * kb, scale=4.0)
    if special == "zero":
        gate[0, :32] = 0.0
    elif special == "nan":  # a NaN passes the clamps, as in NumPy
        up[-1, -1] = gate[0, 0] = np.nan
    return (gate, up, clamp), (gate, up, clamp)


def ref_swiglu_act_q8(gate, up, clamp):
    h = gate.copy()
    canon._swiglu_act(h, up.copy(), F32(clamp))
    return (h, *canon.quantize_q8(h))


def make_grouped(seed, N, groups, hpg, D, rank, wtype):
    if (groups * rank) % 8:
        return None  # wo_b's K must be a multiple of 8
    H, d = groups * hpg, 64
    o = rnd(seed, N, H, D)
    wa, waf = make_weight(seed + 1, groups * rank, hpg * D, wtype)
    wb, wbf = make_weight(seed + 2, d, groups * rank, wtype)
    return (o, wa, wb, groups, wtype, wtype), (o, waf, wbf, groups)


def make_joint(seed, L, G, n, kb, wtype):
    """G matrices of one shape read by one input (the compressor's kv and gate, the shared
    expert's gate and up); n rows past 64 (64 or fewer with K >= 2048 are K-split, run alone)."""
    k = 32 * kb if layouts.BLOCK_QUANTS.get(wtype, (0, 32))[1] == 32 else 256 * max(1, kb // 8)
    made = [make_weight(seed + i, n, k, wtype) for i in range(G)]
    x = rnd(seed + G, L, k)
    return ([w for w, _ in made], x, wtype), (made, x, wtype)


def ref_joint(made, x, wtype):
    """Each product alone: the quantised ones canon.qlinear's of the GGUF rows, the rest linear."""
    if wtype in layouts.QUANT_WTYPES:
        return tuple(canon_qlinear(x, w, wtype) for w, _ in made)
    return tuple(ref.linear(x, wf) for _, wf in made)


def make_hc_pre(seed, N, hc, d, iters):
    mix = 2 * hc + hc * hc
    s = rnd(seed, N, hc, d)
    fn = rnd(seed + 1, mix, hc * d, scale=0.05)
    base, scale = rnd(seed + 2, mix, scale=0.5), np.abs(rnd(seed + 3, 3)) + 0.5
    args = (s, fn, base, scale, 1e-6, 1e-6, iters)
    return args, args


def make_swiglu(seed, L, ff, d, clamp, wtype):
    x = rnd(seed, L, d, scale=2.0)
    (w1, w1f), (w3, w3f), (w2, w2f) = (make_weight(seed + i, *s, wtype) for i, s in
                                        ((1, (ff, d)), (2, (ff, d)), (3, (d, ff))))
    return (x, w1, w3, w2, clamp, wtype), (x, w1f, w3f, w2f, clamp)


def make_argmax(seed, L, V, dup):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((L, V)).astype(F32)
    if dup and V > 1:  # copy each row's max to a few other places: the lower index must win
        for l in range(L):
            x[l, rng.integers(0, V, 3)] = x[l].max()
    return (x,), (x,)


def make_route(seed, rows, E, k, use_bias, use_hash, normalise):
    rng = np.random.default_rng(seed)
    logits = rnd(seed, E, scale=2.0)
    bias = rnd(seed + 1, E, scale=0.1) if use_bias else np.zeros(E, F32)
    hash_ids = rng.choice(E, k, replace=False) if use_hash else None
    args = (logits, k, bias, hash_ids, 1.5, normalise)
    return args, args


def make_pool(seed, R, C, D, p_inf):
    rng = np.random.default_rng(seed)
    kv, score = rnd(seed, R, C, D), rnd(seed + 1, R, C, D, scale=3.0)
    score[rng.random((R, C, D)) < p_inf] = -np.inf
    return (kv, score), (kv, score)


def make_markov_gather(seed, rows, V, d, wtype):
    """A (V, d) table in `wtype` and rows ids, some out of range (an argmax's -2 for a non-finite row)."""
    stored, value = make_weight(seed, V, d, wtype)
    tok = np.random.default_rng(seed).integers(-3, V + 3, rows).astype(I32)
    return (stored, wtype, tok), (value, tok)


def ref_markov_gather(value, tok):
    return value[np.where((tok >= 0) & (tok < value.shape[0]), tok, 0)]


def _same_args(fn):
    def make(seed, rows, **p):
        args = fn(seed, rows, **p)
        return args, args
    return make


# ---- perf mode: device-level launches at DS4 Flash sizes -------------------------------------

L2_BYTES = 64 << 20  # rotate weight copies until a replay touches more than ~4x L2


def median_ms(rt, fn, repeats=15):
    a, b = rt.event(), rt.event()
    ts = []
    for _ in range(repeats):
        rt.record(a)
        fn()
        rt.record(b)
        ts.append(rt.elapsed_ms(a, b))
    return statistics.median(ts)


def copy_bandwidth(rt, nbytes=1 << 30):
    src, dst = rt.malloc(nbytes), rt.malloc(nbytes)
    rt.memset32(src, 0x3F800000, nbytes // 4)
    for _ in range(3):
        rt.d2d(dst, src, nbytes)
    ms = median_ms(rt, lambda: rt.d2d(dst, src, nbytes), 10)
    src.free()
    dst.free()
    return 2 * nbytes / (ms * 1e-3)


def time_op(rt, variants, reps=20):
    """variants: zero-argument launchers over rotating input copies -> µs per call (graph replay)."""
    for v in variants:  # eager warm-up: compiles, loads modules, checks launches
        v()
    rt.synchronize()
    rt.begin_capture()
    for i in range(reps):
        variants[i % len(variants)]()
    graph = rt.end_capture()
    for _ in range(3):
        rt.replay(graph)
    return median_ms(rt, lambda: rt.replay(graph)) * 1e3 / reps


class Bench:
    def __init__(self, rt, bw):
        self.rt, self.bw, self.rows, self.keep = rt, bw, [], []
        self.rng = np.random.default_rng(0)
        self._host: dict = {}

    def up(self, arr):
        b = self.rt.upload(arr)
        self.keep.append(b)
        return b

    def out(self, shape, dtype=F32):
        b = g.poisoned(self.rt, shape, dtype)
        self.keep.append(b)
        return b

    def rnd(self, *shape, scale=1.0):
        return (self.rng.standard_normal(shape) * scale).astype(F32)

    def add(self, name, L, nbytes, variants, note=""):
        floor = nbytes / self.bw * 1e6
        try:
            us = time_op(self.rt, variants)
        except Exception as e:  # noqa: BLE001 - report and keep timing the rest
            print(f"FAILED {name} L={L}: {e}", file=sys.stderr)
            self.rows.append((name, L, float("nan"), nbytes, floor, "FAILED: " + str(e)[:60]))
            return
        self.rows.append((name, L, us, nbytes, floor, note))
        print(f"{name:40s} L={L:3d} {us:9.2f} us  floor {floor:8.2f} us  {floor / us * 100:5.1f}%", flush=True)

    def weights(self, rows, cols, wtype, total_cap=512 << 20):
        """Rotating device copies of one random weight, enough to defeat L2 -> (copies, bytes)."""
        key = (rows, cols, wtype)
        if key not in self._host:  # made once, reused for every lane count
            self._host[key] = make_weight(0, rows, cols, wtype)[0]
        w = self._host[key]
        n = max(1, min(8, -(-4 * L2_BYTES // w.nbytes), total_cap // w.nbytes))
        out = []
        for _ in range(n):
            dw = layouts.DeviceWeight.upload(self.rt, w, wtype)
            self.keep.append(dw.buf)
            out.append(dw)
        return out, w.nbytes

    def free(self):
        for b in self.keep:
            b.free()
        self.keep = []


MATVEC_SHAPES = [("matvec bf16 4096x4096", 4096, 4096, "bf16"),
                 ("attn_q_a q8_0 1024x4096", 1024, 4096, "q8_0"),
                 ("attn_q_b q8_0 32768x1024", 32768, 1024, "q8_0"),
                 ("attn_kv q8_0 512x4096", 512, 4096, "q8_0"),
                 ("attn_output_b q8_0 4096x8192", 4096, 8192, "q8_0"),
                 ("compressor_kv f16 1024x4096", 1024, 4096, "f16"),
                 ("router f16 256x4096", 256, 4096, "f16"),
                 ("shexp gate q8_0 2048x4096", 2048, 4096, "q8_0"),
                 ("output q8_0 129280x4096", 129280, 4096, "q8_0")]
RPWS = (None, 1, 2, 4)  # None: the shipped policy; else the rows per warp forced


def perf_matvec(b, L):
    rt, policy = b.rt, K.matvec_rows_per_warp
    for name, n, k, wt in MATVEC_SHAPES:
        ws, wbytes = b.weights(n, k, wt)
        x, y = b.up(b.rnd(L, k)), b.out((L, n))
        for rpw in RPWS:
            if rpw:  # as DS4REF_MATVEC_RPW would force it (launch_matvec looks the policy up per call)
                K.matvec_rows_per_warp = lambda rt, rows, L=16, r=rpw: r
            try:
                b.add(f"{name} [{f'r{rpw}' if rpw else 'policy'}]", L, wbytes + 4 * L * (k + n),
                      [lambda w=w: K.launch_matvec(rt, w, x, y, L) for w in ws], f"{len(ws)} weight copies")
            finally:
                K.matvec_rows_per_warp = policy


def perf_grouped(b, L):
    """attn_output_a: 8 groups x 1024 rows, 4096 inputs each."""
    ws, wbytes = b.weights(8 * 1024, 4096, "q8_0")
    x, y = b.up(b.rnd(L, 8 * 4096)), b.out((L, 8 * 1024))
    b.add("attn_output_a grouped q8_0 8x1024x4096", L, wbytes + 4 * L * (8 * 4096 + 8192),
          [lambda w=w: K.launch_matvec(b.rt, w, x, y, L, groups=8, ldx=8 * 4096, xg=4096, ldy=8192) for w in ws])


def _flash_routing(b, L):
    """Flash's routed-expert shape (256 experts of 2048 x 4096, top 6) with distinct random ids
    for L lanes among the backend's 16: (E, kk, ff, d, lanes, a launcher of step_expert_list that
    returns its list, experts touched)."""
    E, kk, ff, d = 256, 6, 2048, 4096
    P = max(L, DECODE_LANES)
    ids = np.stack([b.rng.choice(E, kk, replace=False) for _ in range(P)]).astype(I32)
    slot = np.where(np.arange(P) < L, np.arange(P), -1).astype(I32)
    idb, slb = b.up(ids), b.up(slot)
    elist = b.out((K.expert_list_ints(E, kk, P),), I32)

    def make_list():
        K.launch_expert_list(b.rt, idb, slb, P, kk, E, elist)
        return elist
    return E, kk, ff, d, P, make_list, len(np.unique(ids[:L]))


def perf_experts(b, L):
    """step_expert_list + step_experts3 at Flash dims: 256 experts of 2048 x 4096 (gate/up) and
    4096 x 2048 (down), bf16, top-6 distinct random ids per lane; only the chosen experts'
    bytes are counted."""
    rt = b.rt
    E, kk, ff, d, P, make_list, touched = _flash_routing(b, L)
    one = layouts.f32_to_bf16_bits(b.rnd(ff, d, scale=1 / math.sqrt(d)))
    for name, N, cols, per_choice in (("experts gate bf16 256x2048x4096", ff, d, 0),
                                   ("experts down bf16 256x4096x2048", d, ff, 1)):
        wb = b.up(np.tile(one.reshape(-1), E))  # E copies of one matrix: the bytes are what count
        x = b.up(b.rnd(P * kk if per_choice else P, cols))
        y = b.out((P * kk, N))
        for r in (1, 2, 4):
            def run(r=r, N=N, cols=cols, pc=per_choice, x=x, y=y, wb=wb):
                K.launch_routed_experts(rt, wb, "bf16", r, x, pc, make_list(), y, N, cols, kk)
            b.add(f"{name} [r{r}]", L, touched * N * cols * 2 + 4 * L * kk * (cols + N), [run],
                  f"{touched} experts touched")


def perf_qexperts(b, L):
    """step_expert_list + ds4_qexperts in the q2 policy at Flash dims: 256 experts of IQ2_XXS
    2048 x 4096 (gate) and Q2_K 4096 x 2048 (down), top-6 distinct random ids per lane; only the
    chosen experts' bytes are counted. Beside it the grouped GEMM of prompt passes
    (step_expert_tiles + ds4_qexperts_gemm; `--lanes 1024,2048,4096` for its sizes)."""
    rt = b.rt
    E, kk, ff, d, P, make_list, touched = _flash_routing(b, L)
    for name, wtype, N, cols, per_choice in (("experts gate iq2_xxs 256x2048x4096", "iq2_xxs", ff, d, 0),
                                          ("experts down q2_k 256x4096x2048", "q2_k", d, ff, 1)):
        one = layouts.pack_qrows(wtype, make_weight(0, N, cols, wtype)[0])
        wb = b.up(np.tile(one.reshape(-1), E))  # E copies of one matrix: the bytes are what count
        rows = P * kk if per_choice else P
        q = K.Q8Rows.alloc(rt, rows * cols)
        b.keep += [q.xq, q.dx, q.xs]
        x, y = b.up(b.rnd(rows, cols)), b.out((P * kk, N))

        tiles = b.out((K.expert_tiles_ints(E, kk, P),), I32)

        def run(N=N, cols=cols, pc=per_choice, x=x, y=y, wb=wb, q=q, wtype=wtype, rows=rows, gemm=False):
            elist = make_list()
            K.launch_quantize_q8(rt, x, q, rows, cols)
            if gemm:
                K.launch_expert_tiles(rt, elist, tiles)
                K.launch_qexperts_gemm(rt, wb, wtype, q, pc, elist, tiles, y, N, cols, kk, P, E)
            else:
                K.launch_qexperts(rt, wb, wtype, q, pc, elist, y, N, cols, kk)
        for gemm in (False, True):
            b.add(name + (" [grouped gemm]" if gemm else ""), L, touched * one.nbytes + 4 * L * kk * (cols + N),
                  [lambda run=run, gemm=gemm: run(gemm=gemm)], f"{touched} experts touched")


def perf_rmsnorm(b, L):
    d = 4096
    x, y, w = b.up(b.rnd(L, d)), b.out((L, d)), b.up(b.rnd(d))
    b.add("rmsnorm 4096", L, 4 * (2 * L * d + d), [lambda: K.launch_rmsnorm(b.rt, x, w, y, L, d, 1e-6)])


def perf_hc_pre(b, L):
    """The projection (24 x 16384 f32, K-split) and the Sinkhorn finish, hc = 4."""
    rt, d, hc = b.rt, 4096, 4
    mixn = 2 * hc + hc * hc
    fws, fbytes = b.weights(mixn, hc * d, "f32", total_cap=64 << 20)
    st, mix = b.up(b.rnd(L, hc, d)), b.out((L, mixn))
    base, scale = b.up(b.rnd(mixn)), b.up(np.ones(3, F32))
    u, post, comb = b.out((L, d)), b.out((L, hc)), b.out((L, hc, hc))
    part = b.out((K.ksplit_floats(mixn, hc * d, L) or 1,))

    def run(fw):
        K.launch_matvec(rt, fw, st, mix, L, part=part)
        K.launch_hc_pre_finish(rt, st, mix, base, scale, hc, d, 1e-6, 1e-6, 20, u, post, comb, L)
    b.add("hc_pre (K-split proj + sinkhorn) hc=4", L, fbytes + 4 * L * (2 * hc * d + d),
          [lambda fw=fw: run(fw) for fw in fws])


def perf_norm_rope(b, L):
    """q's rms0 and RoPE (64 heads x 512, the last 64 dims rotated), then the KV row's rmsnorm,
    RoPE and FP8 round trip."""
    H, D, half = 64, 512, 32
    pos, cs = b.up(np.arange(L, dtype=I32)), b.up(b.rnd(L, half, 2))
    q, qo, w = b.up(b.rnd(L, H, D)), b.out((L, H, D)), b.up(b.rnd(D))
    b.add("norm_rope q 64h x 512", L, 4 * 2 * L * H * D,
          [lambda: K.launch_norm_rope(b.rt, q, None, qo, L, H, D, 1e-6, pos, cs, half)])
    b.add("norm_rope kv 512 + fp8", L, 4 * (2 * L * D + D),
          [lambda: K.launch_norm_rope(b.rt, q, w, qo, L, 1, D, 1e-6, pos, cs, half, fp8=True)])


def perf_rope(b, L):
    """q of 64 heads x 512, the last 64 dims rotated, positions read on the device."""
    H, D, half = 64, 512, 32
    v, pos, cs = b.up(b.rnd(L, H, D)), b.up(np.arange(L, dtype=I32)), b.up(b.rnd(L, half, 2))
    k = K.kernel(b.rt, "step_ops", "step_rope_pos")
    b.add("rope_pos 64h x 512 (64 rotated)", L, 4 * L * H * 2 * 2 * half,
          [lambda: b.rt.launch(k, (K._blocks(L * H * half, 256),), (256,),
                               (v, pos, cs, I32(L), I32(H), I32(D), I32(half), I32(0)))])


def perf_attention(b, L):
    """64 heads x 512, each lane a slot at position 8191: a 128-row ring and 512 of its 2048
    ratio-4 compressed rows selected by the indexer, float32 rows."""
    rt = b.rt
    H, D, W, ksel, per, ratio, p = 64, 512, 128, 512, 32, 4, 8191
    nvis = (p + 1) // ratio
    maxp = -(-nvis // per)
    slot, pos = np.arange(L, dtype=I32), np.full(L, p, I32)
    btab = np.arange(L * maxp, dtype=I32).reshape(L, maxp)
    q, kv, sinks = b.up(b.rnd(L, H, D, scale=0.1)), b.up(b.rnd(L, D)), b.up(b.rnd(H))
    ring, store = b.up(b.rnd(L, W, D)), b.up(b.rnd(L * maxp, per, D))
    sel = b.up(np.stack([np.sort(b.rng.choice(nvis, ksel, replace=False)) for _ in range(L)]).astype(I32))
    lane = [b.up(a) for a in (slot, pos, pos, slot, np.full(L, nvis, I32))]  # slot pos pstart flane nvis
    nz = K._blocks(W + ksel, K.AT_SPLIT)
    m, den, acc, out, bt = b.out((L, H, nz)), b.out((L, H, nz)), b.out((L, H, nz, D)), b.out((L, H, D)), b.up(btab)
    rope, q8 = b.up(b.rnd(p + 1, 32, 2)), K.Q8Rows.alloc(rt, L * H * D)  # the backend's epilogue
    b.keep += [q8.xq, q8.dx, q8.xs]

    def run():
        K.launch_attention_split(rt, H, L, nz,
                                 (q, kv, ring, np.int64(W * D * 4), store, I32(0), I32(64), bt, I32(maxp), I32(per), sel, I32(ksel),
                                  *lane, I32(H), I32(D), I32(W), F32(1 / math.sqrt(D)), m, den, acc))
        K.launch_attention_combine(rt, m, den, acc, sinks, lane[0], lane[1], store, lane[4], sel, ksel, W, H, D, nz,
                                   out, L, rope=rope, half=32, q8=q8)
    b.add("attention paged 64h x 512, 128 ring + 512 sel (+ rope, int8 rows)", L,
          4 * L * ((W + ksel) * D + 2 * H * D), [run])


def perf_indexer(b, L):
    """Scores over 8192 index rows (32K tokens), 64 heads x 128, float32 rows; then top-512."""
    rt = b.rt
    n, Hi, Di, per = 8192, 64, 128, 32
    maxp = n // per
    qi, wr = b.up(b.rnd(L, Hi, Di)), b.up(b.rnd(L, Hi))
    store, bt = b.up(b.rnd(L * maxp, per, Di)), b.up(np.arange(L * maxp, dtype=I32).reshape(L, maxp))
    slot, nv = b.up(np.arange(L, dtype=I32)), b.up(np.full(L, n, I32))
    sc, ids = b.out((L, n)), b.out((L, 512), I32)
    kix, ktk = K.kernel(rt, "step_state", "step_indexer_paged"), K.kernel(rt, "indexer", "ds4_topk")
    b.add("indexer paged 8192 rows, 64h x 128", L, 4 * L * (n * Di + n + Hi * Di),
          [lambda: rt.launch(kix, (min(K._blocks(n, 8), 128), L), (256,),
                             (qi, wr, F32(0.01), store, I32(0), bt, I32(maxp), I32(per), slot, nv, sc, I32(Hi), I32(Di),
                              I32(n)))])
    b.add("top-512 of 8192", L, 4 * L * (n + 512),
          [lambda: rt.launch(ktk, (L,), (512,), (sc, nv, I32(n), I32(512), ids))])


def perf_pool(b, L):
    D, k = 512, K.kernel(b.rt, "pool", "ds4_pool_window")
    for C in (8, 128):  # ratio 4 (with the previous window's overlap lane), ratio 128
        kv, s, o = b.up(b.rnd(L, C, D)), b.up(b.rnd(L, C, D)), b.out((L, D))
        b.add(f"pool_window C={C} D=512", L, 4 * L * (2 * C * D + D),
              [lambda kv=kv, s=s, o=o, C=C: b.rt.launch(k, (K._blocks(D, 32), L), (256,),
                                                        (kv, s, o, I32(L), I32(C), I32(D)))])


def perf_qat(b, L):
    """The indexer query's QAT: 64 heads x 128, Hadamard rotation then FP4 blocks."""
    Di, R = 128, L * 64
    hq, ho = b.up(b.rnd(R, Di)), b.out((R, Di))
    hh = b.up(np.ascontiguousarray(ref.hadamard(Di, F32).T))  # the kernel reads the table transposed
    b.add("qat 64h x 128 (hadamard + e2m1)", L, 4 * (2 * R * Di + Di * Di),
          [lambda: K.launch_qat(b.rt, hq, hh, ho, R, Di)])


def perf_route(b, L):
    lg, bias, rid, rw = b.up(b.rnd(L, 256)), b.up(b.rnd(256, scale=0.1)), b.out((L, 6), I32), b.out((L, 6))
    k = K.kernel(b.rt, "moe", "ds4_route")
    b.add("route 256 -> 6", L, 4 * L * (256 + 12),
          [lambda: b.rt.launch(k, (L,), (256,), (lg, bias, None, I32(256), I32(6), F32(1.5), I32(1), rid, rw))])


def perf_swiglu(b, L):
    ga, ua, ha = b.up(b.rnd(L, 2048)), b.up(b.rnd(L, 2048)), b.out((L, 2048))
    k = K.kernel(b.rt, "moe", "ds4_swiglu_act")
    b.add("swiglu act 2048", L, 12 * L * 2048,
          [lambda: b.rt.launch(k, (K._blocks(L * 2048, 256),), (256,), (ga, ua, ha, np.int64(L * 2048), F32(7.0)))])


def perf_argmax(b, L):
    V = 129280
    lo, am = b.up(b.rnd(L, V)), b.out((L,), I32)
    b.add("argmax 129280", L, 4 * L * V, [lambda: K.launch_argmax(b.rt, lo, am, L, V)])


# Flash's Q8_0 products in the q2 policy (the shared expert's gate and up are one joint launch)
QMATVEC_SHAPES = [("attn_q_a", 1024, 4096), ("attn_kv", 512, 4096), ("attn_q_b", 32768, 1024),
                  ("attn_output_b", 4096, 8192), ("shexp gate+up", 4096, 4096), ("shexp down", 4096, 2048)]


def perf_qmatvec(b, L):
    """Official numerics' quantised products, quantise included: the three types at 4096 x 4096,
    then Flash's Q8_0 shapes with the rows per warp and the blocks a multiprocessor forced (every
    variant gives the same bits; 0 blocks a multiprocessor: one block a row block)."""
    rt = b.rt
    cases = [(f"qmatvec {wtype} 4096x4096 (+ quantize)", wtype, 4096, 4096, ((None, None),))
             for wtype in ("q8_0", "q2_k", "iq2_xxs")]
    cases += [(f"qmatvec {name} q8_0 {n}x{k} (+ quantize)", "q8_0", n, k, ((1, 0), (2, 0), (2, 2), (2, 4)))
              for name, n, k in QMATVEC_SHAPES]
    for label, wtype, n, k, variants in cases:
        packed = layouts.pack_qrows(wtype, make_weight(0, n, k, wtype)[0])
        copies = max(1, min(8, -(-4 * L2_BYTES // packed.nbytes)))
        dws = [layouts.DeviceWeight(b.up(packed), wtype, n, k, packed=True) for _ in range(copies)]
        q = K.Q8Rows.alloc(rt, L * k)
        b.keep += [q.xq, q.dx, q.xs]
        x, y = b.up(b.rnd(L, k)), b.out((L, n))
        for gemm in (False, True) if L > K.MMA_ROWS else (False,):
            for rpw, per_sm in variants if not gemm else ((None, None),):
                def run(dw, q=q, x=x, y=y, gemm=gemm, k=k, rpw=rpw, per_sm=per_sm):
                    K.launch_quantize_q8(rt, x, q, L, k)
                    K.launch_qmatvec(rt, dw, q, y, L, gemm=gemm, rows_per_warp=rpw, blocks_per_sm=per_sm)
                tag = " [qgemm]" if gemm else f" [r{rpw}{f', {per_sm}/SM' if per_sm else ''}]" if rpw else ""
                b.add(label + tag, L, packed.nbytes + 4 * L * (k + n),
                      [lambda dw=dw, run=run: run(dw) for dw in dws], f"{copies} weight copies")


def _make_block_quants(seed, L, n, kb, wtype):
    """gguf-py's dequantisation and the canonical dot, K past a chunk."""
    w, wf = make_weight(seed, n, 256 * kb, wtype)
    x = rnd(seed + 1, L, 256 * kb)
    return (w, x), (x, wf), {"wtype": wtype}


def _make_matvec(seed, L, n, kb, wtype):
    w, wf = make_weight(seed, n, 32 * kb, wtype)
    x = rnd(seed + 1, L, 32 * kb)
    return (w, x), (x, wf), {"wtype": wtype}


def _make_routed(seed, L, E, kk, shape, down, wtype, rpw):
    if rpw == 4 and wtype not in K.EXPERT_R4:
        return None  # r4 is built for bf16 only
    made = make_experts(seed, L, E, kk, shape, down, wtype)
    return None if made is None else (*made, {"rows_per_warp": rpw})


def _make_qmatvec(seed, L, n, kb, wtype, max_blocks):
    """Every quantised encoding, K up to 6400 (past several staged chunks, not only whole ones);
    max_blocks 2: a block walks several row blocks (reusing staged inputs where K fits)."""
    k = 32 * kb if layouts.BLOCK_QUANTS[wtype][1] == 32 else 256 * max(1, kb // 8)
    raw = make_weight(seed, n, k, wtype)[0]
    x = rnd(seed + 1, L, k)
    return (raw, wtype, x), (x, raw, wtype), dict(max_blocks=max_blocks)


def _make_qrouted(seed, L, E, kk, shape, down, wtype):
    return make_experts(seed, L, E, kk, shape, down, wtype, weight=_quant_weight)


def _make_qrouted_gemm(seed, L, E, kk, shape, down, wtype):
    """The grouped GEMM at any L: few experts fill tiles and cross them (4 experts, 2 choices at 4,096
    rows: ~2,000 pairs an expert), many leave single pairs (256); N past a column tile or at one, K
    past 32 blocks (chains of 2 and 1) and below (empty chains)."""
    made = make_experts(seed, L, E, kk, shape, down, wtype, weight=_quant_weight)
    return None if made is None else (*made, {"gemm": True})


def make_expert_list(seed, L, E, kk, padding, repeats):
    """Routing ids of L lanes (repeats: a lane may choose an expert twice), some lanes padding."""
    rng = np.random.default_rng(seed)
    ids = (rng.integers(0, E, (L, kk)) if repeats else
           np.stack([rng.choice(E, kk, replace=kk > E) for _ in range(L)])).astype(I32)
    slots = np.where(rng.random(L) < padding, -1, np.arange(L)).astype(I32)
    return (ids, slots, E), (ids, slots, E)


def ref_expert_list(ids, slots, E):
    """The documented layout: experts ascending, each valid lane once per expert (its first choice
    of it) in lane order, EL_PAIRS pairs an entry; rows of -1 up to the list's capacity."""
    L, kk = ids.shape
    rows = []
    for e in range(E):
        chose = ids == e
        lanes = np.flatnonzero(chose.any(axis=1) & (slots >= 0))
        pairs = (lanes * kk + chose[lanes].argmax(axis=1)).tolist()  # a lane's first choice of e
        for c0 in range(0, len(pairs), K.EL_PAIRS):
            chunk = pairs[c0:c0 + K.EL_PAIRS]
            rows.append([e, len(chunk), *chunk, *[-1] * (K.EL_PAIRS - len(chunk))])
    out = np.full(((K.expert_list_ints(E, kk, L) - 1) // K.EL_STRIDE, K.EL_STRIDE), -1, I32)
    out[:len(rows)] = np.array(rows, I32).reshape(-1, K.EL_STRIDE)
    return out


def ref_expert_tiles(ids, slots, E):
    """The documented row tiles of the grouped expert GEMM: each expert's entries in runs of
    EL_TILE_ENTRIES from its first, as rows (first entry, pairs); rows of -1 up to the most tiles."""
    L, kk = ids.shape
    rows, expert, place = [], -1, 0
    for u, (e, n) in enumerate(ref_expert_list(ids, slots, E)[:, :2].tolist()):
        if e < 0:
            break
        place = place + 1 if e == expert else 0
        expert = e
        if place % K.EL_TILE_ENTRIES == 0:
            rows.append([u, 0])
        rows[-1][1] += n
    out = np.full((K.expert_tiles(E, kk, L), 2), -1, I32)
    out[:len(rows)] = np.array(rows, I32).reshape(-1, 2)
    return out


# ---- the table -----------------------------------------------------------------------------

CASES: tuple[OpCase, ...] = (
    OpCase("rmsnorm", ("ds4_rmsnorm",), g.rmsnorm,
           lambda x, w, eps: ref.rmsnorm(x, w, eps) if w is not None else ref.rms0(x, eps),
           _same_args(lambda seed, rows, D, weighted: (rnd(seed, rows, D, scale=3.0),
                                                       rnd(seed + 1, D) if weighted else None, 1e-6)),
           dict(D=[64, 100, 512, 4096], weighted=[False, True]), "prompt", perf=perf_rmsnorm),
    OpCase("rope_pos", ("step_rope_pos",), g.rope_pos, ref.rope,
           make_rope, dict(heads=range(1, 5), nope=[0, 64, 448], n_rot=[16, 64], inverse=[False, True]),
           "prompt", perf=perf_rope),
    # norm_rope and qat compare by value, as the fp8sim and E2M1 cases they took over did: equal
    # values are equal bits but for a zero's sign (the cross-backend property and the goldens
    # compare the pass's logits bit for bit)
    OpCase("norm_rope", ("ds4_norm_rope",), g.norm_rope, ref_norm_rope,
           make_norm_rope, dict(heads=[1, 3], nope=[64, 448], n_rot=[16, 64], wscale=[0, 1e-6, 1e-2, 1.0, 30.0, 400.0],
                                inverse=[False, True], fp8=[False, True]),
           "prompt", compare="equal", perf=perf_norm_rope),
    OpCase("qat", ("ds4_qat_rows",), g.qat, ref.qat,
           _same_args(lambda seed, rows, n, scale: (rnd(seed, rows, n, scale=scale), ref.hadamard(n, F32))),
           dict(n=[32, 64, 128], scale=[1e-30, 1e-3, 1.0, 1e4]), compare="equal", perf=perf_qat),
    OpCase("matvec", ("ds4_matvec3_*", "ds4_matvec3_*_ks", "ds4_matvec3_ksum"), g.matvec, ref.linear, _make_matvec,
           dict(n=range(1, 301), kb=range(1, 81), wtype=["f32", "f16", "bf16", "q8_0"]), "prompt",
           perf=perf_matvec),
    OpCase("matvec_block_quants", ("ds4_matvec3_*",), g.matvec, ref.linear,
           _make_block_quants, dict(n=range(1, 301), kb=range(1, 13), wtype=list(QUANTS))),
    OpCase("grouped_output", ("ds4_matvec3_*",), g.grouped_output, ref.grouped_output, make_grouped,
           dict(groups=[1, 2, 4], hpg=range(1, 4), D=[32, 64], rank=range(1, 41), wtype=["f32", "bf16"]),
           perf=perf_grouped),
    OpCase("joint_matvec", ("ds4_matvec3_*", "ds4_quantize_q8", "ds4_qmatvec_*", "ds4_qgemm_*"), g.joint_matvec,
           ref_joint, make_joint, dict(G=[2, 3], n=range(65, 300), kb=range(1, 81),
                                       wtype=["f32", "f16", "bf16", "q8_0", "q2_k", "iq2_xxs"]), "prompt"),
    # d = 1096 ends inside a column block of the finish; every hc * d is a multiple of 8, as the
    # f32 projection needs
    OpCase("hc_pre", ("ds4_hc_pre_finish", "ds4_matvec3_*"), g.hc_pre, ref.hc_pre, make_hc_pre,
           dict(hc=[1, 2, 4], d=[64, 256, 1096], iters=range(1, 21)), "prompt", perf=perf_hc_pre),
    OpCase("hc_post", ("ds4_hc_post",), g.hc_post, ref.hc_post,
           _same_args(lambda seed, N, hc, d: (rnd(seed, N, hc, d), rnd(seed + 1, N, d), rnd(seed + 2, N, hc),
                                              np.abs(rnd(seed + 3, N, hc, hc)))),
           dict(hc=[1, 2, 4], d=[64, 4096])),
    OpCase("add_rows", ("step_add_rows",), g.add_rows, lambda a, b: a + b[:, None],
           _same_args(lambda seed, L, hc, d: (rnd(seed, L, hc, d), rnd(seed + 1, L, d))),
           dict(hc=[1, 4], d=[64, 4096]), "prompt"),
    OpCase("stream_mean", ("step_stream_mean",), g.stream_mean, ref.stream_mean,
           _same_args(lambda seed, L, hc, d: (rnd(seed, L, hc, d),)), dict(hc=[1, 4], d=[64, 4096]), "prompt"),
    OpCase("markov_gather", ("step_markov_gather",), g.markov_gather, ref_markov_gather, make_markov_gather,
           dict(V=[50, 4000], d=[32, 256], wtype=["f32", "f16", "bf16", "q8_0"])),
    OpCase("markov_add", ("step_markov_add",), g.markov_add, lambda base, mk, i: base[:, i] + mk,
           _same_args(lambda seed, R, B, V: (rnd(seed, R, B, V), rnd(seed + 1, R, V), (seed % B))),
           dict(B=[1, 5], V=[7, 1000])),
    OpCase("attention_paged", ("step_attention_split", "step_attention_combine"), g.attention_paged,
           ref_attention_paged, make_attention,
           dict(H=[1, 3, 8, 20], D=[32, 128, 512], W=range(1, 17), store=["none", "all", "selected"],
                kind=[ROW_F32, ROW_KV], span=[1, 40], epilogue=["none", "rope", "rope+q8"]), "prompt",
           perf=perf_attention),
    OpCase("indexer_paged", ("step_indexer_paged",), g.indexer_paged, ref_indexer_paged, make_indexer,
           dict(Hi=[1, 8, 64], Di=[32, 128], kind=[ROW_F32, ROW_IX]), "prompt", perf=perf_indexer),
    OpCase("topk", ("ds4_topk",), g.topk_batched, ref_topk, make_topk,
           dict(ncap=range(1, 3001), k=[1, 7, 64, 512], n_levels=[3, 50, 0]), compare="equal"),
    OpCase("pool_window", ("ds4_pool_window",), g.pool_window, ref.pool_window, make_pool,
           dict(C=[8, 128], D=[64, 512], p_inf=[0.0, 0.3, 1.0]), perf=perf_pool),
    OpCase("route", ("ds4_route",), g.route, ref.route, make_route,
           dict(E=[16, 64, 256], k=[1, 6, 8], use_bias=[False, True], use_hash=[False, True],
                normalise=[False, True]), "one", perf=perf_route),
    OpCase("swiglu", ("ds4_swiglu_act", "ds4_matvec3_*"), g.swiglu,
           lambda x, w1, w3, w2, clamp: np.stack([ref.swiglu(xi, w1, w3, w2, clamp) for xi in x]), make_swiglu,
           dict(ff=[32, 256], d=[64, 512], clamp=[0.5, 7.0], wtype=["f32", "bf16", "q8_0"]), perf=perf_swiglu),
    OpCase("argmax", ("ds4_argmax",), g.argmax, lambda x: np.argmax(x, axis=1).astype(I32), make_argmax,
           dict(V=range(1, 140001), dup=[False, True]), compare="equal", perf=perf_argmax),
    OpCase("expert_list", ("step_expert_list",), g.expert_list, ref_expert_list, make_expert_list,
           dict(E=[4, 16, 256, 1024], kk=[1, 2, 6, 8], padding=[0.0, 0.3], repeats=[False, True]), "pass",
           compare="equal"),
    OpCase("expert_tiles", ("step_expert_list", "step_expert_tiles"), g.expert_tiles, ref_expert_tiles,
           make_expert_list, dict(E=[4, 16, 256, 1024], kk=[1, 2, 6, 8], padding=[0.0, 0.3], repeats=[False, True]),
           "pass", compare="equal"),
    OpCase("routed_experts", ("step_expert_list", "step_experts3_*"), g.routed_experts, ref_experts,
           _make_routed, dict(E=[4, 16], kk=[1, 2, 6], shape=[(256, 512), (64, 256), (512, 2048)], down=[False, True],
                      wtype=["f32", "bf16", "q8_0", *QUANTS], rpw=[1, 2, 4]), "prompt", perf=perf_experts),
    OpCase("quantize_q8", ("ds4_quantize_q8",), g.quantize_q8, canon.quantize_q8, make_quantize,
           dict(kb=range(1, 301), scale=[1e-30, 1e-3, 1.0, 1e4], special=["none", "zero", "inf", "nan"]), "prompt"),
    OpCase("rmsnorm_q8", ("ds4_rmsnorm_q8",), g.rmsnorm_q8, ref_rmsnorm_q8, make_rmsnorm_q8,
           dict(D=[64, 512, 1024, 4096], weighted=[False, True], scale=[1e-30, 1.0, 1e30]), "prompt"),
    OpCase("swiglu_act_q8", ("ds4_swiglu_act_q8",), g.swiglu_act_q8, ref_swiglu_act_q8, make_swiglu_act_q8,
           dict(kb=range(1, 81), clamp=[1.0, 10.0, 1e30], special=["none", "zero", "nan"]), "prompt",
           compare="bits, any NaN"),
    OpCase("qmatvec", ("ds4_quantize_q8", "ds4_qmatvec_*", "ds4_qgemm_*"), g.qmatvec,
           lambda x, raw, wtype: canon_qlinear(x, raw, wtype), _make_qmatvec,
           dict(n=range(1, 301), kb=range(1, 201), wtype=list(layouts.QUANT_WTYPES), max_blocks=[0, 2]), "prompt",
           perf=perf_qmatvec),
    OpCase("qrouted_experts", ("step_expert_list", "ds4_quantize_q8", "ds4_qexperts_*"), g.qrouted_experts,
           ref_qexperts, _make_qrouted,
           dict(E=[4, 16], kk=[1, 2, 6], shape=[(256, 512), (64, 256), (512, 2048)], down=[False, True],
                wtype=list(layouts.QUANT_WTYPES)), "prompt", perf=perf_qexperts),
    # prompt passes' routed experts (launch.qexperts_gemm), drawn up to whole passes of LARGEST_PASS rows
    OpCase("qrouted_experts_gemm",
           ("step_expert_list", "step_expert_tiles", "ds4_quantize_q8", "ds4_qexperts_gemm_*"),
           g.qrouted_experts, ref_qexperts, _make_qrouted_gemm,
           dict(E=[4, 16, 256], kk=[1, 2, 6], shape=[(70, 1280), (130, 256), (64, 2048)], down=[False, True],
                wtype=list(layouts.QUANT_WTYPES)), "pass"),
)


BY_NAME = {c.name: c for c in CASES}


def run_case(case: OpCase, seed: int, rows: int, rt=None, **params):
    """(gpu outputs, reference outputs) of one draw, each a tuple; None when the draw is rejected."""
    made = case.make(seed, rows, **params)
    if made is None:
        return None
    gpu_args, ref_args, *kw = made
    got, want = case.gpu(*gpu_args, rt=rt, **(kw[0] if kw else {})), case.ref(*ref_args)
    as_tuple = lambda v: v if isinstance(v, tuple) else (v,)  # noqa: E731
    return as_tuple(got), as_tuple(want)


# ---- perf mode ------------------------------------------------------------------------------

def perf(rt, lanes, out_path, only=None):
    """Time every case with a perf column at each lane count; write a markdown table."""
    t0 = time.time()
    bw = copy_bandwidth(rt)
    print(f"device {rt.info.name} ({rt.info.arch}, {rt.info.multiprocessors} SMs); copy bandwidth "
          f"{bw / 1e9:.0f} GB/s (read + write)", flush=True)
    b = Bench(rt, bw)
    for L in lanes:
        for case in CASES:
            if case.perf is not None and (not only or case.name in only):
                case.perf(b, L)
                b.free()
    lines = [f"# GPU op timings ({rt.info.name}, {rt.info.arch})", "",
             f"Copy bandwidth (device-to-device, read + write): {bw / 1e9:.0f} GB/s. "
             f"floor = bytes / that bandwidth. Times: graph replay of 20 calls, median of 15, µs per call.",
             f"Generated by `python -m ds4ref.harness.op_cases` (benchmarks/ops_gpu.py) in {time.time() - t0:.0f} s.", "",
             "| op | lanes | µs | MB moved | floor µs | floor / time | note |", "|---|---|---|---|---|---|---|"]
    for name, L, us, nbytes, floor, note in b.rows:
        lines.append(f"| {name} | {L} | {us:.2f} | {nbytes / 1e6:.2f} | {floor:.2f} | "
                     f"{floor / us * 100:.1f}% | {note} |")
    text = "\n".join(lines) + "\n"
    with open(out_path, "w") as f:
        f.write(text)
    print(text)


def main(argv=None):
    ap = argparse.ArgumentParser(description="Per-op GPU time at DS4 Flash sizes against the "
                                             "memory-bandwidth floor (the op-case table's perf mode)")
    ap.add_argument("--out", default="docs/results/ops_gpu.md")
    ap.add_argument("--lanes", default="1,16,256", help="lane counts: decode passes (1, 16), a prompt pass (256)")
    ap.add_argument("--ops", default="", help="comma-separated case names (default: every case with timings)")
    args = ap.parse_args(argv)
    perf(get_runtime(), [int(s) for s in args.lanes.split(",")], args.out,
         {s for s in args.ops.split(",") if s})


if __name__ == "__main__":
    main()
