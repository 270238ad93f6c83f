"""The canonical float32 arithmetic of the DS4 forward pass (docs/exactness.md).

Every float32 operation the forward pass performs has one definition here: the
order of every reduction, and exp / log1p built only from correctly rounded
IEEE `+ - * /`. The HIP kernels (ds4ref/hip/kernels) implement the very same
definitions, so the NumPy reference and the GPU give the same bits. The orders
are the ones the GPU's fast path wants (a 32-lane warp's strided partials and
its xor butterfly), written out as loops.

Rules every function here keeps:
* products and sums are rounded separately, except where a definition writes fma (the
  matrix products' terms and quantised blocks, fma_f32): one rounding, in a fixed order;
* a sum "in order" starts from +0 and adds its terms left to right;
* a "butterfly" sum of 32 partials adds p[i] + p[i + 16], then + 8, 4, 2, 1,
  which is what every lane of a warp holds after the xor shuffles.

Numba compiles the loops; it never contracts or reorders float arithmetic
without fastmath, which is never turned on here (tests/test_canon.py checks).
"""
from __future__ import annotations

import math
import weakref

import numba
import numpy as np
from numba.extending import intrinsic

from ..gguf.quant_codes import QBLOCK, QHALF, QuantCodes

F32 = np.float32
LANES = 32            # a warp
NORM_THREADS = 256    # threads of one norm / hc block: 8 warps
KSPLIT_COLS = 512     # column slices of a split dot product
KSPLIT_MAX_ROWS = 64  # matrices of at most this many rows ...
KSPLIT_MIN_COLS = 4 * KSPLIT_COLS  # ... and at least this many columns are split
ATTN_SLICE = 32       # keys per attention slice

_ZERO, _ONE, _TWO, _HALF = F32(0.0), F32(1.0), F32(2.0), F32(0.5)
_INF = F32(np.inf)
_NAN = F32(np.nan)

# The constants are written as hexadecimal floats, exactly as ds4_hip.h writes them,
# so neither side depends on how a compiler rounds a decimal literal.
def _hex(h: str) -> np.float32:
    return F32(float.fromhex(h))


# exp: x = n ln2 + r, |r| <= ln2/2, exp(r) by a degree-7 polynomial (Cephes expf's
# coefficients), times 2^n. Results below 2^-125 flush to 0 and x > 88 gives inf,
# so the scaling by 2^n is always exact (no subnormal results).
_EXP_HI, _EXP_LO = F32(88.0), F32(-86.5)
_LOG2E = _hex("0x1.715476p+0")
_LN2_C1, _LN2_C2 = _hex("0x1.63p-1"), _hex("-0x1.bd0106p-13")  # C1 has 9 bits: n * C1 is exact
_ROUND = _hex("0x1.8p+23")  # 1.5 * 2^23: (y + R) - R rounds y to an integer, ties to even
_E0, _E1, _E2 = _hex("0x1.a0d2cep-13"), _hex("0x1.6e879cp-10"), _hex("0x1.111210p-7")
_E3, _E4, _E5 = _hex("0x1.555382p-5"), _hex("0x1.555554p-3"), _hex("0x1p-1")
_POW2 = np.array([2.0 ** k for k in range(-126, 128)], dtype=F32)

# log1p: 1 + x = m 2^k with m in [sqrt(1/2), sqrt(2)), log(m) from s = f / (2 + f),
# f = m - 1 (fdlibm's logf polynomial), plus the rounding error of 1 + x.
_SQRTH = _hex("0x1.6a09e6p-1")
_LG1, _LG2 = _hex("0x1.555554p-1"), _hex("0x1.999c26p-2")
_LG3, _LG4 = _hex("0x1.23d3dcp-2"), _hex("0x1.f13c4cp-3")
_LN2_HI, _LN2_LO = _hex("0x1.62e3p-1"), _hex("0x1.2fefa2p-17")


# ---------------------------------------------------------------------------
# Scalar functions (Numba), and their elementwise ufuncs
# ---------------------------------------------------------------------------


@numba.njit(cache=True)
def exp_f32(x):
    if x != x:
        return x
    if x > _EXP_HI:
        return _INF
    if x < _EXP_LO:
        return _ZERO
    n = (x * _LOG2E + _ROUND) - _ROUND
    r = (x - n * _LN2_C1) - n * _LN2_C2
    z = r * r
    p = _E0 * r + _E1
    p = p * r + _E2
    p = p * r + _E3
    p = p * r + _E4
    p = p * r + _E5
    p = (p * z + r) + _ONE
    return p * _POW2[int(n) + 126]


@numba.njit(cache=True)
def log1p_f32(x):
    if x != x or x == _INF:
        return x
    if x <= -_ONE:
        return -_INF if x == -_ONE else _NAN
    u = _ONE + x
    fr, k = math.frexp(u)
    m = F32(fr)
    if m < _SQRTH:
        m = m * _TWO
        k -= 1
    if k > 0:
        c = (_ONE - (u - x)) / u
    else:
        c = (x - (u - _ONE)) / u
    f = m - _ONE
    s = f / (_TWO + f)
    z = s * s
    w = z * z
    big_r = z * (_LG1 + w * _LG3) + w * (_LG2 + w * _LG4)
    hfsq = _HALF * f * f
    kf = F32(k)
    return kf * _LN2_HI - ((hfsq - (s * (hfsq + big_r) + (kf * _LN2_LO + c))) - f)


@numba.njit(cache=True)
def sigmoid_f32(x):
    return _ONE / (_ONE + exp_f32(-x))


@numba.njit(cache=True)
def softplus_f32(x):
    return max(x, _ZERO) + log1p_f32(exp_f32(-abs(x)))


