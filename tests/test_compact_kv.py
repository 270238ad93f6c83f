"""Compact KV storage (ds4ref/paging/compact.py): lossless for every official-numerics row,
refuses anything else, and the paged NumpyBackend on compact rows gives bitwise the logits
of the unpaged float32 reference."""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st
from hypothesis.extra.numpy import arrays

from ds4ref.backend import Row, StepPlan
from ds4ref.paging import compact
from ds4ref.paging.compact import (decode_index_rows, decode_kv_rows, encode_index_rows, encode_kv_rows,
                                   index_row_bytes, kv_row_bytes)
from ds4ref.reference import ops
from ds4ref.reference.model import Model
from ds4ref.reference.numpy_backend import NumpyBackend
from ds4ref.gguf.tiny import random_tensors, tiny_config
from ds4ref.gguf.weights import DictWeights

F32 = np.float32
# (head_dim, n_rot): Flash's, the tiny model's, and no RoPE tail at all
KV_SHAPES = st.sampled_from([(512, 64), (96, 32), (192, 64), (64, 0)])
INDEX_DIMS = st.sampled_from([128, 64, 32])
# fp8sim's scale is 2^e with e >= ceil(log2(1e-4 / 448)) = -22; 448 * 2^119 is the largest finite.
# qat's is >= 2^-126 (its floor / 6); 6 * 2^125 is the largest finite.
KV_EXPONENTS, INDEX_EXPONENTS = (-22, 119), (-126, 125)


def bits(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, F32).view(np.uint32)


def assert_round_trip_kv(rows: np.ndarray, n_rot: int) -> None:
    stored = encode_kv_rows(rows, n_rot)
    assert stored.dtype == np.uint8 and stored.shape == (*rows.shape[:-1], kv_row_bytes(rows.shape[-1], n_rot))
    assert np.array_equal(bits(decode_kv_rows(stored, rows.shape[-1], n_rot)), bits(rows))


def assert_round_trip_index(rows: np.ndarray) -> None:
    stored = encode_index_rows(rows)
    assert stored.dtype == np.uint8 and stored.shape == (*rows.shape[:-1], index_row_bytes(rows.shape[-1]))
    assert np.array_equal(bits(decode_index_rows(stored, rows.shape[-1])), bits(rows))


def grid_rows(rng, lead, n_blocks, block, table, exponents) -> np.ndarray:
    """Any code times any 2^e of the format's range per block: every value the grid has."""
    valid = np.flatnonzero(~np.isnan(table))
    codes = rng.choice(valid, (*lead, n_blocks, block))
    e = rng.integers(exponents[0], exponents[1] + 1, (*lead, n_blocks, 1))
    return np.ldexp(table[codes], e).astype(F32).reshape(*lead, n_blocks * block)


def spread_rows(rng, lead, width) -> np.ndarray:
    """float32 vectors over the whole range: each 32-dim block has its own binade (from
    subnormal to near float32 max) and spread; some blocks are all zero, some dims -0.0."""
    n = width // 32
    top = rng.integers(-149, 128, (*lead, n, 1))
    spread = rng.integers(0, 40, (*lead, n, 1))
    mags = np.ldexp(1 + rng.random((*lead, n, 32)), top - rng.integers(0, spread + 1, (*lead, n, 32)))
    v = np.where(rng.random((*lead, n, 32)) < 0.5, -mags, mags)
    v = np.where(rng.random((*lead, n, 1)) < 0.15, 0.0, v)
    v = np.clip(v, -3.2e38, 3.2e38).astype(F32).reshape(*lead, width)  # fp8sim of more can round to inf
    v[rng.random(v.shape) < 0.05] = -0.0
    return v


# ---- (1) lossless on every official-numerics row -------------------------------------------------


