"""The canonical float32 arithmetic (ds4ref/numerics/canon.py, docs/exactness.md).

* exp / log1p / sigmoid / softplus stay within their stated ulp bounds of float64 maths;
* the Numba loops compute exactly the written order: a second, vectorised NumPy
  implementation of each definition gives the same bits (NumPy never fuses a multiply
  and an add, so this also proves Numba does not contract where no fma is written; the
  float products' fma is computed there independently, by rounding to odd in float64);
* every canonical op stays within 1e-5 (norm-wise) of the same op in float64;
* a batched linear (R rows at once) gives every row the bits it gets alone; the fused
  kernels equal their op compositions;
* the float32 score() (passes of rows through the decode state) and the whole-sequence
  prefill (masks) each equal the streamed decode bit for bit, whatever the prompt;
* official numerics refuse shapes their FP8/FP4 blocks cannot take, naming the key.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ds4ref
from ds4ref.gguf.config import ConfigError
from ds4ref.numerics import canon
from ds4ref.reference import ops as ref
from ds4ref.gguf.tiny import tiny_config, write_tiny

F32, F64 = np.float32, np.float64
# stated bounds (docs/exactness.md), in units in the last place of the float32 result
ULP_BOUND = {"exp": 1.0, "log1p": 2.5, "sigmoid": 2.5, "softplus": 3.0}


def ulps(got: np.ndarray, exact: np.ndarray) -> np.ndarray:
    ulp = np.spacing(np.abs(exact.astype(F32))).astype(F64)
    return np.abs(got.astype(F64) - exact) / ulp


def samples(lo: float, hi: float, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.concatenate([rng.uniform(lo, hi, n), rng.normal(0, 3, n // 4).clip(lo, hi)]).astype(F32)


@pytest.mark.parametrize("name,lo,hi,exact", [
    ("exp", -86.5, 88.0, lambda x: np.exp(x)),
    ("log1p", -0.99, 40.0, lambda x: np.log1p(x)),
    ("sigmoid", -80.0, 80.0, lambda x: 1.0 / (1.0 + np.exp(-x))),
    ("softplus", -80.0, 80.0, lambda x: np.logaddexp(0.0, x)),
])
def test_elementwise_within_ulp_bound(name, lo, hi, exact):
    x = samples(lo, hi, 1_000_000, seed=len(name))
    if name == "log1p":  # and the tiny arguments where 1 + x rounds
        x = np.concatenate([x, (10.0 ** np.random.default_rng(1).uniform(-30, 0, 200_000)).astype(F32)])
    err = ulps(getattr(canon, name)(x), exact(x.astype(F64)))
    assert err.max() <= ULP_BOUND[name], f"{name}: {err.max():.3f} ulp at x = {x[err.argmax()]!r}"


def test_exp_special_values():
    x = np.array([0.0, -0.0, -np.inf, np.inf, np.nan, 88.0, 88.5, -86.5, -87.0], F32)
    got = canon.exp(x)
    assert got[0] == 1 and got[1] == 1 and got[2] == 0 and got[3] == np.inf and np.isnan(got[4])
    assert np.isfinite(got[5]) and got[6] == np.inf and got[7] > 0 and got[8] == 0
    assert canon.log1p(np.array([0.0, -1.0, np.inf], F32)).tolist() == [0.0, -np.inf, np.inf]


@given(x=st.floats(-100, 100, width=32))
def test_scalar_and_elementwise_forms_agree(x):
    x = F32(x)
    for scalar, vec in ((canon.exp_f32, canon.exp), (canon.sigmoid_f32, canon.sigmoid),
                        (canon.softplus_f32, canon.softplus)):
        assert np.array_equal(np.array(scalar(x), F32), vec(np.array([x], F32))[0])


# ---- the written orders, implemented a second time ----------------------------------

def butterfly(p: np.ndarray) -> np.ndarray:
    """Halve the last axis (a power of two) by p[:h] + p[h:], as the xor shuffles do."""
    while p.shape[-1] > 1:
        h = p.shape[-1] // 2
        p = p[..., :h] + p[..., h:]
    return p[..., 0]


def fma_vectorised(a, b, c) -> np.ndarray:
    """fma(a, b, c) of float32 arrays, rounded once, without an fma instruction: a * b is exact
    in float64 (48 bits), their sum with c is taken to float64 by rounding to odd (the nearest
    float64, its last bit set when it is inexact, from TwoSum's error term), and rounding that
    to float32 is then the one correct rounding (Boldo and Melquiond: odd rounding at two or
    more extra bits does not double-round)."""
    a, b, c = np.broadcast_arrays(*(np.atleast_1d(np.asarray(v, F32)) for v in (a, b, c)))
    p = a.astype(np.float64) * b.astype(np.float64)
    c64 = c.astype(np.float64)
    s = p + c64
    with np.errstate(invalid="ignore"):
        v = s - p
        err = (p - (s - v)) + (c64 - v)  # s + err == p + c exactly where s is finite
    bits = s.view(np.int64).copy()
    fix = np.isfinite(s) & (err != 0) & (bits & 1 == 0)
    # the odd neighbour on err's side: one ulp up in magnitude where err has s's sign
    bits[fix] += np.where((err[fix] > 0) == (s[fix] > 0), 1, -1)
    return bits.view(np.float64).astype(F32)


@settings(max_examples=200)
@given(a=st.floats(width=32), b=st.floats(width=32), c=st.floats(width=32))
def test_fma_vectorised_is_the_fused_rounding(a, b, c):
    """The oracle's fma equals LLVM's (canon.fma_f32) bit for bit: subnormals, overflow,
    infinities, NaN and the exact-product cases hypothesis finds at the edges."""
    got, want = fma_vectorised(a, b, c)[0], F32(canon.fma(a, b, c))
    assert (np.isnan(got) and np.isnan(want)) or got.view(np.uint32) == want.view(np.uint32)


def test_fma_vectorised_rounds_once_where_twice_would_differ():
    """a * b + c = 1 + 2^-24 + 2^-60 exactly: just above the float32 tie 1 + 2^-24, so the one
    rounding gives 1 + 2^-23; rounding the sum to float64 first lands on the tie, whose even
    neighbour is 1 (the double rounding the oracle's round-to-odd avoids)."""
    a, b, c = F32(2.0**-24 * (1 + 2.0**-12)), F32(1 - 2.0**-12 + 2.0**-24), F32(1)
    once, twice = F32(1 + 2.0**-23), F32(np.float64(a) * np.float64(b) + np.float64(c))
    assert twice == 1 and canon.fma(a, b, c) == once
    assert fma_vectorised(a, b, c)[0] == once


def warp8_dot_vectorised(x: np.ndarray, w: np.ndarray, slice_cols: int) -> np.ndarray:
    """x (n, K) . w (N, K): per slice, lane t sums columns t*8..t*8+7 of each 256-column step,
    each term as fma(w, x, partial)."""
    n, k = x.shape
    out = np.zeros((n, w.shape[0]), F32)
    for c0 in range(0, k, slice_cols):
        xs, ws = x[:, c0:c0 + slice_cols], w[:, c0:c0 + slice_cols]
        pad = -xs.shape[1] % 256
        xs = np.pad(xs, ((0, 0), (0, pad))).reshape(n, -1, 32, 8)
        ws = np.pad(ws, ((0, 0), (0, pad))).reshape(w.shape[0], -1, 32, 8)
        p = np.zeros((n, w.shape[0], 32), F32)
        for s in range(xs.shape[1]):
            for j in range(8):
                p = fma_vectorised(ws[None, :, s, :, j], xs[:, None, s, :, j], p)
        out = out + butterfly(p)
    return out


@settings(max_examples=20)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 4), rows=st.sampled_from([1, 24, 64, 65, 300]),
       k=st.sampled_from([8, 96, 256, 520, 2048, 4096 + 96]))
