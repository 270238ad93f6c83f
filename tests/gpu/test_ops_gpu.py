"""Every GPU kernel against its twin in ds4ref/reference/ops.py, bit for bit.

The reference runs in float32, the canonical arithmetic (docs/exactness.md), on the
same inputs (weights dequantised exactly to f32), so every comparison is of the float32
bits: no tolerance anywhere. How far the canonical arithmetic sits from float64 maths is
tested on the CPU (tests/test_canon.py). Outputs are poisoned with NaN / -1 inside
ds4ref.hip.ops, so an unwritten element fails.
"""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ds4ref.hip import ops as g
from ds4ref.reference import ops as ref
from ds4ref.gguf.tiny import random_blocks

pytestmark = pytest.mark.gpu
F32 = np.float32
SETTINGS = settings(max_examples=int(os.environ.get("DS4REF_GPU_EXAMPLES", "12")), deadline=None,
                    suppress_health_check=list(HealthCheck))


def same_bits(gpu, want) -> bool:
    """Equal float32 bits (NaN included), with the first difference named on failure."""
    gpu, want = np.asarray(gpu, F32), np.asarray(want, F32)
    assert gpu.shape == want.shape, (gpu.shape, want.shape)
    a, b = gpu.view(np.uint32), want.view(np.uint32)
    bad = np.flatnonzero(a != b)
    assert bad.size == 0, (f"{bad.size} of {a.size} values differ; first at {np.unravel_index(bad[0], a.shape)}: "
                           f"gpu {gpu.flat[bad[0]]!r} reference {want.flat[bad[0]]!r}")
    return True


def rnd(seed, *shape, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(F32)


seeds = st.integers(0, 2**31 - 1)
lanes = st.integers(1, 16)
# a prompt pass: the matvec runs in lane groups of 16, an expert chosen by more than 16
# lanes gets several work entries
wide_lanes = st.one_of(lanes, st.sampled_from([17, 40, 129, 256]))


# ---- norms, RoPE -------------------------------------------------------------

@SETTINGS
@given(seed=seeds, rows=lanes, D=st.sampled_from([64, 100, 512, 4096]), weighted=st.booleans())
def test_rmsnorm(rt, seed, rows, D, weighted):
    x = rnd(seed, rows, D, scale=3.0)
    w = rnd(seed + 1, D) if weighted else None
    got = g.rmsnorm(x, w, 1e-6, rt=rt)
    want = ref.rmsnorm(x, w, 1e-6) if weighted else ref.rms0(x, 1e-6)
    assert same_bits(got, want)


@SETTINGS
@given(seed=seeds, rows=lanes, heads=st.integers(1, 4), nope=st.sampled_from([0, 64, 448]),
       n_rot=st.sampled_from([16, 64]), inverse=st.booleans())
def test_rope_bitwise(rt, seed, rows, heads, nope, n_rot, inverse):
    v = rnd(seed, rows, heads, nope + n_rot)
    pos = np.random.default_rng(seed).integers(0, 1 << 20, rows)
    cos, sin = ref.rope_cos_sin(ref.rope_omega(n_rot, 10000.0, (16.0, 65536, 32.0, 1.0)), pos, F32)
    cos, sin = cos[:, None, :], sin[:, None, :]  # one position per row, shared by its heads
    got = g.rope(v, cos, sin, inverse, rt=rt)
    want = ref.rope(v, cos, sin, inverse)
    assert same_bits(got, want)


# ---- FP8 / FP4 ---------------------------------------------------------------

@SETTINGS
@given(seed=seeds, rows=lanes, nblk=st.integers(1, 7), n_rot=st.sampled_from([0, 64]),
       scale=st.sampled_from([1e-6, 1e-2, 1.0, 30.0, 400.0]))
def test_fp8sim_bitwise(rt, seed, rows, nblk, n_rot, scale):
    v = rnd(seed, rows, 64 * nblk + n_rot, scale=scale)
    assert np.array_equal(g.fp8sim(v, n_rot, rt=rt), ref.fp8sim(v, n_rot))


@SETTINGS
@given(seed=seeds, rows=lanes, scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e4]))
def test_e2m1_blocks_bitwise(rt, seed, rows, scale):
    r = rnd(seed, rows, 128, scale=scale)
    want = ref._block_quant(r, 32, 6.0, 7.052966104933725e-38, ref.e2m1_round)
    assert np.array_equal(g.e2m1_blocks(r, rt=rt), want)


