"""GPU twins of ds4ref/reference/ops.py: numpy in, numpy out.

Each wrapper has the signature and semantics of its reference twin; uploads and
downloads happen inside, so tests call both and compare. Outputs are poisoned
(f32 NaN, int32 -1) before every launch, so an element a kernel forgot to write
fails the comparison instead of passing as a stale zero.

Device-level launchers (`launch_*`) take DeviceBuffers; the benchmark captures
them into graphs. Weights: f32 / f16 arrays as they are; bf16 as raw uint16 with
wtype="bf16"; Q8_0 as raw uint8 rows of K/32 blocks x 34 bytes with wtype="q8_0".
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..reference import canon
from ..settings import getenv, getenv_int
from .builds import qgemm_options
from .runtime import DeviceBuffer, Runtime, get_runtime

I32, F32, F64 = np.int32, np.float32, np.float64
NAN_BITS = 0x7FC00000
MAX_LANES = 16
WTYPES = ("f32", "f16", "bf16", "q8_0", "q2_k", "q4_k", "iq2_xxs", "mxfp4")
# GGUF block quants the kernels dequantise in registers: (bytes, weights) per block
BLOCK_QUANTS = {"q8_0": (34, 32), "q2_k": (84, 256), "q4_k": (144, 256), "iq2_xxs": (66, 256), "mxfp4": (17, 32)}
K_QUANTS = ("q2_k", "q4_k", "iq2_xxs", "mxfp4")  # rows per warp 1 or 2
_SOURCES = {
    "norm": "norm.hip", "quant": "quant.hip", "matvec": "matvec.hip",
    "pool": "pool.hip", "indexer": "indexer.hip", "moe": "moe.hip",
    "hc": "hc.hip", "qdot": "qdot.hip", "qgemm": "qgemm.hip", "step_ops": "step_ops.hip", "step_state": "step_state.hip",
}


class UnsupportedShapeError(ValueError):
    """A kernel's shape limit was exceeded; the message names the limit."""


def _rt(rt: Runtime | None) -> Runtime:
    return rt if rt is not None else get_runtime()


def kernel(rt: Runtime, family: str, name: str):
    return rt.compile_file(_SOURCES[family]).kernel(name)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise UnsupportedShapeError(msg)


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