def test_linear_is_the_written_order(seed, n, rows, k):
    rng = np.random.default_rng(seed)
    x, w = rng.standard_normal((n, k)).astype(F32), rng.standard_normal((rows, k)).astype(F32)
    ks = canon.ksplit(rows, k) or k
    assert np.array_equal(canon.linear(x, w), warp8_dot_vectorised(x, w, ks))
    assert np.array_equal(canon.linear(x, w, split=False), warp8_dot_vectorised(x, w, k))


@settings(max_examples=25)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 64), rows=st.integers(1, 200),
       k=st.sampled_from([1, 8, 96, 255, 256, 520, 2048, 2048 + 300]), split=st.booleans())
def test_batched_linear_equals_per_row_linear(seed, n, rows, k, split):
    """canon.linear over n rows at once (each weight block read once for all of them) gives
    every row the bits of that row alone, and of the one-output-at-a-time matvec; k >= 2048
    with rows <= 64 takes the split rule."""
    rng = np.random.default_rng(seed)
    x, w = rng.standard_normal((n, k)).astype(F32), rng.standard_normal((rows, k)).astype(F32)
    zeros = rng.random(x.shape) < 0.05  # exact zeros of both signs: signed-zero sums
    x[zeros] = np.where(rng.random(x.shape) < 0.5, F32(0.0), F32(-0.0))[zeros]
    got = canon.linear(x, w, split)
    ks = (canon.ksplit(rows, k) if split else 0) or k
    assert np.array_equal(got.view(np.uint32), canon._matvec(x, w, ks).view(np.uint32))
    alone = np.concatenate([canon.linear(x[i:i + 1], w, split) for i in range(n)])
    assert np.array_equal(got.view(np.uint32), alone.view(np.uint32))