@SETTINGS
@given(seed=seeds, rows=lanes, n=st.sampled_from([32, 64, 128]))
def test_qat(rt, seed, rows, n):
    v = rnd(seed, rows, n)
    h = ref.hadamard(n, F32)
    assert same_bits(g.hadamard_rotate(v, h, rt=rt), ref.canon.hadamard_rotate(v, h))
    assert same_bits(g.qat(v, h, rt=rt), ref.qat(v, h))


# ---- matvec, grouped output --------------------------------------------------

def make_weight(seed, n, k, wtype):
    w = rnd(seed, n, k, scale=1.0 / math.sqrt(k))
    if wtype == "f32":
        return w, w
    if wtype == "f16":
        w16 = w.astype(np.float16)
        return w16, w16.astype(F32)
    if wtype == "bf16":
        b = g.f32_to_bf16_bits(w)
        return b, g.bf16_bits_to_f32(b)
    if wtype == "q8_0":
        raw = g.quantize_q8_0(w)
        return raw, g.dequantize_q8_0(raw)
    raw = random_blocks(np.random.default_rng(seed), wtype.upper(), (n, k), 1.0 / math.sqrt(k)).data
    return raw, g.dequantize(raw, wtype)


QUANTS = ["q2_k", "q4_k", "iq2_xxs", "mxfp4"]


@SETTINGS
@given(seed=seeds, L=wide_lanes, n=st.integers(1, 300), kb=st.integers(1, 80),
       wtype=st.sampled_from(["f32", "f16", "bf16", "q8_0"]))
def test_matvec(rt, seed, L, n, kb, wtype):
    k = 32 * kb  # chunk tails: K need not be a multiple of the 512-column chunk
    w, wf = make_weight(seed, n, k, wtype)
    x = rnd(seed + 1, L, k)
    got = g.matvec(w, x, wtype=wtype, rt=rt)
    assert same_bits(got, ref.linear(x, wf))


@pytest.mark.parametrize("wtype", ["f32", "f16", "bf16", "q8_0"])
def test_matvec_batch_invariance(rt, wtype):
    """At Flash's width (4096 columns): the reference's bits, alone, among 16 or among 256
    (v3's lane groups; v1/v2 run 256 lanes as 16 chunks)."""
    w, wf = make_weight(7, 1024, 4096, wtype)
    x = rnd(8, 256, 4096)
    alone = g.matvec(w, x[:1], wtype=wtype, rt=rt)
    among = g.matvec(w, x[:16], wtype=wtype, rt=rt)
    crowd = g.matvec(w, x, wtype=wtype, rt=rt)
    assert same_bits(among, ref.linear(x[:16], wf))
    assert np.array_equal(alone[0], among[0]) and np.array_equal(crowd[:16], among)
    for l in (5, 15, 200):  # any lane, alone or among 16 or 256
        assert np.array_equal(g.matvec(w, x[l:l + 1], wtype=wtype, rt=rt)[0], crowd[l])


@SETTINGS
@given(seed=seeds, N=lanes, groups=st.sampled_from([1, 2, 4]), hpg=st.integers(1, 3),
       D=st.sampled_from([32, 64]), rank=st.integers(1, 40), wtype=st.sampled_from(["f32", "bf16"]))
def test_grouped_output(rt, seed, N, groups, hpg, D, rank, wtype):
    H, d = groups * hpg, 64
    o = rnd(seed, N, H, D)
    wa, waf = make_weight(seed + 1, groups * rank, hpg * D, wtype)
    wb, wbf = make_weight(seed + 2, d, groups * rank, "f32" if (groups * rank) % 8 else wtype)
    wtb = "f32" if (groups * rank) % 8 else wtype
    if (groups * rank) % 8:
        assume(False)  # wo_b's K must be a multiple of 8
    got = g.grouped_output(o, wa, wb, groups, wtype_a=wtype, wtype_b=wtb, rt=rt)
    assert same_bits(got, ref.grouped_output(o, waf, wbf, groups))


# ---- hyper-connections -------------------------------------------------------

@SETTINGS
@given(seed=seeds, N=lanes, hc=st.sampled_from([1, 2, 4]), d=st.sampled_from([64, 256]),
       iters=st.integers(1, 20))
