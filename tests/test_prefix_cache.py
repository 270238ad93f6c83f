"""The prefix cache changes no bit: a request that resumes from cached pages and a snapshot
gets the tokens, logprobs and finish of the same request computed from token 0.

* Over HashBackend (whose tokens depend on each sequence's whole history, read back through
  its pages, and whose snapshot state is checked against those pages on every row): random
  conversations with shared prefixes of random lengths, random arrivals and cancellations,
  pools small enough to evict and to preempt, then next turns that resend a first turn's
  prompt and output (resuming from its partial last page, a tail). Every request gets its
  solo continuation, and the pool, the cache and the backend's snapshots balance.
* Over the NumPy reference (the embedded tiny model, both numerics): multi-turn
  conversations whose history runs past several compression windows of both ratios and the
  indexer's top-k, greedy and seeded sampling with logprobs, served with the cache and by a
  fresh engine without it: equal bits.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import ds4ref
from ds4ref.scheduler import FinishEvent, Request, Sampling, TokenEvent
from ds4ref.scheduler.engine import Engine
from ds4ref.scheduler.hash_backend import reference_tokens
from test_scheduler import EOS, VOCAB, check_balanced, expected, toy_model

T = 128  # page tokens


def history(seed: int, n: int, vocab: int = VOCAB) -> list[int]:
    return np.random.default_rng(seed).integers(2, vocab, n).tolist()


# ---- HashBackend: scheduling, eviction, preemption ------------------------------------------

conversations = st.integers(2, 8).flatmap(lambda n: st.tuples(
    st.integers(0, 10_000),                                                    # the shared root's seed
    st.lists(st.tuples(st.integers(0, 600), st.integers(1, 150), st.integers(1, 40), st.booleans()),
             min_size=n, max_size=n),  # per request: prefix of the root it shares, own tokens, new tokens, ignore_eos
    st.lists(st.integers(0, 40), min_size=n, max_size=n),                       # arrival pass
    st.lists(st.one_of(st.none(), st.integers(0, 80)), min_size=n, max_size=n),  # cancel pass
    st.integers(1, 6),                                                         # max_concurrency
    st.one_of(st.none(), st.integers(1200, 4000)),                             # kv_pool_tokens
    st.sampled_from([1, 2, 8]),                                                # snapshot_every
    st.integers(0, 100)))                                                      # page order seed


next_turns = st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40), st.one_of(st.none(), st.integers(0, 60))),
                      min_size=1, max_size=8)  # per first turn: its new tokens, arrival, cancel pass


def check_no_leak(eng: Engine):
    """The books balance, every snapshot the backend holds is the cache's, and dropping the
    idle cache gives every page and snapshot back."""
    check_balanced(eng)
    se = eng.seq_engine
    assert len(se.backend.snapshots) == se.cache.snapshots
    se.cache.clear()
    se.pool.check(), se.cache.check()
    assert se.pool.used_pages == 0 and not se.backend.snapshots and se.cache.pages == 0


def run_checked(eng: Engine, reqs, arrive, cancel):
    outs = eng.run(reqs, arrivals=dict(enumerate(arrive)),
                   cancel_at={i: at for i, at in enumerate(cancel) if at is not None})
    for r, out, fin in zip(reqs, outs, eng.finishes):
        want, why = expected(r)
        assert isinstance(fin, FinishEvent)
        if fin.reason == "cancelled" or (fin.reason == "length" and fin.message):
            assert out == want[:len(out)]
        else:
            assert (out, fin.reason) == (want, why)
        assert fin.cached_tokens < len(r.prompt_ids)
    return outs, list(eng.finishes)


def test_shared_prefixes_and_next_turns_give_every_request_its_solo_tokens():
    tail_hits = []

    @settings(max_examples=40, deadline=None, derandomize=True)
    @given(conversations, next_turns)
    def prop(c, nxt):
        root_seed, specs, arrive, cancel, conc, pool_tokens, every, order = c
        root = history(root_seed, 600)
        reqs = [Request(root[:k] + history(root_seed + 1 + i, own), m, ignore_eos=ign)
                for i, (k, own, m, ign) in enumerate(specs)]
        eng = Engine(toy_model(), max_concurrency=conc, kv_pool_tokens=pool_tokens, backend="hash",
                     page_order_seed=order)
        eng.seq_engine.snapshot_every = every
        outs, fins = run_checked(eng, reqs, arrive, cancel)
        check_balanced(eng)
        # next turns: a chat resends the prompt, the reply and its end of turn (the stop token
        # that was generated but never fed), then new tokens
        again = [Request(r.prompt_ids + out + ([EOS] if f.reason == "stop" else []) + history(20_000 + root_seed + i, n),
                         m, ignore_eos=ign)
                 for i, ((n, _, _), r, out, f, (_, _, m, ign)) in enumerate(zip(nxt, reqs, outs, fins, specs))]
        first_hits = eng.seq_engine.stats()["prefix_tail_hits"]
        run_checked(eng, again, [a for _, a, _ in nxt[:len(again)]], [c for _, _, c in nxt[:len(again)]])
        tail_hits.append(eng.seq_engine.stats()["prefix_tail_hits"] - first_hits)
        check_no_leak(eng)

    prop()
    assert sum(h > 0 for h in tail_hits) >= len(tail_hits) // 4, f"tails rarely hit: {tail_hits}"


def test_a_second_turn_resumes_at_the_deepest_snapshot():
    """Turn 2 = turn 1's prompt + its output + new tokens: it takes every page of turn 1's
    prompt and the pages decoding filled, up to the last boundary turn 1 reached."""
    eng = Engine(toy_model(), max_concurrency=2, backend="hash")
    first = Request(history(1, 300), 100, ignore_eos=True)
    out1 = eng.run([first])[0]
    assert eng.finishes[0].cached_tokens == 0
    second = Request(first.prompt_ids + out1 + history(2, 50), 10, ignore_eos=True)
    out2 = eng.run([second])[0]
    assert out2 == reference_tokens(second.prompt_ids, 10, VOCAB)
    # turn 1 fed 300 + 99 positions: pages 0..2 are full, and its partial page 3 is a tail
    assert eng.finishes[0].cached_tokens == 399
    st_ = eng.seq_engine.stats()
    assert st_["prefix_hits"] == 1 and st_["prefix_misses"] == 1 and st_["prefix_cached_tokens"] == 399
    # each turn left two: at its prompt's end (a copy of the partial page) and at its own end
    assert st_["prefix_tail_hits"] == 1 and st_["prefix_tails"] == 4
    # a prompt that leaves no token after the tail, or leaves the tail's tokens, resumes at page 3's start
    for tokens in (first.prompt_ids + out1[:-1], first.prompt_ids + out1[:90] + [0]):
        eng.run([Request(tokens, 3, ignore_eos=True)])
        assert eng.finishes[0].cached_tokens == 3 * T
    assert eng.seq_engine.stats()["prefix_tail_hits"] == 1
    check_no_leak(eng)


def test_a_next_turn_that_renders_the_reply_anew_resumes_at_the_prompts_end():
    """A client resends the prompt and its own rendering of the reply (thinking dropped, text
    tokenised anew), not the generated tokens: the tail at the sequence's end cannot match, the
    one taken at the prompt's end does, and the rest is computed bit for bit as from scratch."""
    eng = Engine(toy_model(), max_concurrency=2, backend="hash")
    first = Request(history(11, 2 * T + 37), 20, ignore_eos=True)
    out1 = eng.run([first])[0]
    rendered = [(t + 1) % VOCAB for t in out1]  # differs from the reply at its first token
    second = Request(first.prompt_ids + rendered + history(12, 40), 10, ignore_eos=True)
    assert eng.run([second])[0] == reference_tokens(second.prompt_ids, 10, VOCAB)
    assert eng.finishes[0].cached_tokens == len(first.prompt_ids)
    assert eng.seq_engine.stats()["prefix_tail_hits"] == 1
    # the prompt's tail is a copy: a prompt that ends on a page boundary leaves none
    eng.run([Request(history(13, 2 * T), 3, ignore_eos=True)])
    assert eng.seq_engine.cache.tails == 5  # first's two, second's two, and the third's end only
    check_no_leak(eng)


