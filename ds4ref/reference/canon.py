"""The canonical float32 arithmetic of the DS4 forward pass (docs/exactness.md).

Every float32 operation the forward pass performs has one definition here: the
order of every reduction, and exp / log1p built only from correctly rounded
IEEE `+ - * /`. The HIP kernels (ds4ref/hip/kernels) implement the very same
definitions, so the NumPy reference and the GPU give the same bits. The orders
are the ones the GPU's fast path wants (a 32-lane warp's strided partials and
its xor butterfly), written out as loops.

Rules every function here keeps:
* products and sums are rounded separately: no fused multiply-add;
* a sum "in order" starts from +0 and adds its terms left to right;
* a "butterfly" sum of 32 partials adds p[i] + p[i + 16], then + 8, 4, 2, 1,
  which is what every lane of a warp holds after the xor shuffles.

Numba compiles the loops; it never contracts or reorders float arithmetic
without fastmath, which is never turned on here (tests/test_canon.py checks).
"""
from __future__ import annotations

import math

import numba
import numpy as np

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
def _dot_warp8(w, x, c0, clen, p):
    """Warp dot of w[c0:c0+clen] . x[c0:c0+clen]: lane t sums columns t*8 .. t*8+7 of every
    256-column step, steps in order, then the butterfly."""
    full = clen // (LANES * 8) * (LANES * 8)
    for t in range(LANES):
        acc = _ZERO
        for s in range(0, full, LANES * 8):
            o = c0 + s + t * 8
            for j in range(8):
                acc = acc + w[o + j] * x[o + j]
        for j in range(8):  # the last, partial step
            c = full + t * 8 + j
            if c < clen:
                acc = acc + w[c0 + c] * x[c0 + c]
        p[t] = acc
    return _butterfly(p, LANES)


@numba.njit(cache=True)
def _matvec(x, w, ks):
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


def ksplit(rows: int, cols: int) -> int:
    """Columns per slice of a split dense dot product (0: not split). A property of the
    matrix's shape: few long rows (hc mixes, router, indexer weights) are cut into slices
    summed in order, so the GPU can spread them over more blocks."""
    return KSPLIT_COLS if rows <= KSPLIT_MAX_ROWS and cols >= KSPLIT_MIN_COLS else 0


def linear(x: np.ndarray, w: np.ndarray, split: bool = True) -> np.ndarray:
    """x @ w.T, each output one warp dot (sliced by `ksplit` for dense weights; routed
    experts pass split=False, their kernel never slices)."""
    x = np.ascontiguousarray(x, F32)
    w = np.ascontiguousarray(w, F32)
    k = x.shape[-1]
    ks = (ksplit(w.shape[0], k) if split else 0) or max(k, 1)
    y = _matvec(x.reshape(-1, k), w, ks)
    return y.reshape(x.shape[:-1] + (w.shape[0],))


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
        for i in range(d):
            t = i % NORM_THREADS
            p[t] = p[t] + x[r, i] * x[r, i]
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
def _dot_lanes(q, k, p):
    """Warp dot of two length-D vectors: lane t sums dims t, t+32, ... in order, then the butterfly."""
    for t in range(LANES):
        p[t] = _ZERO
    for t in range(LANES):
        for i in range(t, q.size, LANES):
            p[t] = p[t] + q[i] * k[i]
    return _butterfly(p, LANES)


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


