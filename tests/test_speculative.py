"""Speculative decoding changes no bit: every request's tokens, logprobs and finish reason are
those of plain decoding, whatever the drafts (the backend's, or an oracle right at a chosen
rate), k, the lanes beside it, preemption, cancellation and the prefix cache."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ds4ref.scheduler import FinishEvent, Request, Sampling, TokenEvent
from ds4ref.scheduler.engine import Engine
from ds4ref.scheduler.hash_backend import HashBackend
from ds4ref.scheduler.speculative import Acceptance, OracleDrafter

VOCAB, EOS = 32, 1


def toy_model(accuracy: int = 70):
    cfg = SimpleNamespace(eos_id=EOS, vocab_size=VOCAB, context_length=2048)
    return SimpleNamespace(config=cfg, make_backend=lambda name=None: HashBackend(VOCAB, draft_accuracy=accuracy))


def prompt(n, salt=0, shared=0):
    """n tokens, the first `shared` of them common to every prompt (prefix-cache hits)."""
    return [(5 * i + 1) % (VOCAB - 2) + 2 if i < shared else (7 * i + 3 * salt) % (VOCAB - 2) + 2 for i in range(n)]


SAMPLINGS = [Sampling(), Sampling(logprobs=2), Sampling(repetition_penalty=1.3, presence_penalty=0.5),
             Sampling(temperature=0.9, top_k=20, seed=7, frequency_penalty=0.3, logprobs=3),
             Sampling(temperature=1.2, top_p=0.9, min_p=0.05, seed=0)]


def make_requests(specs, shared):
    return [Request(prompt(n, i, shared), m, SAMPLINGS[s], ignore_eos=ign, stop_ids=tuple(stops), req_id=1000 + i)
            for i, (n, m, s, ign, stops) in enumerate(specs)]


def trace(eng: Engine, n: int):
    """Per request: its (token, logprob, top logprobs) events and its finish."""
    ev = [[] for _ in range(n)]
    for e in eng.events:
        if isinstance(e, TokenEvent):
            ev[e.req_id - 1000].append((e.token, e.logprob, e.top_logprobs))
    return ev, [(f.reason, f.completion_tokens) for f in eng.finishes]


def balanced(eng: Engine) -> None:
    s = eng.scheduler.stats()
    assert s["running"] == s["waiting"] == 0 and s["pages_reserved"] == 0
    assert s["pages_used"] == s["prefix_cached_pages"]
    eng.seq_engine.pool.check()
    if eng.seq_engine.cache is not None:
        eng.seq_engine.cache.check()
    assert not eng.seq_engine.backend.snapshots or eng.seq_engine.cache is not None


workloads = st.integers(1, 20).flatmap(lambda n: st.tuples(
    st.lists(st.tuples(st.integers(1, 300), st.integers(1, 40), st.integers(0, len(SAMPLINGS) - 1), st.booleans(),
                       st.lists(st.integers(0, VOCAB - 1), max_size=2)), min_size=n, max_size=n),
    st.lists(st.integers(0, 30), min_size=n, max_size=n),                        # arrival pass
    st.lists(st.one_of(st.none(), st.integers(0, 60)), min_size=n, max_size=n),  # cancel pass
    st.integers(1, 16),                                                          # max_concurrency
    st.sampled_from([1, 5, None]),                                               # prompt_quantum
    st.one_of(st.none(), st.integers(0, 40)),                                    # pass rows beyond the lanes
    st.one_of(st.none(), st.integers(700, 3000)),                                # kv_pool_tokens
    st.integers(1, 4),                                                           # k
    st.one_of(st.integers(0, 100), st.floats(0, 1)),                             # backend accuracy | oracle rate
    st.booleans(), st.sampled_from([0, 130])))                                   # prefix cache, shared prefix


@settings(max_examples=30, deadline=None)
@given(workloads)
def test_speculation_changes_no_token_logprob_or_finish(w):
    specs, arrive, cancel, conc, quantum, spare, pool, k, drafts, cache, shared = w
    # request 0 arrives first, is never cancelled and decodes at least 8 tokens: as the oldest
    # decoder it takes the first draft rows of every pass that has one beyond the lanes
    n0, m0, s0, _, _ = specs[0]
    specs, arrive, cancel = [(n0, max(m0, 8), s0, True, [])] + specs[1:], [0] + arrive[1:], [None] + cancel[1:]
    kw = dict(max_concurrency=conc, kv_pool_tokens=pool, prompt_quantum=quantum, prefix_cache=cache,
              max_batched_rows=None if spare is None else conc + spare, backend="hash")
    arrivals = dict(enumerate(arrive))
    plain = Engine(toy_model(), **kw)
    plain.run(make_requests(specs, shared), arrivals=arrivals)
    want, want_fin = trace(plain, len(specs))
    oracle = isinstance(drafts, float)
    drafter = OracleDrafter({1000 + i: [t for t, _, _ in e] for i, e in enumerate(want)}, drafts, VOCAB) if oracle else None
    spec = Engine(toy_model(0 if oracle else drafts), speculative_tokens=k, drafter=drafter, spec_min_rate=0.0, **kw)
    cancel_at = {i: c for i, c in enumerate(cancel) if c is not None}
    spec.run(make_requests(specs, shared), arrivals=arrivals, cancel_at=cancel_at)
    got, got_fin = trace(spec, len(specs))
    for i in range(len(specs)):
        if got_fin[i][0] == "cancelled":
            assert got[i] == want[i][:len(got[i])]
        else:
            assert (got[i], got_fin[i]) == (want[i], want_fin[i])  # logprobs compared as exact floats
    rows = spec.scheduler.max_batched_rows
    assert all(p.n_rows <= rows for p in spec.seq_engine.backend.passes)
    stats = spec.scheduler.stats()
    assert 0 <= stats["spec_accepted"] <= stats["spec_proposed"]
    if spare is None or spare > 0:  # rows beyond the lanes: speculation ran (passes of only the lanes' rows have none)
        assert stats["spec_rounds"] > 0 and spec.finishes[0].draft_tokens > 0, stats
    fins = [f for f in spec.finishes if f.reason != "cancelled"]
    assert all(0 <= f.accepted_drafts <= f.draft_tokens for f in fins)
    balanced(spec)


def test_full_acceptance_makes_k_plus_1_tokens_a_pass_and_none_turns_itself_off():
    """An oracle always right: a lone greedy request needs one pass per k + 1 tokens (rounds stop
    at page boundaries, none here). Always wrong: after the window's drafts it stops drafting."""
    req = lambda: [Request(prompt(20), 60, ignore_eos=True, req_id=1000)]  # noqa
    plain = Engine(toy_model(), 1, backend="hash")
    truth = plain.run(req())[0]
    for k in (1, 3):
        eng = Engine(toy_model(), 1, backend="hash", speculative_tokens=k,
                     drafter=OracleDrafter({1000: truth}, 1.0, VOCAB))
        assert eng.run(req())[0] == truth
        assert eng.scheduler.stats()["steps"] == 1 + -(-(60 - 1) // (k + 1))  # the prompt's pass, then rounds
        rounds = -(-(60 - 1) // (k + 1))
        assert (eng.finishes[0].draft_tokens, eng.finishes[0].accepted_drafts) == (59 - rounds,) * 2
    eng = Engine(toy_model(), 1, backend="hash", speculative_tokens=3, drafter=OracleDrafter({1000: truth}, 0.0, VOCAB))
    assert eng.run(req())[0] == truth
    f = eng.finishes[0]
    assert f.accepted_drafts == 0 and 16 <= f.draft_tokens < 16 + 3 and eng.scheduler.stats()["spec_off"] == 1


def test_acceptance_window_rule():
    a = Acceptance(min_rate=0.5, window=8)
    for _ in range(4):
        a.record(2, 2)
    a.record(4, 0)  # the last 8: 2 + 2 accepted of 2 + 2 + 4
    assert a.on
    a.record(4, 1)
    assert not a.on and (a.proposed, a.accepted) == (16, 9)


def test_speculation_needs_a_drafter():
    bare = SimpleNamespace(config=toy_model().config, make_backend=lambda name=None: SimpleNamespace(
        name="bare", max_pass_rows=256, configure=lambda *a: None))
    with pytest.raises(ValueError, match="speculative decoding needs"):
        Engine(bare, 1, speculative_tokens=2)


# ---- the reference model: the embedded tiny model and its (random) MTP block ---------------

@pytest.fixture(scope="module")
def tiny():
    import ds4ref
    return ds4ref.load()


@settings(max_examples=2, deadline=None)
@given(st.integers(1, 4), st.integers(0, 2), st.integers(118, 140), st.booleans())
def test_tiny_model_speculation_is_exact(tiny, k, seed, n, cache):
    """Prompts that reach the ratio-128 window and the indexer's top-k, decoding across the
    128-token boundary, greedy and seeded sampling with logprobs beside each other: the MTP's
    drafts (never right: its weights are random, so every round rolls back) and an oracle's
    (mostly right) give the tokens and logprobs of plain decoding."""
    assert 128 in tiny.config.compress_ratios and tiny.mtp is not None
    reqs = lambda: [Request([(11 * i + seed) % 500 + 2 for i in range(n)], 14, ignore_eos=True, req_id=1000),  # noqa
                    Request([(13 * i + seed) % 500 + 2 for i in range(n - 9)], 14, req_id=1001,
                            sampling=Sampling(temperature=0.8, seed=seed, logprobs=2, repetition_penalty=1.1))]
    plain = Engine(tiny, 2, prefix_cache=cache)
    plain.run(reqs())
    want = trace(plain, 2)
    truth = {1000 + i: [t for t, _, _ in e] for i, e in enumerate(want[0])}
    for drafter in (None, OracleDrafter(truth, 0.7, tiny.config.vocab_size, seed)):
        eng = Engine(tiny, 2, prefix_cache=cache, speculative_tokens=k, drafter=drafter, spec_min_rate=0.0)
        eng.run(reqs())
        assert trace(eng, 2) == want
        assert eng.scheduler.stats()["spec_rounds"] > 0


def test_tiny_model_speculation_survives_preemption_and_cancellation(tiny):
    """The tiny model on NumpyBackend, requests decoding across the 128-token window and past
    their reserved pages in a pool of 4 pages, so decoding preempts (the youngest is recomputed,
    its drafts dropped), and one is cancelled while it decodes. With MTP drafts (every round
    rolls back) and an oracle: every request not cancelled gets plain decoding's tokens, logprobs
    and finish; the cancelled one a prefix of its plain tokens."""
    sampled = Sampling(temperature=0.8, seed=3, logprobs=2)
    shapes = ((100, 170), (90, 170), (40, 30), (30, 60))
    reqs = lambda: [Request([(17 * i + 5 * j) % 500 + 2 for i in range(n)], m, ignore_eos=True, req_id=1000 + j,  # noqa
                            sampling=sampled if j == 1 else Sampling()) for j, (n, m) in enumerate(shapes)]
    kw = dict(max_concurrency=3, kv_pool_tokens=4 * 128)
    plain = Engine(tiny, **kw)
    plain.run(reqs())
    want, want_fin = trace(plain, len(shapes))
    truth = {1000 + i: [t for t, _, _ in e] for i, e in enumerate(want)}
    # the pass to cancel at: while request 3 decodes (passes 184-243 with MTP drafts, 63-85 with the oracle)
    for drafter, cancel in ((None, 200), (OracleDrafter(truth, 0.8, tiny.config.vocab_size, 1), 70)):
        eng = Engine(tiny, speculative_tokens=3, drafter=drafter, spec_min_rate=0.0, **kw)
        eng.run(reqs(), cancel_at={3: cancel})
        got, fin = trace(eng, len(shapes))
        stats = eng.scheduler.stats()
        assert stats["preemptions"] > 0 and stats["spec_rounds"] > 0
        assert fin[3][0] == "cancelled" and 0 < len(got[3]) < 60 and got[3] == want[3][:len(got[3])]
        assert (got[:3], fin[:3]) == (want[:3], want_fin[:3])


@pytest.mark.parametrize("rows", [4, 6, 9])
def test_drafts_never_overfill_a_tight_pass(rows):
    """Four lanes in passes of `rows` rows: drafts only take rows that leave every prompt one and
    every decoder's next round its rows were all drafts refused."""
    reqs = lambda: make_requests([(10 + 40 * i, 30, 0, True, []) for i in range(6)], 0)  # noqa
    plain = Engine(toy_model(), 4, max_batched_rows=rows, backend="hash")
    want = plain.run(reqs())
    for accuracy in (0, 60, 100):
        eng = Engine(toy_model(accuracy), 4, max_batched_rows=rows, backend="hash", speculative_tokens=4,
                     spec_min_rate=0.0)
        assert eng.run(reqs()) == want
        assert max(p.n_rows for p in eng.seq_engine.backend.passes) <= rows
        assert eng.scheduler.stats()["spec_rounds"] > 0


# ---- restore_state keeping the accepted rows ------------------------------------------------
def kept_rows_against_fed_rows(b, prompt, detour, keep, other):
    """Slot 0 feeds `prompt`, snapshots, runs `detour` in one pass, and restore_state keeps its
    first `keep` rows; slot 1 feeds `prompt` and detour[:keep] only. Both then feed `other` in
    one pass. Returns restore_state's answer and the two slots' logits of `other` (a backend
    that keeps no rows has the engine's fallback run: slot 0 feeds detour[:keep] again)."""
    from ds4ref.backend import Row, StepPlan
    T = 128
    end = len(prompt) + len(detour) + len(other)
    for s in (0, 1):
        b.reset_slot(s)
        b.set_block_table(s, [3 * s + j for j in range(-(-end // T))])

    def feed(s, at, tokens, emit=False):
        out = []
        for i in range(0, len(tokens), 64):
            chunk = tokens[i:i + 64]
            rows = [Row(s, at + i + j, t, emit, emit) for j, t in enumerate(chunk)]
            out += b.step(StepPlan.from_rows(rows, b.max_pass_rows)).logits
        return out

    feed(0, 0, prompt)
    feed(1, 0, prompt)
    snap = b.save_state(0)
    feed(0, len(prompt), detour)
    kept = b.restore_state(0, snap, keep)
    b.drop_state(snap)
    feed(0, len(prompt) + kept, detour[kept:keep])
    feed(1, len(prompt), detour[:keep])
    at = len(prompt) + keep
    return kept, feed(0, at, other, emit=True), feed(1, at, other, emit=True)


kept_rows_cases = st.tuples(st.integers(100, 300), st.integers(1, 7), st.integers(0, 7), st.integers(1, 5),
                            st.integers(0, 2**31 - 1))


def draw_kept_rows_case(case, vocab):
    """(prompt, detour, keep, other) from kept_rows_cases: prompts past several ratio-4 windows,
    the indexer's top-k and the 128-token window and compressor; detours across boundaries."""
    n, d, keep, o, seed = case
    rng = np.random.default_rng(seed)
    prompt, detour, other = (rng.integers(2, vocab, m).tolist() for m in (n, d, o))
    return prompt, detour, min(keep, d), other


@settings(max_examples=3, deadline=None)
@given(kept_rows_cases)
def test_restore_state_keeping_rows_equals_feeding_only_them(tiny, case):
    """NumpyBackend: a round's snapshot, its pass, restore_state keeping the accepted rows, leave
    the slot as feeding only those rows did, bit for bit in the logits that follow."""
    from ds4ref.reference.numpy_backend import NumpyBackend
    prompt, detour, keep, other = draw_kept_rows_case(case, tiny.config.vocab_size)
    b = NumpyBackend(tiny.reference)
    b.configure(2, 6)
    kept, got, want = kept_rows_against_fed_rows(b, prompt, detour, keep, other)
    assert kept == keep
    for j, (g, w) in enumerate(zip(got, want)):
        assert np.array_equal(g.view(np.uint32), w.view(np.uint32)), f"row {j} of the tokens after the round"
    with pytest.raises(ValueError, match="cannot keep"):
        b.restore_state(0, b.save_state(0), 1)  # the last step ran slot 1, not slot 0


def test_bench_prints_exact_rounds_and_refuses_mtp_without_a_block(capsys, monkeypatch):
    """`bench --speculative-tokens` on the tiny model (NumPy): every row's tokens equal plain
    decoding's (its exit status says so), the oracle at rate 1 accepts every draft; asked for MTP
    drafts from a model without a block, it stops with a message before running anything."""
    import ds4ref.model
    from ds4ref.cli.bench_spec import main
    argv = ["--speculative-tokens", "2", "--concurrency", "1", "--max-tokens", "10", "--prompt-tokens", "8"]
    assert main(argv + ["--draft", "oracle:1", "--draft", "mtp"]) == 0
    table = capsys.readouterr().out.split("x @ a=")[0]  # the runs' table, not the implied speed-ups after it
    rows = {line.split()[1]: line.split() for line in table.splitlines() if line.split()[:1] == ["1"]}
    assert set(rows) == {"plain", "oracle:1", "mtp"} and all(r[-1] == "yes" for r in rows.values())
    assert rows["oracle:1"][2] == "1.00"
    tiny = ds4ref.model.load()
    monkeypatch.setattr(ds4ref.model, "load", lambda *a, **kw: SimpleNamespace(**{**vars(tiny), "mtp": None}))
    with pytest.raises(SystemExit) as exc:
        main(argv + ["--draft", "mtp"])
    assert exc.value.code == 2 and "needs a model with an MTP block" in capsys.readouterr().err