def test_tails_are_held_to_the_snapshot_budget():
    eng = Engine(toy_model(), max_concurrency=1, backend="hash")
    eng.seq_engine.cache.max_snapshots = 3
    for i in range(6):
        eng.run([Request(history(20 + i, 50), 5, ignore_eos=True)])
    cache = eng.seq_engine.cache
    assert cache.tails == cache.snapshots == cache.pages == 3
    check_no_leak(eng)


def test_idle_cached_pages_are_evicted_least_recent_first_and_never_while_mapped():
    eng = Engine(toy_model(), max_concurrency=1, kv_pool_tokens=6 * T, backend="hash")
    cache = eng.seq_engine.cache
    a = Request(history(3, 3 * T + 5), 2, ignore_eos=True)
    eng.run([a])
    # 3 full pages, the partial one as a tail, and the prompt's end as a tail of its own (a copy)
    assert cache.pages == 5 and cache.tails == 2
    b = Request(history(4, 5 * T + 5), 2, ignore_eos=True)  # needs 6 pages: evicts a's
    assert eng.run([b])[0] == reference_tokens(b.prompt_ids, 2, VOCAB)
    assert eng.seq_engine.stats()["prefix_evictions"] >= 1
    again = Request(b.prompt_ids[:5 * T] + [5, 6], 2, ignore_eos=True)  # b's pages are the newest
    assert eng.run([again])[0] == reference_tokens(again.prompt_ids, 2, VOCAB)
    assert eng.finishes[0].cached_tokens == 5 * T
    check_no_leak(eng)