def test_hc_pre(rt, seed, N, hc, d, iters):
    mix = 2 * hc + hc * hc
    s = rnd(seed, N, hc, d)
    fn = rnd(seed + 1, mix, hc * d, scale=0.05)
    base, scale = rnd(seed + 2, mix, scale=0.5), np.abs(rnd(seed + 3, 3)) + 0.5
    u, post, comb = g.hc_pre(s, fn, base, scale, 1e-6, 1e-6, iters, rt=rt)
    wu, wpost, wcomb = ref.hc_pre(s, fn, base, scale, 1e-6, 1e-6, iters)
    assert same_bits(u, wu) and same_bits(post, wpost) and same_bits(comb, wcomb)


@SETTINGS
@given(seed=seeds, N=lanes, hc=st.sampled_from([1, 2, 4]), d=st.sampled_from([64, 4096]))
def test_hc_post(rt, seed, N, hc, d):
    s, y = rnd(seed, N, hc, d), rnd(seed + 1, N, d)
    post, comb = rnd(seed + 2, N, hc), np.abs(rnd(seed + 3, N, hc, hc))
    got = g.hc_post(s, y, post, comb, rt=rt)
    assert same_bits(got, ref.hc_post(s, y, post, comb))


# ---- attention ---------------------------------------------------------------

@SETTINGS
@given(seed=seeds, L=lanes, H=st.integers(1, 20), D=st.sampled_from([32, 128, 512]),
       N=st.integers(0, 40), p_vis=st.sampled_from([0.0, 0.5, 1.0]))
def test_attention_with_sinks(rt, seed, L, H, D, N, p_vis):
    rng = np.random.default_rng(seed)
    q, keys = rnd(seed, L, H, D), rnd(seed + 1, L, N, D)
    sinks = rnd(seed + 2, H)
    mask = rng.random((L, N)) < p_vis
    got = g.attention_with_sinks(q, keys, sinks, mask, rt=rt)
    assert same_bits(got, ref.attention_with_sinks(q, keys, sinks, mask))


@SETTINGS
@given(seed=seeds, L=lanes, window=st.integers(1, 16), cap=st.integers(0, 24), data=st.data())
def test_attention_ring_plus_compressed(rt, seed, L, window, cap, data):
    """Capacity-padded ring (fill varies per lane) plus gathered compressed rows with
    a per-lane visible length; padding rows hold garbage that must be ignored."""
    H, D = 8, 512
    rng = np.random.default_rng(seed)
    q = rnd(seed, L, H, D, scale=0.2)
    ring, comp = rnd(seed + 1, L, window, D), rnd(seed + 2, L, cap, D)
    fill = np.array([data.draw(st.integers(0, window)) for _ in range(L)])
    vis_c = np.array([data.draw(st.integers(0, cap)) for _ in range(L)])
    rmask = np.arange(window)[None, :] < fill[:, None]
    cmask = np.arange(cap)[None, :] < vis_c[:, None]
    ring[~rmask] = 1e30  # garbage in unused slots
    comp[~cmask] = -1e30
    sinks = rnd(seed + 3, H)
    got = g.attention_ring_comp(q, ring, rmask, comp, cmask, sinks, rt=rt)
    keys = np.concatenate([ring, comp], axis=1)
    mask = np.concatenate([rmask, cmask], axis=1)
    assert same_bits(got, ref.attention_with_sinks(q, keys, sinks, mask))


# ---- compressor pooling, indexer, top-k --------------------------------------

@SETTINGS
@given(seed=seeds, R=lanes, C=st.sampled_from([8, 128]), D=st.sampled_from([64, 512]),
       p_inf=st.sampled_from([0.0, 0.3, 1.0]))
def test_pool_window(rt, seed, R, C, D, p_inf):
    """C = 8: ratio 4 with the previous window's overlap lane; C = 128: ratio 128."""
    rng = np.random.default_rng(seed)
    kv, score = rnd(seed, R, C, D), rnd(seed + 1, R, C, D, scale=3.0)
    score[rng.random((R, C, D)) < p_inf] = -np.inf
    got = g.pool_window(kv, score, rt=rt)
    assert same_bits(got, ref.pool_window(kv, score))