@given(shape=KV_SHAPES, lead=st.sampled_from([(1,), (3,), (2, 3)]), seed=st.integers(0, 2**32 - 1))
def test_every_fp8_grid_row_round_trips(shape, lead, seed):
    d, n_rot = shape
    rng = np.random.default_rng(seed)
    rows = np.empty((*lead, d), F32)
    rows[..., :d - n_rot] = grid_rows(rng, lead, (d - n_rot) // 64, 64, compact.E4M3FN, KV_EXPONENTS)
    rope = rng.integers(0, 2**32, (*lead, n_rot), dtype=np.uint64).astype(np.uint32)
    rows[..., d - n_rot:] = rope.view(F32)  # any bits at all, NaN payloads included
    assert_round_trip_kv(rows, n_rot)


@given(di=INDEX_DIMS, lead=st.sampled_from([(1,), (4,), (2, 2)]), seed=st.integers(0, 2**32 - 1))
def test_every_fp4_grid_row_round_trips(di, lead, seed):
    rng = np.random.default_rng(seed)
    assert_round_trip_index(grid_rows(rng, lead, di // 32, 32, compact.E2M1, INDEX_EXPONENTS))


@given(shape=KV_SHAPES, lead=st.sampled_from([(1,), (5,), (2, 3)]), seed=st.integers(0, 2**32 - 1))
def test_fp8sim_outputs_over_the_whole_range_round_trip(shape, lead, seed):
    d, n_rot = shape
    rows = ops.fp8sim(spread_rows(np.random.default_rng(seed), lead, d), n_rot)
    assert np.isfinite(rows).all()
    assert_round_trip_kv(rows, n_rot)


@given(di=INDEX_DIMS, lead=st.sampled_from([(1,), (5,), (2, 3)]), seed=st.integers(0, 2**32 - 1))
def test_qat_outputs_over_the_whole_range_round_trip(di, lead, seed):
    # scaled so the Hadamard sums stay finite: qat of larger inputs overflows to inf itself
    v = spread_rows(np.random.default_rng(seed), lead, di) * F32(2.0 ** -8)
    rows = ops.qat(v, ops.hadamard(di, F32))
    assert np.isfinite(rows).all()
    assert_round_trip_index(rows)


BIG = float(F32(3.2e38))  # fp8sim of more can round up to inf
FINITE = st.floats(width=32, allow_nan=False, allow_infinity=False, min_value=-BIG, max_value=BIG)


@given(v=arrays(F32, (2, 192), elements=FINITE))
def test_fp8sim_of_drawn_floats_round_trips(v):
    assert_round_trip_kv(ops.fp8sim(v, 64), 64)


@given(v=arrays(F32, (2, 64), elements=FINITE))
def test_qat_of_drawn_floats_round_trips(v):
    rows = ops.qat(v * F32(2.0 ** -8), ops.hadamard(64, F32))
    assert_round_trip_index(rows)


@pytest.mark.parametrize("table, fmt, rnd, top", [
    (compact.E4M3FN, compact.E4M3FN_FORMAT, ops.e4m3_round, 448.0),
    (compact.E2M1, compact.E2M1_FORMAT, ops.e2m1_round, 6.0)])
def test_codes_are_the_nearest_grid_values(table, fmt, rnd, top):
    """With e = 0 the code of x is ops' rounding of x (ties to even), the sign of -0.0 kept."""
    x = np.concatenate([np.linspace(-1.2 * top, 1.2 * top, 100_001), np.linspace(-top / 64, top / 64, 20_001),
                        [-0.0, 0.0]]).astype(F32)
    codes = np.empty((1, x.size), np.uint8)
    compact._grid_codes(x[None], np.zeros(1, np.int32), *fmt, codes)
    assert np.array_equal(bits(table[codes[0]]), bits(rnd(np.clip(x, -top, top))))


def test_all_zero_and_negative_zero_blocks():
    kv = np.zeros((2, 192), F32)
    kv[1, ::3] = -0.0
    stored = encode_kv_rows(kv, 64)
    assert stored[1, 0] == 0x80 and stored[1, 1] == 0  # -0.0 is 0x80
    assert_round_trip_kv(kv, 64)
    ix = np.zeros((2, 64), F32)
    ix[1, 0] = -0.0
    assert encode_index_rows(ix)[1, 0] == 0x08
    assert_round_trip_index(ix)


def test_the_smallest_fp4_value_decodes_exactly():
    """0.5 * 2^-126 is a float32 subnormal: the block's 2^e is 2^-126, the code 0.5."""
    tiny = F32(2.0 ** -127)
    row = np.zeros((1, 64), F32)
    row[0, 0], row[0, 3], row[0, 40] = tiny, -tiny, 3 * tiny * 2  # 3 * 2^-126 is on the grid as well
    stored = encode_index_rows(row)
    assert stored[0, 0] == 0x01 and stored[0, 1] == 0x90  # dims 0 (0.5) and 3 (-0.5, high nibble)
    assert stored[0, 32] == 1 and stored[0, 33] == 1      # both blocks at e = -126
    assert_round_trip_index(row)


def test_byte_layout():
    """The fixed format, byte for byte (the GPU side reads the same bytes)."""
    kv = np.zeros(192, F32)  # nope 128 = 2 blocks, 64 RoPE dims
    kv[:4] = [1.0, -0.0, 0.5, -2.0]  # block 0: amax 2, e = ceil(log2(2 / 448)) = -7
    kv[128:] = np.arange(64, dtype=F32) + F32(0.25)
    b = encode_kv_rows(kv, 64)
    assert b.shape == (kv_row_bytes(192, 64),) == (132 + 256,)
    assert list(b[:4]) == [0x70, 0x80, 0x68, 0xF8]  # 128, -0, 64, -256 as E4M3FN
    assert b[128] == -7 + 127 and b[129] == -22 + 127  # block 1 is zero: the floor 1e-4 decides
    assert b[130] == b[131] == 0  # padding
    assert bytes(b[132:]) == kv[128:].astype("<f4").tobytes()
    ix = np.zeros(64, F32)
    ix[:3] = [6.0, -0.5, 1.5]  # amax 6: e = 0
    b = encode_index_rows(ix)
    assert b.shape == (36,) and list(b[:2]) == [0x97, 0x03]  # 6 -> 7, -0.5 -> 0x9 (high), 1.5 -> 3
    assert list(b[32:]) == [127, 1, 0, 0]  # e = 0; the zero block's floor gives e = -126


# ---- (2) anything off the grid is refused ----------------------------------------------------------


def off_grid(v: np.float32) -> np.float32:
    return np.nextafter(v, F32(0) if v != 0 else F32(1))


@settings(max_examples=10)
@given(seed=st.integers(0, 2**32 - 1), row=st.integers(0, 3), dim=st.integers(0, 447))
def test_one_ulp_off_the_grid_is_refused_naming_row_and_dim(seed, row, dim):
    # One ulp toward zero (away from it for a zero) never changes the block's exponent, so
    # the first difference is that dim's.
    rows = ops.fp8sim(np.random.default_rng(seed).standard_normal((4, 512)).astype(F32), 64)
    rows[row, dim] = off_grid(rows[row, dim])
    with pytest.raises(ValueError, match=f"KV row {row} dim {dim}: .* not a value of the official"):
        encode_kv_rows(rows, 64)
    ix = ops.qat(np.random.default_rng(seed).standard_normal((4, 128)).astype(F32), ops.hadamard(128, F32))
    ix[row, dim % 128] = off_grid(ix[row, dim % 128])
    with pytest.raises(ValueError, match=f"indexer row {row} dim {dim % 128}:"):
        encode_index_rows(ix)


def test_plain_rows_and_non_finite_values_are_refused():
    plain = np.random.default_rng(0).standard_normal((2, 3, 512)).astype(F32)
    with pytest.raises(ValueError, match=r"KV row \(0, 0\) dim 0"):
        encode_kv_rows(plain, 64)
    with pytest.raises(ValueError, match="indexer row 0 dim 0"):
        encode_index_rows(plain[0, :, :128])
    for bad in (np.nan, np.inf, -np.inf):
        row = np.zeros((1, 192), F32)
        row[0, 5] = bad
        with pytest.raises(ValueError, match="KV row 0 dim 5"):
            encode_kv_rows(row, 64)
        with pytest.raises(ValueError, match="indexer row 0 dim 5"):
            encode_index_rows(row[:, :64])
    with pytest.raises(ValueError, match="float32"):
        encode_kv_rows(np.zeros((1, 192)), 64)  # float64 official rows keep their own storage
    with pytest.raises(ValueError, match="blocks of 64"):
        encode_kv_rows(np.zeros((1, 100), F32), 4)


# ---- (3) the paged backend on compact rows equals the unpaged reference ------------------------------

# Three layers (sliding, ratio 4, ratio 128), window 5 and top-k 3: the ring wraps, the
# ratio-4 layer selects from its 4th compressed row (position 15) on, and 260 positions
# give two ratio-128 rows.
LENGTHS = (260, 140, 140)  # of each slot's own prompt: distinct tokens, so no slot can pass on another's state


@lru_cache(maxsize=None)
def official_f32_model() -> Model:
    cfg = tiny_config(n_layer=3, compress_ratios=(0, 4, 128), swiglu_clamp=(2.0,) * 3, n_hash_layers=1,
                      sliding_window=5, indexer_top_k=3)
    return Model(DictWeights(cfg, random_tensors(cfg, 11), F32), "official")


@lru_cache(maxsize=None)
def reference(slot: int) -> tuple[list[int], np.ndarray]:
    """The slot's prompt and its unpaged (SeqState) logits; any prefix's logits are a prefix."""
    m = official_f32_model()
    ids = np.random.default_rng(slot).integers(0, m.config.vocab_size, LENGTHS[slot]).tolist()
    return ids, m.decode_logits(ids)


@example(lens=[260, 133, 9], chunk=16, order=0)
@settings(max_examples=2)
@given(lens=st.lists(st.integers(1, 140), min_size=1, max_size=3), chunk=st.integers(1, 16),
       order=st.integers(0, 99))
def test_compact_backend_equals_unpaged_reference(lens, chunk, order):
    """Ragged prompts in three slots, their rows interleaved in passes of up to 16, on
    scattered pages: every logits row is bitwise the unpaged float32 reference's."""
    m = official_f32_model()
    b = NumpyBackend(m)
    assert b.storage == "compact"
    n_pages = sum(-(-n // 128) for n in lens)
    b.configure(n_slots=3, n_pages=n_pages)
    assert b.rings.dtype == np.uint8 and all(p.dtype == np.uint8 for p in b.pages.values())
    pages = np.random.default_rng(order).permutation(n_pages).tolist()
    for slot, n in enumerate(lens):
        b.reset_slot(slot)
        b.set_block_table(slot, [pages.pop() for _ in range(-(-n // 128))])
    fed, got = [0] * len(lens), [[] for _ in lens]
    while any(f < n for f, n in zip(fed, lens)):
        rows = []
        for slot, n in enumerate(lens):
            take = min(chunk, n - fed[slot], 16 - len(rows))
            rows += [Row(slot, p, reference(slot)[0][p]) for p in range(fed[slot], fed[slot] + take)]
            fed[slot] += take
        for r, lg in zip(rows, b.step(StepPlan.from_rows(rows)).logits):
            got[r.slot].append(lg)
    for slot, n in enumerate(lens):
        assert np.array_equal(bits(np.stack(got[slot])), bits(reference(slot)[1][:n])), f"slot {slot}"


def test_only_official_float32_is_stored_compact():
    cfg = official_f32_model().config
    weights = random_tensors(cfg, 11)
    for dtype, numerics, storage, row_dtype in [(F32, "official", "compact", np.uint8), (F32, "plain", "f32", F32),
                                                (np.float64, "official", "f64", np.float64)]:
        b = NumpyBackend(Model(DictWeights(cfg, weights, dtype), numerics))
        b.configure(n_slots=1, n_pages=1)
        assert b.storage == storage and b.rings.dtype == row_dtype
        assert b.pages[(1, "index")].dtype == row_dtype


# ---- (4) sizes ------------------------------------------------------------------------------------------


def test_flash_row_sizes():
    assert kv_row_bytes(512, 64) == 448 + 7 + 1 + 256 == 712     # vs 2048 as float32
    assert index_row_bytes(128) == 64 + 4 == 68                  # vs 512
    assert kv_row_bytes(96, 32) == 64 + 1 + 3 + 128 and index_row_bytes(64) == 32 + 2 + 2
