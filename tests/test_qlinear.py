"""Products with block-quantised weights (canon.quantize_q8, quant_codes, qlinear; the
"quantised linear" of docs/exactness.md).

* quantize_q8 and qlinear equal a plainly written oracle of the spec (Python loops over
  blocks, NumPy float32 scalar operations, each fma computed exactly with Fraction and
  rounded once), bit for bit, on long and ragged inputs with zero, non-finite, tiny and
  tie-making blocks;
* quant_codes reproduces gguf-py's dequantised value of every weight of every type;
* a row's outputs are its own, alone or in any batch, on one thread or all;
* in official float32 numerics the policy files' products take the integer path, and the
  whole-sequence prefill, score() and the streamed decode still agree bit for bit.
"""
from __future__ import annotations

from fractions import Fraction

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ds4ref
from ds4ref.gguf import quant_codes as qcodes
from ds4ref.numerics import canon
from ds4ref.reference.layers import LayerWeights, product_weight
from ds4ref.reference.prefill import prefill_logits
from tests.golden.make_golden import policy_model

F32 = np.float32
TYPES = sorted(qcodes.QUANT_TYPES)


# ---- the oracle: the spec, written plainly ------------------------------------------------

OVERFLOW = Fraction(2) ** 128 - Fraction(2) ** 103  # max float32 + half its ulp: from here on, inf


def round_f32(q: Fraction) -> np.float32:
    """The float32 nearest the exact value q, ties to even; inf past the largest float32."""
    if abs(q) >= OVERFLOW:
        return F32(np.inf) if q > 0 else F32(-np.inf)
    f = F32(float(q))  # within one float32 step of the answer (float64 first: double rounding)
    cands = [np.nextafter(f, F32(-np.inf)), f, np.nextafter(f, F32(np.inf))]
    best = min(cands, key=lambda c: (abs(Fraction(float(c)) - q), int(np.array(c).view(np.uint32)) & 1))
    return F32(best)


def fma_exact(a, b, c) -> np.float32:
    """a * b + c rounded once, IEEE semantics for zeros, infinities and NaN."""
    a, b, c = F32(a), F32(b), F32(c)
    if not (np.isfinite(a) and np.isfinite(b) and np.isfinite(c)):
        return F32(np.float64(a) * np.float64(b) + np.float64(c))  # inf / NaN: the f64 rules are IEEE's
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    if exact == 0:
        neg_product = (a == 0 or b == 0) and (np.signbit(a) != np.signbit(b))
        return F32(-0.0) if (neg_product and np.signbit(c)) else F32(0.0)
    return round_f32(exact)


