"""Scheduler and SeqEngine over HashBackend, whose tokens depend only on each
sequence's own history: whatever the batching, every request must get exactly
its solo continuation, and the bookkeeping must balance."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st, target

from ds4ref.backend import StepResult
from ds4ref.scheduler.engine import Engine
from ds4ref.scheduler import CohortFailed, FinishEvent, QueueFull, Refused, Request, Sampling, TokenEvent
from ds4ref.scheduler.hash_backend import HashBackend, reference_tokens

VOCAB, EOS = 32, 1


def toy_model(context=2048, backend_cls=HashBackend):
    cfg = SimpleNamespace(eos_id=EOS, vocab_size=VOCAB, context_length=context)
    return SimpleNamespace(config=cfg, make_backend=lambda name=None: backend_cls(VOCAB))


def prompt(n, salt=0):
    return [(7 * i + 3 * salt) % (VOCAB - 2) + 2 for i in range(n)]


def tokens_of(events, r: Request) -> list[int]:
    """The tokens `events` hold for request r, in order."""
    return [e.token for e in events if isinstance(e, TokenEvent) and e.req_id == r.req_id]


def expected(req: Request) -> tuple[list[int], str]:
    """Greedy solo continuation with the request's stop rules applied."""
    out = []
    for t in reference_tokens(req.prompt_ids, req.max_new_tokens, VOCAB):
        if (t == EOS and not req.ignore_eos) or t in req.stop_ids:
            return out, "stop"
        out.append(t)
    return out, "length"


def idle_pool(stats: dict) -> bool:
    """No sequence holds or is promised a page: the only used pages are the prefix cache's
    idle ones, which the pool counts free."""
    return (stats["pages_used"] == stats["prefix_cached_pages"] and stats["pages_reserved"] == 0
            and stats["pages_free"] == stats["pages_total"])


def check_balanced(eng: Engine):
    st_ = eng.scheduler.stats()
    assert st_["running"] == st_["waiting"] == 0
    assert idle_pool(st_)
    eng.seq_engine.pool.check()
    if eng.seq_engine.cache is not None:
        eng.seq_engine.cache.check()


# ---- the property: batching never changes anyone's tokens ------------------------

workloads = st.integers(1, 10).flatmap(lambda n: st.tuples(
    st.lists(st.tuples(st.integers(1, 300), st.integers(1, 40), st.booleans(),
                       st.lists(st.integers(0, VOCAB - 1), max_size=2)), min_size=n, max_size=n),
    st.lists(st.integers(0, 30), min_size=n, max_size=n),                    # arrival pass
    st.lists(st.one_of(st.none(), st.integers(0, 60)), min_size=n, max_size=n),  # cancel pass
    st.integers(1, 16),                                                      # max_concurrency
    st.sampled_from([1, 2, 5, 16, None]),                                    # prompt_quantum
    st.one_of(st.none(), st.integers(0, 40)),                                # pass rows beyond the decoders'
    st.one_of(st.none(), st.integers(700, 3000)),                            # kv_pool_tokens
    st.integers(0, 1000)))                                                   # page order seed


@settings(max_examples=80, deadline=None)
@given(workloads)
def test_every_request_gets_its_solo_tokens(w):
    specs, arrive, cancel, conc, quantum, spare_rows, pool_tokens, order = w
    reqs = [Request(prompt(n, i), m, ignore_eos=ign, stop_ids=tuple(stops))
            for i, (n, m, ign, stops) in enumerate(specs)]
    eng = Engine(toy_model(), max_concurrency=conc, kv_pool_tokens=pool_tokens, prompt_quantum=quantum,
                 max_batched_rows=None if spare_rows is None else conc + spare_rows,
                 backend="hash", page_order_seed=order)
    cancel_at = {i: c for i, c in enumerate(cancel) if c is not None}
    outs = eng.run(reqs, arrivals=dict(enumerate(arrive)), cancel_at=cancel_at)
    for r, out, fin in zip(reqs, outs, eng.finishes):
        want, why = expected(r)
        assert isinstance(fin, FinishEvent) and fin.req_id == r.req_id
        if fin.reason == "cancelled":
            assert out == want[:len(out)]
        elif fin.reason == "length" and fin.message:  # ended early: the pool was too small to grow
            assert pool_tokens is not None and out == want[:len(out)]
        else:
            assert (out, fin.reason) == (want, why)
    for plan in eng.seq_engine.backend.passes:
        assert plan.n_rows <= eng.scheduler.max_batched_rows
    check_balanced(eng)