@SETTINGS
@given(seed=seeds, n=st.integers(1, 600), Hi=st.sampled_from([1, 8, 64]), Di=st.sampled_from([32, 128]))
def test_indexer_scores(rt, seed, n, Hi, Di):
    q, keys, w = rnd(seed, Hi, Di), rnd(seed + 1, n, Di), rnd(seed + 2, Hi)
    got = g.indexer_scores(q, w, keys, rt=rt)
    assert same_bits(got, ref.indexer_scores(q, w, keys))


@SETTINGS
@given(seed=seeds, L=lanes, ncap=st.integers(1, 3000), k=st.sampled_from([1, 7, 64, 512]),
       n_levels=st.sampled_from([3, 50, 0]), data=st.data())
def test_topk_exact_with_ties(rt, seed, L, ncap, k, n_levels, data):
    """n_levels > 0 draws scores from few distinct values: many exact ties."""
    rng = np.random.default_rng(seed)
    if n_levels:
        scores = rng.integers(0, n_levels, (L, ncap)).astype(F32) * F32(0.25) - F32(3.0)
    else:
        scores = rng.standard_normal((L, ncap)).astype(F32)
    scores[rng.random((L, ncap)) < 0.05] = -np.inf
    nvalid = np.array([data.draw(st.integers(0, ncap)) for _ in range(L)], np.int32)
    got = g.topk_batched(scores, nvalid, k, rt=rt)
    for l in range(L):
        want = ref.topk_lower_index(scores[l, :nvalid[l]], k)
        pad = np.full(k - len(want), -1)
        assert np.array_equal(got[l], np.concatenate([want, pad])), l


@SETTINGS
@given(seed=seeds, E=st.sampled_from([16, 64, 256]), k=st.sampled_from([1, 6, 8]),
       use_bias=st.booleans(), use_hash=st.booleans(), normalise=st.booleans())
def test_route(rt, seed, E, k, use_bias, use_hash, normalise):
    rng = np.random.default_rng(seed)
    logits = rnd(seed, E, scale=2.0)
    bias = rnd(seed + 1, E, scale=0.1) if use_bias else np.zeros(E, F32)
    hash_ids = rng.choice(E, k, replace=False) if use_hash else None
    ids, w = g.route(logits, k, bias, hash_ids, 1.5, normalise, rt=rt)
    wids, ww = ref.route(logits, k, bias, hash_ids, 1.5, normalise)
    assert np.array_equal(ids, wids)
    assert same_bits(w, ww)


@SETTINGS
@given(seed=seeds, L=lanes, ff=st.sampled_from([32, 256]), d=st.sampled_from([64, 512]),
       clamp=st.sampled_from([0.5, 7.0]), wtype=st.sampled_from(["f32", "bf16", "q8_0"]))
def test_swiglu(rt, seed, L, ff, d, clamp, wtype):
    x = rnd(seed, L, d, scale=2.0)
    (w1, w1f), (w3, w3f), (w2, w2f) = (make_weight(seed + i, *s, wtype) for i, s in
                                        ((1, (ff, d)), (2, (ff, d)), (3, (d, ff))))
    got = g.swiglu(x, w1, w3, w2, clamp, wtype=wtype, rt=rt)
    want = np.stack([ref.swiglu(xi, w1f, w3f, w2f, clamp) for xi in x])
    assert same_bits(got, want)


@SETTINGS
@given(seed=seeds, L=lanes, V=st.integers(1, 140000), dup=st.booleans())
def test_argmax_lower_index(rt, seed, L, V, dup):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((L, V)).astype(F32)
    if dup and V > 1:  # copy each row's max to a few later (and earlier) places: lower index must win
        for l in range(L):
            m = x[l].max()
            x[l, rng.integers(0, V, 3)] = m
    assert np.array_equal(g.argmax(x, rt=rt), np.argmax(x, axis=1).astype(np.int32))


# ---- v2 kernels against the v1 ones, batch invariance of attention -----------

@pytest.mark.parametrize("wtype", ["f32", "f16", "bf16", "q8_0"])
@pytest.mark.parametrize("n,k,L", [(300, 4096 + 96, 1), (1000, 1024, 16), (5000, 256, 3), (9000, 512, 7),
                                   (600, 4096 + 96, 16)])