def quantize_oracle(x: np.ndarray):
    n, k = x.shape
    xq, dx = np.zeros((n, k), np.int64), np.zeros((n, k // 32), F32)
    for r in range(n):
        for b in range(k // 32):
            blk = [F32(v) for v in x[r, 32 * b:32 * b + 32]]
            if not all(np.isfinite(v) for v in blk):
                dx[r, b] = np.nan
                continue
            amax = max(abs(v) for v in blk)
            d = F32(amax / F32(127))
            dx[r, b] = d
            if d == 0:  # amax == 0, or amax / 127 underflowed
                continue
            for i, v in enumerate(blk):
                xq[r, 32 * b + i] = min(127, max(-127, int(np.rint(F32(v / d)))))
    return xq, dx


def qlinear_oracle(x: np.ndarray, qc: qcodes.QuantCodes) -> np.ndarray:
    xq, dx = quantize_oracle(x)
    codes = qc.codes.astype(np.int64)
    n, (rows, k) = x.shape[0], qc.shape
    y = np.zeros((n, rows), F32)
    for r in range(n):
        for o in range(rows):
            p = [F32(0.0)] * 32
            for b in range(k // 32):
                s = [int(codes[o, 16 * h:16 * h + 16] @ xq[r, 16 * h:16 * h + 16]) for h in (2 * b, 2 * b + 1)]
                xs = [int(xq[r, 16 * h:16 * h + 16].sum()) for h in (2 * b, 2 * b + 1)]
                big_a = int(qc.mul[o, 2 * b]) * s[0] + int(qc.mul[o, 2 * b + 1]) * s[1]
                big_b = int(qc.mn[o, 2 * b]) * xs[0] + int(qc.mn[o, 2 * b + 1]) * xs[1]
                assert abs(big_a) < 2 ** 24 and abs(big_b) < 2 ** 24
                t = F32(qc.s1[o, b] * F32(big_a)) - F32(qc.s2[o, b] * F32(big_b))
                p[b % 32] = fma_exact(dx[r, b], t, p[b % 32])
            h = 16
            while h:
                p = [F32(p[i] + p[i + h]) for i in range(h)]
                h //= 2
            y[r, o] = p[0]
    return y


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equal, any NaN matching any NaN."""
    na, nb = np.isnan(a), np.isnan(b)
    return np.array_equal(na, nb) and np.array_equal(a[~na].view(np.uint32), b[~nb].view(np.uint32))


# ---- inputs ---------------------------------------------------------------------------------

def activation_rows(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """Rows of 32-column blocks of mixed kinds: gaussian at scales 1e-30 .. 1e30, all zeros
    (both signs), holding inf or NaN, subnormal, and amax = 127 with half-integers (exact ties
    of x / dx)."""
    x = np.empty((n, k), F32)
    for r in range(n):
        for b in range(k // 32):
            kind = rng.integers(0, 8)
            blk = (rng.standard_normal(32) * 10.0 ** rng.uniform(-30, 30)).astype(F32)
            if kind == 0:
                blk = np.where(rng.random(32) < 0.5, F32(0.0), F32(-0.0))
            elif kind == 1:
                blk[rng.integers(0, 32)] = rng.choice([np.inf, -np.inf, np.nan])
            elif kind == 2:
                blk = (rng.integers(-40, 41, 32) * F32(2.0 ** -149)).astype(F32)
            elif kind == 3:
                blk = (rng.integers(-127, 127, 32) + F32(0.5)).astype(F32)
                blk[rng.integers(0, 32)] = rng.choice([-127.0, 127.0])
            x[r, 32 * b:32 * b + 32] = blk
    return x


def random_raw(rng: np.random.Generator, qtype_name: str, rows: int, k: int, wild: bool) -> np.ndarray:
    """Uniformly random block bytes (every code, grid index, sign and sub-scale valid), the f16
    scales random finite f16 of either sign (wild: any exponent; else small) and, for MXFP4,
    the E8M0 byte anything (wild) or near 2^0."""
    per, size, _ = qcodes.QUANT_TYPES[qtype_name]
    raw = rng.integers(0, 256, (rows, k // per, size), dtype=np.uint8)
    f16_at = {"Q8_0": (0,), "IQ2_XXS": (0,), "Q2_K": (80, 82), "Q4_K": (0, 2), "MXFP4": ()}[qtype_name]
    for at in f16_at:
        bits = rng.integers(0, 1 << 16, raw.shape[:2], dtype=np.uint16)
        exp_field = (bits >> 10) & 31
        bits = np.where(exp_field == 31, bits & ~np.uint16(1 << 14), bits).astype(np.uint16)  # finite
        if not wild:  # |scale| in [2^-12, 2^-4)
            bits = (bits & np.uint16(0x83FF)) | (np.uint16(3) + (bits >> 10 & 7).astype(np.uint16)) << np.uint16(10)
        raw[..., at:at + 2] = bits.view(np.uint8).reshape(*raw.shape[:2], 2)
    if qtype_name == "MXFP4" and not wild:
        raw[..., 0] = rng.integers(118, 130, raw.shape[:2])
    return raw.reshape(rows, -1)


# ---- quantize_q8, qlinear against the oracle ----------------------------------------------

@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), n=st.integers(1, 5), blocks=st.integers(1, 80))
def test_quantize_q8_is_the_spec(seed, n, blocks):
    x = activation_rows(np.random.default_rng(seed), n, 32 * blocks)
    xq, dx = canon.quantize_q8(x)
    want_q, want_d = quantize_oracle(x)
    assert xq.dtype == np.int8 and dx.dtype == F32
    assert np.array_equal(xq.astype(np.int64), want_q) and same_bits(dx, want_d)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), qtype=st.sampled_from(TYPES), n=st.integers(1, 3),
       rows=st.integers(1, 9), units=st.integers(1, 6), wild=st.booleans())
def test_qlinear_is_the_spec(seed, qtype, n, rows, units, wild):
    """K up to 6 super-blocks (48 blocks of 32: the fma partials wrap past 32) or 6 blocks."""
    rng = np.random.default_rng(seed)
    k = units * qcodes.QUANT_TYPES[qtype][0]
    qc = qcodes.quant_codes(qtype, random_raw(rng, qtype, rows, k, wild))
    x = activation_rows(rng, n, k) if wild else (rng.standard_normal((n, k)) * 3).astype(F32)
    with np.errstate(all="ignore"):
        got, want = canon.qlinear(x, qc), qlinear_oracle(x, qc)
    assert got.shape == (n, rows) and same_bits(got, want)


def test_fma_is_fused():
    """The one fused operation: a * b + c rounded once, not twice."""
    a = F32(1 + 2 ** -12)
    c = -F32(1 + 2 ** -11)
    assert canon.fma(a, a, c) == F32(2 ** -24) and a * a + c == F32(0)


# ---- quant_codes against gguf-py's dequantisation -------------------------------------------

@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), qtype=st.sampled_from(TYPES), rows=st.integers(1, 6),
       units=st.integers(1, 4), wild=st.booleans())
def test_quant_codes_reproduce_gguf_values(seed, qtype, rows, units, wild):
    """Every weight: gguf-py's float32 value == the float32 nearest the exact real
    s1 * mul * code - s2 * mn (gguf forms that value with exact products and at most one
    rounding, for every type here). The products are exact in float64 (at most 38 bits); the
    difference is exact where its TwoSum error is 0, and settled with Fraction elsewhere."""
    rng = np.random.default_rng(seed)
    k = units * qcodes.QUANT_TYPES[qtype][0]
    raw = random_raw(rng, qtype, rows, k, wild)
    qc = qcodes.quant_codes(qtype, raw)
    with np.errstate(over="ignore"):  # wild MXFP4: 2^127 * 12 is inf on both sides
        ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
        want = dequantised(qc)
    ranges = {"Q8_0": range(-128, 128), "Q2_K": range(4), "Q4_K": range(16),
              "MXFP4": {0, 1, 2, 3, 4, 6, 8, 12, -1, -2, -3, -4, -6, -8, -12},
              "IQ2_XXS": {8, 25, 43, -8, -25, -43}}
    assert set(np.unique(qc.codes).tolist()) <= set(ranges[qtype])
    assert qc.codes.shape == (rows, k) and qc.mul.shape == qc.mn.shape == (rows, k // 16)
    assert qc.s1.shape == qc.s2.shape == (rows, k // 32)
    assert np.array_equal(want.view(np.uint32), ref.view(np.uint32))


def dequantised(qc: qcodes.QuantCodes) -> np.ndarray:
    """The float32 nearest the exact s1 * mul * code - s2 * mn of every weight."""
    k = qc.shape[1]
    col16, col32 = np.arange(k) // 16, np.arange(k) // 32
    p1 = qc.s1[:, col32].astype(np.float64) * qc.mul[:, col16] * qc.codes
    p2 = qc.s2[:, col32].astype(np.float64) * qc.mn[:, col16]
    d = p1 - p2
    err = (p1 - (d - (d - p1))) + (-p2 - (d - p1))  # TwoSum: d + err == p1 - p2 exactly
    out = d.astype(F32)
    for i in zip(*np.nonzero(err)):
        out[i] = round_f32(Fraction(float(p1[i])) - Fraction(float(p2[i])))
    return out


def test_quant_codes_refuse_what_they_cannot_read():
    with pytest.raises(ValueError, match="Q6_K is not one of"):
        qcodes.quant_codes("Q6_K", np.zeros((1, 210), np.uint8))
    with pytest.raises(ValueError, match="multiple of 34 bytes"):
        qcodes.quant_codes("Q8_0", np.zeros((1, 35), np.uint8))


# ---- batches ------------------------------------------------------------------------------

@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), qtype=st.sampled_from(TYPES),
       n=st.sampled_from([2, 3, canon.PARALLEL_ROWS - 1, canon.PARALLEL_ROWS, 41]),
       rows=st.integers(1, 300))
def test_rows_are_independent(seed, qtype, n, rows):
    """A row's outputs alone (one thread) equal its outputs in a batch, threaded from
    PARALLEL_ROWS on; weight rows past one block of MM_ROWS and a padded last block."""
    import numba
    rng = np.random.default_rng(seed)
    k = 2 * qcodes.QUANT_TYPES[qtype][0]
    qc = qcodes.quant_codes(qtype, random_raw(rng, qtype, rows, k, wild=False))
    x = activation_rows(rng, n, k)
    before = numba.get_num_threads()
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    try:
        with np.errstate(all="ignore"):
            got = canon.qlinear(x, qc)
    finally:
        numba.set_num_threads(before)
    with np.errstate(all="ignore"):
        for r in range(n):
            assert same_bits(got[r], canon.qlinear(x[r], qc)), r


# ---- the model ------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["q2", "q4", "mxfp4"])
def policy32(request):
    return ds4ref.load(policy_model(request.param), numerics="official").reference


def test_official_float32_products_take_the_quantised_codes(policy32):
    """Official float32: the block-quantised tensors (Q8_0 attention, shared experts, head; the
    policy's experts) are QuantCodes operands; float tensors, plain numerics and float64 are floats."""
    w = policy32.weights
    lw = LayerWeights(w, 0, "official")
    for suffix in ("attn_q_a.weight", "attn_output_a.weight", "ffn_down_shexp.weight"):
        assert isinstance(lw.matrix(suffix), qcodes.QuantCodes), suffix
    assert isinstance(lw.expert("ffn_gate_exps.weight", 3), qcodes.QuantCodes)
    assert isinstance(product_weight(w, "output.weight", "official"), qcodes.QuantCodes)
    assert isinstance(lw.matrix("ffn_gate_inp.weight"), np.ndarray)  # F16
    assert isinstance(LayerWeights(w, 0, "plain").expert("ffn_gate_exps.weight", 3), np.ndarray)
    assert isinstance(product_weight(w.with_dtype(np.float64), "output.weight", "official"), np.ndarray)


def test_codes_are_the_tensors_they_stand_for(policy32):
    """Each QuantCodes a product takes decodes to the very floats of its tensor (its expert's
    slice, its output group's rows): no product reads another tensor's codes."""
    w, cfg = policy32.weights, policy32.config
    for il in (0, cfg.n_layer - 1):
        lw = LayerWeights(w, il, "official")
        for suffix in ("attn_q_a.weight", "attn_q_b.weight", "attn_kv.weight", "attn_output_b.weight",
                       "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"):
            assert np.array_equal(dequantised(lw.matrix(suffix)), lw[suffix]), (il, suffix)
        for e in (0, 5, cfg.n_expert - 1):
            for suffix in ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"):
                assert np.array_equal(dequantised(lw.expert(suffix, e)), w.expert(lw.prefix + suffix, e)), (il, e)
        wo_a = lw.matrix("attn_output_a.weight")
        rank = wo_a.shape[0] // cfg.o_groups
        g = cfg.o_groups - 1
        assert np.array_equal(dequantised(wo_a.rows(g * rank, (g + 1) * rank)),
                              lw["attn_output_a.weight"][g * rank:(g + 1) * rank])
    assert np.array_equal(dequantised(product_weight(w, "output.weight", "official")), w.get("output.weight"))


@settings(max_examples=1, deadline=None)
@given(data=st.data())
def test_policy_prefill_score_and_decode_agree_bitwise(policy32, data):
    """The integer path keeps prefill.py (masks), score() (passes of SCORE_CHUNK rows, the
    second starting from the state the first left) and the streamed decode one function: past
    score()'s first pass, four ratio-128 windows and the indexer's threshold."""
    from ds4ref.reference.model import SCORE_CHUNK
    n = data.draw(st.integers(SCORE_CHUNK + 1, SCORE_CHUNK + 64))
    ids = data.draw(st.lists(st.integers(0, policy32.config.vocab_size - 1), min_size=n, max_size=n))
    streamed = policy32.decode_logits(ids)
    assert np.array_equal(policy32.score(ids).view(np.uint32), streamed.view(np.uint32))
    whole = prefill_logits(policy32.weights, policy32.tables, policy32.numerics, np.array(ids))
    assert np.array_equal(whole.view(np.uint32), streamed.view(np.uint32))
