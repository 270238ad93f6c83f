"""Prompt passes sized by what else runs (docs/scheduler.md "How passes are sized").

Over HashBackend, whose tokens depend only on each sequence's own history, with an injected
cost model so every schedule is deterministic: beside decoders a pass's predicted time stays
within the inter-token budget and holds the most prompt rows that do, yet always at least
min_prompt_rows; with no decoder a prompt takes the whole (large) pass; every decoder runs
every pass, every prompt advances within a few passes, and every request gets exactly its
solo tokens. The learned cost model is checked against passes timed on a fake clock.
"""
from __future__ import annotations

import pytest
from hypothesis import example, given, settings, strategies as st

from ds4ref.backend import DECODE_LANES
from ds4ref.gguf.tiny import flash_config
from ds4ref.hip.backend import capacity_buckets
from ds4ref.hip.launch import EL_EXPERTS, LARGEST_PASS, largest_pass
from ds4ref.scheduler import FinishEvent, Request
from ds4ref.scheduler.engine import Engine
from ds4ref.scheduler.hash_backend import HashBackend, reference_tokens
from ds4ref.scheduler.pass_cost import (DEFAULT_MAX_ITL_MS, FLASH_H200, LONG_PASS_ROWS, MIN_PROMPT_ROWS,
                                        MeasuredPassCost, PassCost)
from test_scheduler import VOCAB, check_balanced, prompt, tokens_of, toy_model


class BucketedHash(HashBackend):
    """HashBackend padding each pass to HipBackend's capacity buckets, as HipBackend reports them."""

    def __init__(self, vocab_size: int, max_pass_rows: int):
        super().__init__(vocab_size, max_pass_rows)
        self.buckets = capacity_buckets(max_pass_rows)

    def bucket(self, n_rows: int) -> int:
        return next(L for L in self.buckets if n_rows <= L)


def toy(max_pass_rows: int = LONG_PASS_ROWS, bucketed: bool = True):
    backend = BucketedHash if bucketed else HashBackend
    return toy_model(8192, lambda vocab: backend(vocab, max_pass_rows))


def largest_share(cost, lanes, decode_rows: int, rows_left: int, budget: float) -> int:
    """The most prompt rows beside decode_rows whose pass the cost predicts within budget, by
    trying every count (the Scheduler bisects)."""
    return max([n for n in range(rows_left + 1) if cost.ms(lanes(decode_rows + n)) <= budget], default=0)


def admit_now(sch) -> None:
    """Admit the waiting requests the coming step() would admit first, so that the state its pass
    is planned from can be read (admission is FIFO and idempotent)."""
    with sch._lock:
        sch._admit()


def check_solo(events, reqs) -> None:
    """Nothing lost: every request got exactly its solo greedy tokens and finished once."""
    for r in reqs:
        assert tokens_of(events, r) == reference_tokens(r.prompt_ids, r.max_new_tokens, VOCAB), r.req_id
        assert [e.reason for e in events if isinstance(e, FinishEvent) and e.req_id == r.req_id] == ["length"]


# ---- the brief's case: one long prompt beside 15 decoders, H200 costs -------------------------


