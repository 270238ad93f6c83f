"""Reference primitives against hand-worked values and their defining properties."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from ds4ref.numerics import canon
from ds4ref.reference import ops

FLOATS = (np.float32, np.float64)


# ---- FP4 E2M1 ----------------------------------------------------------------

@pytest.mark.parametrize("x,want", [
    # ties go to the even code: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
    (0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0),
    (0.3, 0.5), (2.9, 3.0), (5.1, 6.0), (6.0, 6.0), (-1.75, -2.0), (-0.2, -0.0), (0.0, 0.0),
])
@pytest.mark.parametrize("dtype", FLOATS)
def test_e2m1_hand_values(x, want, dtype):
    assert ops.e2m1_round(np.array([x], dtype))[0] == want


@pytest.mark.parametrize("dtype", FLOATS)
def test_e2m1_is_nearest_grid_value(dtype):
    grid = np.array([0, .5, 1, 1.5, 2, 3, 4, 6])
    x = np.random.default_rng(0).uniform(-6, 6, 5000).astype(dtype)
    got = ops.e2m1_round(x)
    dist = np.abs(np.abs(x)[:, None] - grid[None, :])
    assert np.all(np.abs(np.abs(got) - np.abs(x)) <= dist.min(axis=1) + 1e-12)
    assert np.all(np.isin(np.abs(got), grid))


# ---- FP8 E4M3 ----------------------------------------------------------------

def e4m3_values() -> np.ndarray:
    """Every finite non-negative E4M3FN value, decoded bit by bit from its code."""
    vals = []
    for code in range(0, 127):  # 127 = NaN in E4M3FN
        e, m = code >> 3, code & 7
        vals.append(m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(vals)


@pytest.mark.parametrize("dtype", FLOATS)
def test_e4m3_matches_decoded_codes(dtype):
    grid = e4m3_values()
    assert grid.max() == 448.0
    x = np.random.default_rng(1).uniform(-448, 448, 4000) * np.random.default_rng(2).choice([1, 1e-2, 1e-4], 4000)
    x = x.astype(dtype)
    got = ops.e4m3_round(x)
    assert np.all(np.isin(np.abs(got), grid))
    best = np.abs(np.abs(x)[:, None] - grid[None, :]).min(axis=1)
    assert np.all(np.abs(np.abs(got) - np.abs(x)) == best.astype(dtype))


@pytest.mark.parametrize("x,want", [
    (17.0, 16.0), (19.0, 20.0),              # ties between 16|18 and 18|20 go to the even mantissa
    (1.0625, 1.0), (1.1875, 1.25),
    (1.5 * 2.0 ** -9, 2.0 ** -8),            # subnormal tie 1.5 -> 2 quanta
    (0.5 * 2.0 ** -9, 0.0),                  # below half the smallest subnormal rounds to 0
    (448.0, 448.0), (-300.0, -288.0),
])
def test_e4m3_hand_values(x, want):
    assert ops.e4m3_round(np.array([x]))[0] == want


def test_fp8sim_block_scale_and_rope_dims():
    n_rot = 64
    v = np.zeros(512)
    v[:64] = np.linspace(-3, 3, 64)        # amax 3 -> scale 2^ceil(log2(3/448)) = 2^-7
    v[64:128] = 1e-7                        # amax floored at 1e-4 -> scale 2^ceil(log2(1e-4/448)) = 2^-22
    v[448:] = np.random.default_rng(3).normal(size=64)
    out = ops.fp8sim(v, n_rot)
    s = 2.0 ** -7
    assert np.array_equal(out[:64], ops.e4m3_round(v[:64] / s) * s)
    s2 = 2.0 ** math.ceil(math.log2(1e-4 / 448))
    assert np.array_equal(out[64:128], ops.e4m3_round(v[64:128] / s2) * s2)
    assert np.array_equal(out[448:], v[448:]), "the RoPE dims must pass untouched"


def test_qat_block_scale():
    h = ops.hadamard(128)
    v = np.random.default_rng(4).normal(size=128)
    r = h @ v
    out = ops.qat(v, h)
    for b in range(4):
        blk = r[32 * b: 32 * b + 32]
        s = 2.0 ** math.ceil(math.log2(np.abs(blk).max() / 6))
        assert np.array_equal(out[32 * b: 32 * b + 32], ops.e2m1_round(blk / s) * s)


@given(st.integers(1, 7))
def test_hadamard_orthonormal(k):
    n = 2 ** k
    h = ops.hadamard(n)
    assert np.allclose(h @ h.T, np.eye(n), atol=1e-12)
    assert np.all(np.abs(np.abs(h) - 1 / math.sqrt(n)) < 1e-15)


# ---- RoPE --------------------------------------------------------------------

FLASH_YARN = (16.0, 65536, 32.0, 1.0)  # factor, original context, beta_fast, beta_slow (DS4_SPEC.md §4)


def official_omega(n_rot: int, base: float, yarn=None) -> list:
    """The frequencies of the official DeepSeek code's precompute_freqs_cis (inference/model.py;
    DS4_SPEC.md §4 quotes its formulas for V4), in 160-bit arithmetic, with the correction range
    it computes:
      freqs_j = 1 / base ** (2j / dim), j < dim / 2
      find_correction_dim(r) = dim * ln(original_seq_len / (r * 2 pi)) / (2 ln base)
      low = max(floor(find_correction_dim(beta_fast)), 0), high = min(ceil(find_correction_dim(beta_slow)), dim - 1)
      ramp_j = clamp((j - low) / (high - low), 0, 1)   (high += 0.001 when high == low)
      smooth = 1 - ramp;  freqs = freqs / factor * (1 - smooth) + freqs * smooth
    Returns ([mpmath frequencies], (low, high))."""
    import mpmath
    with mpmath.workprec(160):
        dim, base = mpmath.mpf(n_rot), mpmath.mpf(base)
        freqs = [1 / base ** (2 * mpmath.mpf(j) / dim) for j in range(n_rot // 2)]
        if yarn is None:
            return freqs, None
        factor, orig, fast, slow = (mpmath.mpf(v) for v in yarn)
        corr = lambda r: dim * mpmath.log(orig / (r * 2 * mpmath.pi)) / (2 * mpmath.log(base))  # noqa: E731
        low, high = max(int(mpmath.floor(corr(fast))), 0), min(int(mpmath.ceil(corr(slow))), n_rot - 1)
        span = mpmath.mpf(high - low) if high != low else mpmath.mpf("0.001")
        ramp = [min(max((j - low) / span, 0), 1) for j in range(n_rot // 2)]
        return [f / factor * r + f * (1 - r) for f, r in zip(freqs, ramp)], (low, high)


def _float64(v) -> float:
    import mpmath
    with mpmath.workprec(160):
        return float(v)  # mpmath rounds to nearest: the correctly rounded float64


def _float32(v) -> np.float32:
    import mpmath
    with mpmath.workprec(24):  # round half to even onto float32's significand
        return np.float32(float(+v))


@pytest.mark.parametrize("base, yarn", [(10000.0, None), (160000.0, FLASH_YARN)], ids=["main", "compress"])
def test_rope_omega_is_the_official_formula(base, yarn):
    """Flash's two tables (64 rotary dims) against the official formula, exact: pairs the ramp
    leaves alone (ramp 0: the frequency, correctly rounded; ramp 1: that / 16, exact) bit for bit;
    the blended pairs (YaRN's ramp between low and high) to 4 float64 ulps, since rope_omega
    blends in float64 (omega (1 - ramp) + omega / 16 ramp: four roundings) and the formula's value
    here is exact. What the tables use, each frequency rounded to float32, is in every pair the
    float32 nearest the exact value."""
    want, lohi = official_omega(64, base, yarn)
    got = ops.rope_omega(64, base, yarn)
    blended = range(lohi[0] + 1, lohi[1]) if lohi else range(0)
    if yarn:
        assert lohi == (15, 25)  # DS4_SPEC.md §4: corr(32) = 15.453, corr(1) = 24.708
    for j, (g, w) in enumerate(zip(got, want)):
        if j in blended:
            assert abs(g - _float64(w)) <= 4 * math.ulp(_float64(w)), j
        else:
            assert g == _float64(w), j
        assert np.float32(g) == _float32(w), j


def test_the_specs_printed_frequencies_are_the_formulas():
    """DS4_SPEC.md §4 prints omega_1 = 0.687656, omega_2 = 0.472871 (compress table, pairs below
    the ramp: 160000^(-2j/64) as they are), omega_31 = 5.68053e-7 (above it: divided by 16) and the
    main table's omega_31 = 1.33352e-4, each to 6 significant digits."""
    compress, main = ops.rope_omega(64, 160000.0, FLASH_YARN), ops.rope_omega(64, 10000.0)
    printed = [(compress[0], 1.0), (compress[1], 0.687656), (compress[2], 0.472871), (compress[31], 5.68053e-7),
               (main[31], 1.33352e-4)]
    assert all(float(f"{got:.6g}") == spec for got, spec in printed), printed


@settings(max_examples=30)
@given(st.integers(0, 100000), st.sampled_from(FLOATS))
def test_rope_inverse_and_untouched_dims(pos, dtype):
    v = np.random.default_rng(pos).normal(size=(3, 96)).astype(dtype)
    cos, sin = ops.rope_cos_sin(ops.rope_omega(32, 10000.0), pos, dtype)
    r = ops.rope(v, cos, sin)
    assert np.array_equal(r[:, :64], v[:, :64])
    back = ops.rope(r, cos, sin, inverse=True)
    assert np.allclose(back, v, atol=1e-5 if dtype == np.float32 else 1e-12)
    # the rotation preserves each pair's length
    pairs = lambda x: x[:, 64::2] ** 2 + x[:, 65::2] ** 2  # noqa: E731
    assert np.allclose(pairs(r), pairs(v), rtol=1e-4)


# ---- HC, attention, pooling, selection ----------------------------------------

def test_sinkhorn_doubly_stochastic():
    c = np.random.default_rng(5).uniform(0.01, 1, (10, 4, 4))
    out = canon.sinkhorn(c, 50, 1e-12)
    assert np.allclose(out.sum(axis=1), 1, atol=1e-9) and np.allclose(out.sum(axis=2), 1, atol=1e-6)


def test_sinkhorn_orientation_first_step_is_column():
    c = np.random.default_rng(6).uniform(0.01, 1, (1, 4, 4))
    one = canon.sinkhorn(c, 1, 0.0)[0]
    assert np.allclose(one.sum(axis=0), 1) and not np.allclose(one.sum(axis=1), 1)


def test_attention_with_sinks_formula():
    rng = np.random.default_rng(7)
    q, k, sinks = rng.normal(size=(3, 8)), rng.normal(size=(5, 8)), rng.normal(size=3)
    out = ops.attention_with_sinks(q, k, sinks)
    for h in range(3):
        z = q[h] @ k.T / math.sqrt(8)
        w = np.exp(z) / (np.exp(sinks[h]) + np.exp(z).sum())
        assert np.allclose(out[h], w @ k)


def test_pool_window_softmax_and_empty():
    rng = np.random.default_rng(8)
    kv, sc = rng.normal(size=(8, 5)), rng.normal(size=(8, 5))
    sc[:4] = -np.inf
    got = ops.pool_window(kv, sc)
    w = np.exp(sc[4:]) / np.exp(sc[4:]).sum(axis=0)
    assert np.allclose(got, (w * kv[4:]).sum(axis=0))
    assert np.array_equal(ops.pool_window(kv, np.full((8, 5), -np.inf)), np.zeros(5))


@given(arrays(np.float64, st.integers(1, 40), elements=st.sampled_from([0.0, 1.0, 2.0, -1.0])),
       st.integers(1, 45))
def test_topk_ties_lower_index_wins(scores, k):
    got = ops.topk_lower_index(scores, k)
    n = len(scores)
    assert list(got) == sorted(got) and len(got) == min(k, n)
    chosen = set(got.tolist())
    for i in range(n):
        for j in range(n):
            if i in chosen and j not in chosen:
                # everything chosen beats everything left out, ties by lower index
                assert scores[i] > scores[j] or (scores[i] == scores[j] and i < j)


@given(arrays(np.float32, st.tuples(st.integers(1, 6), st.integers(1, 40)),
              elements=st.sampled_from([0.0, -0.0, 1.0, 2.0, -1.0, np.inf, -np.inf])), st.integers(1, 45))
def test_topk_rows_is_topk_of_each_row(scores, k):
    """The router's batched top-k picks, per row, what topk_lower_index picks for the row alone."""
    want = [ops.topk_lower_index(row, k) for row in scores]
    assert np.array_equal(ops.topk_rows(scores, k), np.stack(want))


def test_route_bias_only_selects():
    logits = np.array([0.0, 1.0, 2.0, 3.0])
    bias = np.array([10.0, 0.0, 0.0, 0.0])
    ids, w = ops.route(logits, 2, bias, None, 1.5, True)
    s = np.sqrt(np.log1p(np.exp(logits)))
    assert list(ids) == [0, 3]
    assert np.allclose(w, 1.5 * s[[0, 3]] / s[[0, 3]].sum())
    ids, _ = ops.route(logits, 2, None, np.array([2, 1]), 1.5, True)
    assert list(ids) == [1, 2]


def test_swiglu_clamps():
    x = np.array([1.0])
    w1, w3, w2 = np.array([[50.0]]), np.array([[-50.0]]), np.array([[1.0]])
    got = ops.swiglu(x, w1, w3, w2, 10.0)
    assert np.allclose(got, [10 / (1 + math.exp(-10)) * -10])