@settings(max_examples=20)
@given(seed=st.integers(0, 2**31 - 1), d=st.sampled_from([1, 96, 255, 256, 512, 4096, 16384 + 40]))
def test_sum_of_squares_is_the_written_order(seed, d):
    x = np.random.default_rng(seed).standard_normal((3, d)).astype(F32)
    pad = -d % 256
    sq = np.pad(x * x, ((0, 0), (0, pad))).reshape(3, -1, 256)
    part = np.zeros((3, 256), F32)
    for i in range(sq.shape[1]):
        part = part + sq[:, i]
    want = butterfly(butterfly(part.reshape(3, 8, 32)))
    assert np.array_equal(canon.sumsq(x)[:, 0], want)


def lanes_dot_vectorised(q: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """q (D,) . keys (N, D): lane t sums dims t, t+32, ... in order, then the butterfly."""
    pad = -q.shape[0] % 32
    qs = np.pad(q, (0, pad)).reshape(-1, 32)
    ks = np.pad(keys, ((0, 0), (0, pad))).reshape(keys.shape[0], -1, 32)
    p = np.zeros((keys.shape[0], 32), F32)
    for b in range(qs.shape[0]):
        p = p + qs[b] * ks[:, b]
    return butterfly(p)


def attention_written(q, keys, sinks):
    """docs/exactness.md's attention, key by key in NumPy float32 scalars."""
    scale = F32(1.0 / math.sqrt(q.shape[-1]))
    out = np.empty_like(q)
    for h in range(q.shape[0]):
        sc = lanes_dot_vectorised(q[h], keys) * scale
        zs = []
        for z0 in range(0, len(keys), 32):
            m, den, acc = F32(-np.inf), F32(0), np.zeros(q.shape[1], F32)
            for i in range(z0, min(len(keys), z0 + 32)):
                if sc[i] > m:
                    c = canon.exp(np.array([m - sc[i]]))[0]
                    den, acc, m = den * c + F32(1), acc * c + keys[i], sc[i]
                else:
                    e = canon.exp(np.array([sc[i] - m]))[0]
                    den, acc = den + e, acc + e * keys[i]
            zs.append((m, den, acc))
        mf = sinks[h]
        for m, _, _ in zs:
            mf = max(mf, m)
        ez = [canon.exp(np.array([m - mf]))[0] for m, _, _ in zs]
        dtot = canon.exp(np.array([sinks[h] - mf]))[0]
        num = np.zeros(q.shape[1], F32)
        for (m, den, acc), e in zip(zs, ez):
            dtot = dtot + den * e
        for (m, den, acc), e in zip(zs, ez):
            num = num + acc * e
        out[h] = num / dtot
    return out


@settings(max_examples=10)
@given(seed=st.integers(0, 2**31 - 1), heads=st.integers(1, 4), d=st.sampled_from([16, 96, 130]),
       n=st.integers(1, 70))
def test_attention_and_indexer_are_the_written_order(seed, heads, d, n):
    rng = np.random.default_rng(seed)
    q, keys, sinks = rnd(rng, heads, d), rnd(rng, n, d), rnd(rng, heads)
    assert np.array_equal(canon.attention_with_sinks(q, keys, sinks), attention_written(q, keys, sinks))
    w = rnd(rng, heads)
    want = np.zeros(n, F32)
    for h in range(heads):
        want = want + np.maximum(lanes_dot_vectorised(q[h], keys), F32(0)) * w[h]
    assert np.array_equal(canon.indexer_scores(q, w, keys), want)
    # many rows at once: each row's own keys, given in pieces
    cut = rng.integers(0, n + 1)
    q2 = rnd(rng, 3, heads, d)
    rows = [[keys[:cut], keys[cut:]], [keys[:1]], [keys]]
    got = canon.attention_rows(q2, rows, sinks)
    for r in range(3):
        assert np.array_equal(got[r], canon.attention_with_sinks(q2[r], np.concatenate(rows[r]), sinks))


@settings(max_examples=10)
@given(seed=st.integers(0, 2**31 - 1), n_rows=st.sampled_from([canon.PARALLEL_ROWS - 1, canon.PARALLEL_ROWS, 70]))
def test_threaded_passes_equal_rows_alone(seed, n_rows):
    """From PARALLEL_ROWS rows on, the products and attention run on Numba's threads: each
    row's bits are still its own alone (which runs on one thread)."""
    import numba
    rng = np.random.default_rng(seed)
    q, sinks, w = rnd(rng, n_rows, 2, 96), rnd(rng, 2), rnd(rng, 300, 96)
    keys = [[rnd(rng, int(rng.integers(1, 40)), 96)] for _ in range(n_rows)]
    x = q.reshape(n_rows, -1)[:, :96]
    before = numba.get_num_threads()
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)  # a test worker runs on one; use them all here
    try:
        got, lin = canon.attention_rows(q, keys, sinks), canon.linear(x, w)
    finally:
        numba.set_num_threads(before)
    for r in range(n_rows):
        assert np.array_equal(got[r], canon.attention_rows(q[r:r + 1], keys[r:r + 1], sinks)[0])
        assert np.array_equal(lin[r], canon.linear(x[r:r + 1], w)[0])