def decoders_then_prompt(eng: Engine, decoders: int, prompt_len: int, new: int = 200):
    """`decoders` requests decode; then a long prompt arrives. Per pass while the prompt runs:
    (decoding slots, rows per slot, (prompt rows left, rows to the next snapshot) per prompting
    slot, the long prompt's slot); the events; the requests."""
    sch, seqs = eng.scheduler, eng.seq_engine.seqs
    reqs = [Request(prompt(5 + i, i), new, ignore_eos=True, req_id=i + 1) for i in range(decoders)]
    long = Request(prompt(prompt_len, 99), 3, ignore_eos=True, req_id=999)
    for r in reqs:
        sch.submit(r)
    events = []
    while not seqs or any(s.prompting for s in seqs.values()):
        events += sch.step()
    sch.submit(long)
    admit_now(sch)
    (long_slot,) = [slot for slot, s in seqs.items() if s.request is long]
    passes = []
    while seqs[long_slot].prompting:
        decoding = {slot for slot, s in seqs.items() if not s.prompting}
        left = {slot: (s.prompt_left, eng.seq_engine.rows_to_snapshot(slot)) for slot, s in seqs.items()
                if s.prompting}
        events += sch.step()
        plan = eng.seq_engine.backend.passes[-1]
        slots = plan.slots[plan.slots >= 0].tolist()
        passes.append((decoding, {s: slots.count(s) for s in set(slots)}, left, long_slot))
    while sch.has_work():
        events += sch.step()
    return passes, events, reqs + [long]


def test_a_prompt_beside_15_decoders_keeps_their_passes_within_the_budget():
    """H200 Flash costs (16.9 ms + 1.305 ms a lane) and a 200 ms budget: the 128-lane bucket is
    predicted at 16.9 + 1.305 * 128 = 183.9 ms and the 256-lane one at 351.0 ms, so a pass holds
    the 15 decode rows and 128 - 15 = 113 prompt rows, every pass until the prompt is done."""
    eng = Engine(toy(), 16, backend=None, max_itl_ms=200.0, pass_cost=FLASH_H200, prefix_cache=False)
    passes, events, reqs = decoders_then_prompt(eng, 15, 3000)
    lanes = eng.seq_engine.backend.bucket
    prompt_rows = []
    for decoding, per, left, _ in passes:
        assert len(decoding) == 15 and all(per.get(s) == 1 for s in decoding), "a decoder missed a pass"
        rows = sum(per.values())
        assert FLASH_H200.ms(lanes(rows)) <= 200.0
        prompt_rows.append(rows - 15)
    assert prompt_rows[:-1] == [113] * (len(prompt_rows) - 1) and 0 < prompt_rows[-1] <= 113
    assert sum(prompt_rows) == 3000
    check_solo(events, reqs)
    check_balanced(eng)


def test_a_prompt_alone_runs_in_the_large_pass():
    """No decoder waits: the prompt takes the whole pass, LONG_PASS_ROWS rows, whatever the budget;
    with the prefix cache a chunk also ends where a snapshot is taken: every largest pass's pages
    (16: 2048 rows, so the passes stay whole) and at the last page boundary of the prompt (39
    pages: 4992)."""
    assert Engine(toy(), 4).seq_engine.snapshot_every == LONG_PASS_ROWS // 128
    for cache, want in ((False, [2048, 2048, 904]), (True, [2048, 2048, 4992 - 4096, 8])):
        eng = Engine(toy(), 4, max_itl_ms=1.0, pass_cost=FLASH_H200, prefix_cache=cache)
        r = Request(prompt(5000, 7), 4, ignore_eos=True)
        toks = eng.run([r])
        sizes = [p.n_rows for p in eng.seq_engine.backend.passes]
        assert sizes[:len(want)] == want and sizes[len(want):] == [1, 1, 1]
        assert toks == [reference_tokens(r.prompt_ids, 4, VOCAB)]


def test_decoders_beyond_the_budget_still_let_the_prompt_advance():
    """A budget below the decode rows' own cost: the prompt still gets min_prompt_rows a pass."""
    eng = Engine(toy(), 16, max_itl_ms=20.0, pass_cost=FLASH_H200, prefix_cache=False)
    assert FLASH_H200.ms(16) > 20.0
    passes, events, reqs = decoders_then_prompt(eng, 15, 300)
    for decoding, per, left, slot in passes:
        assert all(per.get(s) == 1 for s in decoding)
        assert per[slot] == min(MIN_PROMPT_ROWS, left[slot][0])
    check_solo(events, reqs)


# ---- the property: random costs, budgets, buckets, arrivals -----------------------------------