def test_matvec_v2_bitwise_equals_v1(rt, monkeypatch, wtype, n, k, L):
    """Same per-row arithmetic in both versions, for rows per warp 1, 2 and 4."""
    w, _ = make_weight(n + k, n, k, wtype)
    x = rnd(L, L, k)
    monkeypatch.setattr(g, "KERNELS", "v1")
    y1 = g.matvec(w, x, wtype=wtype, rt=rt)
    monkeypatch.setattr(g, "MATVEC2_MAX_ROWS", 1 << 30)  # force v2 for every shape here
    for ver in ("v2", "v3"):
        monkeypatch.setattr(g, "KERNELS", ver)
        for rpw in ("1", "2", "4"):
            monkeypatch.setenv("DS4REF_MATVEC_RPW", rpw)
            y2 = g.matvec(w, x, wtype=wtype, rt=rt)
            assert np.array_equal(y1, y2), (ver, rpw)


@pytest.mark.parametrize("wtype", ["f32", "bf16", "q8_0"])
@pytest.mark.parametrize("n_active", [1, 5, 16])
def test_matvec_v3_lane_slot_skips_padding(rt, monkeypatch, wtype, n_active):
    """v3 with the backend's lane_slot: lanes past the last slot are not written (still NaN),
    active lanes are bitwise what a plain 16-lane call gives, for every rows-per-warp."""
    monkeypatch.setattr(g, "KERNELS", "v3")
    n, k = 700, 4096 + 256
    w, _ = make_weight(11, n, k, wtype)
    x = rnd(12, 16, k)
    full = g.matvec(w, x, wtype=wtype, rt=rt)
    slots = np.full(16, -1, np.int32)
    slots[:n_active] = np.arange(n_active) + 3
    dw = g.DeviceWeight.upload(rt, w, wtype)
    try:
        for rpw in ("1", "2", "4"):
            monkeypatch.setenv("DS4REF_MATVEC_RPW", rpw)
            with g._Scope(rt) as s:
                y = s.out((16, n))
                g.launch_matvec(rt, dw, s.up(x), y, 16, lane_slot=s.up(slots))
                got = s.get(y, (16, n))
            assert np.array_equal(got[:n_active], full[:n_active]), rpw
            assert np.all(np.isnan(got[n_active:])), rpw
    finally:
        dw.buf.free()


@pytest.mark.parametrize("wtype", ["f32", "bf16"])
@pytest.mark.parametrize("L", [1, 16])
def test_matvec_v3_unaligned_rows_stage_scalar(rt, monkeypatch, wtype, L):
    """Input rows that are not 16-byte aligned (ldx = K + 1) take v3's scalar staging; the
    result is bitwise the aligned (16-byte staging) one, for every rows-per-warp."""
    monkeypatch.setattr(g, "KERNELS", "v3")
    n, k = 500, 2048 + 96
    w, _ = make_weight(5 + L, n, k, wtype)
    x = rnd(6 + L, L, k)
    want = g.matvec(w, x, wtype=wtype, rt=rt)
    xp = np.zeros((L, k + 1), F32)
    xp[:, :k] = x
    dw = g.DeviceWeight.upload(rt, w, wtype)
    try:
        for rpw in ("1", "2"):
            monkeypatch.setenv("DS4REF_MATVEC_RPW", rpw)
            with g._Scope(rt) as s:
                y = s.out((L, n))
                g.launch_matvec(rt, dw, s.up(xp), y, L, ldx=k + 1)
                got = s.get(y, (L, n))
            assert np.array_equal(got, want), rpw
    finally:
        dw.buf.free()


@pytest.mark.parametrize("wtype", ["f32", "bf16", "q8_0"])
@pytest.mark.parametrize("n,k", [(24, 16384), (4, 16384), (64, 4096 + 96)])
def test_matvec_v3_ksplit(rt, monkeypatch, wtype, n, k):
    """The fixed K-split (few rows, long rows): the reference's split, and a lane alone vs among 16."""
    monkeypatch.setattr(g, "KERNELS", "v3")
    assert g.matvec_ksplit(n, k)
    w, wf = make_weight(n * 7 + k, n, k, wtype)
    x = rnd(n + k, 40, k)  # three lane groups, the last one partial
    among = g.matvec(w, x, wtype=wtype, rt=rt)
    assert same_bits(among, ref.linear(x, wf))
    for l in (0, 9, 37):
        assert np.array_equal(g.matvec(w, x[l:l + 1], wtype=wtype, rt=rt)[0], among[l])