def test_lone_prompt_with_all_free_rows_gives_the_same_tokens_sooner():
    reqs = lambda: [Request(prompt(200), 10, ignore_eos=True)]
    exact = Engine(toy_model(), 4, prompt_quantum=1, backend="hash")
    fast = Engine(toy_model(), 4, prompt_quantum=16, backend="hash")
    a, b = exact.run(reqs()), fast.run(reqs())
    assert a == b == [reference_tokens(prompt(200), 10, VOCAB)]
    assert exact.scheduler.stats()["steps"] == 200 + 9
    assert fast.scheduler.stats()["steps"] == 13 + 9  # ceil(200 / 16) prompt passes


# ---- policy -------------------------------------------------------------------

def rows_per_slot(plan) -> dict[int, int]:
    return {int(k): int(v) for k, v in zip(*np.unique(plan.slots[plan.slots >= 0], return_counts=True))}


def test_exact_mode_gives_every_live_sequence_one_row_per_pass():
    eng = Engine(toy_model(), 16, prompt_quantum=1, backend="hash")
    eng.run([Request(prompt(1 + 3 * i, i), 20, ignore_eos=True) for i in range(16)])
    for plan in eng.seq_engine.backend.passes:
        assert set(rows_per_slot(plan).values()) == {1}
    assert len(eng.seq_engine.backend.passes) == 3 * 15 + 20  # the longest prompt, then its output


def test_decoders_run_every_pass_and_prompts_share_the_rest_without_starving():
    # 10 decoders leave 6 rows of a 16-row pass; 3 prompts with quantum 4 want 12: the start rotates.
    eng = Engine(toy_model(), 16, prompt_quantum=4, max_batched_rows=16, backend="hash")
    decoders = [Request(prompt(1, i), 40, ignore_eos=True) for i in range(10)]
    prompts = [Request(prompt(60, 50 + i), 1, ignore_eos=True) for i in range(3)]
    eng.run(decoders + prompts, arrivals={10 + i: 2 for i in range(3)})
    passes = eng.seq_engine.backend.passes
    decoder_slots, prompt_slots = set(range(10)), {10, 11, 12}
    last: dict[int, int] = {}
    for k, plan in enumerate(passes[3:25], start=3):
        per = rows_per_slot(plan)
        assert sum(per.values()) == 16, "free rows were left unused while prompts waited"
        assert decoder_slots <= set(per) and all(per[d] == 1 for d in decoder_slots)
        for s in prompt_slots & set(per):
            assert per[s] <= 4
            last[s] = k
        assert all(k - last.get(s, 2) <= 2 for s in prompt_slots), "a prompt was starved"
    check_balanced(eng)


def test_prompt_quantum_caps_rows_per_prompt_per_pass():
    eng = Engine(toy_model(), 4, prompt_quantum=5, backend="hash")
    eng.run([Request(prompt(40, i), 2, ignore_eos=True) for i in range(3)])
    for p in eng.seq_engine.backend.passes:
        per = np.bincount(p.slots[p.slots >= 0])
        assert per.max() <= 5


def test_fifo_admission_when_the_pool_is_busy():
    # 2 pages of 128: one 100-token prompt (+1 page) fills it, the others wait in order
    eng = Engine(toy_model(), 4, kv_pool_tokens=256, backend="hash")
    reqs = [Request(prompt(100, i), 40, ignore_eos=True) for i in range(3)]
    outs = eng.run(reqs)
    assert outs == [reference_tokens(r.prompt_ids, 40, VOCAB) for r in reqs]
    finish_order = [e.req_id for e in eng.events if isinstance(e, FinishEvent)]
    assert finish_order == [r.req_id for r in reqs]
    for p in eng.seq_engine.backend.passes:
        assert len(set(p.slots[p.slots >= 0].tolist())) == 1, "only one request fits at a time"