@settings(max_examples=15)
@given(seed=st.integers(0, 2**31 - 1), m=st.integers(1, 6), n=st.integers(2, 60), k=st.integers(1, 12),
       levels=st.sampled_from([0, 3]))
def test_indexer_topk_is_scores_then_topk(seed, m, n, k, levels):
    """The batched indexer selection picks, per query, topk_lower_index of its own scores over
    its first counts[r] keys; few distinct key values (levels > 0) make exact ties."""
    rng = np.random.default_rng(seed)
    qi, wts = rnd(rng, m, 4, 40), rnd(rng, m, 4)
    keys = (rng.integers(0, levels, (n, 40)).astype(F32) if levels else rnd(rng, n, 40))
    counts = rng.integers(min(k + 1, n), n + 1, m)
    got = ref.indexer_topk(qi, wts, keys, counts, min(k, n - 1))
    for r in range(m):
        want = ref.topk_lower_index(canon.indexer_scores(qi[r], wts[r], keys[:counts[r]]), min(k, n - 1))
        assert np.array_equal(got[r], want), r


@settings(max_examples=15)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 9), clamp=st.sampled_from([0.5, 1.75, 7.0]))
def test_fused_swiglu_is_the_composition(seed, n, clamp):
    """canon.swiglu in one call equals linear, np.minimum, np.clip, silu, linear, with
    clamping, inf and NaN among the projections."""
    rng = np.random.default_rng(seed)
    x, w1, w3, w2 = rnd(rng, n, 96, scale=2), rnd(rng, 40, 96), rnd(rng, 40, 96), rnd(rng, 96, 40)
    x[-1, :3] = [np.inf, -np.inf, np.nan]
    g = np.minimum(canon.linear(x, w1, False), clamp)
    v = np.clip(canon.linear(x, w3, False), -clamp, clamp)
    with np.errstate(invalid="ignore"):
        want = canon.linear(canon.silu(g) * v, w2, False)
        got = canon.swiglu(x, w1, w3, w2, clamp, split=False)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def hc_pre_composed(streams, fn, base, scale, rms_eps, hc_eps, iters):
    """The hc_pre table of docs/exactness.md as NumPy float32 array operations."""
    n, hc, d = streams.shape
    m = canon._hc_mix(streams, fn, rms_eps)
    eps = F32(hc_eps)
    pre = canon.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + eps
    post = F32(2) * canon.sigmoid(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    logits = (m[:, 2 * hc:] * scale[2] + base[2 * hc:]).reshape(n, hc, hc)
    e = canon.exp(logits - np.max(logits, axis=-1, keepdims=True))
    comb = e / canon.seqsum(e[..., j:j + 1] for j in range(hc)) + eps
    comb = canon.sinkhorn(np.ascontiguousarray(comb), int(iters), eps)
    u = canon.seqsum(pre[:, k, None] * streams[:, k, :] for k in range(hc))
    return u, post, comb


def hc_inputs(seed: int, hc: int, width: int, fn_scale: float, base_scale: float):
    """streams (3, hc, width), fn, base and scale of one hc_pre call."""
    rng = np.random.default_rng(seed)
    mix = 2 * hc + hc * hc
    s, fn = rnd(rng, 3, hc, width), rnd(rng, mix, hc * width, scale=fn_scale)
    return s, fn, rnd(rng, mix, scale=base_scale), np.abs(rnd(rng, 3)) + 0.5


@settings(max_examples=10)
@given(seed=st.integers(0, 2**31 - 1), hc=st.sampled_from([2, 4]), iters=st.integers(1, 20))
def test_fused_hc_pre_is_the_composition(seed, hc, iters):
    s, fn, base, scale = hc_inputs(seed, hc, 96, 0.5, 2)
    s[1, 0, 0] = np.nan
    with np.errstate(invalid="ignore"):
        got = canon.hc_pre(s, fn, base, scale, 1e-6, 1e-6, iters)
        want = hc_pre_composed(s, fn, base, scale, 1e-6, 1e-6, iters)
    for a, b in zip(got, want):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_ksplit_rule():
    assert canon.ksplit(24, 16384) == 512 and canon.ksplit(64, 2048) == 512
    assert canon.ksplit(65, 16384) == 0 and canon.ksplit(24, 2047) == 0


# ---- canonical against float64 maths ---------------------------------------------------

def rel(a, b) -> float:
    a, b = np.asarray(a, F64), np.asarray(b, F64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def rnd(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(F32)


def both(fn, *args):
    """fn on float32 inputs (canonical) and on the same values in float64 (plain maths)."""
    lo = fn(*args)
    hi = fn(*(a.astype(F64) if isinstance(a, np.ndarray) and a.dtype == F32 else a for a in args))
    return lo, hi


@settings(max_examples=10)
@given(seed=st.integers(0, 2**31 - 1))
def test_canonical_ops_close_to_float64(seed):
    rng = np.random.default_rng(seed)
    checks = {
        "rmsnorm": both(ref.rmsnorm, rnd(rng, 5, 4096, scale=3), rnd(rng, 4096), 1e-6),
        "linear": both(ref.linear, rnd(rng, 3, 4096), rnd(rng, 70, 4096, scale=1 / 64)),
        "linear split": both(ref.linear, rnd(rng, 3, 16384), rnd(rng, 24, 16384, scale=1 / 128)),
        "attention": both(ref.attention_with_sinks, rnd(rng, 8, 512, scale=0.2), rnd(rng, 150, 512), rnd(rng, 8),
                          rng.random(150) < 0.7),
        "pool": both(ref.pool_window, rnd(rng, 4, 128, 64), rnd(rng, 4, 128, 64, scale=3)),
        "indexer": both(ref.indexer_scores, rnd(rng, 16, 128), rnd(rng, 16), rnd(rng, 300, 128)),
        "hc_post": both(ref.hc_post, rnd(rng, 3, 4, 256), rnd(rng, 3, 256), rnd(rng, 3, 4),
                        np.abs(rnd(rng, 3, 4, 4))),
        "swiglu": both(ref.swiglu, rnd(rng, 256, scale=2), rnd(rng, 64, 256, scale=1 / 16),
                       rnd(rng, 64, 256, scale=1 / 16), rnd(rng, 256, 64, scale=1 / 8), 7.0),
        "qat rotation": both(canon.hadamard_rotate, rnd(rng, 6, 128), ref.hadamard(128, F32)),
    }
    for name, (lo, hi) in checks.items():
        assert lo.dtype == F32 and rel(lo, hi) <= 1e-5, (name, rel(lo, hi))


@settings(max_examples=10)
@given(seed=st.integers(0, 2**31 - 1), hc=st.sampled_from([2, 4]), iters=st.integers(1, 20))
def test_hc_pre_close_to_float64(seed, hc, iters):
    s, fn, base, scale = hc_inputs(seed, hc, 512, 0.05, 0.5)
    lo = ref.hc_pre(s, fn, base, scale, 1e-6, 1e-6, iters)
    hi = ref.hc_pre(s.astype(F64), fn.astype(F64), base.astype(F64), scale.astype(F64), 1e-6, 1e-6, iters)
    for a, b in zip(lo, hi):
        assert a.dtype == F32 and rel(a, b) <= 1e-5


def test_route_close_to_float64():
    rng = np.random.default_rng(3)
    logits, bias = rnd(rng, 256, scale=2), rnd(rng, 256, scale=0.1)
    ids32, w32 = ref.route(logits, 6, bias, None, 2.5, True)
    ids64, w64 = ref.route(logits.astype(F64), 6, bias.astype(F64), None, 2.5, True)
    assert np.array_equal(ids32, ids64) and rel(w32, w64) <= 1e-6


# ---- whole model -----------------------------------------------------------------------

@pytest.fixture(scope="module", params=["official", "plain"])
def model32(request):
    return ds4ref.load(numerics=request.param).reference


@settings(max_examples=2)
@given(data=st.data())
def test_score_equals_streamed_decode_bitwise(model32, data):
    """Prompts past score()'s first pass of SCORE_CHUNK rows (so its second pass starts from the
    state the first left), four to six ratio-128 windows and the indexer's threshold."""
    from ds4ref.reference.model import SCORE_CHUNK
    n = data.draw(st.integers(SCORE_CHUNK + 1, SCORE_CHUNK + 256))
    ids = data.draw(st.lists(st.integers(0, model32.config.vocab_size - 1), min_size=n, max_size=n))
    a, b = model32.score(ids), model32.decode_logits(ids)
    assert a.dtype == F32 and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@settings(max_examples=2)
@given(data=st.data())
def test_whole_sequence_prefill_equals_streamed_decode_bitwise(model32, data):
    """prefill.py (masks instead of state, written independently of decode.py) in float32."""
    from ds4ref.reference.prefill import prefill_logits
    n = data.draw(st.integers(130, 260))  # past a ratio-128 window and the indexer's threshold
    ids = data.draw(st.lists(st.integers(0, model32.config.vocab_size - 1), min_size=n, max_size=n))
    a = prefill_logits(model32.weights, model32.tables, model32.numerics, np.array(ids))
    assert np.array_equal(a, model32.decode_logits(ids))


def test_official_numerics_refuse_small_blocks_naming_the_key(tmp_path):
    path = tmp_path / "small.gguf"
    write_tiny(path, tiny_config(head_dim=32, n_rot=16, indexer_head_dim=16))
    with pytest.raises(ConfigError, match=r"indexer\.key_length is 16.*numerics='plain' takes this file"):
        ds4ref.load(path, numerics="official")
    plain = ds4ref.load(path, numerics="plain")
    assert np.isfinite(plain.score([1, 2, 3])).all()
    write_tiny(path, tiny_config(head_dim=80, n_rot=32))
    with pytest.raises(ConfigError, match=r"key_length - .*rope\.dimension_count = 48.*multiple of 64"):
        ds4ref.load(path, numerics="official")
    assert math.isfinite(float(ds4ref.load(path, numerics="plain").score([5])[0, 0]))


def _nearest_f32(v) -> np.float32:
    import mpmath
    with mpmath.workprec(24):
        return np.float32(float(+v))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), base=st.sampled_from([10000.0, 160000.0]))
def test_rope_tables_are_correctly_rounded(seed, base):
    """Every cos/sin entry is the float32 nearest the true value, whatever libm NumPy uses
    (so the uploaded table is the same bits on every machine); checked in 160-bit arithmetic."""
    import mpmath
    rng = np.random.default_rng(seed)
    omega = ref.rope_omega(32, base, (16.0, 65536, 32.0, 1.0))
    pos = rng.integers(0, 1 << 20, 24)
    cos, sin = canon.rope_cos_sin(omega, pos)
    theta = pos.astype(np.float32)[:, None] * omega.astype(np.float32)
    with mpmath.workprec(160):
        for (i, j), t in np.ndenumerate(theta):
            x = mpmath.mpf(float(t))
            assert cos[i, j] == _nearest_f32(mpmath.cos(x)) and sin[i, j] == _nearest_f32(mpmath.sin(x)), (t,)


def test_correct_rounding_settles_the_doubtful_entries_exactly():
    """A float64 approximation on a float32 rounding boundary (where a libm's last ulp decides)
    is settled by the exact value, on either side of the boundary."""
    import mpmath
    lo = np.float32(0.75)
    mid = (float(lo) + float(np.nextafter(lo, np.float32(1)))) / 2  # a float32 midpoint: ties go to even
    tiny = mpmath.mpf(2) ** -80
    above = canon.correctly_rounded_f32(np.array([mid]), lambda i: mpmath.mpf(mid) + tiny)
    below = canon.correctly_rounded_f32(np.array([mid]), lambda i: mpmath.mpf(mid) - tiny)
    assert above[0] == np.nextafter(lo, np.float32(1)) and below[0] == lo


def test_rope_frequencies_are_correctly_rounded():
    import mpmath
    omega = ref.rope_omega(64, 10000.0)
    with mpmath.workprec(160):
        want = [float(mpmath.power(10000, mpmath.mpf(-2.0 * j / 64))) for j in range(32)]
    assert omega.tolist() == want