costs = st.builds(PassCost, st.floats(0, 60), st.floats(0.01, 5))
mixes = st.lists(st.tuples(st.integers(1, 900), st.integers(1, 30), st.integers(0, 20)), min_size=1, max_size=12)


@example(cost=FLASH_H200, budget=DEFAULT_MAX_ITL_MS, mix=[(3, 60, 0)] * 15 + [(900, 2, 3)], pass_rows=LONG_PASS_ROWS,
         bucketed=True, min_rows=MIN_PROMPT_ROWS, quantum=None, cache=False)
@settings(max_examples=100, deadline=None)
@given(cost=costs, budget=st.floats(1, 600), mix=mixes, pass_rows=st.sampled_from([64, 256, LONG_PASS_ROWS]),
       bucketed=st.booleans(), min_rows=st.sampled_from([1, MIN_PROMPT_ROWS]),
       quantum=st.sampled_from([None, 7, 100]), cache=st.booleans())
def test_every_pass_is_sized_by_the_budget_and_nobody_stalls(cost, budget, mix, pass_rows, bucketed, min_rows,
                                                             quantum, cache):
    mix = mix[:16]
    conc = min(16, len(mix))
    eng = Engine(toy(pass_rows, bucketed), conc, max_itl_ms=budget, pass_cost=cost, prefix_cache=cache,
                 prompt_quantum=quantum)
    eng.scheduler.min_prompt_rows = min_rows
    sch, seng = eng.scheduler, eng.seq_engine
    lanes = getattr(seng.backend, "bucket", lambda n: n)
    reqs = [Request(prompt(n, i), new, ignore_eos=True, req_id=i + 1) for i, (n, new, _) in enumerate(mix)]
    unsent = sorted(range(len(reqs)), key=lambda i: (mix[i][2], i))
    events, step, waited = [], 0, {}
    while unsent or sch.has_work():
        while unsent and mix[unsent[0]][2] <= step:
            sch.submit(reqs[unsent.pop(0)])
        step += 1
        admit_now(sch)
        decoding = {s.slot for s in seng.live() if not s.prompting}
        could = {s.slot: min(quantum or sch.max_batched_rows, s.prompt_left, seng.rows_to_snapshot(s.slot))
                 for s in seng.live() if s.prompting}
        n_passes = len(seng.backend.passes)
        events += sch.step()
        if len(seng.backend.passes) == n_passes:
            continue
        plan = seng.backend.passes[-1]
        slots = plan.slots[plan.slots >= 0].tolist()
        per = {s: slots.count(s) for s in set(slots)}
        assert all(per.get(s) == 1 for s in decoding), "a decoder missed its row"
        d = len(decoding)
        p = plan.n_rows - d
        assert p == sum(per.get(s, 0) for s in could)
        want = min(sum(could.values()), sch.max_batched_rows - d)  # every row a lone prompt can take
        if d:
            share = max(min_rows, largest_share(cost, lanes, d, sch.max_batched_rows - d, budget))
            want = min(want, share)
            assert cost.ms(lanes(plan.n_rows)) <= budget or p <= min_rows, "a pass over the budget"
        assert p == want, f"prompt rows {p}, the policy gives {want} (decoders {d}, could {could})"
        for s in could:  # least recently served first: at most the other live prompts go before it
            waited[s] = 0 if per.get(s) else waited.get(s, 0) + 1
            assert waited[s] < conc, f"slot {s} waited {waited[s]} passes"
        waited = {s: w for s, w in waited.items() if s in could}
    check_solo(events, reqs)
    check_balanced(eng)


# ---- the learned cost model ------------------------------------------------------------------