def test_hc_pre_flash_width(rt):
    """hc_pre at the Flash width (hc 4 x 4096: the K-split projection)."""
    N, hc, d, iters = 16, 4, 4096, 20
    mix = 2 * hc + hc * hc
    s = rnd(5, N, hc, d)
    fn = rnd(6, mix, hc * d, scale=0.01)
    base, scale = rnd(7, mix, scale=0.5), np.abs(rnd(8, 3)) + 0.5
    u, post, comb = g.hc_pre(s, fn, base, scale, 1e-6, 1e-6, iters, rt=rt)
    wu, wpost, wcomb = ref.hc_pre(s, fn, base, scale, 1e-6, 1e-6, iters)
    assert same_bits(u, wu) and same_bits(post, wpost) and same_bits(comb, wcomb)


def test_attention_batch_invariance(rt):
    L, H, D, W, C = 16, 64, 512, 128, 200
    rng = np.random.default_rng(3)
    q, ring, comp = rnd(1, L, H, D, scale=0.2), rnd(2, L, W, D), rnd(3, L, C, D)
    rm, cm = rng.random((L, W)) < 0.8, rng.random((L, C)) < 0.5
    sinks = rnd(4, H)
    among = g.attention_ring_comp(q, ring, rm, comp, cm, sinks, rt=rt)
    for l in (0, 9):
        alone = g.attention_ring_comp(q[l:l + 1], ring[l:l + 1], rm[l:l + 1], comp[l:l + 1], cm[l:l + 1], sinks, rt=rt)
        assert np.array_equal(alone[0], among[l])
    want = ref.attention_with_sinks(q, np.concatenate([ring, comp], 1), sinks, np.concatenate([rm, cm], 1))
    assert same_bits(among, want)


# ---- block quants (GGUF's Q2_K, Q4_K, IQ2_XXS, MXFP4), dequantised in registers ----------

@SETTINGS
@given(seed=seeds, L=lanes, n=st.integers(1, 300), kb=st.integers(1, 12), wtype=st.sampled_from(QUANTS))
def test_matvec_block_quants(rt, seed, L, n, kb, wtype):
    """gguf-py's dequantisation and the canonical dot: the kernel's bits, also past a chunk."""
    k = 256 * kb
    w, wf = make_weight(seed, n, k, wtype)
    x = rnd(seed + 1, L, k)
    assert same_bits(g.matvec(w, x, wtype=wtype, rt=rt), ref.linear(x, wf))


@pytest.mark.parametrize("wtype", QUANTS)
@pytest.mark.parametrize("n,k", [(24, 16384), (4096, 4096), (2048, 4096)])
def test_matvec_block_quants_flash_shapes(rt, wtype, n, k):
    """The hc mix's K-split shape and Flash's 4096-wide projections, 16 lanes and alone."""
    w, wf = make_weight(n + k, n, k, wtype)
    x = rnd(n * 3 + k, 16, k)
    among = g.matvec(w, x, wtype=wtype, rt=rt)
    assert same_bits(among, ref.linear(x, wf))
    assert same_bits(g.matvec(w, x[7:8], wtype=wtype, rt=rt)[0], among[7])


@SETTINGS
@given(seed=seeds, L=wide_lanes, E=st.sampled_from([4, 16]), kk=st.sampled_from([1, 2, 6]),
       shape=st.sampled_from([(256, 512), (64, 256), (512, 2048)]), down=st.booleans(),
       wtype=st.sampled_from(["f32", "bf16", "q8_0"] + QUANTS), rpw=st.sampled_from([1, 2, 4]))
def test_routed_experts(rt, seed, L, E, kk, shape, down, wtype, rpw):
    """Each (lane, choice) is the reference's unsplit dot with that expert, whoever else chose
    it, at every rows-per-warp the backend may pick (4 is built for bf16 only)."""
    assume(kk <= E and (rpw < 4 or wtype in g.EXPERT_R4))
    N, K = shape
    rng = np.random.default_rng(seed)
    mats = [make_weight(seed + 10 * e, N, K, wtype) for e in range(E)]
    w = np.stack([m[0] for m in mats])
    ids = np.stack([np.sort(rng.choice(E, kk, replace=False)) for _ in range(L)]).astype(np.int32)
    x = rnd(seed + 1, L, kk, K) if down else rnd(seed + 1, L, K)
    got = g.routed_experts(w, wtype, x, ids, rt=rt, rows_per_warp=rpw)
    for l in range(L):
        for t in range(kk):
            xi = x[l, t] if down else x[l]
            assert same_bits(got[l, t], ref.linear(xi, mats[ids[l, t]][1], split=False))


