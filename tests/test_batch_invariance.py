"""Batch invariance on the real reference: the embedded tiny model through the
Engine, the Scheduler and the paged NumpyBackend.

Whatever else is running, however prompt rows are grouped into passes, in
whichever slot and physical pages a request lands, its tokens and its logits
are those of running it alone, and those of the unpaged reference model.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

import ds4ref
from ds4ref.backend import StepPlan
from ds4ref.scheduler.engine import Engine
from ds4ref.scheduler import Request, Sampling


@pytest.fixture(scope="module")
def model():
    return ds4ref.load()


class Recording:
    """Wraps a backend; keeps a copy of every logits row it returns, by request id."""

    def __init__(self, inner):
        self.inner, self.name, self.max_pass_rows = inner, "recording", inner.max_pass_rows
        self.seqs = None  # the SeqEngine's slot -> sequence map, set once the engine exists
        self.logits: dict[int, list[np.ndarray]] = {}
        self.sizes: list[int] = []  # rows of every pass

    def configure(self, *a, **k):
        self.inner.configure(*a, **k)

    def reset_slot(self, slot):
        self.inner.reset_slot(slot)

    def set_block_table(self, slot, pages):
        self.inner.set_block_table(slot, pages)

    def step(self, plan: StepPlan):
        res = self.inner.step(plan)
        self.sizes.append(plan.n_rows)
        for r, lg in zip(plan.rows(), res.logits):
            if lg is not None:
                self.logits.setdefault(self.seqs[r.slot].request.req_id, []).append(np.array(lg))
        return res


def engine(model, record=False, max_pass_rows=None, **kw) -> Engine:
    backend = model.make_backend("numpy", max_pass_rows)
    eng = Engine(model, backend=Recording(backend) if record else backend, **kw)
    if record:
        eng.seq_engine.backend.seqs = eng.seq_engine.seqs
    return eng


def logits_by_request(eng: Engine, reqs) -> list[list[np.ndarray]]:
    return [eng.seq_engine.backend.logits.get(r.req_id, []) for r in reqs]


def solo(model, req: Request, **kw) -> list[int]:
    return engine(model, max_concurrency=1, **kw).run([clone(req)])[0]


def clone(r: Request) -> Request:
    return Request(list(r.prompt_ids), r.max_new_tokens, r.sampling, tuple(r.stop_ids), r.ignore_eos)


def prompt(n: int, salt: int, vocab: int) -> list[int]:
    rng = np.random.default_rng(1000 + salt)
    return [0] + rng.integers(2, vocab, n - 1).tolist()


SAMPLINGS = st.sampled_from([
    Sampling(),
    Sampling(temperature=0.8, seed=0),
    Sampling(temperature=1.2, top_k=20, top_p=0.9, seed=7),
    Sampling(temperature=0.7, min_p=0.05, presence_penalty=0.4, seed=3, logprobs=2),
    Sampling(repetition_penalty=1.3),
])
# Mostly short prompts; sometimes one long enough to cross a 128-token page.
PROMPT_LEN = st.one_of(st.integers(1, 24), st.integers(1, 24), st.integers(1, 24), st.integers(120, 300))


SIXTEEN = [(n, m, Sampling(temperature=0.8, seed=i) if i % 3 == 0 else Sampling(), a, c)
           for i, (n, m, a, c) in enumerate([
               (5, 6, 0, None), (1, 8, 0, None), (140, 4, 0, None), (12, 8, 1, 9), (3, 2, 1, None),
               (20, 8, 2, None), (7, 8, 2, 4), (260, 3, 3, None), (2, 8, 3, None), (9, 5, 4, None),
               (16, 8, 4, 30), (4, 8, 5, None), (11, 1, 5, None), (8, 8, 6, None), (1, 4, 6, None),
               (24, 8, 6, 12)])]


@example(SIXTEEN, 16, 16, 3)
@example(SIXTEEN, 5, 1, 4)
@settings(max_examples=12, deadline=None)
@given(st.lists(st.tuples(PROMPT_LEN, st.integers(1, 8), SAMPLINGS, st.integers(0, 6),
                          st.one_of(st.none(), st.integers(0, 20))), min_size=1, max_size=16),
       st.integers(2, 16), st.sampled_from([1, 3, 16]), st.integers(0, 99))
def test_batched_tokens_equal_solo_tokens(model, specs, conc, quantum, order):
    v = model.config.vocab_size
    reqs = [Request(prompt(n, i, v), m, s) for i, (n, m, s, _, _) in enumerate(specs)]
    eng = engine(model, max_concurrency=conc, prompt_quantum=quantum, page_order_seed=order)
    outs = eng.run(reqs, arrivals={i: a for i, (*_, a, _) in enumerate(specs)},
                   cancel_at={i: c for i, (*_, c) in enumerate(specs) if c is not None})
    for r, out, fin in zip(reqs, outs, eng.finishes):
        alone = solo(model, r)
        if fin.reason == "cancelled":
            assert out == alone[:len(out)]
        else:
            assert out == alone, f"request {r.req_id} ({len(r.prompt_ids)} prompt tokens) changed in a batch"


def test_logits_bitwise_alone_vs_batched_and_one_row_vs_many(model):
    v = model.config.vocab_size
    lens = [3, 17, 140, 1, 9]
    reqs = lambda: [Request(prompt(n, i, v), 6, Sampling(logprobs=0), ignore_eos=True)
                    for i, n in enumerate(lens)]
    runs = []
    for conc, quantum in ((1, 1), (5, 1), (5, 16)):
        rs = reqs()
        eng = engine(model, record=True, max_concurrency=conc, prompt_quantum=quantum, page_order_seed=conc)
        toks = eng.run(rs, arrivals={i: 2 * i for i in range(len(rs))})
        runs.append((toks, logits_by_request(eng, rs)))
    (t0, l0) = runs[0]
    for toks, lgs in runs[1:]:
        assert toks == t0
        for a, b in zip(l0, lgs):
            assert len(a) == len(b) == 6
            assert all(np.array_equal(x, y) for x, y in zip(a, b)), "logits changed bitwise"


def test_paged_engine_equals_unpaged_reference(model):
    v = model.config.vocab_size
    for i, n in enumerate((1, 5, 130, 260)):
        p = prompt(n, 50 + i, v)
        eng = engine(model, record=True, max_concurrency=4, page_order_seed=i)
        r = Request(p, 10, Sampling(logprobs=0), ignore_eos=True)
        out = eng.run([r])[0]
        assert out == model.reference.generate(p, 10)
        ref = model.reference.decode_logits(p + out[:-1])[len(p) - 1:]
        got = logits_by_request(eng, [r])[0]
        assert all(np.array_equal(x, y) for x, y in zip(ref, got)) and len(got) == 10


def test_slot_reuse_gives_fresh_state_results(model):
    v = model.config.vocab_size
    a = Request(prompt(30, 1, v), 8, Sampling(temperature=0.9, seed=0, frequency_penalty=0.5), ignore_eos=True)
    b = Request(prompt(150, 2, v), 8, ignore_eos=True)
    eng = engine(model, max_concurrency=1, page_order_seed=5)
    first = eng.run([clone(a)])[0]
    eng.run([clone(b)])  # dirties slot 0, its ring, compressors and pages
    again = eng.run([clone(a)])[0]
    assert first == again == engine(model, max_concurrency=1).run([clone(a)])[0]
