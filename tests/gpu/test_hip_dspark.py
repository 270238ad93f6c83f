"""The DSpark draft on the device (hip/dspark.py), bitwise against the NumPy reference on the tiny
DeepSeek-V4-Flash-0731 model and its random draft, in both numerics (marker gpu):

(a) draft(): each drafting request's block tokens and the logits of its whole Markov chain
    (B x vocab) equal reference/dspark.py's DSpark.draft over the reference's fed state, over
    rounds of several slots with ragged row counts (prompt chunks of up to 60 rows: the 64-lane
    bucket; single decode rows), k from 0 to the block size, past many windows of the stages'
    16-row sliding window (the rings hold W + B rows: a block's keys wrap them);
(b) speculative decoding with DSpark drafts on the HIP backend gives plain decoding's tokens,
    logprobs and finishes on the reference (hypothesis: prompts, k, prefix cache).
Skipped with the reason when no GPU runtime opens (tests/gpu/conftest.py)."""
from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ds4ref
from ds4ref.backend import DraftRequest, Row, StepPlan
from ds4ref.reference.numpy_backend import NumpyBackend
from ds4ref.scheduler.engine import Engine
from ds4ref.scheduler.request import Request, Sampling

from test_hip_speculative import trace

pytestmark = pytest.mark.gpu
EXAMPLES = int(os.environ.get("DS4REF_GPU_EXAMPLES", "8"))


@pytest.fixture(scope="module", params=["official", "plain"])
def model(request, tiny_0731):
    m = ds4ref.load(tiny_0731[0], numerics=request.param, dspark=tiny_0731[1])
    assert m.dspark is not None and m.config.sliding_window < 40
    return m


def bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10_000), n_slots=st.integers(1, 4))
def test_drafts_and_their_chains_are_the_references(model, rt, seed, n_slots):
    from ds4ref.hip.backend import HipBackend
    rng = np.random.default_rng(seed)
    V, B = model.config.vocab_size, model.dspark.config.block_size
    hb = HipBackend(model.config, model.weights, model.numerics, model.tables, runtime=rt,
                    dspark=model.dspark.weights)
    nb = model.make_backend("numpy")
    rounds, pages = 16, 8  # at most 16 x 60 rows a slot: 960 positions, in 8 pages of 128
    seqs = {s: rng.integers(2, V, rounds * 60 + 1).tolist() for s in range(n_slots)}
    for b in (hb, nb):
        b.configure(n_slots, pages * n_slots)
        for s in range(n_slots):
            b.reset_slot(s)
            b.set_block_table(s, list(range(pages * s, pages * (s + 1))))
    pos = dict.fromkeys(range(n_slots), 0)
    drafted = compared = 0
    for _ in range(rounds):
        rows, reqs = [], []
        for s in range(n_slots):
            n = int(rng.integers(1, 61)) if s == 0 or pos[s] == 0 or rng.random() < 0.5 else 1
            rows += [Row(s, pos[s] + j, seqs[s][pos[s] + j]) for j in range(n)]
            k = int(rng.integers(0, B + 1))
            reqs.append(DraftRequest(s, tuple(range(pos[s], pos[s] + n)), tuple(seqs[s][pos[s] + 1:pos[s] + n + 1]), k))
            pos[s] += n
        plan = StepPlan.from_rows(rows, hb.max_pass_rows)
        got, want = hb.step(plan), nb.step(plan)
        assert np.array_equal(got.argmax, want.argmax)
        tokens, chains = hb.dspark_draft(reqs, want_logits=True)
        ref = nb.draft(reqs)
        drafting = [q for q in reqs if q.k]
        block = nb.dspark.draft([nb.draft_states[q.slot] for q in drafting], [q.next_tokens[-1] for q in drafting]) \
            if drafting else None
        for q, t, lg, r in zip(reqs, tokens, chains, ref):
            assert t.tolist() == r.tolist(), f"slot {q.slot}: drafts {t.tolist()} vs reference {r.tolist()}"
            if q.k:
                i = drafting.index(q)
                assert np.array_equal(bits(lg), bits(block.logits[i])), f"slot {q.slot}: the chain's logits differ"
                assert block.tokens[i].tolist() == np.argmax(lg, axis=-1).tolist()
                drafted, compared = drafted + 1, compared + lg.size
    assert drafted and max(pos.values()) > 6 * (model.config.sliding_window + B)  # many windows, wrapped rings


@settings(max_examples=max(2, EXAMPLES // 2), deadline=None, suppress_health_check=list(HealthCheck))
@given(k=st.integers(1, 5), seed=st.integers(0, 1000), n=st.integers(40, 200), cache=st.booleans())
def test_dspark_speculation_on_the_device_changes_no_bit(model, rt, k, seed, n, cache):
    from ds4ref.hip.backend import HipBackend
    V = model.config.vocab_size
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(2, V, m).tolist() for m in (n, max(1, n - 37), 30)]

    def reqs():
        return [Request(prompts[0], 24, ignore_eos=True, req_id=1000),
                Request(prompts[1], 20, req_id=1001, sampling=Sampling(temperature=0.8, seed=seed, logprobs=2)),
                Request(prompts[2], 16, ignore_eos=True, req_id=1002, sampling=Sampling(logprobs=1))]
    ids = [1000, 1001, 1002]
    plain = Engine(model, 3, backend=NumpyBackend(model.reference), prefix_cache=False)
    plain.run(reqs())
    eng = Engine(model, 3, backend=HipBackend(model.config, model.weights, model.numerics, model.tables,
                                              runtime=rt, dspark=model.dspark.weights), prefix_cache=cache,
                 speculative_tokens=k, spec_min_rate=0.0)
    eng.run(reqs())
    assert trace(eng, ids) == trace(plain, ids)
    assert eng.scheduler.stats()["spec_rounds"] > 0
