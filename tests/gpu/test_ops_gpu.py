"""Every GPU op the backend runs against its twin in ds4ref/reference, bit for bit: the op-case
table (ds4ref/harness/op_cases.py) in test mode, then the properties a table row does not express
(batch invariance, padding lanes, staging paths, rows per warp).

The reference runs in float32, the canonical arithmetic (docs/exactness.md), on the
same inputs (weights dequantised exactly to f32), so every comparison is of the float32
bits: no tolerance anywhere. How far the canonical arithmetic sits from float64 maths is
tested on the CPU (tests/test_canon.py). Outputs are poisoned with NaN / -1 inside
ds4ref.harness.twins, so an unwritten element fails.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ds4ref.hip import builds
from ds4ref.hip import launch as K
from ds4ref.hip import layouts
from ds4ref.hip.device_state import ROW_F32, ROW_KV
from ds4ref.harness import twins as g
from ds4ref.harness.op_cases import (BY_NAME, CASES, LANE_ROWS, PASS_ROWS, QUANTS, canon_qlinear, make_weight,
                                     ref_qexperts, rnd, run_case)
from ds4ref.reference import ops as ref

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


seeds = st.integers(0, 2**31 - 1)
lanes = st.integers(1, 16)
# a prompt pass: the matvec runs in lane groups of 16, an expert chosen by more than 16
# lanes gets several work entries
wide_lanes = st.one_of(lanes, st.sampled_from(LANE_ROWS))
ROWS = {"decode": lanes, "prompt": wide_lanes, "pass": st.one_of(wide_lanes, st.sampled_from(PASS_ROWS)),
        "one": st.just(1)}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@SETTINGS
@given(data=st.data())
def test_twin(rt, case, data):
    """One draw of the case's shapes: the launcher's outputs equal the reference's (integers
    exactly, floats in their bits, or by value where the case says `equal`)."""
    params = {k: data.draw(st.sampled_from(v), label=k) for k, v in case.params.items()}
    out = run_case(case, data.draw(seeds, label="seed"), data.draw(ROWS[case.rows], label="rows"), rt, **params)
    assume(out is not None)
    for got, want in zip(*out):
        if np.asarray(want).dtype.kind == "f" and case.compare == "bits, any NaN":
            nan = np.isnan(want)  # the case's docstring in op_cases says why a NaN's payload may differ
            assert np.array_equal(np.isnan(got), nan)
            assert same_bits(np.where(nan, F32(0), got), np.where(nan, F32(0), want))
        elif np.asarray(want).dtype.kind == "f" and case.compare == "bits":
            assert same_bits(got, want)
        else:
            assert np.array_equal(np.asarray(got), np.asarray(want))


# ---- properties beside the table ---------------------------------------------------------

@pytest.mark.parametrize("wtype", ["f32", "f16", "bf16", "q8_0"])
def test_matvec_batch_invariance(rt, wtype):
    """At Flash's width (4096 columns): the reference's bits, alone, among 16 or among 256
    (lane groups)."""
    w, wf = make_weight(7, 1024, 4096, wtype)
    x = rnd(8, 256, 4096)
    alone = g.matvec(w, x[:1], wtype=wtype, rt=rt)
    among = g.matvec(w, x[:16], wtype=wtype, rt=rt)
    crowd = g.matvec(w, x, wtype=wtype, rt=rt)
    assert same_bits(among, ref.linear(x[:16], wf))
    assert np.array_equal(alone[0], among[0]) and np.array_equal(crowd[:16], among)
    for l in (5, 15, 200):  # any lane, alone or among 16 or 256
        assert np.array_equal(g.matvec(w, x[l:l + 1], wtype=wtype, rt=rt)[0], crowd[l])


@pytest.mark.parametrize("wtype", ["f32", "bf16", "q8_0"])
@pytest.mark.parametrize("n_active", [1, 5, 16])
def test_matvec_lane_slot_skips_padding(rt, monkeypatch, wtype, n_active):
    """With the backend's lane_slot: lanes past the last slot are not written (still NaN),
    active lanes are bitwise what a plain 16-lane call gives, for every rows-per-warp."""
    n, k = 700, 4096 + 256
    w, _ = make_weight(11, n, k, wtype)
    x = rnd(12, 16, k)
    full = g.matvec(w, x, wtype=wtype, rt=rt)
    slots = np.full(16, -1, np.int32)
    slots[:n_active] = np.arange(n_active) + 3
    dw = layouts.DeviceWeight.upload(rt, w, wtype)
    try:
        for rpw in ("1", "2", "4"):
            monkeypatch.setenv("DS4REF_MATVEC_RPW", rpw)
            with g._Scope(rt) as s:
                y = s.out((16, n))
                K.launch_matvec(rt, dw, s.up(x), y, 16, lane_slot=s.up(slots))
                got = s.get(y, (16, n))
            assert np.array_equal(got[:n_active], full[:n_active]), rpw
            assert np.all(np.isnan(got[n_active:])), rpw
    finally:
        dw.buf.free()


@pytest.mark.parametrize("wtype", ["f32", "bf16"])
@pytest.mark.parametrize("L", [1, 16])
def test_matvec_unaligned_rows_stage_scalar(rt, monkeypatch, wtype, L):
    """Input rows that are not 16-byte aligned (ldx = K + 1) take the scalar staging; the
    result is bitwise the aligned (16-byte staging) one, for every rows-per-warp."""
    n, k = 500, 2048 + 96
    w, _ = make_weight(5 + L, n, k, wtype)
    x = rnd(6 + L, L, k)
    want = g.matvec(w, x, wtype=wtype, rt=rt)
    xp = np.zeros((L, k + 1), F32)
    xp[:, :k] = x
    dw = layouts.DeviceWeight.upload(rt, w, wtype)
    try:
        for rpw in ("1", "2"):
            monkeypatch.setenv("DS4REF_MATVEC_RPW", rpw)
            with g._Scope(rt) as s:
                y = s.out((L, n))
                K.launch_matvec(rt, dw, s.up(xp), y, L, ldx=k + 1)
                got = s.get(y, (L, n))
            assert np.array_equal(got, want), rpw
    finally:
        dw.buf.free()


@pytest.mark.parametrize("wtype", ["f32", "bf16", "q8_0"])
@pytest.mark.parametrize("n,k", [(24, 16384), (4, 16384), (64, 4096 + 96)])
def test_matvec_ksplit(rt, monkeypatch, wtype, n, k):
    """The fixed K-split (few rows, long rows): the reference's split, and a lane alone vs among 16."""
    assert K.matvec_ksplit(n, k)
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
    """The paged attention at Flash's heads and width: a lane's bits alone equal its bits among
    16 (ring, pass rows and 200 selected compressed rows), and the reference's."""
    from ds4ref.harness.op_cases import make_attention, ref_attention_paged
    args = make_attention(3, 16, 64, 512, 128, "selected", ROW_F32)[0]
    q, pass_kv, ring, pages, sel, ksel, lanes, sinks, kind, n_rot, _rope, _q8 = args
    among = g.attention_paged(*args, rt=rt)
    assert same_bits(among, ref_attention_paged(*args))
    for l in np.flatnonzero(lanes.slot >= 0)[[0, -1]]:
        f = lanes.flane[l]  # alone: the lane with its slot's earlier rows of the pass before it
        one = K.PagedLanes(*(a[f:l + 1] for a in (lanes.slot, lanes.pos, lanes.pstart)), lanes.flane[f:l + 1] - f,
                           lanes.nvis[f:l + 1], lanes.btab, lanes.per)
        alone = g.attention_paged(q[f:l + 1], pass_kv[f:l + 1], ring, pages, sel[f:l + 1], ksel, one, sinks,
                                  kind, n_rot, rt=rt)
        assert np.array_equal(alone[-1], among[l])


