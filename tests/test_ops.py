"""Reference primitives against hand-worked values and their defining properties."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from ds4ref.reference import canon, ops

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

def test_yarn_omega_matches_spec_numbers():
    om = ops.rope_omega(64, 160000.0, (16.0, 65536, 32.0, 1.0))
    assert om[0] == 1.0
    assert abs(om[1] - 0.687656) < 1e-6 and abs(om[2] - 0.472871) < 1e-6
    assert abs(om[31] / 5.68053e-7 - 1) < 1e-5
    main = ops.rope_omega(64, 10000.0)
    assert abs(main[31] / 1.33352e-4 - 1) < 1e-5
    plain = ops.rope_omega(64, 160000.0)
    assert np.array_equal(om[:16], plain[:16]), "pairs below the ramp are unscaled"
    assert np.allclose(om[25:], plain[25:] / 16), "pairs above the ramp are divided by the factor"


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