@numba.njit(cache=True)
def silu_f32(x):
    return x * sigmoid_f32(x)


def _ufunc(scalar):
    u = numba.vectorize(["float32(float32)"], cache=True)(scalar.py_func)

    def elementwise(x):
        # the compiled loop may evaluate both sides of a branch (inf - inf) before
        # selecting one: the flags it raises say nothing about the result
        with np.errstate(invalid="ignore", over="ignore"):
            return u(np.asarray(x, F32))
    elementwise.__name__ = elementwise.__qualname__ = scalar.__name__.replace("_f32", "")
    elementwise.__doc__ = f"Elementwise canonical {elementwise.__name__} over a float32 array."
    return elementwise


exp = _ufunc(exp_f32)
log1p = _ufunc(log1p_f32)
sigmoid = _ufunc(sigmoid_f32)
softplus = _ufunc(softplus_f32)
silu = _ufunc(silu_f32)


# ---------------------------------------------------------------------------
# Reductions
# ---------------------------------------------------------------------------


@numba.njit(cache=True)
def _butterfly(p, n):
    """Sum p[:n] (n a power of two) as an xor butterfly leaves it in lane 0; p is scratch."""
    h = n // 2
    while h >= 1:
        for i in range(h):
            p[i] = p[i] + p[i + h]
        h //= 2
    return p[0]


@numba.njit(cache=True)
def _butterfly_cols(p, live, n):
    """The butterfly of the 32 partials p[:, i] of each column i < n, lanes >= live being +0.
    A partial summed from +0 is never -0 (in round to nearest, a sum is -0 only when both
    terms are), so adding a +0 lane changes nothing and is skipped: exactly the full
    butterfly's result, p[0]."""
    h = LANES // 2
    while h >= 1:
        for q in range(min(h, live - h)):
            for i in range(n):
                p[q, i] = p[q, i] + p[q + h, i]
        live = min(live, h)
        h //= 2


@numba.njit(cache=True)
def _dot_warp8(w, x, c0, clen, p):
    """Warp dot of w[c0:c0+clen] . x[c0:c0+clen]: lane t sums columns t*8 .. t*8+7 of every
    256-column step, steps in order, each term as fma(w, x, partial), then the butterfly."""
    full = clen // (LANES * 8) * (LANES * 8)
    for t in range(LANES):
        acc = _ZERO
        for s in range(0, full, LANES * 8):
            o = c0 + s + t * 8
            for j in range(8):
                acc = fma_f32(w[o + j], x[o + j], acc)
        for j in range(8):  # the last, partial step
            c = full + t * 8 + j
            if c < clen:
                acc = fma_f32(w[c0 + c], x[c0 + c], acc)
        p[t] = acc
    return _butterfly(p, LANES)


@numba.njit(cache=True)
def _matvec(x, w, ks):
    """The written order, one output at a time: the per-row yardstick of _matmul (tests)."""
    n, k = x.shape
    rows = w.shape[0]
    y = np.empty((n, rows), np.float32)
    p = np.empty(LANES, np.float32)
    for r in range(rows):
        for a in range(n):
            tot = _ZERO
            for c0 in range(0, k, ks):
                tot = tot + _dot_warp8(w[r], x[a], c0, min(ks, k - c0), p)
            y[a, r] = tot
    return y


MM_ROWS = 256  # weight rows per block of _matmul: their 32 partials per input fit in L1


