"""Chunked prefill is exact: prompts fed in passes of any size up to LONG_PASS_ROWS rows (the
server's lone-prompt pass), several prompts sharing a pass beside decoding sequences and cut
at arbitrary offsets, give bitwise the logits, the tokens and the stored state of feeding one
row per pass.

The pass sizes are drawn: a decode pass's 16 rows, PARALLEL_ROWS (from which the reference runs
its threaded kernels, the code path of every larger pass), PREFILL_ROWS, LARGE (the tiny model's
stand-in for 2048: past PREFILL_ROWS, yet shorter than the longest prompt, so prompts run past
several passes of it) and LONG_PASS_ROWS itself.

The prompts cross ratio-4 and ratio-128 compressor windows (cuts land inside them),
outgrow the raw window and pass the indexer's top-k threshold, so every piece of state
that one row hands to the next (ring, compressor windows, compressed and indexer rows in
the pages) is exercised across chunk and pass boundaries.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

import ds4ref
from ds4ref.backend import DECODE_LANES, PAGE_TOKENS, PREFILL_ROWS, Row, StepPlan
from ds4ref.numerics.canon import PARALLEL_ROWS
from ds4ref.scheduler.pass_cost import LONG_PASS_ROWS, PassCost
from ds4ref.scheduler.engine import Engine
from ds4ref.reference.numpy_backend import NumpyBackend
from ds4ref.scheduler import Request, Sampling
from ds4ref.scheduler.hash_backend import reference_tokens
from test_batch_invariance import engine, logits_by_request, prompt
from test_scheduler import VOCAB, tokens_of, toy_model
from test_scheduler import prompt as hash_prompt

CFG = ds4ref.load().config
WINDOW, TOP_K = CFG.sliding_window, CFG.indexer_top_k
SMALL, BIG = min(set(CFG.compress_ratios) - {0}), max(CFG.compress_ratios)
# Prompt lengths: inside the raw window, just past it, just past the indexer's threshold
# (more than TOP_K ratio-SMALL rows), either side of a BIG window, and several BIG windows
# in, ending inside one.
LENGTHS = sorted({1, WINDOW + 1, SMALL * (TOP_K + 1) + 3, BIG - 1, BIG + 1, 2 * BIG + 5, 3 * BIG + WINDOW})
STREAMS = 3  # distinct token streams; a sequence is a prefix of one
LARGE = 2 * BIG + 64
PASS_ROWS = (DECODE_LANES, PARALLEL_ROWS, PREFILL_ROWS, LARGE, LONG_PASS_ROWS)


def test_the_lengths_reach_what_they_claim():
    longest = max(LENGTHS)
    assert longest > WINDOW and longest // SMALL > TOP_K and longest // BIG >= 3
    assert longest % BIG and longest > LARGE > PREFILL_ROWS  # ends mid-window; no one pass holds it
    assert LONG_PASS_ROWS > 5 * longest  # the lone-prompt pass holds every sequence's whole prompt


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def slot_state(b: NumpyBackend, slot: int) -> dict[str, bytes]:
    """Every stored byte of one slot: position, rings, compressor state, and its pages read
    through its block table (so physical placement does not count)."""
    n = int(b.next_pos[slot])
    out = {"next_pos": n.to_bytes(8, "little"), "rings": b.rings[slot].tobytes()}
    for (il, kind), c in b.comps[slot].items():
        for name in ("cur_kv", "cur_score", "prev_kv", "prev_score"):
            if hasattr(c, name):
                out[f"comp {il} {kind} {name}"] = getattr(c, name).tobytes()
    table = b.block_tables[slot][:b.layout.pages_for_tokens(n)]
    for (il, kind), store in b.pages.items():
        out[f"pages {il} {kind}"] = store[table].tobytes()
    return out


def fresh_backend(model, n_slots: int, tables: list[list[int]], max_pass_rows: int = PREFILL_ROWS) -> NumpyBackend:
    b = NumpyBackend(model.reference, max_pass_rows)
    b.configure(n_slots, sum(len(t) for t in tables))
    for slot, t in enumerate(tables):
        b.reset_slot(slot)
        b.set_block_table(slot, t)
    return b


@pytest.fixture(scope="module", params=["official", "plain"])
def one_row_feed(request):
    """Per stream: the logits of every position and the slot's state after each of LENGTHS,
    fed one row per pass, alone."""
    model = ds4ref.load(numerics=request.param)
    n, v = max(LENGTHS), model.config.vocab_size
    streams = [prompt(n, 900 + k, v) for k in range(STREAMS)]
    feeds = []
    for toks in streams:
        b = fresh_backend(model, 1, [list(range(-(-n // PAGE_TOKENS)))])
        logits, states = [], {}
        for p, t in enumerate(toks):
            logits.append(b.step(StepPlan.from_rows([Row(0, p, t)])).logits[0])
            if p + 1 in LENGTHS:
                states[p + 1] = slot_state(b, 0)
        feeds.append((toks, logits, states))
    return model, feeds


# One sequence of a chunked feed: which stream, how long, the pass it starts at, the chunk
# sizes it asks for (cycled), and how many last rows it feeds one a pass, as a decoder does.
SEQ = st.tuples(st.integers(0, STREAMS - 1), st.sampled_from(LENGTHS), st.integers(0, 3),
                st.lists(st.one_of(st.integers(1, 40), st.integers(1, LONG_PASS_ROWS)), min_size=1, max_size=4),
                st.integers(0, 6))


def chunked_passes(seqs, rows_per_pass: int) -> list[list[tuple[int, int, int]]]:
    """Passes of (sequence, first position, rows): each sequence takes its next chunk, cut
    to what the pass has left, so cuts fall at offsets the strategy never chose directly."""
    fed = [0] * len(seqs)
    passes: list[list[tuple[int, int, int]]] = []
    k = 0
    while any(f < s[1] for f, s in zip(fed, seqs)):
        rows_left, plan = rows_per_pass, []
        for i, (_, n, start, chunks, tail) in enumerate(seqs):
            if k < start or fed[i] >= n or not rows_left:
                continue
            want = 1 if fed[i] >= n - tail else min(chunks[k % len(chunks)], n - tail - fed[i])
            take = min(want, rows_left)
            plan.append((i, fed[i], take))
            fed[i], rows_left = fed[i] + take, rows_left - take
        passes.append(plan)
        k += 1
    return passes


def run_chunked(model, feeds, seqs, emit_all: bool, page_seed: int, pass_rows: int = PREFILL_ROWS):
    """Feed seqs through one backend in chunked passes of up to pass_rows rows; (emitted logits by
    (seq, position), the backend)."""
    per_seq = [-(-n // PAGE_TOKENS) for _, n, *_ in seqs]
    pages = np.random.default_rng(page_seed).permutation(sum(per_seq)).tolist()
    tables = [pages[sum(per_seq[:i]):sum(per_seq[:i + 1])] for i in range(len(seqs))]
    b = fresh_backend(model, len(seqs), tables, pass_rows)
    got = {}
    for plan in chunked_passes(seqs, pass_rows):
        rows = [Row(i, p, feeds[seqs[i][0]][0][p], emit=emit_all or p == first + take - 1,
                    want_logits=emit_all or p == first + take - 1)
                for i, first, take in plan for p in range(first, first + take)]
        res = b.step(StepPlan.from_rows(rows, pass_rows))
        for r, lg, am in zip(rows, res.logits, res.argmax):
            if r.emit:
                got[(r.slot, r.position)] = (lg, int(am))
    return got, b


@example(seqs=[(0, max(LENGTHS), 0, [PREFILL_ROWS], 0), (1, max(LENGTHS), 0, [BIG + 1, 7], 3),
               (2, WINDOW + 1, 0, [1], 5), (0, BIG + 1, 1, [SMALL + 1], 0)], emit_all=True, page_seed=0,
         pass_rows=PREFILL_ROWS)
@example(seqs=[(0, max(LENGTHS), 0, [LONG_PASS_ROWS], 0), (1, max(LENGTHS), 0, [LARGE], 2),
               (2, 2 * BIG + 5, 1, [LARGE - 1, 3], 0)], emit_all=False, page_seed=1, pass_rows=LARGE)
@settings(max_examples=8, deadline=None)
@given(seqs=st.lists(SEQ, min_size=1, max_size=5), emit_all=st.booleans(), page_seed=st.integers(0, 99),
       pass_rows=st.sampled_from(PASS_ROWS))
def test_chunked_passes_equal_one_row_per_pass(one_row_feed, seqs, emit_all, page_seed, pass_rows):
    model, feeds = one_row_feed
    got, b = run_chunked(model, feeds, seqs, emit_all, page_seed, pass_rows)
    for (i, p), (lg, am) in got.items():
        want = feeds[seqs[i][0]][1][p]
        assert same_bits(lg, want), f"sequence {i} ({seqs[i]}), position {p}: logits differ"
        assert am == int(np.argmax(want))
    for i, (stream, n, *_) in enumerate(seqs):
        want = feeds[stream][2][n]
        have = slot_state(b, i)
        assert have.keys() == want.keys()
        differ = [k for k in want if have[k] != want[k]]
        assert not differ, f"sequence {i} ({seqs[i]}): stored state differs in {differ}"


@pytest.mark.parametrize("pass_rows", [PREFILL_ROWS, LARGE])
def test_chunked_passes_share_full_passes_and_cover_every_position(pass_rows):
    """Guards the helper the property rests on, not the backend: its passes do fill up
    and hold several sequences, a prompt runs past several of them, and each sequence's
    chunks tile its positions."""
    seqs = [(0, max(LENGTHS), 0, [100, LONG_PASS_ROWS], 0), (1, max(LENGTHS), 0, [100], 2), (2, 9, 0, [1], 9)]
    passes = chunked_passes(seqs, pass_rows)
    assert max(sum(t for *_, t in plan) for plan in passes) == pass_rows
    assert any(len(plan) == 3 for plan in passes)
    assert sum(1 for plan in passes if any(j == 0 for j, *_ in plan)) > 1
    for i, (_, n, *_) in enumerate(seqs):
        starts = [(first, take) for plan in passes for j, first, take in plan if j == i]
        assert [f for f, _ in starts] == np.cumsum([0] + [t for _, t in starts])[:-1].tolist()
        assert sum(t for _, t in starts) == n


# ---- through the Engine: chunked prefill beside decoders, against one row per pass ----------

@pytest.mark.parametrize("sizing", [{}, dict(max_pass_rows=LONG_PASS_ROWS, max_itl_ms=66.0,
                                             pass_cost=PassCost(2.0, 1.0))], ids=["whole-pass", "itl-budget"])
def test_engine_chunked_prefill_equals_one_row_per_pass(sizing):
    """Decoders run while two long prompts arrive and prefill in chunks; every request's
    tokens and logits are bitwise those of running it alone, one row per pass. Chunks take
    every row the decoders leave, or (itl-budget) the rows of a pass predicted within 66 ms at
    2 ms + 1 ms a row: 64 rows a pass beside decoders, a large pass when none decodes."""
    model = ds4ref.load()
    v = model.config.vocab_size
    lens = [5, WINDOW + 3, 3 * BIG + WINDOW, 2 * BIG + SMALL + 1, 2]
    reqs = lambda: [Request(prompt(n, 70 + i, v), 6, Sampling(logprobs=0), ignore_eos=True)  # noqa: E731
                    for i, n in enumerate(lens)]
    chunked = engine(model, record=True, max_concurrency=len(lens), page_order_seed=1, **sizing)
    rs = reqs()
    toks = chunked.run(rs, arrivals={2: 3, 3: 4})
    assert chunked.scheduler.stats()["steps"] < max(lens)  # so the long prompts went in chunks
    if sizing:
        sizes = chunked.seq_engine.backend.sizes
        alone = sizes.index(max(sizes))  # the decoders are done: the prompts' rest in one large pass
        assert sizes[0] == 5 + WINDOW + 3 + 2 and max(sizes[1:alone]) == 64 and sizes[alone] > PREFILL_ROWS
    alone = engine(model, record=True, max_concurrency=1, prompt_quantum=1, max_batched_rows=1)
    ra = reqs()
    assert toks == alone.run(ra)
    for a, b in zip(logits_by_request(chunked, rs), logits_by_request(alone, ra)):
        assert len(a) == len(b) == 6 and all(same_bits(x, y) for x, y in zip(a, b))


# ---- the policy: decoders never wait for a prompt, passes never exceed the bound ------------

def rows_per_slot(plan) -> dict[int, int]:
    slots, counts = np.unique(plan.slots[plan.slots >= 0], return_counts=True)
    return {int(s): int(c) for s, c in zip(slots, counts)}


@pytest.mark.parametrize("spare", [0, 1, 37, None])
def test_a_long_prompt_never_stalls_the_decoders(spare):
    decoders = 6
    bound = None if spare is None else decoders + 1 + spare  # the long prompt's lane counts too
    eng = Engine(toy_model(), decoders + 1, max_batched_rows=bound, backend="hash")
    sch, seqs = eng.scheduler, eng.seq_engine.seqs
    reqs = [Request(hash_prompt(1 + i, i), 40, ignore_eos=True) for i in range(decoders)]
    reqs.append(Request(hash_prompt(700, 99), 3, ignore_eos=True))
    for r in reqs[:-1]:
        sch.submit(r)
    events = []
    while not seqs or any(s.prompting for s in seqs.values()):  # the decoders' own prompts first
        events += sch.step()
    sch.submit(reqs[-1])
    long_left, shared = len(reqs[-1].prompt_ids), 0
    while sch.has_work():
        decoding = {slot for slot, s in seqs.items() if not s.prompting}
        long_slot = [slot for slot, s in seqs.items() if s.request is reqs[-1]]
        # a chunk stops at a page boundary where the prefix cache snapshots the state
        to_snapshot = eng.seq_engine.rows_to_snapshot(long_slot[0]) if long_slot else long_left
        events += sch.step()
        plan = eng.seq_engine.backend.passes[-1]
        per = rows_per_slot(plan)
        assert plan.n_rows <= sch.max_batched_rows
        assert all(per.get(s) == 1 for s in decoding), "a decoder lost its row to the prompt"
        prompt_rows = plan.n_rows - len(decoding)
        assert prompt_rows == min(long_left, to_snapshot, sch.max_batched_rows - len(decoding)), "rows left unused"
        shared += bool(decoding) and prompt_rows > 0
        long_left -= prompt_rows
    assert shared, "the long prompt never shared a pass with decoders"
    assert sch.stats()["preemptions"] == 0
    for r in reqs:
        assert tokens_of(events, r) == reference_tokens(r.prompt_ids, r.max_new_tokens, VOCAB)


def test_max_batched_rows_outside_its_range_is_refused():
    max_pass_rows = toy_model().make_backend().max_pass_rows
    for bad in (0, -1, max_pass_rows + 1):
        with pytest.raises(ValueError, match=f"max_batched_rows must be in 1..{max_pass_rows}"):
            Engine(toy_model(), 1, max_batched_rows=bad, backend="hash")
    with pytest.raises(ValueError, match="at least max_concurrency"):
        Engine(toy_model(), 4, max_batched_rows=3, backend="hash")
    with pytest.raises(ValueError, match="prompt_quantum"):
        Engine(toy_model(), 1, prompt_quantum=0, backend="hash")
    for good in (1, max_pass_rows):
        assert Engine(toy_model(), 1, max_batched_rows=good, backend="hash").scheduler.max_batched_rows == good
    assert Engine(toy_model(), 4, backend="hash").scheduler.prompt_quantum == max_pass_rows


def test_plans_are_padded_to_the_smallest_capacity_that_holds_them():
    row = lambda p: Row(0, p, 1)  # noqa: E731
    for n, want in ((0, DECODE_LANES), (DECODE_LANES, DECODE_LANES), (DECODE_LANES + 1, PREFILL_ROWS),
                    (PREFILL_ROWS, PREFILL_ROWS)):
        plan = StepPlan.from_rows([row(p) for p in range(n)], PREFILL_ROWS)
        assert (plan.slots.size, plan.n_rows) == (want, n)
    assert StepPlan.from_rows([row(0)], 4).slots.size == 4  # a backend smaller than the decode lanes
    with pytest.raises(ValueError, match=f"at most {PREFILL_ROWS} rows"):
        StepPlan.from_rows([row(p) for p in range(PREFILL_ROWS + 1)], PREFILL_ROWS)