def test_no_prefix_cache_keeps_no_pages():
    eng = Engine(toy_model(), max_concurrency=2, backend="hash", prefix_cache=False)
    r = Request(history(5, 400), 5, ignore_eos=True)
    eng.run([r, Request(r.prompt_ids + [3], 5, ignore_eos=True)])
    assert eng.seq_engine.cache is None and [f.cached_tokens for f in eng.finishes] == [0, 0]
    st_ = eng.seq_engine.stats()
    assert st_["pages_used"] == 0 and st_["prefix_hits"] == st_["prefix_cached_pages"] == 0


# ---- the reference: equal bits ----------------------------------------------------------------

@pytest.fixture(scope="module", params=["official", "plain"])
def tiny(request):
    return ds4ref.load(numerics=request.param)


def run_events(engine: Engine, reqs):
    """Per request: (tokens, [(logprob, top logprobs) per token], finish reason), the floats as bits."""
    outs = engine.run(reqs)
    lps = [[] for _ in reqs]
    index = {r.req_id: i for i, r in enumerate(reqs)}
    for ev in engine.events:
        if isinstance(ev, TokenEvent):
            top = None if ev.top_logprobs is None else [(t, np.float32(v).view(np.uint32).item())
                                                        for t, v in ev.top_logprobs]
            lp = None if ev.logprob is None else np.float32(ev.logprob).view(np.uint32).item()
            lps[index[ev.req_id]].append((lp, top))
    return [(o, lp, f.reason) for o, lp, f in zip(outs, lps, engine.finishes)]


SAMPLINGS = [Sampling(logprobs=3), Sampling(temperature=0.9, seed=11, logprobs=2)]


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 1000), first=st.integers(260, 700), turn=st.integers(20, 300),
       sampling=st.integers(0, 1), every=st.sampled_from([1, 2, 8]))
def test_cached_turns_equal_computing_from_scratch(tiny, seed, first, turn, sampling, every):
    """Three turns of one conversation; each later turn starts from cached pages and a
    snapshot (past several windows of ratio 4 and 128 and the indexer's top-k of 8)."""
    V = tiny.config.vocab_size
    cached = Engine(tiny, max_concurrency=2)
    cached.seq_engine.snapshot_every = every
    prompt, fed = history(seed, first, V), 0
    for t in range(3):
        req = lambda: Request(list(prompt), 24, sampling=SAMPLINGS[sampling], ignore_eos=True)  # noqa: E731
        got = run_events(cached, [req()])[0]
        hit = cached.finishes[0].cached_tokens
        assert hit == fed, (t, hit, fed)  # every later turn resumes where the last one stopped feeding
        fed = len(prompt) + 24 - 1
        want = run_events(Engine(tiny, max_concurrency=2, prefix_cache=False), [req()])[0]
        assert got == want, f"turn {t}: the cached run's bits differ from the run from scratch"
        prompt = prompt + got[0] + history(seed + 1 + t, turn, V)
    check_balanced(cached)


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 1000), root=st.integers(T, 2 * T - 1), own=st.integers(1, 60), arrive=st.integers(2, 12),
       cancel=st.sampled_from([None, 5, 20]))