def _blocks(n: int, per: int) -> int:
    return max(1, -(-int(n) // per))


# ---------------------------------------------------------------------------
# 16-bit and Q8_0 weight encodings (host side, for tests and the benchmark)
# ---------------------------------------------------------------------------


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round f32 to bf16 (nearest, ties to even) as raw uint16."""
    u = np.ascontiguousarray(x, dtype=F32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(F32)


def quantize_q8_0(w: np.ndarray) -> np.ndarray:
    """(N, K) f32 -> (N, K/32*34) uint8 Q8_0 rows: f16 scale amax/127, then 32 int8."""
    n, k = w.shape
    if k % 32:
        raise UnsupportedShapeError(f"Q8_0 needs K % 32 == 0, got K={k}")
    blk = w.reshape(n, k // 32, 32).astype(F32)
    d = (np.max(np.abs(blk), axis=-1) / 127.0).astype(np.float16)
    dinv = np.where(d == 0, 0.0, 1.0 / np.where(d == 0, 1, d.astype(F32)))
    q = np.clip(np.rint(blk * dinv[..., None]), -127, 127).astype(np.int8)
    out = np.empty((n, k // 32, 34), dtype=np.uint8)
    out[..., :2] = d.view(np.uint8).reshape(n, k // 32, 2)
    out[..., 2:] = q.view(np.uint8)
    return out.reshape(n, k // 32 * 34)


def dequantize_q8_0(raw: np.ndarray) -> np.ndarray:
    n = raw.shape[0]
    blk = raw.reshape(n, -1, 34)
    d = blk[..., :2].copy().view(np.float16).astype(F32)  # (n, nb, 1)
    q = blk[..., 2:].view(np.int8).astype(F32)
    return (d * q).reshape(n, -1)


def dequantize(w: np.ndarray, wtype: str) -> np.ndarray:
    """Host f32 copy of a weight in any supported encoding (the reference's W)."""
    if wtype == "f32":
        return np.asarray(w, F32)
    if wtype == "f16":
        return np.asarray(w, np.float16).astype(F32)
    if wtype == "bf16":
        return bf16_bits_to_f32(w)
    if wtype == "q8_0":
        return dequantize_q8_0(w)
    if wtype in BLOCK_QUANTS:  # gguf-py's dequantisation is the reference's
        from gguf import GGMLQuantizationType, quants
        return quants.dequantize(np.ascontiguousarray(w, np.uint8), GGMLQuantizationType[wtype.upper()])
    raise UnsupportedShapeError(f"weight type {wtype!r} is not one of {WTYPES}")


def _wtype_of(w: np.ndarray, wtype: str | None) -> str:
    if wtype is not None:
        if wtype not in WTYPES:
            raise UnsupportedShapeError(f"weight type {wtype!r} is not one of {WTYPES}")
        return wtype
    if w.dtype == F32:
        return "f32"
    if w.dtype == np.float16:
        return "f16"
    raise UnsupportedShapeError(f"weight dtype {w.dtype} needs an explicit wtype ('bf16' for uint16 bits, "
                                f"'q8_0' for uint8 blocks)")


def weight_cols(w: np.ndarray, wtype: str) -> int:
    if wtype in BLOCK_QUANTS:
        nbytes, per = BLOCK_QUANTS[wtype]
        return w.shape[-1] // nbytes * per
    return w.shape[-1]


# ---------------------------------------------------------------------------
# Norms, RoPE
# ---------------------------------------------------------------------------


def launch_rmsnorm(rt, x: DeviceBuffer, w: DeviceBuffer | None, y: DeviceBuffer, rows: int, D: int, eps: float,
                   lane_slot=None, rows_per_lane: int = 1):
    rt.launch(kernel(rt, "norm", "ds4_rmsnorm"), (rows,), (256,),
              (x, w, y, I32(D), F32(eps), lane_slot, I32(rows_per_lane)))


def launch_rmsnorm_q8(rt, x: DeviceBuffer, w: DeviceBuffer | None, y: DeviceBuffer, rows: int, D: int, eps: float,
                      q: "Q8Rows", lane_slot=None):
    """ds4_rmsnorm, and y's rows quantised into q (D wide) for the products that read them."""
    _need(D % 32 == 0, f"rmsnorm_q8: width {D} is not a multiple of 32")
    _need(rows * D <= q.capacity, f"rmsnorm_q8: {rows} x {D} exceeds the scratch ({q.capacity})")
    rt.launch(kernel(rt, "norm", "ds4_rmsnorm_q8"), (rows, _blocks(D, 256)), (256,),
              (x, w, y, I32(D), F32(eps), lane_slot, q.xq, q.dx, q.xs))


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


def launch_norm_rope(rt, x: DeviceBuffer, w: DeviceBuffer | None, y: DeviceBuffer, L: int, rows_per_lane: int,
                     D: int, eps: float, pos: DeviceBuffer, cs: DeviceBuffer, half: int, inverse: bool = False,
                     fp8: bool = False, lane_slot=None) -> None:
    """y <- rmsnorm of x's L * rows_per_lane rows, RoPE'd at their lanes' positions and, with
    fp8, the other dims FP8 round-tripped (reference ops.fp8sim): launch_rmsnorm, step_rope_pos and
    the round trip in one launch."""
    _need(2 * half <= D, f"norm_rope: {2 * half} rotated dims exceed the row length {D}")
    _need(not fp8 or (D - 2 * half) % 64 == 0, f"norm_rope: non-RoPE dims {D - 2 * half} must be a multiple of 64")
    rt.launch(kernel(rt, "norm", "ds4_norm_rope"), (L * rows_per_lane,), (256,),
              (x, w, y, I32(D), F32(eps), lane_slot, I32(rows_per_lane), pos, cs, I32(half),
               I32(1 if inverse else 0), I32(1 if fp8 else 0)))


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


# ---------------------------------------------------------------------------
# FP8 / FP4 numerics
# ---------------------------------------------------------------------------


def launch_qat(rt, v: DeviceBuffer, ht: DeviceBuffer, out: DeviceBuffer, rows: int, n: int,
               lane_slot=None, rows_per_lane: int = 1) -> None:
    """out <- the indexer's QAT of rows of n: the Hadamard rotation (ht: the table transposed),
    then FP4 E2M1 in blocks of 32."""
    _need(n % 32 == 0, f"qat: row length {n} must be a multiple of 32")
    rt.launch(kernel(rt, "quant", "ds4_qat_rows"), (_blocks(rows * n, 256),), (256,),
              (v, ht, out, I32(rows), I32(n), lane_slot, I32(rows_per_lane)))


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


# ---------------------------------------------------------------------------
# Batched matvec and the grouped output projection
# ---------------------------------------------------------------------------


@dataclass
class DeviceWeight:
    buf: DeviceBuffer
    wtype: str
    rows: int
    cols: int
    packed: bool = False  # rows in pack_qrows' layout (the quantised products' kernels read only those)

    @classmethod
    def upload(cls, rt: Runtime, w: np.ndarray, wtype: str | None = None) -> "DeviceWeight":
        wt = _wtype_of(w, wtype)
        k = weight_cols(w, wt)
        block = BLOCK_QUANTS.get(wt, (0, 8))[1]
        _need(k % block == 0, f"matvec: K={k} must be a multiple of {block} for {wt}")
        return cls(rt.upload(np.ascontiguousarray(w)), wt, int(np.prod(w.shape[:-1])), k)


def lane_groups(L: int) -> int:
    """Groups of MAX_LANES a pass of L lanes runs in (matvec v3 and the routed experts)."""
    return -(-int(L) // MAX_LANES)


def launch_matvec(rt, w: DeviceWeight, x: DeviceBuffer, y: DeviceBuffer, L: int, *, groups: int = 1,
                  ldx: int | None = None, xg: int = 0, ldy: int | None = None, gs: int | None = None,
                  lane_slot: DeviceBuffer | None = None, part: DeviceBuffer | None = None) -> None:
    """y[l*ldy + g*gs + r] = W[g*N + r] . x[l, g*xg : g*xg + K] for l < L, N = rows / groups
    (gs = N by default: the groups side by side in each lane's row).

    Any L, in lane groups of 16 (a prompt pass). `lane_slot` (int32[L] slot ids, -1 =
    padding after the rows) limits the work to lanes up to the last one with a slot (later
    lanes' y is left as it was); `part` is scratch for the fixed K-split of few-row matrices
    (matvec_ksplit); without it they run unsplit."""
    _need(1 <= L, f"matvec: {L} lanes")
    n = w.rows // groups
    ldx = ldx if ldx is not None else w.cols
    ldy = ldy if ldy is not None else w.rows
    nlg = lane_groups(L)
    ks = matvec_ksplit(w.rows, w.cols) if groups == 1 else 0
    if ks and part is not None:
        nsplit = launch_matvec_slices(rt, w, x, part, L, ldx=ldx, lane_slot=lane_slot)
        rt.launch(kernel(rt, "matvec", "ds4_matvec3_ksum"), (_blocks(nlg * MAX_LANES * n, 256),), (256,),
                  (part, y, I32(n), I32(L), I32(ldy), I32(nsplit), lane_slot))
        return
    rpw = matvec_rows_per_warp(rt, n * groups, L)
    if w.wtype in K_QUANTS:
        rpw = min(rpw, 2)  # r1 and r2 are built for the K-quants and MXFP4
    rt.launch(kernel(rt, "matvec", f"ds4_matvec3_{w.wtype}_r{rpw}"), (_blocks(n, 8 * rpw), groups, nlg),
              (256,), (w.buf, x, y, I32(n), I32(w.cols), I32(L), I32(ldx), I32(xg), I32(ldy),
                       np.int64(n if gs is None else gs), lane_slot))


def launch_matvec_slices(rt, w: DeviceWeight, x: DeviceBuffer, part: DeviceBuffer, L: int, *,
                         ldx: int | None = None, lane_slot: DeviceBuffer | None = None) -> int:
    """The K-split's first half for a matrix matvec_ksplit splits: slice z of lane l's product into
    part[(z * LS + l) * N + r] (LS = lane_groups(L) * MAX_LANES). Returns the slice count; the
    slices are added in order by ds4_matvec3_ksum, or by the kernel that reads the product."""
    ks = matvec_ksplit(w.rows, w.cols)
    _need(ks > 0 and part is not None, f"matvec: a {w.rows} x {w.cols} matrix is not K-split")
    _need(part.nbytes >= 4 * ksplit_floats(w.rows, w.cols, L), "matvec: K-split scratch too small")
    nsplit = -(-w.cols // ks)
    rt.launch(kernel(rt, "matvec", f"ds4_matvec3_{w.wtype}_r1_ks"), (_blocks(w.rows, 8), lane_groups(L), nsplit),
              (256,), (w.buf, x, part, I32(w.rows), I32(w.cols), I32(L), I32(ldx if ldx is not None else w.cols),
                       lane_slot, I32(ks)))
    return nsplit


# K-split: few-row, long-row matrices (hc projections 24 x 16384, router, indexer
# weights) are cut into column slices summed in order, so they occupy more blocks. The
# rule is part of the canonical arithmetic (canon.ksplit): the reference slices the same.


def matvec_ksplit(rows: int, cols: int) -> int:
    """Columns per slice of the fixed K-split for this shape, 0 = not split (canon.ksplit)."""
    return canon.ksplit(rows, cols)


def ksplit_floats(rows: int, cols: int, L: int = MAX_LANES) -> int:
    """Scratch floats the K-split of this shape needs (L lanes in whole groups x rows x slices)."""
    ks = matvec_ksplit(rows, cols)
    return lane_groups(L) * MAX_LANES * rows * -(-cols // ks) if ks else 0


def matvec_rows_per_warp(rt, rows: int, L: int = MAX_LANES) -> int:
    """Rows per warp: by the matrix's row count (RPW3_POLICY: the smallest row count
    from which each R is used), and for a prompt pass (L > 16) PREFILL_RPW for every matrix;
    DS4REF_MATVEC_RPW forces one for experiments. The choice never changes a result."""
    forced = getenv("DS4REF_MATVEC_RPW")
    if forced:
        if forced not in ("1", "2", "4"):
            raise UnsupportedShapeError(f"DS4REF_MATVEC_RPW={forced!r} is not 1, 2 or 4")
        return int(forced)
    if L > MAX_LANES:
        return PREFILL_RPW
    r = 1
    for rpw, min_rows in RPW3_POLICY:
        if rows >= min_rows:
            r = rpw
    return r


# measured on the H200 (docs/results/ops_gpu.md): r1 wins up to 2048 rows,
# r2 above at 1 and 16 lanes; r4 (208 registers, one block per SM) never won
RPW3_POLICY = ((2, 2049),)
# a prompt pass's dense matvecs: r2 for every matrix (r1 would stage each lane group's inputs
# for 8 rows only; r4 measured slower: 208 registers, one block per multiprocessor; H200,
# docs/performance.md "Prompt passes")
PREFILL_RPW = getenv_int("DS4REF_PREFILL_RPW")


def ksplit_scratch(rt, dw: DeviceWeight, L: int = MAX_LANES) -> DeviceBuffer | None:
    """A K-split scratch buffer for this weight at L lanes, or None when it is not split."""
    n = ksplit_floats(dw.rows, dw.cols, L)
    return rt.malloc(4 * n) if n else None


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
        for c0 in range(0, n, MAX_LANES):
            oc = og[c0:c0 + MAX_LANES]
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


# ---------------------------------------------------------------------------
# Hyper-connections
# ---------------------------------------------------------------------------

HC_MAX = 8
HC_COLS = 512  # ds4_hc_pre_finish: the columns of u a block forms in a decode pass


def launch_hc_pre_finish(rt, streams, mix, base, scale, hc: int, d: int, rms_eps: float, hc_eps: float,
                         iters: int, u, post, comb, rows: int, lane_slot=None, slices=None) -> None:
    """u, post and comb of rows mixes (hc.hip): per row a block for post and comb and blocks over
    u's columns, HC_COLS a block in decode passes and all of them in prompt passes (each block
    re-reads the row for its norm, which only a few rows can afford). lane_slot: padding rows
    (negative entries) are skipped, their outputs left as they were. slices: (part, nsplit) of a
    K-split projection (launch_matvec_slices), whose slices the finish adds in place of mix."""
    cols = HC_COLS if rows <= MAX_LANES else d
    part, nsplit = slices or (None, 0)
    rt.launch(kernel(rt, "hc", "ds4_hc_pre_finish"), (max(rows, 1), 1 + _blocks(d, cols)), (256,),
              (streams, mix, base, scale, I32(hc), I32(d), F32(rms_eps), F32(hc_eps), I32(iters), I32(cols),
               u, post, comb, lane_slot, part, I32(nsplit), I32(lane_groups(rows) * MAX_LANES if part else 0)))


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


def view(buf: DeviceBuffer, offset: int, nbytes: int) -> DeviceBuffer:
    """A non-owning DeviceBuffer at buf + offset (its free() does nothing): free `buf`."""
    if offset + nbytes > buf.nbytes:
        raise ValueError(f"view of {nbytes} B at {offset} exceeds {buf}")
    return DeviceBuffer(buf.rt, buf.ptr + offset, nbytes, owned=False)


def launch_add_rows(rt, a: DeviceBuffer, b: DeviceBuffer, out: DeviceBuffer, L: int, hc: int, d: int) -> None:
    """out[l, k] = a[l, k] + b[l] for hc rows of d per lane (the MTP block's input streams)."""
    rt.launch(kernel(rt, "step_ops", "step_add_rows"), (_blocks(L * hc * d, 256),), (256,),
              (a, b, out, I32(L), I32(hc), I32(d)))


def add_rows(a, b, rt=None):
    """Twin of a + b[:, None]: a (L, hc, d), b (L, d)."""
    rt = _rt(rt)
    a, b = _f32(a), _f32(b)
    L, hc, d = a.shape
    with _Scope(rt) as s:
        out = s.out((L, hc, d))
        launch_add_rows(rt, s.up(a), s.up(b), out, L, hc, d)
        return s.get(out, (L, hc, d))


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


# ---------------------------------------------------------------------------
# Paged state: attention with sinks and indexer scores over a slot's ring and pages
# ---------------------------------------------------------------------------

AT_SPLIT = 32  # keys per slice: canon.ATTN_SLICE, and step_state.hip's AT3_SPLIT
AT3_SPLIT = AT_SPLIT
AT_CT = 128  # step_attention_combine's threads (step_state.hip's AT_CT)
ROW_F32, ROW_KV, ROW_IX = 0, 1, 2  # step_state.hip's stored-row formats (docs/paging.md)


def launch_attention_split(rt, H: int, L: int, nz: int, args: tuple) -> None:
    """step_attention_split over (head sets of 8, lanes, key slices), a warp a head."""
    rt.launch(kernel(rt, "step_state", "step_attention_split"), (_blocks(H, 8), L, nz), (256,), args)


@dataclass
class PagedLanes:
    """One pass over a small paged state, as the backend lays it out (device_state.py):
    per-lane slot (-1 = padding), position, the slot's first position and lane in the pass,
    visible compressed rows; block table (slots, maxp) of pages of `per` rows each."""
    slot: np.ndarray
    pos: np.ndarray
    pstart: np.ndarray
    flane: np.ndarray
    nvis: np.ndarray
    btab: np.ndarray
    per: int


def _stored(rows, kind: int, n_rot: int) -> np.ndarray:
    """Rows (..., D) float32 as the state stores them: float32, or the compact lossless form."""
    from ..paging.compact import encode_index_rows, encode_kv_rows
    rows = _f32(rows)
    if kind == ROW_F32:
        return rows
    return encode_kv_rows(rows, n_rot) if kind == ROW_KV else encode_index_rows(rows)


def launch_attention_combine(rt, m, den, acc, sinks, slot, pos, store, nvis, sel, ksel: int, W: int, H: int,
                             D: int, nz: int, out, L: int, rope=None, half: int = 0, q8: "Q8Rows | None" = None):
    """out <- each (head, lane)'s slices merged in order with the sink; with rope (the (P, half, 2)
    table) the last 2 * half dims inverse-RoPE'd at the lane's position; with q8 the rows (H * D
    wide) quantised into it as well, for the output product."""
    _need(rope is not None or not half, "attention combine: RoPE dims without a table")
    _need(q8 is None or D % 32 == 0, f"attention combine: head dim {D} is not a multiple of 32")
    _need(q8 is None or L * H * D <= q8.capacity, f"attention combine: {L} x {H * D} exceeds the int8 scratch")
    rt.launch(kernel(rt, "step_state", "step_attention_combine"), (H, L), (AT_CT,),
              (m, den, acc, sinks, slot, pos, store, nvis, sel, I32(ksel), I32(W), I32(H), I32(D), I32(nz), out,
               rope, I32(half), *((q8.xq, q8.dx, q8.xs) if q8 is not None else (None, None, None))))


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
        for c0 in range(0, x2.shape[0], MAX_LANES):
            xc = x2[c0:c0 + MAX_LANES]
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


def launch_swiglu_act(rt, g: DeviceBuffer, u: DeviceBuffer, h: DeviceBuffer, n: int, clamp: float,
                      q: "Q8Rows | None" = None) -> None:
    """h = the clamped SwiGLU activation of g and u (n values); with q, h's rows (a multiple of
    32 wide) are also quantised into q for the down product."""
    if q is None:
        rt.launch(kernel(rt, "moe", "ds4_swiglu_act"), (_blocks(n, 256),), (256,),
                  (g, u, h, np.int64(n), F32(clamp)))
        return
    _need(n % 32 == 0 and n <= q.capacity, f"swiglu_act_q8: {n} values do not fit the scratch ({q.capacity})")
    rt.launch(kernel(rt, "moe", "ds4_swiglu_act_q8"), (_blocks(n, 256),), (256,),
              (g, u, h, np.int64(n // 32), F32(clamp), q.xq, q.dx, q.xs))


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


EL_PAIRS = MAX_LANES  # step_expert_list's entry: expert id, pair count, up to 16 (lane, choice) pairs
EL_STRIDE = 2 + EL_PAIRS
EL_BITS, EL_EXPERTS = 8192, 1024  # step_expert_list's (expert, lane) bit words and experts in shared memory


def launch_expert_list(rt, ids, slots, L: int, kk: int, n_expert: int, elist) -> None:
    """elist <- step_expert_list's work entries for the routing ids (L, kk) of a pass of L lanes."""
    _need(n_expert <= EL_EXPERTS and n_expert * -(-L // 32) <= EL_BITS,
          f"expert list: {n_expert} experts x {L} lanes exceed the kernel's shared memory")
    rt.launch(rt.compile_file("step_ops.hip").kernel("step_expert_list"), (1,), (256,),
              (ids, slots, I32(L), I32(kk), I32(n_expert), elist))


def expert_list_ints(n_expert: int, kk: int, L: int = MAX_LANES) -> int:
    """int32s of step_expert_list's output for a pass of L lanes: the count, then the entries.
    An expert with c pairs takes ceil(c / 16) entries, so the chosen experts (at most
    min(E, L*kk)) take at most that many plus L*kk / 16."""
    return 1 + (min(n_expert, L * kk) + L * kk // EL_PAIRS) * EL_STRIDE


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


# encodings with a 4-rows-per-warp routed-expert kernel (step_ops.hip). bf16 only: in a prompt
# pass it took bf16 experts from 114.6 to 85.3 ms, but IQ2_XXS from 330.8 to 342.2 and Q2_K from
# 154.9 to 171.0 ms (H200, docs/performance.md "Prompt passes"), so the others stop at 2
EXPERT_R4 = ("bf16",)


def expert_rows_per_warp(wtype: str, want: int) -> int:
    """The rows per warp a routed-expert launch of this encoding gets when `want` is asked."""
    return want if want <= 2 or wtype in EXPERT_R4 else 2


def expert_blocks(rt) -> int:
    """The routed-expert kernel's fixed grid: a few resident blocks per multiprocessor, each
    walking work items, so the grid never depends on how many experts exist."""
    return 4 * max(1, int(getattr(rt.info, "multiprocessors", 0) or 32))


def launch_routed_experts(rt, wbuf, wtype: str, r: int, x, per_choice: int, elist, y, N: int, K: int,
                          kk: int) -> None:
    kern = rt.compile_file("step_ops.hip").kernel(f"step_experts3_{wtype}_r{r}")
    rt.launch(kern, (expert_blocks(rt),), (256,), (wbuf, x, I32(per_choice), elist, y, I32(N), I32(K), I32(kk)))


def _padded_expert_inputs(x: np.ndarray, ids: np.ndarray, K: int):
    """(P, inputs, slots, ids) of L lanes padded like a decode pass to P = max(L, 16) lanes:
    padding lanes carry slot -1, zero inputs and expert 0."""
    L, kk = ids.shape
    P = max(L, MAX_LANES)
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


NON_FINITE_ROW = -2  # ds4_argmax's answer for a row holding a NaN or an infinity (DS4_NON_FINITE_ROW)


def launch_argmax(rt, x: DeviceBuffer, out: DeviceBuffer, L: int, V: int, lane_slot=None) -> None:
    rt.launch(kernel(rt, "moe", "ds4_argmax"), (max(L, 1),), (1024,), (x, I32(V), out, lane_slot))


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


# ---------------------------------------------------------------------------
# Quantised products (qdot.hip): official numerics' products with block-quantised weights,
# int8 activations and exact integer block dots (canon.quantize_q8, canon.qlinear)
# ---------------------------------------------------------------------------
QUANT_WTYPES = tuple(BLOCK_QUANTS)


def packed_row_bytes(wtype: str, K: int) -> int:
    """Bytes per row of K weights in pack_qrows' layout (a multiple of 16 for the repacked types)."""
    nbytes, per = BLOCK_QUANTS[wtype]
    if wtype == "q4_k":
        return K // per * nbytes
    body = {"q8_0": K + K // 16, "iq2_xxs": K // 4 + K // 128, "mxfp4": K // 2 + K // 32,
            "q2_k": K // 4 + K // 16 + K // 64}[wtype]
    return -(-body // 16) * 16


def pack_qrows(wtype: str, raw: np.ndarray) -> np.ndarray:
    """GGUF rows (rows, row bytes) uint8 -> the layout qdot.hip reads, where a lane's 32-column
    block is one aligned load: Q8_0 [K int8 codes in runs of 32 blocks, each run's first 16 codes
    of every block, then their last 16 (q8_run_halves)][K/32 f16 d], IQ2_XXS [K/32 x 8-byte
    sub-blocks][K/256 f16 d], MXFP4 [K/32 x 16 code bytes][K/32 E8M0 bytes], Q2_K
    [K/32 x 8 code bytes (q2k_block_codes)][K/16 scale bytes][K/256 x f16 d, f16 dmin], each row
    padded to 16 bytes. Q4_K keeps the file's super-blocks (16-byte aligned already). Every
    byte of the file is kept (unpack_q2k_rows inverts the Q2_K layout)."""
    raw = np.ascontiguousarray(raw, np.uint8)
    rows = raw.shape[0]
    K = weight_cols(raw, wtype)
    if wtype == "q4_k":
        return raw
    nbytes, per = BLOCK_QUANTS[wtype]
    blk = raw.reshape(rows, K // per, nbytes)
    if wtype == "q2_k":
        parts = [q2k_block_codes(blk[..., 16:80]).reshape(rows, -1), blk[..., :16].reshape(rows, -1),
                 blk[..., 80:84].reshape(rows, -1)]
    else:
        head = {"q8_0": 2, "iq2_xxs": 2, "mxfp4": 1}[wtype]  # the block's scale bytes come first
        codes = q8_run_halves(blk[..., head:]) if wtype == "q8_0" else blk[..., head:]
        parts = [codes.reshape(rows, -1), blk[..., :head].reshape(rows, -1)]
    body = np.concatenate(parts, axis=1)
    out = np.zeros((rows, packed_row_bytes(wtype, K)), np.uint8)
    out[:, :body.shape[1]] = body
    return out


def q8_run_halves(codes: np.ndarray, inverse: bool = False) -> np.ndarray:
    """Q8_0 codes (rows, blocks, 32) -> (rows, blocks * 32) in runs of 32 blocks (the last run
    shorter), each run's first halves (16 codes a block) before its second halves: the order
    ds4_qblock.h's q8_half reads. inverse: the same run order back to (rows, blocks, 32)."""
    codes = np.asarray(codes, np.uint8)
    rows = codes.shape[0]
    nb = codes.size // (rows * 32)
    flat = codes.reshape(rows, nb * 32)
    out = np.empty_like(flat)
    for b0 in range(0, nb, 32):
        m = min(32, nb - b0)
        run = flat[:, b0 * 32:(b0 + m) * 32]
        out[:, b0 * 32:(b0 + m) * 32] = (run.reshape(rows, 2, m, 16) if inverse else
                                         run.reshape(rows, m, 2, 16)).swapaxes(1, 2).reshape(rows, -1)
    return out.reshape(rows, nb, 32) if inverse else out


def q2k_block_codes(qs: np.ndarray) -> np.ndarray:
    """Q2_K's qs bytes (..., 64) of each super-block -> (..., 8 blocks, 8 bytes): block j's 32
    2-bit codes on their own, so a lane reads 8 bytes instead of the 32 its block shares with
    three others. Byte 4w + e of a block holds the codes of its columns 16w + 4s + e at bits
    2s (s < 4): the block's code word k (columns 4k .. 4k + 3, one per byte, as dp4a takes them)
    is (word k/4 >> 2(k%4)) & 0x03030303. In the file, column l of block j = 4u + s is bits 2s of
    qs[32u + l]."""
    qs = np.asarray(qs, np.uint8)
    lead = qs.shape[:-1]
    # codes[..., j, l]: block j = 4u + s, column l
    codes = (qs.reshape(*lead, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)) & 3
    codes = codes.reshape(*lead, 8, 2, 4, 4)  # (block, w, s, e): column 16w + 4s + e
    out = np.zeros((*lead, 8, 2, 4), np.uint8)  # (block, w, e)
    for s in range(4):
        out |= codes[..., :, :, s, :] << (2 * s)
    return out.reshape(*lead, 8, 8)


def unpack_q2k_rows(packed: np.ndarray, K: int) -> np.ndarray:
    """pack_qrows' Q2_K rows (rows, packed_row_bytes) -> the file's rows (rows, K/256 * 84)."""
    packed = np.ascontiguousarray(packed, np.uint8)
    rows, nsb = packed.shape[0], K // 256
    cb = packed[:, :K // 4].reshape(rows, nsb, 8, 2, 4)  # (super-block, block, w, e)
    codes = (cb[..., None, :] >> (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)) & 3  # (.., w, s, e)
    codes = codes.reshape(rows, nsb, 2, 4, 32)  # (u, s, l): block 4u + s, column l
    qs = np.zeros((rows, nsb, 2, 32), np.uint8)
    for s in range(4):
        qs |= codes[:, :, :, s, :] << (2 * s)
    scales = packed[:, K // 4:K // 4 + K // 16].reshape(rows, nsb, 16)
    dd = packed[:, K // 4 + K // 16:K // 4 + K // 16 + K // 64].reshape(rows, nsb, 4)
    return np.concatenate([scales, qs.reshape(rows, nsb, 64), dd], axis=2).reshape(rows, -1)


@dataclass
class Q8Rows:
    """Device buffers of quantised activation rows: codes (rows, W) int8, block scales
    (rows, W/32) f32 and half sums (rows, W/16) int16, for up to `capacity` elements."""
    xq: DeviceBuffer
    dx: DeviceBuffer
    xs: DeviceBuffer
    capacity: int

    @classmethod
    def alloc(cls, rt, elements: int) -> "Q8Rows":
        n = -(-int(elements) // 32) * 32
        return cls(rt.malloc(n), rt.malloc(4 * (n // 32)), rt.malloc(2 * (n // 16)), n)

    def free(self) -> None:
        for b in (self.xq, self.dx, self.xs):
            b.free()

    def get(self, rt, rows: int, W: int) -> tuple[np.ndarray, np.ndarray]:
        """(codes (rows, W) int8, block scales (rows, W/32) f32) of the first rows."""
        rt.synchronize()
        return rt.download(self.xq, (rows, W), np.int8), rt.download(self.dx, (rows, W // 32), F32)


def launch_quantize_q8(rt, x: DeviceBuffer, q: Q8Rows, rows: int, W: int, ldx: int | None = None) -> None:
    """q <- the rows of x (rows x W floats, ldx apart) quantised per 32-column block."""
    _need(W % 32 == 0, f"quantize_q8: width {W} is not a multiple of 32")
    _need(rows * W <= q.capacity, f"quantize_q8: {rows} x {W} exceeds the scratch ({q.capacity})")
    rt.launch(kernel(rt, "qdot", "ds4_quantize_q8"), (_blocks(rows * W, 256),), (256,),
              (x, np.int64(ldx or W), I32(W), I32(rows), q.xq, q.dx, q.xs))


# Passes of more rows than MMA_ROWS run dense quantised products as the tiled int8 GEMM
# (qgemm.hip): 1.4x (Q8_0) to 2.5x (IQ2_XXS) the dp4a kernel at 256 rows on the H200
# (docs/performance.md, "Latency-bound kernels spread out, ..."), the same bits.
MMA_ROWS = 16


def qmatvec_rows_per_warp(rows: int) -> int:
    """Rows a warp of the decode products (rows: the launch's, all groups). Measured on the H200
    (docs/performance.md): one row a warp up to 1,024 rows (Flash's attn_q_a, attn_kv), where
    the grid is otherwise too small to keep the memory busy; two from there on."""
    return 2 if rows > 1024 else 1


# Blocks a multiprocessor of the decode products' grid (0: one block a row block). A block then
# walks row blocks and stages its inputs once where all of K fits (qdot.hip's mq_body): at 2,
# Flash's attn_q_b (32768 x 1024) took 15 % less at 1 and at 16 lanes, the others the same.
QMATVEC_BLOCKS_PER_SM = 2


def qmatvec_grid(rt, row_blocks: int, per_sm: int | None = None) -> int:
    per_sm = QMATVEC_BLOCKS_PER_SM if per_sm is None else per_sm
    cap = per_sm * max(1, int(getattr(rt.info, "multiprocessors", 0) or 32))
    return min(row_blocks, cap) if cap else row_blocks


def launch_qmatvec(rt, w: DeviceWeight, q: Q8Rows, y: DeviceBuffer, L: int, *, groups: int = 1,
                   Wx: int | None = None, xg: int = 0, ldy: int | None = None, gs: int | None = None,
                   lane_slot: DeviceBuffer | None = None, gemm: bool = True, max_blocks: int = 0,
                   rows_per_warp: int | None = None, blocks_per_sm: int | None = None) -> None:
    """y[l*ldy + g*gs + r] = W[g*N + r] . x[l, g*xg : g*xg + K] (gs = N by default) with x quantised
    in q (rows Wx wide); past MMA_ROWS rows the tiled GEMM (qgemm.hip) unless gemm is off (the
    decode kernel, for timing them side by side). max_blocks caps the decode kernel's grid (the op
    twins' check of its row-block loop); rows_per_warp and blocks_per_sm override the policy
    (qmatvec_rows_per_warp, QMATVEC_BLOCKS_PER_SM; 0 blocks: uncapped) for the op table."""
    _need(w.packed and w.wtype in QUANT_WTYPES, f"qmatvec: {w.wtype} weights not in pack_qrows' layout")
    n = w.rows // groups
    if L > MMA_ROWS and gemm:
        module = rt.compile_file(_SOURCES["qgemm"], qgemm_options(w.wtype))
        grid, fn = (_blocks(n, 64), _blocks(L, 64), groups), module.kernel(f"ds4_qgemm_{w.wtype}")
    else:
        r = rows_per_warp or qmatvec_rows_per_warp(w.rows)
        row_blocks = _blocks(n, 8 * r)
        blocks = min(row_blocks, max_blocks) if max_blocks else qmatvec_grid(rt, row_blocks, blocks_per_sm)
        grid, fn = (blocks, groups, lane_groups(L)), kernel(rt, "qdot", f"ds4_qmatvec_{w.wtype}_r{r}")
    rt.launch(fn, grid, (256,), (w.buf, np.int64(packed_row_bytes(w.wtype, w.cols)), q.xq, q.dx, q.xs, y, I32(n),
                                 I32(w.cols), I32(L), I32(Wx or w.cols), I32(xg), I32(ldy or w.rows),
                                 np.int64(n if gs is None else gs), lane_slot))


def launch_qexperts(rt, wbuf, wtype: str, q: Q8Rows, per_choice: int, elist, y, N: int, K: int, kk: int) -> None:
    """The routed experts of step_expert_list's entries, inputs quantised in q (rows K wide)."""
    rt.launch(kernel(rt, "qdot", f"ds4_qexperts_{wtype}_r{qmatvec_rows_per_warp(N)}"), (expert_blocks(rt),), (256,),
              (wbuf, np.int64(packed_row_bytes(wtype, K)), q.xq, q.dx, q.xs, I32(per_choice), elist, y,
               I32(N), I32(K), I32(kk)))


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


def qrouted_experts(raw, wtype: str, x, ids, rt=None):
    """The backend's quantised routed experts: raw (E, N, row bytes) GGUF blocks, x (L, K) or
    (L, kk, K) (one input per choice), ids (L, kk) -> (L, kk, N), each expert product canon.qlinear's."""
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
            launch_qexperts(rt, s.up(packed), wtype, q, 1 if per_choice else 0, elist, y, N, K, kk)
            return s.get(y, (P, kk, N))[:L]
    finally:
        q.free()