def hc_pre(streams, fn, base, scale, rms_eps, hc_eps, iters):
    n, hc, d = streams.shape
    m = _hc_mix(streams, fn, rms_eps)
    eps = F32(hc_eps)
    pre = sigmoid(m[:, :hc] * scale[0] + base[:hc]) + eps
    post = _TWO * sigmoid(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    logits = (m[:, 2 * hc:] * scale[2] + base[2 * hc:]).reshape(n, hc, hc)
    e = exp(logits - np.max(logits, axis=-1, keepdims=True))
    comb = e / seqsum(e[..., j:j + 1] for j in range(hc)) + eps
    comb = sinkhorn(np.ascontiguousarray(comb), int(iters), eps)
    return _weighted_streams(pre, streams), post, comb


def hc_post(streams, y, post, comb):
    """S'[j] = post_j * y + comb[0, j] S[0] + comb[1, j] S[1] + ..., in that order."""
    acc = post[:, :, None] * y[:, None, :]
    for i in range(streams.shape[1]):
        acc = acc + comb[:, i, :, None] * streams[:, i, None, :]
    return acc


def hc_head(streams, fn, base, scale, rms_eps, hc_eps):
    m = _hc_mix(streams, fn, rms_eps)
    pre = sigmoid(m * scale[0] + base) + F32(hc_eps)
    return _weighted_streams(pre, streams)


# ---------------------------------------------------------------------------
# RoPE table, Hadamard rotation
# ---------------------------------------------------------------------------


def rope_cos_sin(omega: np.ndarray, pos) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin of theta = f32(pos) * f32(omega), each computed in float64 and rounded
    once. The HIP backend uploads this very table (by position), so the libm behind
    np.cos never splits the two backends."""
    theta = np.asarray(pos, dtype=F32)[..., None] * np.asarray(omega, F32)
    t64 = theta.astype(np.float64)
    return np.cos(t64).astype(F32), np.sin(t64).astype(F32)


@numba.njit(cache=True)
def _rotate(v, h):
    n, d = v.shape
    out = np.empty((n, h.shape[0]), np.float32)
    for r in range(n):
        for j in range(h.shape[0]):
            acc = _ZERO
            for i in range(d):
                acc = acc + v[r, i] * h[j, i]
            out[r, j] = acc
    return out


def hadamard_rotate(v: np.ndarray, h: np.ndarray) -> np.ndarray:
    """v @ h.T, each output summed over i in order (one thread per output on the GPU)."""
    v = np.ascontiguousarray(v, F32)
    return _rotate(v.reshape(-1, v.shape[-1]), np.ascontiguousarray(h, F32)).reshape(v.shape[:-1] + (h.shape[0],))


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
    p = np.empty(LANES, np.float32)
    zm = np.empty(nz, np.float32)
    zden = np.empty(nz, np.float32)
    zacc = np.empty((nz, d), np.float32)
    for h in range(h_n):
        for z in range(nz):
            m, den = -_INF, _ZERO
            acc = zacc[z]
            acc[:] = _ZERO
            for i in range(z * ATTN_SLICE, min(n, (z + 1) * ATTN_SLICE)):
                k = keys[i]
                sc = _dot_lanes(q[h], k, p) * scale
                if sc > m:
                    c = exp_f32(m - sc)
                    den = den * c + _ONE
                    for t in range(d):
                        acc[t] = acc[t] * c + k[t]
                    m = sc
                else:
                    e = exp_f32(sc - m)
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
            dtot = dtot + zden[z] * exp_f32(zm[z] - mf)
        for t in range(d):
            a = _ZERO
            for z in range(nz):
                a = a + zacc[z, t] * exp_f32(zm[z] - mf)
            out[h, t] = a / dtot
    return out


def attention_with_sinks(q: np.ndarray, keys: np.ndarray, sinks: np.ndarray) -> np.ndarray:
    """q (H, D), keys (N, D): the visible K=V rows in their fixed order -> (H, D)."""
    scale = F32(1.0 / math.sqrt(q.shape[-1]))
    return _attention(np.ascontiguousarray(q, F32), np.ascontiguousarray(keys, F32),
                      np.ascontiguousarray(sinks, F32), scale)


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
def _indexer_scores(qi, wts, keys):
    n = keys.shape[0]
    out = np.empty(n, np.float32)
    p = np.empty(LANES, np.float32)
    for r in range(n):
        total = _ZERO
        for h in range(qi.shape[0]):
            total = total + max(_dot_lanes(qi[h], keys[r], p), _ZERO) * wts[h]
        out[r] = total
    return out


def indexer_scores(qi: np.ndarray, wts: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """score_n = sum over heads h, in order, of relu(q_h . k_n) * w_h (w already scaled)."""
    return _indexer_scores(np.ascontiguousarray(qi, F32), np.ascontiguousarray(wts, F32),
                           np.ascontiguousarray(keys, F32))