def test_prompt_that_can_never_fit_is_refused_at_once():
    eng = Engine(toy_model(), 2, kv_pool_tokens=256, backend="hash")
    with pytest.raises(Refused, match="kv_pool_tokens"):
        eng.scheduler.submit(Request(prompt(300), 5))   # 3 prompt pages > 2
    with pytest.raises(Refused, match="context"):
        Engine(toy_model(context=64), 2, backend="hash").scheduler.submit(Request(prompt(64), 5))
    with pytest.raises(Refused, match="vocabulary"):
        eng.scheduler.submit(Request([VOCAB], 5))
    assert not eng.scheduler.has_work()


def test_output_cap_is_clamped_to_the_context():
    eng = Engine(toy_model(context=50), 2, backend="hash")
    out = eng.run([Request(prompt(45), 100, ignore_eos=True)])[0]
    assert out == reference_tokens(prompt(45), 5, VOCAB) and eng.finishes[0].reason == "length"


def test_stop_on_eos_and_stop_ids_without_reporting_the_stop_token():
    full = reference_tokens(prompt(9), 40, VOCAB)
    stop = full[6]
    eng = Engine(toy_model(), 2, backend="hash")
    out = eng.run([Request(prompt(9), 40, stop_ids=(stop,), ignore_eos=True)])[0]
    assert out == full[:full.index(stop)] and eng.finishes[0].reason == "stop"
    assert eng.finishes[0].completion_tokens == len(out) + 1
    # the same sequence with `stop` as EOS
    model = toy_model()
    model.config.eos_id = stop
    out = Engine(model, 2, backend="hash").run([Request(prompt(9), 40)])[0]
    assert out == full[:full.index(stop)]


def test_cancel_frees_slot_and_pages_within_one_step():
    eng = Engine(toy_model(), 2, backend="hash")
    sch = eng.scheduler
    a = sch.submit(Request(prompt(5), 50, ignore_eos=True))
    b = sch.submit(Request(prompt(5, 1), 50, ignore_eos=True))
    w = sch.submit(Request(prompt(5, 2), 50, ignore_eos=True))  # waits: 2 slots
    for _ in range(8):
        sch.step()
    assert sch.stats()["running"] == 2 and sch.stats()["waiting"] == 1
    used = sch.stats()["pages_used"] + sch.stats()["pages_reserved"]
    assert sch.cancel(a) and not sch.cancel(12345)
    ev = sch.step()
    assert any(isinstance(e, FinishEvent) and e.req_id == a and e.reason == "cancelled" for e in ev)
    assert not any(isinstance(e, TokenEvent) and e.req_id == a for e in ev)
    assert sch.stats()["running"] == 2 and sch.stats()["waiting"] == 0  # w took a's slot
    assert sch.cancel(w) and sch.cancel(b)
    sch.step()
    assert sch.stats()["running"] == 0 and not sch.has_work()
    s = sch.stats()
    assert idle_pool(s) and s["pages_total"] >= used


def test_queue_full_and_duplicate_ids():
    sch = Engine(toy_model(), 1, max_queue=1, backend="hash").scheduler
    r = Request(prompt(3), 2)
    sch.submit(r)
    with pytest.raises(ValueError, match="already"):
        sch.submit(r)
    sch.submit(Request(prompt(3), 2))      # one for the free slot, one queued
    with pytest.raises(QueueFull):
        sch.submit(Request(prompt(3), 2))