# ---- quantised products (official numerics: int8 activations, exact integer block dots) ----

def quant_raw(seed, n, k, wtype):
    """GGUF rows of a block-quantised weight (the bytes the file holds)."""
    return make_weight(seed, n, k, wtype)[0]


def canon_qlinear(x, raw, wtype):
    from ds4ref.gguf.quant_codes import quant_codes
    from ds4ref.reference import canon
    return canon.qlinear(x, quant_codes(wtype.upper(), raw))


@SETTINGS
@given(seed=seeds, rows=wide_lanes, kb=st.integers(1, 300),
       scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e4]), special=st.sampled_from(["none", "zero", "inf", "nan"]))
def test_quantize_q8(rt, seed, rows, kb, scale, special):
    from ds4ref.reference import canon
    x = rnd(seed, rows, 32 * kb, scale=scale)
    if special != "none":  # a whole block of zeros, or one non-finite value in a block
        x[0, 32:64] = 0.0 if special == "zero" else x[0, 32:64]
        if special in ("inf", "nan") and x.shape[1] > 40:
            x[0, 40] = np.inf if special == "inf" else np.nan
    xq, dx = g.quantize_q8(x, rt=rt)
    want_q, want_d = canon.quantize_q8(x)
    assert np.array_equal(xq, want_q) and same_bits(dx, want_d)


@SETTINGS
@given(seed=seeds, L=wide_lanes, n=st.integers(1, 300), kb=st.integers(1, 200),
       wtype=st.sampled_from(g.QUANT_WTYPES))
def test_qmatvec(rt, seed, L, n, kb, wtype):
    """Every quantised encoding, K up to 6400 (past several staged chunks, and not only whole
    1024-column chunks), any row count, lanes alone and in prompt-pass groups: the reference's bits."""
    k = 32 * kb if g.BLOCK_QUANTS[wtype][1] == 32 else 256 * max(1, kb // 8)
    raw = quant_raw(seed, n, k, wtype)
    x = rnd(seed + 1, L, k)
    assert same_bits(g.qmatvec(raw, wtype, x, rt=rt), canon_qlinear(x, raw, wtype))


@pytest.mark.parametrize("wtype", g.QUANT_WTYPES)
def test_qmatvec_batch_invariance(rt, wtype):
    """At Flash's width: a lane's bits alone, among 16 or among 256 equal the reference's."""
    raw = quant_raw(7, 512, 4096, wtype)
    x = rnd(8, 256, 4096)
    crowd = g.qmatvec(raw, wtype, x, rt=rt)
    assert same_bits(crowd[:16], canon_qlinear(x[:16], raw, wtype))
    assert np.array_equal(g.qmatvec(raw, wtype, x[:16], rt=rt), crowd[:16])
    for l in (0, 5, 200):
        assert np.array_equal(g.qmatvec(raw, wtype, x[l:l + 1], rt=rt)[0], crowd[l])


@SETTINGS
@given(seed=seeds, L=wide_lanes, E=st.sampled_from([4, 16]), kk=st.sampled_from([1, 2, 6]),
       shape=st.sampled_from([(256, 512), (64, 256), (512, 2048)]), down=st.booleans(),
       wtype=st.sampled_from(g.QUANT_WTYPES))
def test_qrouted_experts(rt, seed, L, E, kk, shape, down, wtype):
    """Each (lane, choice) is the reference's quantised product with that expert, whoever
    else chose it."""
    assume(kk <= E)
    N, K = shape
    rng = np.random.default_rng(seed)
    raws = [quant_raw(seed + 10 * e, N, K, wtype) for e in range(E)]
    ids = np.stack([np.sort(rng.choice(E, kk, replace=False)) for _ in range(L)]).astype(np.int32)
    x = rnd(seed + 1, L, kk, K) if down else rnd(seed + 1, L, K)
    got = g.qrouted_experts(np.stack(raws), wtype, x, ids, rt=rt)
    for l in range(L):
        for t in range(kk):
            xi = x[l, t] if down else x[l]
            assert same_bits(got[l, t], canon_qlinear(xi[None], raws[ids[l, t]], wtype)[0])