@pytest.mark.parametrize("defines", builds.ATTENTION_TUNING)
@pytest.mark.parametrize("kind", [ROW_F32, ROW_KV])
@pytest.mark.parametrize("H", [20, 64])
def test_attention_tuning_macros_agree(rt, monkeypatch, defines, kind, H):
    """step_attention_split's key tile, heads per warp and staging loads in flight (docs/kernels.md,
    tuning macros) give the reference's bits: Flash's width in both row formats, 20 heads leaving
    warps idle."""
    from ds4ref.harness.op_cases import make_attention, ref_attention_paged
    monkeypatch.setenv("DS4REF_KERNEL_DEFINES", defines)
    args = make_attention(5, 16, H, 512, 128, "selected", kind)[0]
    assert same_bits(g.attention_paged(*args, rt=rt), ref_attention_paged(*args))


@pytest.mark.parametrize("wtype", ["f32", "f16", "bf16", "q8_0", *QUANTS])
@pytest.mark.parametrize("n,k,L", [(300, 4096 + 96, 1), (1000, 1024, 16), (5000, 256, 3), (9000, 512, 7),
                                   (600, 4096 + 96, 16), (700, 2048, 40)])
def test_matvec_rows_per_warp_agree(rt, monkeypatch, wtype, n, k, L):
    """Every rows-per-warp the kernel is built with gives the reference's bits (the policy's
    choice never changes a result)."""
    k = -(-k // 256) * 256 if wtype in QUANTS else k
    w, wf = make_weight(n + k, n, k, wtype)
    x = rnd(L, L, k)
    want = ref.linear(x, wf)
    for rpw in ("1", "2") + (() if wtype in QUANTS else ("4",)):
        monkeypatch.setenv("DS4REF_MATVEC_RPW", rpw)
        assert same_bits(g.matvec(w, x, wtype=wtype, rt=rt), want), rpw


# ---- block quants (GGUF's Q2_K, Q4_K, IQ2_XXS, MXFP4), dequantised in registers ----------

@pytest.mark.parametrize("wtype", QUANTS)
@pytest.mark.parametrize("n,k", [(24, 16384), (4096, 4096), (2048, 4096)])
def test_matvec_block_quants_flash_shapes(rt, wtype, n, k):
    """The hc mix's K-split shape and Flash's 4096-wide projections, 16 lanes and alone."""
    w, wf = make_weight(n + k, n, k, wtype)
    x = rnd(n * 3 + k, 16, k)
    among = g.matvec(w, x, wtype=wtype, rt=rt)
    assert same_bits(among, ref.linear(x, wf))
    assert same_bits(g.matvec(w, x[7:8], wtype=wtype, rt=rt)[0], among[7])


# ---- quantised products (official numerics: int8 activations, exact integer block dots) ----

@pytest.mark.parametrize("wtype", layouts.QUANT_WTYPES)
def test_qmatvec_batch_invariance(rt, wtype):
    """At Flash's width: a lane's bits alone, among 16 or among 256 equal the reference's."""
    raw = make_weight(7, 512, 4096, wtype)[0]
    x = rnd(8, 256, 4096)
    crowd = g.qmatvec(raw, wtype, x, rt=rt)
    assert same_bits(crowd[:16], canon_qlinear(x[:16], raw, wtype))
    assert np.array_equal(g.qmatvec(raw, wtype, x[:16], rt=rt), crowd[:16])
    for l in (0, 5, 200):
        assert np.array_equal(g.qmatvec(raw, wtype, x[l:l + 1], rt=rt)[0], crowd[l])


@pytest.mark.parametrize("wtype", layouts.QUANT_WTYPES)
@pytest.mark.parametrize("k", [1024, 4096 + 1024])
def test_qmatvec_row_block_loop(rt, wtype, k):
    """A block walking row blocks (grid capped at 3) gives every row the bits of one block a row
    block: reusing its staged inputs where K fits (1024 at 16 lanes), staging chunk by chunk where
    it does not, with a partial last row block (1000 rows)."""
    raw = make_weight(13, 1000, k, wtype)[0]
    x = rnd(14, 16, k)
    one_each = g.qmatvec(raw, wtype, x, rt=rt)
    assert same_bits(one_each, canon_qlinear(x, raw, wtype))
    for L in (16, 1):
        assert np.array_equal(g.qmatvec(raw, wtype, x[:L], rt=rt, max_blocks=3), one_each[:L])


@pytest.mark.parametrize("wtype", layouts.QUANT_WTYPES)
@pytest.mark.parametrize("k", [2048 + 256, 1024, 256])
def test_qgemm_every_type(rt, wtype, k):
    """The tiled GEMM of prompt passes (ds4_qgemm_*: §2a's partial chains walked in the
    butterfly's post-order): bitwise the reference and the decode kernel, with partial 16-row
    groups and 64-row tiles, weight rows past a 64-row tile, and K past 32 blocks, at exactly 32
    (one block a chain) and below (empty chains between full ones)."""
    raw = make_weight(11, 70, k, wtype)[0]
    x = rnd(12, 77, k)
    crowd = g.qmatvec(raw, wtype, x, rt=rt, gemm=True)
    assert same_bits(crowd, canon_qlinear(x, raw, wtype))
    assert np.array_equal(g.qmatvec(raw, wtype, x[:16], rt=rt), crowd[:16])


@pytest.mark.parametrize("defines,wtype", builds.qgemm_tuning_cases())
def test_qgemm_tuning_changes_no_bit(rt, monkeypatch, defines, wtype):
    """The tiled GEMM's fetch ring (QG_AHEAD blocks of the walk ahead, refilled across chains), its
    register budget and AMD's dot4 tiles with the leaves in a loop (QG_DOT4=1) change no bit: with K
    past 32 blocks and below (empty chains skipped by the fetch cursor), and rows and weight rows
    that end inside a tile, every setting gives the reference's bits."""
    monkeypatch.setenv("DS4REF_KERNEL_DEFINES", defines)
    for k in (2048 + 256, 256):
        raw = make_weight(21, 70, k, wtype)[0]
        x = rnd(22, 77, k)
        assert same_bits(g.qmatvec(raw, wtype, x, rt=rt, gemm=True), canon_qlinear(x, raw, wtype))


@pytest.mark.parametrize("defines", ["", "QG_DOT4=1"])
@pytest.mark.parametrize("wtype", ["q8_0", "q2_k", "iq2_xxs"])
@pytest.mark.parametrize("E,rows", [(16, 1025), (256, 2048)])
def test_qexperts_gemm_gives_the_dp4a_walks_bits(rt, monkeypatch, defines, wtype, E, rows):
    """The routed experts of prompt passes as the grouped GEMM (step_expert_tiles, ds4_qexperts_gemm_*),
    with NVIDIA's MMA and with AMD's dot4 tiles (QG_DOT4=1): every pair has the reference's bits and
    the dp4a walk's (ds4_qexperts_*), gate and down inputs, in whole passes whose experts fill
    several tiles each (16 experts, ~380 pairs) or part of one (Flash's 256 experts, top 6)."""
    if defines:
        monkeypatch.setenv("DS4REF_KERNEL_DEFINES", defines)
    for down in (False, True):
        gpu_args, ref_args, kw = BY_NAME["qrouted_experts_gemm"].make(7 + rows, rows, E=E, kk=6, shape=(70, 1280),
                                                                      down=down, wtype=wtype)
        grouped = g.qrouted_experts(*gpu_args, rt=rt, **kw)
        assert same_bits(grouped, ref_qexperts(*ref_args))
        assert np.array_equal(g.qrouted_experts(*gpu_args, rt=rt), grouped)


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_attention_combine_across_weight_chunks(rt, monkeypatch, seed):
    """step_attention_combine forms its slices' weights AT_CZ slices at a time (128 by default, so
    only contexts past 4,096 keys cross a chunk): with the tuning macro at 2, lanes of up to 6
    slices cross chunks, and the bits stay the reference's (a tuning macro changes none)."""
    monkeypatch.setenv("DS4REF_KERNEL_DEFINES", builds.ATTENTION_COMBINE_TUNING)
    got, want = run_case(BY_NAME["attention_paged"], seed, 16, rt, H=3, D=128, W=16, store="all",
                         kind=ROW_KV, span=40)
    lanes = BY_NAME["attention_paged"].make(seed, 16, H=3, D=128, W=16, store="all", kind=ROW_KV, span=40)[0][6]
    assert max(n + min(16, p + 1) for n, p, s in zip(lanes.nvis, lanes.pos, lanes.slot) if s >= 0) > 2 * 32
    for a, b in zip(got, want):
        assert same_bits(a, b)



@pytest.mark.parametrize("L", PASS_ROWS)
@pytest.mark.parametrize("E,kk", [(256, 6), (1024, 8), (8, 6)])
def test_expert_list_whole_passes(rt, L, E, kk):
    """step_expert_list over a whole pass of up to launch.LARGEST_PASS rows: the lanes in several
    chunks of its shared bit set at Flash's 256 experts (1,024 lanes a chunk) and at 1,024 (256),
    in one at the tiny model's 8; padding lanes and repeated choices among them. The list is
    op_cases.ref_expert_list's, entry for entry."""
    got, want = run_case(BY_NAME["expert_list"], 11 + L, L, rt, E=E, kk=kk, padding=0.3, repeats=True)
    assert np.array_equal(got[0], want[0])


@pytest.mark.parametrize("E,L", [(4, 700), (16, 129), (256, 40)])
def test_expert_list_chunks_change_nothing(rt, monkeypatch, E, L):
    """Chunks of 32 lanes (the tuning macro EL_CHUNK_WORDS=1) give the list of one chunk: an
    expert's pairs cross chunks, entries too."""
    monkeypatch.setenv("DS4REF_KERNEL_DEFINES", builds.EXPERT_LIST_TUNING)
    got, want = run_case(BY_NAME["expert_list"], 5, L, rt, E=E, kk=6, padding=0.3, repeats=True)
    assert np.array_equal(got[0], want[0])