def test_the_measured_model_follows_the_passes_it_sees():
    # float64 sums of the scaled and interpolated terms: equal to rounding, hence the tolerances
    near = lambda x: pytest.approx(x, rel=1e-12)  # noqa: E731
    prior = PassCost(17.0, 1.3)
    m = MeasuredPassCost(prior=prior)
    assert [m.ms(x) for x in (16, 256)] == [prior.ms(16), prior.ms(256)]
    m.observe(16, 5000.0)  # the first pass of a size (a graph capture) is not counted
    assert m.ms(16) == prior.ms(16) and m.knots == []
    m.observe(16, 2 * prior.ms(16))  # one size known: the prior scaled through it
    assert [m.ms(x) for x in (16, 100, 2048)] == [near(2 * prior.ms(x)) for x in (16, 100, 2048)]
    m.observe(64, 1.0)
    m.observe(64, 100.0)
    m.observe(64, 200.0)  # smoothed: 100 + 0.25 * (200 - 100)
    assert m.knots == [(16, 75.6), (64, 125.0)]
    assert m.ms(40) == near((75.6 + 125.0) / 2) and m.ms(8) == near(75.6 - (125.0 - 75.6) / 6)
    assert m.ms(128) == near(125.0 + 125.0 / 64 * 64)  # past the largest: at least its average row
    m.observe(128, 0.0)
    m.observe(128, 90.0)  # faster than 64 rows: noise; the prediction stays non-decreasing
    assert m.knots == [(16, 75.6), (64, 125.0), (128, 125.0)] and m.ms(100) == 125.0
    law, fresh = PassCost(10.0, 2.0), MeasuredPassCost()
    for lanes in (16, 64, 128, 16, 64, 128):
        fresh.observe(lanes, law.ms(lanes))
    assert [fresh.ms(x) for x in (16, 40, 100, 128)] == [near(law.ms(x)) for x in (16, 40, 100, 128)]


class Clocked(BucketedHash):
    """A pass advances a fake clock by `law`'s time for its bucket: the engine's timing, without time."""

    def __init__(self, max_pass_rows: int, law: PassCost):
        super().__init__(VOCAB, max_pass_rows)
        self.law, self.now = law, 0.0

    def step(self, plan):
        self.now += self.law.ms(self.bucket(plan.n_rows)) / 1e3
        return super().step(plan)


def test_the_scheduler_learns_the_cost_from_the_passes_it_times():
    """Passes that really cost 5 ms + 0.5 ms a lane (the prior says 16.9 + 1.305): once it has timed
    them, beside 15 decoders a 100 ms budget takes the 128-lane bucket (69 ms), not the 256-lane
    one (133 ms; predicted 69 + 128 * 69 / 128 = 138)."""
    law = PassCost(5.0, 0.5)
    backend = Clocked(LONG_PASS_ROWS, law)
    model = toy_model(8192, lambda vocab: backend)
    eng = Engine(model, 16, max_itl_ms=100.0, prefix_cache=False)
    eng.scheduler.clock = lambda: backend.now
    passes, events, reqs = decoders_then_prompt(eng, 15, 4000)
    sizes = [sum(per.values()) for _, per, _, _ in passes]
    # the prior first (16.9 + 1.305 * 64 = 100.4 > 100: 32 lanes); once a 32-lane pass is timed
    # (its second: the first is not counted), the prior scaled through it (21 / 58.7) picks 128
    assert sizes[:2] == [32, 32] and sizes[2:-1] == [128] * (len(sizes) - 3)
    # the fake clock is a float sum of pass times, so a pass's time comes back to rounding
    knots = dict(eng.scheduler.pass_cost.knots)  # the decoders' passes after the prompt timed 16 too
    assert knots == {x: pytest.approx(law.ms(x), rel=1e-9) for x in (16, 32, 128)}
    check_solo(events, reqs)


# ---- sizes that follow: the hip kernels' limit, the server's flags ------------------------------