def test_slot_reuse_starts_from_fresh_state():
    eng = Engine(toy_model(), 1, backend="hash")
    sampled = Sampling(temperature=1.0, seed=0, frequency_penalty=0.5)
    first = eng.run([Request(prompt(20), 30, ignore_eos=True, sampling=sampled)])
    eng.run([Request(prompt(300, 3), 30, ignore_eos=True)])  # dirties slot 0 and many pages
    again = eng.run([Request(prompt(20), 30, ignore_eos=True, sampling=sampled)])
    assert first == again


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 60), st.integers(0, 3)), min_size=1, max_size=8),
       st.integers(1, 8))
def test_seeded_sampling_is_batch_invariant(specs, conc):
    samp = [Sampling(temperature=0.9, top_k=12, top_p=0.9, seed=s, presence_penalty=0.3, logprobs=2)
            for _, s in specs]
    mk = lambda: [Request(prompt(n, i), 12, sampling=samp[i]) for i, (n, _) in enumerate(specs)]
    solo = [Engine(toy_model(), 1, backend="hash").run([r])[0] for r in mk()]
    eng = Engine(toy_model(), conc, backend="hash", prompt_quantum=3)
    assert eng.run(mk()) == solo
    assert all(e.logprob is not None and len(e.top_logprobs) == 2 for e in eng.events if isinstance(e, TokenEvent))


# ---- failures are loud -------------------------------------------------------------

class DroppingBackend(HashBackend):
    """Loses the last row of any pass with 3+ rows: a broken device backend."""

    def step(self, plan):
        res = super().step(plan)
        if plan.n_rows >= 3:
            return StepResult(res.logits[:-1], res.argmax[:-1])
        return res


def test_a_broken_pass_fails_its_cohort_loudly_and_the_rest_goes_on():
    # one prompt row a pass: three prompts make a broken pass, a lone request only unbroken ones
    eng = Engine(toy_model(backend_cls=DroppingBackend), 4, prompt_quantum=1, backend="hash")
    sch = eng.scheduler
    ids = [sch.submit(Request(prompt(4, i), 5, ignore_eos=True)) for i in range(3)]
    with pytest.raises(CohortFailed) as err:
        sch.step()
    fins = [e for e in err.value.events if isinstance(e, FinishEvent)]
    assert sorted(e.req_id for e in fins) == sorted(ids) and {e.reason for e in fins} == {"error"}
    assert "returned" in fins[0].message
    assert sch.stats()["running"] == 0 and idle_pool(sch.stats())
    # the engine is still usable for passes the backend gets right
    assert eng.run([Request(prompt(4), 5, ignore_eos=True)]) == [reference_tokens(prompt(4), 5, VOCAB)]


def test_submit_and_cancel_from_another_thread():
    eng = Engine(toy_model(), 4, backend="hash")
    sch = eng.scheduler
    reqs = [Request(prompt(3 + i, i), 6, ignore_eos=True) for i in range(12)]
    done = threading.Event()

    def client():
        for r in reqs:
            sch.submit(r)
        sch.cancel(reqs[-1].req_id)
        done.set()

    th = threading.Thread(target=client)
    th.start()
    events = []
    while not done.is_set() or sch.has_work():
        events += sch.step()
    th.join()
    toks = {r.req_id: [] for r in reqs}
    for e in events:
        if isinstance(e, TokenEvent):
            toks[e.req_id].append(e.token)
    for r in reqs[:-1]:
        assert toks[r.req_id] == reference_tokens(r.prompt_ids, 6, VOCAB)
    assert sum(isinstance(e, FinishEvent) for e in events) == 12
    check_balanced(eng)


def test_undersized_pool_preempts_the_youngest_and_both_finish_in_full():
    eng = Engine(toy_model(), 2, kv_pool_tokens=4 * 128, backend="hash")
    reqs = [Request(prompt(10, i), 400, ignore_eos=True) for i in range(2)]
    outs = eng.run(reqs)
    for r, out, fin in zip(reqs, outs, eng.finishes):
        assert out == reference_tokens(r.prompt_ids, 400, VOCAB) and fin.reason == "length"
        assert fin.completion_tokens == 400
    assert eng.scheduler.stats()["preemptions"] >= 1
    check_balanced(eng)