def test_concurrent_sharers_under_page_pressure_equal_their_solo_bits(tiny, seed, root, own, arrive, cancel):
    """Three requests on one root (its first page shared) into a pool too small for them: they
    share its pages, one is preempted and comes back through the cache, and one may be
    cancelled; each one's bits are those it gets alone, from scratch.

    Preemption, forced: A (a prompt of two whole pages, T + 2 tokens) arrives first and
    reserves its prompt's pages and one more; B (T + 2 tokens) arrives a pass later, takes the
    rest of the pool and leaves A's spare unpaid, so when A's history crosses into its fourth
    page, with B still decoding, the scheduler preempts B, the youngest live sequence; C (40
    tokens) arrives later and waits for pages."""
    V = tiny.config.vocab_size
    base = history(seed, root, V)

    def reqs():
        return [Request(base + history(seed + 1, 2 * T - root, V), T + 2, sampling=SAMPLINGS[0], ignore_eos=True),
                Request(base + history(seed + 2, own, V), T + 2, sampling=SAMPLINGS[1], ignore_eos=True),
                Request(base + history(seed + 3, own, V), 40, sampling=SAMPLINGS[0], ignore_eos=True)]

    b_pages = -(-(root + own) // T)  # B's reservation: its prompt's pages and one more, less the shared root page
    eng = Engine(tiny, max_concurrency=3, kv_pool_tokens=(3 + b_pages) * T)
    eng.seq_engine.snapshot_every = 1
    cancel_at = {} if cancel is None else {2: cancel}
    outs = eng.run(reqs(), arrivals={0: 0, 1: 1, 2: arrive}, cancel_at=cancel_at)
    stats = eng.scheduler.stats()
    assert stats["preemptions"] >= 1, stats
    # every admission but A's, B's return after its preemption included, started from cached pages
    assert stats["prefix_misses"] == 1 and stats["prefix_hits"] >= 1 + stats["preemptions"], stats
    index = {f.req_id: i for i, f in enumerate(eng.finishes)}
    lps = [[] for _ in outs]
    for ev in eng.events:
        if isinstance(ev, TokenEvent):
            lps[index[ev.req_id]].append(np.float32(ev.logprob).view(np.uint32).item())
    for i, r in enumerate(reqs()):
        want = run_events(Engine(tiny, max_concurrency=1, prefix_cache=False), [r])[0]
        n = len(outs[i])
        assert outs[i] == want[0][:n] and lps[i] == [lp for lp, _ in want[1][:n]]
        if eng.finishes[i].reason != "cancelled":
            assert n == r.max_new_tokens
    check_balanced(eng)


def test_the_gpu_benchmark_runs_on_the_tiny_model(tmp_path):
    """benchmarks/prefix_gpu.py, as the H200 runs it but on the NumPy backend: turn 2 resumes
    where turn 1 stopped feeding and its logits equal the uncached run's."""
    import importlib.util
    import json
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "prefix_gpu.py"
    spec = importlib.util.spec_from_file_location("prefix_gpu", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "prefix.md"
    assert bench.main(["--tiny", "--history", "200", "--turn", "20", "--reply", "4", "--out", str(out),
                       "--json", str(tmp_path / "prefix.json")]) == 0
    run, = json.loads((tmp_path / "prefix.json").read_text())["runs"]
    assert run["bitwise"] and run["cached"] == 203 and run["recomputed"] == 1 + 1 + 20 and run["tail_hits"] == 1
    assert "| 200 | 225 | 203 | 22 |" in out.read_text()