def test_the_largest_pass_is_the_kernels_for_any_expert_count():
    """step_expert_list takes a pass's lanes in chunks of its shared bit set, so the expert count
    no longer bounds a pass: Flash's 256 experts and the tiny model's 8 both run 4096 rows, the
    server's lone-prompt pass (2048) fits either, and a model past the kernel's 1024 experts runs
    none."""
    import dataclasses
    import ds4ref
    assert largest_pass(flash_config()) == largest_pass(ds4ref.load().config) == LARGEST_PASS == 4096
    assert largest_pass(dataclasses.replace(flash_config(), n_expert=EL_EXPERTS + 1)) == 0
    from ds4ref import serve
    assert LONG_PASS_ROWS == 2048
    assert serve.pass_rows("hip", flash_config(), None) == LONG_PASS_ROWS
    assert serve.pass_rows("hip", flash_config(), LARGEST_PASS) == LARGEST_PASS
    assert serve.pass_rows("numpy", flash_config(), None) == LONG_PASS_ROWS
    assert serve.pass_rows("hip", ds4ref.load().config, None) == LONG_PASS_ROWS
    with pytest.raises(ValueError, match="at most 4096"):
        serve.pass_rows("hip", flash_config(), 2 * LARGEST_PASS)


def test_the_server_flags():
    from ds4ref.serve.__main__ import parser
    assert parser().parse_args([]).max_itl_ms == DEFAULT_MAX_ITL_MS
    assert parser().parse_args(["--max-itl-ms", "0"]).max_itl_ms == 0
    assert parser().parse_args(["--max-itl-ms", "75.5"]).max_itl_ms == 75.5
    for bad in ("-1", "inf", "nan", "fast"):
        with pytest.raises(SystemExit):
            parser().parse_args(["--max-itl-ms", bad])


def test_the_hip_plan_follows_the_largest_pass(tiny_model_path):
    from ds4ref import serve
    plans = {rows: serve.plan_start(str(tiny_model_path), "hip", "official", 4, None, 1000, rows)[1]
             for rows in (None, 256, 1024, LARGEST_PASS)}
    assert plans[None].workspace_rows == LONG_PASS_ROWS
    assert [plans[r].workspace_rows for r in (256, 1024, LARGEST_PASS)] == [256, 1024, LARGEST_PASS]
    assert plans[256].workspace < plans[1024].workspace < plans[None].workspace < plans[LARGEST_PASS].workspace


def test_the_default_hip_pass_is_the_largest_the_device_holds(tiny_model_path):
    """The server's default pass halves from LONG_PASS_ROWS until the plan's state and workspace
    fit 95% of the free device memory, as HipBackend.configure checks them; PREFILL_ROWS when
    none does."""
    from ds4ref import serve
    _, plan = serve.plan_start(str(tiny_model_path), "hip", "official", 16, None, None)
    need = {rows: (lambda p: p.paged + p.slots + p.workspace + p.draft)(serve.hip_plan(plan, rows, "official", "mtp"))
            for rows in (2048, 1024, 512, 256)}
    assert need[2048] > need[1024] > need[512] > need[256]
    for rows in (2048, 1024, 512):
        assert serve.fitting_pass_rows(plan, int(need[rows] / 0.95) + 1, "official", "mtp") == rows
        assert serve.fitting_pass_rows(plan, int(need[rows] / 0.95) - 1, "official", "mtp") == rows // 2
    assert serve.fitting_pass_rows(plan, 0, "official", "mtp") == 256


def test_a_budget_and_cost_are_checked():
    with pytest.raises(ValueError, match="max_itl_ms"):
        Engine(toy(), 1, max_itl_ms=0.0)
    with pytest.raises(ValueError, match="row_ms"):
        PassCost(1.0, 0.0)
    assert Engine(toy(), 1).scheduler.pass_cost is None  # no budget: nothing timed
    assert isinstance(Engine(toy(), 1, max_itl_ms=50.0).scheduler.pass_cost, MeasuredPassCost)
    assert DECODE_LANES == MIN_PROMPT_ROWS