def test_a_request_that_cannot_fit_even_alone_is_refused_naming_the_pool():
    eng = Engine(toy_model(), 2, kv_pool_tokens=4 * 128, backend="hash")
    with pytest.raises(Refused, match=r"needs 5 KV pages .* holds 4; lower max_tokens"):
        eng.scheduler.submit(Request(prompt(10), 600))
    eng.scheduler.submit(Request(prompt(10), 500))  # 509 positions: 4 pages, fits alone


pressure = st.tuples(
    st.lists(st.tuples(st.integers(1, 60), st.integers(150, 450), st.one_of(st.none(), st.integers(0, 99))),
             min_size=3, max_size=6),                                        # prompt, max_new, seed (None = greedy)
    st.integers(2, 6),                                                       # max_concurrency
    st.integers(4, 6),                                                       # pool pages
    st.sampled_from([1, 4, 16]),                                             # prompt_quantum
    st.lists(st.integers(0, 20), min_size=8, max_size=8))                    # arrival passes


@settings(max_examples=40, deadline=None)
@given(pressure)
def test_tiny_pools_never_cut_a_request_short(case):
    """Property: with pools far smaller than the work, every request still produces exactly its solo
    output at full length (greedy or seeded sampling), and every page comes back."""
    specs, lanes, pages, quantum, arrive = case
    sampling = lambda seed: Sampling() if seed is None else Sampling(temperature=0.9, top_k=20, seed=seed)  # noqa
    reqs = [Request(prompt(n, i), m, sampling(seed), ignore_eos=True)
            for i, (n, m, seed) in enumerate(specs) if -(-(n + m - 1) // 128) <= pages]
    if not reqs:
        return
    eng = Engine(toy_model(), lanes, kv_pool_tokens=pages * 128, prompt_quantum=quantum, backend="hash",
                 page_order_seed=pages)
    outs = eng.run(reqs, arrivals={i: arrive[i] for i in range(len(reqs))})
    target(eng.scheduler.stats()["preemptions"])  # steer the search towards heavy preemption
    for r, out, fin in zip(reqs, outs, eng.finishes):
        solo = Engine(toy_model(), 1, backend="hash").generate(r.prompt_ids, r.max_new_tokens,
                                                              sampling=r.sampling, ignore_eos=True)
        assert out == solo and len(out) == r.max_new_tokens and fin.reason == "length"
    check_balanced(eng)


def test_seq_engine_admit_outcomes_and_bad_plans_change_nothing():
    from ds4ref.scheduler import SeqEngine, Work
    be = HashBackend(VOCAB)
    eng = SeqEngine(be, toy_model().config, max_concurrency=2, kv_pool_tokens=512)
    assert eng.admit(Request([], 3)).status == "refused"
    assert eng.admit(Request(prompt(600), 3)).status == "refused"   # 5 prompt pages > 4
    a = eng.admit(Request(prompt(3), 4, ignore_eos=True))
    b = eng.admit(Request(prompt(300, 1), 4, ignore_eos=True))       # 3 pages + 1 spare: all that is left
    assert (a.status, b.status) == ("admitted", "admitted") and a.slot != b.slot
    assert eng.admit(Request(prompt(3), 4)).status == "busy"
    before = (eng.seqs[a.slot].fed, eng.pool.used_pages, len(be.passes))
    over_a_pass = Work(b.slot, be.max_pass_rows + 1)  # within b's 300-row prompt, but more than a pass holds
    for bad in ([Work(a.slot, 4)], [Work(7, 1)], [Work(a.slot, 1), Work(a.slot, 1)], [over_a_pass]):
        with pytest.raises(ValueError):
            eng.step(bad)
        assert (eng.seqs[a.slot].fed, eng.pool.used_pages, len(be.passes)) == before
    out = eng.step([Work(a.slot, 3), Work(b.slot, 13)])
    assert [c.token for c in out[0].choices] == reference_tokens(prompt(3), 1, VOCAB) and out[1].choices == ()
    with pytest.raises(ValueError):
        eng.step([Work(a.slot, 2)])  # a decoder runs one row per pass
