"""The reference model: streamed decode equals whole-sequence prefill; paged equals
unpaged; bad input is refused with a clear message."""
from functools import lru_cache

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4ref.backend import Row, StepPlan
from ds4ref.reference.model import InputError, Model
from ds4ref.reference.numpy_backend import NumpyBackend
from ds4ref.gguf.tiny import random_tensors, tiny_config
from ds4ref.gguf.weights import DictWeights

# Small variants: short windows and top-k so ratio-4 selection, ratio-128 emission and
# window eviction all happen within ~300 tokens.
VARIANTS = {
    "flash6": dict(),
    "deep_window": dict(sliding_window=5, indexer_top_k=3),
    "hca_first": dict(n_layer=4, compress_ratios=(0, 128, 4, 4), swiglu_clamp=(2.0,) * 4, n_hash_layers=1,
                      indexer_top_k=5, n_expert_used=3),
}


@lru_cache(maxsize=None)
def model(variant: str, seed: int, dtype=np.float64, numerics: str = "official") -> Model:
    cfg = tiny_config(**VARIANTS[variant])
    return Model(DictWeights(cfg, random_tensors(cfg, seed), dtype), numerics)


def prompt(seed: int, n: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(variant=st.sampled_from(sorted(VARIANTS)), seed=st.integers(0, 3), n=st.integers(1, 300),
       numerics=st.sampled_from(["official", "plain"]))
def test_decode_equals_score_float64(variant, seed, n, numerics):
    m = model(variant, seed, np.float64, numerics)
    ids = prompt(seed + 100, n, m.config.vocab_size)
    full, streamed = m.score(ids), m.decode_logits(ids)
    # float64 is plain NumPy maths, not the canonical arithmetic: score() is prefill.py's whole-
    # sequence forward (masks, products over all rows at once), whose BLAS sums round in other
    # orders than the decode step's one row at a time, so the two agree to float64's rounding.
    diff = np.abs(full - streamed).max()
    assert diff <= 1e-9, f"max |score - decode| = {diff:.3e}"


def test_decode_equals_score_float32_plain_bitwise():
    """float32 score() runs the decode step's very computation over passes of rows
    (docs/exactness.md): the streamed decode's bits (official numerics, and prompts past
    score()'s first pass: tests/test_canon.py)."""
    m = model("flash6", 0, np.float32, "plain")
    ids = prompt(7, 300, m.config.vocab_size)
    full, streamed = m.score(ids), m.decode_logits(ids)
    assert full.dtype == np.float32 and np.array_equal(full.view(np.uint32), streamed.view(np.uint32))


def test_generate_is_greedy_over_score():
    m = model("flash6", 1)
    ids = prompt(3, 40, m.config.vocab_size)
    new = m.generate(ids, 12)
    logits = m.score(ids + new)
    assert new == [int(np.argmax(logits[len(ids) - 1 + i])) for i in range(12)]


def test_numerics_modes_differ_only_by_the_simulation():
    ids = prompt(4, 200, 512)
    off, plain = model("flash6", 2, np.float64, "official"), model("flash6", 2, np.float64, "plain")
    a, b = off.score(ids), plain.score(ids)
    assert not np.array_equal(a, b), "official numerics must change the logits"
    assert np.corrcoef(a.ravel(), b.ravel())[0, 1] > 0.9, "the two modes should still mostly agree"


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), n=st.integers(1, 300), chunk=st.integers(1, 16),
       pages=st.permutations(list(range(8))))
def test_paged_backend_equals_unpaged(seed, n, chunk, pages):
    """Any chunking of the prompt into passes and any scattered page placement gives
    logits bitwise equal to the unpaged decode."""
    m = model("deep_window", 0, np.float32)
    ids = prompt(seed, n, m.config.vocab_size)
    ref = m.decode_logits(ids)
    b = NumpyBackend(m)
    b.configure(n_slots=3, n_pages=8)
    slot = seed % 3
    b.reset_slot(slot)
    b.set_block_table(slot, pages[: -(-n // 128)])
    got = []
    for p in range(0, n, chunk):
        rows = [Row(slot, q, ids[q]) for q in range(p, min(n, p + chunk))]
        got += b.step(StepPlan.from_rows(rows)).logits
    assert np.array_equal(np.stack(got), ref)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_interleaved_slots_in_one_pass_equal_unpaged(dtype):
    """Rows of several slots interleaved within passes (a slot's rows not adjacent in the plan,
    a slot with several rows, emitting and silent rows mixed) give each slot the logits of its
    unpaged decode, bitwise; float64 runs such a pass row by row."""
    m = model("deep_window", 1, dtype)
    n = (48, 41, 30)
    ids = [prompt(10 + s, n[s], m.config.vocab_size) for s in range(3)]
    ref = [m.decode_logits(x) for x in ids]
    b = NumpyBackend(m)
    b.configure(n_slots=3, n_pages=3)
    for s in range(3):
        b.reset_slot(s)
        b.set_block_table(s, [2 - s])
    got, pos = [[] for _ in range(3)], [0, 0, 0]
    while any(pos[s] < n[s] for s in range(3)):
        rows = []
        for rep in range(3):  # up to three rows per slot, round robin: s0 s1 s2 s0 s1 s2 ...
            for s in range(3):
                if pos[s] < n[s] and len(rows) < 16:
                    rows.append(Row(s, pos[s], ids[s][pos[s]], emit=(pos[s] % 3 != 1),
                                    want_logits=(pos[s] % 3 != 1)))
                    pos[s] += 1
        for r, lg in zip(rows, b.step(StepPlan.from_rows(rows)).logits):
            if lg is not None:
                got[r.slot].append((r.position, lg))
    for s in range(3):
        want = [ref[s][p] for p, _ in got[s]]
        assert all(np.array_equal(a, w) for (_, a), w in zip(got[s], want)) and len(got[s]) == len(want)


def test_backend_refuses_out_of_order_rows_without_changing_state():
    m = model("deep_window", 0, np.float32)
    b = NumpyBackend(m)
    b.configure(n_slots=1, n_pages=2)
    b.reset_slot(0)
    b.set_block_table(0, [1])
    b.step(StepPlan.from_rows([Row(0, 0, 5)]))
    before = b.rings.copy()
    with pytest.raises(ValueError, match="position 2"):
        b.step(StepPlan.from_rows([Row(0, 2, 6)]))
    assert np.array_equal(b.rings, before)
    b.reset_slot(0)  # back to position 0 with an empty block table
    with pytest.raises(ValueError, match="needs 1 mapped pages"):
        b.step(StepPlan.from_rows([Row(0, 0, 6)]))


@pytest.mark.parametrize("ids,match", [
    ([], "empty"),
    ([1, 512], "out of range"),
    ([-1], "out of range"),
    ([[1, 2]], "flat"),
    ([1.5], "integer"),
])
def test_bad_prompts_are_refused(ids, match):
    m = model("flash6", 0, np.float32)
    with pytest.raises(InputError, match=match):
        m.score(ids)
    with pytest.raises(InputError, match=match):
        m.generate(ids, 2)


def test_context_limit():
    m = Model(DictWeights(tiny_config(context_length=8), random_tensors(tiny_config(context_length=8), 0)))
    with pytest.raises(InputError, match="context length 8"):
        m.generate([1, 2, 3], 7)