@numba.njit(cache=True)
def _lane_partials(wt, x, c0, clen, p, n_in, fused):
    """The 32 lane partials of every column of the block wt (K, bw) against the n_in (1 or 2)
    inputs x[:n_in], sharing each weight load: lane t's partial takes column
    c = s*256 + t*8 + j of the slice [c0, c0 + clen), and visiting (s, j, t) in that nesting
    keeps each partial's additions in the order s, then j. Returns the lanes that got a column.
    fused: each term enters as fma(w, x, partial), the canonical product (docs/exactness.md
    §2); without it, as partial + w * x (two roundings), the alternative that
    benchmarks/fma_products.py measures against it."""
    bw = wt.shape[1]
    live = min(LANES, (clen + 7) // 8)
    p[:n_in, :live, :] = _ZERO
    for s in range(0, clen, LANES * 8):
        for j in range(8):
            for t in range(LANES):
                c = s + t * 8 + j
                if c >= clen:
                    break
                wc = wt[c0 + c]
                q0, u0 = p[0, t], x[0, c0 + c]
                if n_in == 1:
                    if fused:
                        for i in range(bw):
                            q0[i] = fma_f32(wc[i], u0, q0[i])
                    else:
                        for i in range(bw):
                            q0[i] = q0[i] + wc[i] * u0
                else:
                    q1, u1 = p[1, t], x[1, c0 + c]
                    if fused:
                        for i in range(bw):
                            q0[i] = fma_f32(wc[i], u0, q0[i])
                            q1[i] = fma_f32(wc[i], u1, q1[i])
                    else:
                        for i in range(bw):
                            wi = wc[i]
                            q0[i] = q0[i] + wi * u0
                            q1[i] = q1[i] + wi * u1
    return live


@numba.njit(cache=True)
def _matmul_item(x, wb, rows, ks, y, b, a, p, fused):
    """Outputs y[a:a+2, block b's rows] (see _matmul)."""
    n, k = x.shape
    wt, bw = wb[b], wb.shape[2]
    r0, rb = b * bw, min(bw, rows - b * bw)
    n_in = min(2, n - a)
    for c0 in range(0, k, ks):
        live = _lane_partials(wt, x[a:a + n_in], c0, min(ks, k - c0), p, n_in, fused)
        for e in range(n_in):
            _butterfly_cols(p[e], live, rb)
            for i in range(rb):
                y[a + e, r0 + i] = y[a + e, r0 + i] + p[e, 0, i]


@numba.njit(cache=True)
def _matmul(x, wb, rows, ks, fused=True):
    """y = x @ w.T for every input row at once, w given as `weight_blocks(w)`. Each output
    element is exactly the warp dot of _matvec: the same 32 partials, each summed in the
    same order, the same butterfly, the slices summed in order; so a row's outputs do not
    depend on the other rows. The innermost loop runs over a block's weight rows
    (independent accumulators, vectorisable), for two input rows at a time."""
    n = x.shape[0]
    y = np.zeros((n, rows), np.float32)
    p = np.empty((2, LANES, wb.shape[2]), np.float32)
    for b in range(wb.shape[0]):
        for a in range(0, n, 2):
            _matmul_item(x, wb, rows, ks, y, b, a, p, fused)
    return y


@numba.njit(cache=True, parallel=True)
def _matmul_par(x, wb, rows, ks, fused=True):
    """_matmul on all of Numba's threads: the items (weight block, input pair) write disjoint
    outputs, so no sum depends on the thread or the order."""
    n = x.shape[0]
    y = np.zeros((n, rows), np.float32)
    pairs = (n + 1) // 2
    for item in numba.prange(wb.shape[0] * pairs):
        p = np.empty((2, LANES, wb.shape[2]), np.float32)
        _matmul_item(x, wb, rows, ks, y, item // pairs, (item % pairs) * 2, p, fused)
    return y


# Passes of at least this many rows run the reference's products on all of Numba's threads;
# a decode pass stays on one (the threads' start-up costs more than its rows: the embedded
# model's decode at C = 1 went from 235 to 180 tok/s when every call ran threaded).
PARALLEL_ROWS = 32


def _matmul_for(n_rows: int):
    return _matmul_par if n_rows >= PARALLEL_ROWS else _matmul


def _blocks(w: np.ndarray) -> np.ndarray:
    rows, k = w.shape
    bw = max(1, min(rows, MM_ROWS))
    nb = -(-rows // bw)
    padded = np.zeros((nb * bw, k), F32)
    padded[:rows] = w
    return np.ascontiguousarray(padded.reshape(nb, bw, k).transpose(0, 2, 1))


_BLOCKS: dict[int, tuple] = {}   # id(root array) -> (weakref, {view: blocks})
_BY_ID: dict[int, tuple] = {}    # id(array) -> (weakref, blocks): the fast path


def weight_blocks(w: np.ndarray) -> np.ndarray:
    """w (rows, K) as _matmul reads it: blocks of bw = min(rows, MM_ROWS) rows, each transposed
    to (K, bw), the last one padded with zero rows. A read-only w (the model's weights are) is laid out
    once: the copy is kept, per view, for as long as the memory w views lives."""
    hit = _BY_ID.get(id(w))
    if hit is not None and hit[0]() is w:
        return hit[1]
    root = w
    while isinstance(root.base, np.ndarray):
        root = root.base
    if w.flags.writeable or root.flags.writeable:
        return _blocks(w)
    key = id(root)
    entry = _BLOCKS.get(key)
    if entry is None or entry[0]() is not root:
        entry = _BLOCKS[key] = (weakref.ref(root, lambda _, key=key: _BLOCKS.pop(key, None)), {})
    view = (w.__array_interface__["data"][0] - root.__array_interface__["data"][0], w.shape, w.strides)
    wb = entry[1].get(view)
    if wb is None:
        wb = entry[1][view] = _blocks(w)
    _BY_ID[id(w)] = (weakref.ref(w, lambda _, key=id(w): _BY_ID.pop(key, None)), wb)
    return wb


# ---------------------------------------------------------------------------
# Products with block-quantised weights (official numerics): exact integer block dots
# ---------------------------------------------------------------------------
# The activation row is quantised to int8 per 32 columns; each 16-column half's dot with
# the weight's integer codes is an exact int32 sum, so its order cannot matter (dp4a, int8
# tensor cores and these loops give the same integers). Only the combination of the block
# results is float, in the fixed order of qlinear (docs/exactness.md, "quantised linear").

_Q8_MAX = F32(127.0)


@intrinsic
def fma_f32(typingctx, a, b, c):
    """a * b + c with one rounding (LLVM's llvm.fma.f32, correctly rounded: in hardware on
    x86-64 with FMA, else libm's fmaf). The canonical arithmetic's only fused operation: each
    term of a float product, and each block of a quantised one, enters its partial by it."""
    if not all(t == numba.types.float32 for t in (a, b, c)):
        return None
    sig = numba.types.float32(numba.types.float32, numba.types.float32, numba.types.float32)

    def codegen(context, builder, signature, args):
        return builder.fma(*args)
    return sig, codegen


@numba.njit(cache=True)
def _fma_scalar(a, b, c):
    return fma_f32(a, b, c)


def fma(a, b, c) -> np.float32:
    """fma_f32 on float32 scalars, from Python (tests and oracles)."""
    return _fma_scalar(F32(a), F32(b), F32(c))


@numba.njit(cache=True)
def _quantize_q8_rows(x, xq, dx, xs):
    """quantize_q8 of every row of x into xq, dx, and the int32 sums of each 16-column half of
    xq into xs (qlinear's mn term needs them, once per input row)."""
    n, k = x.shape
    for r in range(n):
        for b in range(k // QBLOCK):
            c0 = b * QBLOCK
            amax = _ZERO
            finite = True
            for i in range(QBLOCK):
                a = abs(x[r, c0 + i])
                if not a < _INF:  # inf or NaN
                    finite = False
                elif a > amax:
                    amax = a
            if not finite:
                d = _NAN
            else:
                d = amax / _Q8_MAX
            dx[r, b] = d
            for h in range(2):
                s = 0
                for i in range(h * QHALF, (h + 1) * QHALF):
                    q = 0
                    if d > _ZERO:  # amax == 0 (d = 0), an underflowed d = 0 and NaN all give q = 0
                        v = x[r, c0 + i] / d
                        v = min(max(v, -_Q8_MAX), _Q8_MAX)
                        q = int((v + _ROUND) - _ROUND)  # round half to even (|v| <= 127)
                    xq[r, c0 + i] = q
                    s += q
                xs[r, 2 * b + h] = s


def _quantize_q8(x: np.ndarray):
    x = np.ascontiguousarray(x, F32)
    n, k = x.shape
    if k % QBLOCK:
        raise ValueError(f"quantize_q8: {k} columns are not a multiple of {QBLOCK}")
    xq, dx = np.empty((n, k), np.int8), np.empty((n, k // QBLOCK), F32)
    xs = np.empty((n, k // QHALF), np.int32)
    _quantize_q8_rows(x, xq, dx, xs)
    return xq, dx, xs


def quantize_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x float32 (n, K), K % 32 == 0 -> (xq int8 (n, K), dx float32 (n, K // 32)): per row and
    32-column block, dx = amax / 127 and xq = rint(x / dx) clamped to +-127 (docs/exactness.md).
    A block holding inf or NaN gets dx = NaN (so the NaN reaches the output), q = 0."""
    xq, dx, _ = _quantize_q8(x)
    return xq, dx


def _blocks_t(a: np.ndarray) -> np.ndarray:
    rows, k = a.shape
    bw = max(1, min(rows, MM_ROWS))
    nb = -(-rows // bw)
    padded = np.zeros((nb * bw, k), a.dtype)
    padded[:rows] = a
    return np.ascontiguousarray(padded.reshape(nb, bw, k).transpose(0, 2, 1))


def _code_blocks(qc: QuantCodes):
    """The layout _qmatmul reads: blocks of bw = min(N, MM_ROWS) weight rows, each array
    transposed to (columns or halves or blocks, bw), the last block padded with zero rows;
    made once per QuantCodes."""
    if "blocks" not in qc._views:
        qc._views["blocks"] = tuple(_blocks_t(a) for a in (qc.codes, qc.mul, qc.mn, qc.s1, qc.s2))
    return qc._views["blocks"]


@numba.njit(cache=True)
def _q_partials(ct, mt, nt, s1t, s2t, xq, dx, xs, a, n_in, p, acc):
    """The 32 fma partials of every weight row of one block (ct (K, bw) ...) against the n_in
    (1 or 2) input rows a, a + 1: partial t takes blocks t, t + 32, ... in order. The integer
    sums of a block run over its 16 + 16 columns with the weight rows innermost (exact, so
    any order; this one vectorises). Returns the partials that got a block."""
    k, bw = ct.shape
    nb = k // QBLOCK
    live = min(LANES, nb)
    p[:n_in, :live, :] = _ZERO
    for b in range(nb):
        t = b % LANES
        for e in range(n_in):
            acc[e, :, :] = 0
        for h in range(2):
            for i in range(b * QBLOCK + h * QHALF, b * QBLOCK + (h + 1) * QHALF, 4):
                # four columns per pass over the accumulators: a quarter of their loads and stores
                w0, w1, w2, w3 = ct[i], ct[i + 1], ct[i + 2], ct[i + 3]
                for e in range(n_in):
                    u0, u1 = np.int32(xq[a + e, i]), np.int32(xq[a + e, i + 1])
                    u2, u3 = np.int32(xq[a + e, i + 2]), np.int32(xq[a + e, i + 3])
                    se = acc[e, h]
                    for o in range(bw):
                        se[o] += ((np.int32(w0[o]) * u0 + np.int32(w1[o]) * u1)
                                  + (np.int32(w2[o]) * u2 + np.int32(w3[o]) * u3))
        m0, m1, n0, n1 = mt[2 * b], mt[2 * b + 1], nt[2 * b], nt[2 * b + 1]
        sc1, sc2 = s1t[b], s2t[b]
        for e in range(n_in):
            d = dx[a + e, b]
            x0, x1 = np.int32(xs[a + e, 2 * b]), np.int32(xs[a + e, 2 * b + 1])
            pe, g0, g1 = p[e, t], acc[e, 0], acc[e, 1]
            for o in range(bw):
                big_a = np.int32(m0[o]) * g0[o] + np.int32(m1[o]) * g1[o]
                big_b = np.int32(n0[o]) * x0 + np.int32(n1[o]) * x1
                tb = sc1[o] * np.float32(big_a) - sc2[o] * np.float32(big_b)
                pe[o] = fma_f32(d, tb, pe[o])
    return live


@numba.njit(cache=True)
def _qmatmul_item(xq, dx, xs, cb, mb, nbk, s1b, s2b, rows, y, blk, a, p, acc):
    """Outputs y[a:a+2, block blk's rows] (see _qmatmul)."""
    n = xq.shape[0]
    bw = cb.shape[2]
    r0, rb = blk * bw, min(bw, rows - blk * bw)
    n_in = min(2, n - a)
    live = _q_partials(cb[blk], mb[blk], nbk[blk], s1b[blk], s2b[blk], xq, dx, xs, a, n_in, p, acc)
    for e in range(n_in):
        _butterfly_cols(p[e], live, rb)
        for i in range(rb):
            y[a + e, r0 + i] = p[e, 0, i]


@numba.njit(cache=True)
def _qmatmul(xq, dx, xs, cb, mb, nbk, s1b, s2b, rows):
    """qlinear's outputs for every input row, two input rows at a time per weight block (the
    weight codes read once for both); each output is exactly its own 32 partials' butterfly."""
    n = xq.shape[0]
    y = np.zeros((n, rows), np.float32)
    p = np.empty((2, LANES, cb.shape[2]), np.float32)
    acc = np.empty((2, 2, cb.shape[2]), np.int32)
    for blk in range(cb.shape[0]):
        for a in range(0, n, 2):
            _qmatmul_item(xq, dx, xs, cb, mb, nbk, s1b, s2b, rows, y, blk, a, p, acc)
    return y


@numba.njit(cache=True, parallel=True)
def _qmatmul_par(xq, dx, xs, cb, mb, nbk, s1b, s2b, rows):
    """_qmatmul on all of Numba's threads: the items (weight block, input pair) write disjoint
    outputs, so no sum depends on the thread or the order."""
    n = xq.shape[0]
    y = np.zeros((n, rows), np.float32)
    pairs = (n + 1) // 2
    for item in numba.prange(cb.shape[0] * pairs):
        p = np.empty((2, LANES, cb.shape[2]), np.float32)
        acc = np.empty((2, 2, cb.shape[2]), np.int32)
        _qmatmul_item(xq, dx, xs, cb, mb, nbk, s1b, s2b, rows, y, item // pairs, (item % pairs) * 2, p, acc)
    return y


def _qlinear2(x2: np.ndarray, qc: QuantCodes) -> np.ndarray:
    rows, k = qc.shape
    if x2.shape[1] != k:
        raise ValueError(f"qlinear: input has {x2.shape[1]} columns, the weight {k}")
    xq, dx, xs = _quantize_q8(x2)
    run = _qmatmul_par if x2.shape[0] >= PARALLEL_ROWS else _qmatmul
    return run(xq, dx, xs, *_code_blocks(qc), rows)


def qlinear(x: np.ndarray, qc: QuantCodes) -> np.ndarray:
    """x @ w.T for a block-quantised w (n, N) float32: x quantised by quantize_q8, each block's
    dot an exact integer sum, the blocks combined by fma into 32 partials and the butterfly
    (docs/exactness.md). Never split; every output depends on its own input row only."""
    x = np.ascontiguousarray(x, F32)
    k = x.shape[-1]
    return _qlinear2(x.reshape(-1, k), qc).reshape(x.shape[:-1] + (qc.shape[0],))


def ksplit(rows: int, cols: int) -> int:
    """Columns per slice of a split dense dot product (0: not split). A property of the
    matrix's shape: few long rows (hc mixes, router, indexer weights) are cut into slices
    summed in order, so the GPU can spread them over more blocks."""
    return KSPLIT_COLS if rows <= KSPLIT_MAX_ROWS and cols >= KSPLIT_MIN_COLS else 0


def _product(x2: np.ndarray, w, split: bool) -> np.ndarray:
    """x2 (n, K) @ w.T: the int path for a QuantCodes w (never split), else the warp dots."""
    if isinstance(w, QuantCodes):
        return _qlinear2(x2, w)
    ks = (ksplit(*w.shape) if split else 0) or max(w.shape[1], 1)
    return _matmul_for(x2.shape[0])(x2, weight_blocks(w), w.shape[0], ks)


def _operand(w):
    return w if isinstance(w, QuantCodes) else np.asarray(w, F32)


def linear(x: np.ndarray, w, split: bool = True) -> np.ndarray:
    """x @ w.T. Float w: each output one warp dot (sliced by `ksplit` for dense weights; routed
    experts pass split=False, their kernel never slices). A QuantCodes w: qlinear. All rows of
    x in one pass over the weights; every row's result is bitwise that of the row alone."""
    x = np.ascontiguousarray(x, F32)
    w = _operand(w)
    k = x.shape[-1]
    return _product(x.reshape(-1, k), w, split).reshape(x.shape[:-1] + (w.shape[0],))


@numba.njit(cache=True)
def _swiglu_act(g, u, clamp):
    """g = silu(min(g, clamp)) * clip(u, +-clamp), in place."""
    for r in range(g.shape[0]):
        for i in range(g.shape[1]):
            gi, ui = g[r, i], u[r, i]
            if not gi < clamp and gi == gi:  # np.minimum(g, clamp): NaN stays NaN
                gi = clamp
            if not ui > -clamp and ui == ui:  # np.clip(u, -clamp, clamp), likewise
                ui = -clamp
            if not ui < clamp and ui == ui:
                ui = clamp
            g[r, i] = silu_f32(gi) * ui


def swiglu(x: np.ndarray, w1, w3, w2, clamp: float, split: bool = True) -> np.ndarray:
    """Clamped SwiGLU expert: linear(silu(min(x W1, clamp)) * clip(x W3, +-clamp), W2), the
    products as `linear` computes them (a QuantCodes weight by qlinear, its input row quantised
    afresh), in one call."""
    x = np.ascontiguousarray(x, F32)
    w1, w3, w2 = (_operand(w) for w in (w1, w3, w2))
    x2 = x.reshape(-1, x.shape[-1])
    g = _product(x2, w1, split)
    _swiglu_act(g, _product(x2, w3, split), F32(clamp))
    return _product(g, w2, split).reshape(x.shape[:-1] + (w2.shape[0],))


@numba.njit(cache=True)
def _sumsq_rows(x):
    """Per row: thread i of 256 sums x[i]^2, x[i+256]^2, ... in order; each warp's
    butterfly; then the butterfly over the 8 warp sums."""
    n, d = x.shape
    out = np.empty(n, np.float32)
    p = np.empty(NORM_THREADS, np.float32)
    wsum = np.empty(8, np.float32)
    for r in range(n):
        for i in range(NORM_THREADS):
            p[i] = _ZERO
        xr = x[r]
        for b in range(0, d, NORM_THREADS):  # columns b .. b+255: one per thread, in order
            for t in range(min(NORM_THREADS, d - b)):
                p[t] = p[t] + xr[b + t] * xr[b + t]
        for wp in range(8):
            wsum[wp] = _butterfly(p[wp * LANES:(wp + 1) * LANES], LANES)
        out[r] = _butterfly(wsum, 8)
    return out


def sumsq(x: np.ndarray) -> np.ndarray:
    """Sum of squares over the last axis, keepdims."""
    x = np.ascontiguousarray(x, F32)
    return _sumsq_rows(x.reshape(-1, x.shape[-1])).reshape(x.shape[:-1] + (1,))


def seqsum(terms) -> np.ndarray:
    """Elementwise sum of the terms in order, from +0."""
    acc = None
    for t in terms:
        acc = (_ZERO + t) if acc is None else acc + t
    return acc


@numba.njit(cache=True)
def _dots_lanes(q, kt, n, p, out):
    """out[i] = warp dot of q (D,) with key i < n, kt = keys.T (D, >= n): lane t sums dims t,
    t+32, ... in order, then the butterfly. All keys at once (the innermost loop runs over
    keys); p is (32, >= n) scratch."""
    d = kt.shape[0]
    p[:, :n] = _ZERO
    for b in range(0, d, LANES):  # dims b .. b+31: one per lane, each lane's terms in order
        for t in range(min(LANES, d - b)):
            qv = q[b + t]
            row = kt[b + t]
            pt = p[t]
            for i in range(n):
                pt[i] = pt[i] + qv * row[i]
    h = LANES // 2
    while h >= 1:
        for t in range(h):
            for i in range(n):
                p[t, i] = p[t, i] + p[t + h, i]
        h //= 2
    out[:n] = p[0, :n]


# ---------------------------------------------------------------------------
# Norms, hyper-connections
# ---------------------------------------------------------------------------


def rms0(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(sumsq(x) / F32(x.shape[-1]) + F32(eps))


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return w * rms0(x, eps)


def _hc_mix(streams: np.ndarray, fn: np.ndarray, rms_eps: float) -> np.ndarray:
    n, hc, d = streams.shape
    f = streams.reshape(n, hc * d)
    r = _ONE / np.sqrt(sumsq(f) / F32(hc * d) + F32(rms_eps))
    return linear(f, fn) * r


def _weighted_streams(pre: np.ndarray, streams: np.ndarray) -> np.ndarray:
    """u[n, e] = sum over streams k, in order, of pre[n, k] * streams[n, k, e]."""
    return seqsum(pre[:, k, None] * streams[:, k, :] for k in range(streams.shape[1]))


@numba.njit(cache=True)
def _normalise_rows(m, eps):
    """m[i, :] /= (sum in order of m[i, :]) + eps; columns through m.T."""
    for i in range(m.shape[0]):
        s = _ZERO
        for j in range(m.shape[1]):
            s = s + m[i, j]
        d = s + eps
        for j in range(m.shape[1]):
            m[i, j] = m[i, j] / d


@numba.njit(cache=True)
def sinkhorn(c, iters, eps):
    """Column normalisation first, then iters-1 rounds of rows then columns, in c's dtype
    (float32 here; the float64 reference runs the same loops)."""
    out = c.copy()
    for t in range(c.shape[0]):
        m = out[t]
        for it in range(iters):
            if it > 0:
                _normalise_rows(m, eps)
            _normalise_rows(m.T, eps)
    return out


@numba.njit(cache=True)
def _hc_split_row(r, m, streams, base, scale, eps, iters, pre, post, comb, u):
    """Row r of _hc_split_rows' outputs."""
    _, hc, d = streams.shape
    v = np.empty(hc, np.float32)
    for k in range(hc):
        pre[r, k] = sigmoid_f32(m[r, k] * scale[0] + base[k]) + eps
        post[r, k] = _TWO * sigmoid_f32(m[r, hc + k] * scale[1] + base[hc + k])
    for i in range(hc):
        o = 2 * hc + i * hc
        for j in range(hc):
            v[j] = m[r, o + j] * scale[2] + base[o + j]
        mx = v[0]
        for j in range(1, hc):
            if v[j] > mx or v[j] != v[j]:  # np.max: NaN wins
                mx = v[j]
        tot = _ZERO
        for j in range(hc):
            v[j] = exp_f32(v[j] - mx)
            tot = tot + v[j]
        for j in range(hc):
            comb[r, i, j] = v[j] / tot + eps
    c = comb[r]
    for it in range(iters):
        if it > 0:
            _normalise_rows(c, eps)
        _normalise_rows(c.T, eps)
    for e in range(d):
        acc = _ZERO
        for k in range(hc):
            acc = acc + pre[r, k] * streams[r, k, e]
        u[r, e] = acc


@numba.njit(cache=True)
def _hc_split_rows(m, streams, base, scale, eps, iters, pre, post, comb, u):
    """From the mixing logits m (n, hc*(2+hc)): pre, post, the Sinkhorn-normalised comb, and the
    block input u; elementwise as the docs' hc_pre table, sums in order."""
    for r in range(m.shape[0]):
        _hc_split_row(r, m, streams, base, scale, eps, iters, pre, post, comb, u)


@numba.njit(cache=True, parallel=True)
def _hc_split_rows_par(m, streams, base, scale, eps, iters, pre, post, comb, u):
    for r in numba.prange(m.shape[0]):  # rows are independent: any thread, any order
        _hc_split_row(r, m, streams, base, scale, eps, iters, pre, post, comb, u)


def hc_pre(streams, fn, base, scale, rms_eps, hc_eps, iters):
    m = _hc_mix(streams, fn, rms_eps)
    streams = np.ascontiguousarray(streams, F32)
    n, hc, d = streams.shape
    pre, post = np.empty((n, hc), F32), np.empty((n, hc), F32)
    comb, u = np.empty((n, hc, hc), F32), np.empty((n, d), F32)
    run = _hc_split_rows_par if n >= PARALLEL_ROWS else _hc_split_rows
    run(m, streams, np.asarray(base, F32), np.asarray(scale, F32), F32(hc_eps), int(iters), pre, post, comb, u)
    return u, post, comb


@numba.njit(cache=True)
def _hc_post(streams, y, post, comb):
    n, hc, d = streams.shape
    out = np.empty((n, hc, d), np.float32)
    for r in range(n):
        for j in range(hc):
            o = out[r, j]
            for e in range(d):
                o[e] = post[r, j] * y[r, e]
            for i in range(hc):
                c, si = comb[r, i, j], streams[r, i]
                for e in range(d):
                    o[e] = o[e] + c * si[e]
    return out


def hc_post(streams, y, post, comb):
    """S'[j] = post_j * y + comb[0, j] S[0] + comb[1, j] S[1] + ..., in that order."""
    return _hc_post(*(np.ascontiguousarray(a, F32) for a in (streams, y, post, comb)))


def hc_head(streams, fn, base, scale, rms_eps, hc_eps):
    m = _hc_mix(streams, fn, rms_eps)
    pre = sigmoid(m * scale[0] + base) + F32(hc_eps)
    return _weighted_streams(pre, streams)


# ---------------------------------------------------------------------------
# RoPE table, Hadamard rotation
# ---------------------------------------------------------------------------


# A float64 libm result is within a few ulps of the true value, but which few differs between
# libms (glibc, NumPy's SIMD paths): a table that must be the same bits on every machine takes
# the float32 nearest the true value. The float64 value decides it unless it lies within
# _DOUBT of a float32 rounding boundary; those rare entries are recomputed in 160-bit arithmetic.
_DOUBT = 2.0 ** -44  # 512 float64 ulps, relative


def correctly_rounded_f32(approx: np.ndarray, exact) -> np.ndarray:
    """float32 nearest exact(x) for each entry, given approx ~ exact in float64; `exact` maps
    the entry's flat index to an mpmath value."""
    import mpmath
    approx = np.asarray(approx, np.float64)
    out = approx.astype(F32)
    margin = np.abs(approx) * _DOUBT
    doubt = (approx - margin).astype(F32) != (approx + margin).astype(F32)
    flat = out.reshape(-1)
    for i in np.flatnonzero(doubt.reshape(-1)):
        with mpmath.workprec(160):
            v = exact(int(i))
        with mpmath.workprec(24):  # round half to even onto float32's 24-bit significand
            flat[i] = F32(float(+v))
    return out


def correctly_rounded_pow(base: float, exponent: np.ndarray) -> np.ndarray:
    """base ** exponent, each the float64 nearest the true value (rope_omega's frequencies)."""
    import mpmath
    with mpmath.workprec(160):
        return np.array([float(mpmath.power(mpmath.mpf(base), mpmath.mpf(float(e)))) for e in exponent])


def rope_cos_sin(omega: np.ndarray, pos) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin of theta = f32(pos) * f32(omega), each the float32 nearest the true value
    (correctly rounded, so the same bits on every machine). The HIP backend uploads this
    very table (by position), so the two backends read the same bits."""
    import mpmath
    theta = np.asarray(pos, dtype=F32)[..., None] * np.asarray(omega, F32)
    t64 = theta.astype(np.float64)
    flat = t64.reshape(-1)
    return tuple(correctly_rounded_f32(f(t64), lambda i, g=g: g(mpmath.mpf(float(flat[i]))))
                 for f, g in ((np.cos, mpmath.cos), (np.sin, mpmath.sin)))


@numba.njit(cache=True)
def _rotate(v, ht):
    """out[r, j] = sum over i in order of v[r, i] * h[j, i], ht = h.T: every output j of a row
    at once (the innermost loop runs over j)."""
    n, d = v.shape
    out = np.zeros((n, ht.shape[1]), np.float32)
    for r in range(n):
        o = out[r]
        for i in range(d):
            vi = v[r, i]
            hi = ht[i]
            for j in range(o.size):
                o[j] = o[j] + vi * hi[j]
    return out


def hadamard_rotate(v: np.ndarray, h: np.ndarray) -> np.ndarray:
    """v @ h.T, each output summed over i in order (one thread per output on the GPU)."""
    v = np.ascontiguousarray(v, F32)
    ht = np.ascontiguousarray(np.asarray(h, F32).T)
    return _rotate(v.reshape(-1, v.shape[-1]), ht).reshape(v.shape[:-1] + (h.shape[0],))


# ---------------------------------------------------------------------------
# Attention with sinks, compressor pooling, indexer
# ---------------------------------------------------------------------------


@numba.njit(cache=True)
def _attention(q, keys, sinks, scale):
    """Per head: slices of 32 keys, each an online softmax in key order; slices merged in
    order, then the sink (it adds to the denominator only)."""
    h_n, d = q.shape
    n = keys.shape[0]
    nz = (n + ATTN_SLICE - 1) // ATTN_SLICE
    out = np.empty((h_n, d), np.float32)
    kt = keys.T.copy()
    p = np.empty((LANES, n), np.float32)
    sc = np.empty(n, np.float32)
    zm = np.empty(nz, np.float32)
    zden = np.empty(nz, np.float32)
    ze = np.empty(nz, np.float32)
    zacc = np.empty((nz, d), np.float32)
    for h in range(h_n):
        _dots_lanes(q[h], kt, n, p, sc)
        for z in range(nz):
            m, den = -_INF, _ZERO
            acc = zacc[z]
            acc[:] = _ZERO
            for i in range(z * ATTN_SLICE, min(n, (z + 1) * ATTN_SLICE)):
                k = keys[i]
                si = sc[i] * scale
                if si > m:
                    c = exp_f32(m - si)
                    den = den * c + _ONE
                    for t in range(d):
                        acc[t] = acc[t] * c + k[t]
                    m = si
                else:
                    e = exp_f32(si - m)
                    den = den + e
                    for t in range(d):
                        acc[t] = acc[t] + e * k[t]
            zm[z], zden[z] = m, den
        sk = sinks[h]
        mf = sk
        for z in range(nz):
            mf = max(mf, zm[z])
        dtot = exp_f32(sk - mf)
        for z in range(nz):
            ze[z] = exp_f32(zm[z] - mf)
            dtot = dtot + zden[z] * ze[z]
        for t in range(d):
            a = _ZERO
            for z in range(nz):
                a = a + zacc[z, t] * ze[z]
            out[h, t] = a / dtot
    return out


@numba.njit(cache=True)
def _attention_rows(q, keys, offsets, sinks, scale):
    out = np.empty(q.shape, np.float32)
    for r in range(q.shape[0]):
        out[r] = _attention(q[r], keys[offsets[r]:offsets[r + 1]], sinks, scale)
    return out


@numba.njit(cache=True, parallel=True)
def _attention_rows_par(q, keys, offsets, sinks, scale):
    out = np.empty(q.shape, np.float32)
    for r in numba.prange(q.shape[0]):  # rows are independent: any thread, any order
        out[r] = _attention(q[r], keys[offsets[r]:offsets[r + 1]], sinks, scale)
    return out


def attention_rows(q: np.ndarray, keys: list, sinks: np.ndarray) -> np.ndarray:
    """Row r of q (R, H, D) attends to its own visible rows: the concatenation of the arrays
    keys[r] (one list per row, in order) -> (R, H, D), in one call."""
    scale = F32(1.0 / math.sqrt(q.shape[-1]))
    flat = np.concatenate([k for row in keys for k in row]).astype(F32, copy=False)
    offsets = np.concatenate([[0], np.cumsum([sum(len(k) for k in row) for row in keys])])
    run = _attention_rows_par if len(keys) >= PARALLEL_ROWS else _attention_rows
    return run(np.ascontiguousarray(q, F32), flat, offsets, np.ascontiguousarray(sinks, F32), scale)


def attention_with_sinks(q: np.ndarray, keys: np.ndarray, sinks: np.ndarray) -> np.ndarray:
    """q (H, D), keys (N, D): the visible K=V rows in their fixed order -> (H, D)."""
    return attention_rows(np.asarray(q)[None], [[keys]], sinks)[0]


def pool_window(kv: np.ndarray, score: np.ndarray) -> np.ndarray:
    """Per channel over the C candidates in order: e = exp(s - max), den and num summed
    in order, num / den (0 where every candidate is -inf)."""
    mx = np.max(score, axis=-2)
    mx = np.where(np.isfinite(mx), mx, _ZERO)
    den = np.zeros(mx.shape, F32)
    num = np.zeros(mx.shape, F32)
    for c in range(score.shape[-2]):
        e = exp(score[..., c, :] - mx)
        den = den + e
        num = num + e * kv[..., c, :]
    return np.where(den > _ZERO, num / np.where(den > _ZERO, den, _ONE), _ZERO)


@numba.njit(cache=True)
def _indexer_row(r, qi, wts, kt, counts, out):
    n = kt.shape[1]
    p = np.empty((LANES, n), np.float32)
    dots = np.empty(n, np.float32)
    c, o = counts[r], out[r]
    o[:c] = _ZERO
    for h in range(qi.shape[1]):
        _dots_lanes(qi[r, h], kt, c, p, dots)
        for i in range(c):
            o[i] = o[i] + max(dots[i], _ZERO) * wts[r, h]


@numba.njit(cache=True)
def _indexer_scores(qi, wts, kt, counts, out):
    for r in range(qi.shape[0]):
        _indexer_row(r, qi, wts, kt, counts, out)


@numba.njit(cache=True, parallel=True)
def _indexer_scores_par(qi, wts, kt, counts, out):
    for r in numba.prange(qi.shape[0]):  # rows are independent: any thread, any order
        _indexer_row(r, qi, wts, kt, counts, out)


def indexer_scores_rows(qi: np.ndarray, wts: np.ndarray, keys: np.ndarray, counts) -> np.ndarray:
    """indexer_scores of m queries (qi (m, Hi, Di), wts (m, Hi)) against the first counts[r]
    of the same keys (N, Di), in one call -> (m, N), NaN past counts[r]."""
    kt = np.ascontiguousarray(np.asarray(keys, F32).T)
    out = np.full((len(qi), kt.shape[1]), np.nan, F32)
    run = _indexer_scores_par if len(qi) >= PARALLEL_ROWS else _indexer_scores
    run(np.ascontiguousarray(qi, F32), np.ascontiguousarray(wts, F32), kt, np.asarray(counts, np.int64), out)
    return out


def indexer_scores(qi: np.ndarray, wts: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """score_n = sum over heads h, in order, of relu(q_h . k_n) * w_h (w already scaled)."""
    return indexer_scores_rows(np.asarray(qi)[None], np.asarray(wts)[None], keys, [len(keys)])[0]
