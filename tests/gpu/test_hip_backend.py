"""HipBackend on the embedded tiny model against the NumPy reference (marker gpu).

Both backends compute the canonical float32 arithmetic (docs/exactness.md), so every
comparison here is bitwise, in both numerics:
(a) per-position logits equal the reference's, over a prompt past several ratio-128
    boundaries and the indexer's selection threshold, fed in ragged passes;
(b) tokens and logprobs equal NumpyBackend's under the shared Engine for random request
    mixes (long ragged prompts, arrivals, cancellations, prompt quanta 1, 16, 256 and the whole
    pass, in passes of up to LONG_PASS_ROWS rows: the server's, every bucket up to 2048 lanes;
    greedy, seeded sampling, penalties), plus a sampled request that forks without the
    canonical arithmetic;
(c) batch invariance: a lane's logits are bitwise identical alone and among 15 others,
    in another slot and on other pages;
(d) one graph capture serves passes across many ratio-4 boundaries while lanes come and go;
(e) the golden greedy continuations through the Engine with the HIP backend;
(f) prompt passes of up to launch.LARGEST_PASS = 4096 rows (every capacity bucket, chunked
    prefill): every row's logits and the stored state are bitwise those of one row a pass,
    whichever other slots' rows share the pass. The kernels a 4096-lane pass runs are the ones
    every pass past 16 lanes runs, over more lane groups; step_expert_list's chunks of lanes
    (1024 at Flash's 256 experts, 32768 at the tiny model's 8) are checked by its op twin.
Skipped with the reason when no GPU runtime opens (tests/gpu/conftest.py).
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ds4ref
from ds4ref.backend import Row, StepPlan
from ds4ref.scheduler.engine import Engine
from ds4ref.reference.numpy_backend import NumpyBackend
from ds4ref.hip.launch import LARGEST_PASS
from ds4ref.scheduler.pass_cost import LONG_PASS_ROWS
from ds4ref.scheduler.request import Request, Sampling, TokenEvent

pytestmark = pytest.mark.gpu
EXAMPLES = int(os.environ.get("DS4REF_GPU_EXAMPLES", "8"))
# the cross-backend property runs in shards, so pytest-xdist can spread its NumPy side
# over the GPU machine's cores: DS4REF_CROSS_SHARDS x DS4REF_CROSS_EXAMPLES per numerics
CROSS_SHARDS = int(os.environ.get("DS4REF_CROSS_SHARDS", "1"))
CROSS_EXAMPLES = int(os.environ.get("DS4REF_CROSS_EXAMPLES", str(EXAMPLES)))
# the prompt-pass property: its NumPy side feeds one row a pass, so it runs in shards too
PREFILL_SHARDS = int(os.environ.get("DS4REF_PREFILL_SHARDS", "3"))
PREFILL_EXAMPLES = int(os.environ.get("DS4REF_PREFILL_EXAMPLES", "3"))
GOLDEN = Path(__file__).parents[1] / "golden"


@pytest.fixture(scope="module", params=["official", "plain"])
def model(request):
    return ds4ref.load(numerics=request.param)


def hip(model, rt, prefill_rows=None):
    from ds4ref.backend import PREFILL_ROWS
    from ds4ref.hip.backend import HipBackend
    return HipBackend(model.config, model.weights, model.numerics, model.tables, runtime=rt,
                      prefill_rows=prefill_rows or PREFILL_ROWS)


def assert_rows_bitwise(got, want, what: str) -> None:
    for p, (a, b) in enumerate(zip(got, want)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        bad = np.flatnonzero(a.view(np.uint32) != b.view(np.uint32))
        assert bad.size == 0, (f"{what}, row {p}: {bad.size} logits differ, first at id {bad[0]}: "
                               f"hip {a[bad[0]]!r} numpy {b[bad[0]]!r}")


def feed(backend, slot: int, tokens, chunks, start: int = 0) -> list[np.ndarray]:
    """Feed tokens to one slot in passes of the given sizes; logits of every row."""
    out, pos, i = [], start, 0
    for n in chunks:
        rows = [Row(slot, pos + j, int(t)) for j, t in enumerate(tokens[i:i + n])]
        if not rows:
            break
        res = backend.step(StepPlan.from_rows(rows, backend.max_pass_rows))
        out += res.logits
        pos, i = pos + len(rows), i + len(rows)
    return out


def ragged(rng, total: int) -> list[int]:
    sizes, left = [], total
    while left > 0:
        n = int(min(left, rng.choice([1, 1, 2, 5, 16])))
        sizes.append(n)
        left -= n
    return sizes


# ---------------------------------------------------------------------------
# (a) logits per position
# ---------------------------------------------------------------------------


def test_logits_bitwise_equal_reference(model, rt):
    """700 positions: five ratio-128 windows, and the indexer selecting among far more
    compressed rows than its top-k, fed in ragged passes of 1..16 rows."""
    rng = np.random.default_rng(1)
    ids = rng.integers(0, model.config.vocab_size, 700)
    want = model.reference.decode_logits(ids)
    b = hip(model, rt)
    b.configure(2, 8)
    b.reset_slot(1)
    b.set_block_table(1, [5, 2, 7, 0, 3, 6])
    got = feed(b, 1, ids, ragged(rng, len(ids)))
    assert len(got) == len(ids)
    assert_rows_bitwise(got, want, f"[{model.numerics}] one slot vs decode_logits")


def test_stored_rows_are_numpys_bytes(model, rt):
    """The state both backends keep after the same 700 ragged positions is the same bytes:
    in official numerics the compact FP8/FP4 rows of docs/paging.md (the device encodes them
    in step_comp_store / step_ring_commit), in plain numerics float32 rows."""
    from ds4ref.reference.state import ATTN, INDEX
    rng = np.random.default_rng(3)
    ids = rng.integers(0, model.config.vocab_size, 700)
    table = [5, 2, 7, 0, 3, 6]
    backends = [hip(model, rt), NumpyBackend(model.reference)]
    for b in backends:
        b.configure(2, 8)
        b.reset_slot(1)
        b.set_block_table(1, table)
        feed(b, 1, ids, ragged(np.random.default_rng(4), len(ids)))
    dev, ref = backends
    assert dev.compact == (model.numerics == "official")
    st = dev.state
    for (il, kind), buf in st.pages.items():
        want = np.ascontiguousarray(ref.pages[(il, kind)]).view(np.uint8).reshape(8, -1)
        got = rt.download(buf, want.shape, np.uint8)
        assert st.row_bytes[kind] * ref.layout.rows_per_page(model.config.ratio(il)) == want.shape[1]
        for page in table:
            assert np.array_equal(got[page], want[page]), f"layer {il} {kind}, page {page}: bytes differ"
    ring = rt.download(st.rings, (2, st.ring_slot_bytes), np.uint8)
    want = np.ascontiguousarray(ref.rings).view(np.uint8).reshape(2, -1)
    assert np.array_equal(ring[1], want[1]), "raw window rings differ"


# ---------------------------------------------------------------------------
# (b) tokens and logprobs under the shared Engine
# ---------------------------------------------------------------------------

def prompt_lengths():
    """Mostly short prompts, often long ones: up to 1100 tokens crosses eight ratio-128
    windows, and past 4 * (top_k + 1) tokens the indexer chooses among compressed rows.
    With quantum 256 a long prompt runs in prompt passes of up to 256 rows; with the whole pass
    (None), prompts share passes of up to 2048 rows."""
    return st.one_of(st.integers(1, 40), st.integers(100, 300), st.integers(500, 1100))


samplings = st.one_of(
    st.just(Sampling()),
    st.builds(Sampling, temperature=st.sampled_from([0.0, 0.7, 1.3]), top_k=st.sampled_from([0, 5]),
              top_p=st.sampled_from([1.0, 0.9]), min_p=st.sampled_from([0.0, 0.05]),
              seed=st.integers(0, 2**31 - 1), presence_penalty=st.sampled_from([0.0, 0.5]),
              frequency_penalty=st.sampled_from([0.0, 0.3]), repetition_penalty=st.sampled_from([1.0, 1.2]),
              logprobs=st.sampled_from([None, 0, 5])))


@st.composite
def request_mixes(draw):
    n = draw(st.integers(1, 16))
    mix = []
    for _ in range(n):
        length = draw(prompt_lengths())
        prompt = draw(st.lists(st.integers(0, 511), min_size=length, max_size=length))
        mix.append((prompt, draw(st.integers(1, 8)), draw(samplings), draw(st.integers(0, 6)),
                    draw(st.one_of(st.none(), st.integers(1, 60)))))
    return mix, draw(st.sampled_from([1, 16, 256, None]))


def numpy_like(model, hip_backend):
    """The NumPy reference with the HIP backend's pass size: arrivals and cancellations are
    given in passes, so both engines must plan the same passes to be compared."""
    return NumpyBackend(model.reference, max_pass_rows=hip_backend.max_pass_rows)


def run_engine(model, backend, mix, quantum, max_context=None):
    reqs = [Request(list(p), n, sampling=smp, ignore_eos=True, req_id=i + 1)
            for i, (p, n, smp, _, _) in enumerate(mix)]
    arrivals = {i: a for i, (_, _, _, a, _) in enumerate(mix)}
    cancels = {i: c for i, (_, _, _, _, c) in enumerate(mix) if c is not None}
    eng = Engine(model, max_concurrency=16, backend=backend, prompt_quantum=quantum, max_context=max_context)
    tokens = eng.run(reqs, arrivals, cancels)
    seen = [(e.req_id, e.token, e.logprob, e.top_logprobs) for e in eng.events if isinstance(e, TokenEvent)]
    return tokens, seen, [(f.reason, f.completion_tokens) for f in eng.finishes]


@pytest.mark.parametrize("shard", range(CROSS_SHARDS))
@settings(max_examples=CROSS_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=request_mixes())
def test_engine_tokens_equal_across_backends(model, rt, shard, case):
    mix, quantum = case
    dev = hip(model, rt, LONG_PASS_ROWS)
    want = run_engine(model, numpy_like(model, dev), mix, quantum)
    got = run_engine(model, dev, mix, quantum)
    dev.close()  # device memory is freed by close(), not by the collector: each example's, at once
    assert got[0] == want[0], "tokens differ"
    assert got[1] == want[1], "token events (logprobs) differ"
    assert got[2] == want[2], "finishes differ"
    log = os.environ.get("DS4REF_CROSS_LOG")  # the device script counts the examples that ran
    if log:
        with open(log, "a") as f:
            f.write(f"{model.numerics}\t{len(mix)}\t{max(len(m[0]) for m in mix)}\t{quantum}\t"
                    f"{sum(len(t) for t in got[0])}\n")


@settings(max_examples=max(2, CROSS_EXAMPLES // 2), deadline=None, suppress_health_check=list(HealthCheck))
@given(case=request_mixes(), max_context=st.sampled_from([1200, 1300]))
def test_a_workspace_sized_by_max_context_gives_the_same_bits(model, rt, case, max_context):
    """Lanes of a small max_context (below the model's 4,096): the block tables, RoPE tables,
    indexer scores and attention slices are sized for it (workspace.lane_context), and the
    tokens and logprobs are the NumPy reference's, as with the model's whole context."""
    mix, quantum = case
    dev = hip(model, rt, LONG_PASS_ROWS)
    want = run_engine(model, numpy_like(model, dev), mix, quantum, max_context)
    got = run_engine(model, dev, mix, quantum, max_context)
    assert dev.at_nz < hip_slices_for_model_context(model, dev), "the small context did not shrink the slices"
    dev.close()
    assert got == want, "a backend sized by max_context differs from the reference"


def hip_slices_for_model_context(model, dev) -> int:
    from ds4ref.hip.workspace import attention_slices
    return attention_slices(model.config, -(-model.config.context_length // dev.state.page_tokens),
                            dev.state.page_tokens)


def test_a_sampled_long_prompt_agrees(model, rt):
    """A request that forks between the backends in official numerics without the canonical
    arithmetic (docs/exactness.md): a 257-token prompt (random.Random(7)'s 12th draw, lengths drawn in order), sampled."""
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 2, 5, 31, 64, 127, 128, 129, 200, 255, 256, 257)]
    smp = Sampling(temperature=0.9, top_p=0.95, seed=1245, logprobs=5)
    mix = [(prompts[-1], 24, smp, 0, None)]
    dev = hip(model, rt)
    want = run_engine(model, numpy_like(model, dev), mix, 1)
    got = run_engine(model, dev, mix, 1)
    assert got == want


# ---------------------------------------------------------------------------
# (c) batch invariance
# ---------------------------------------------------------------------------


def test_lane_bitwise_alone_and_among_16(model, rt):
    rng = np.random.default_rng(7)
    ids = rng.integers(0, 512, 140)
    chunks = ragged(rng, len(ids))
    alone = hip(model, rt)
    alone.configure(16, 40)
    alone.reset_slot(0)
    alone.set_block_table(0, [0, 1])
    want = feed(alone, 0, ids, chunks)

    crowd = hip(model, rt)
    crowd.configure(16, 40)
    pages = list(rng.permutation(40))
    target = 11
    for s in range(16):
        crowd.reset_slot(s)
        crowd.set_block_table(s, [int(pages.pop()) for _ in range(2)])
    others = {s: rng.integers(0, 512, 200) for s in range(16) if s != target}
    pos = {s: 0 for s in range(16)}
    got, i = [], 0
    for n in chunks:
        mine = [Row(target, pos[target] + j, int(t)) for j, t in enumerate(ids[i:i + n])]
        rest = []
        for s in rng.permutation(sorted(others)):  # the other lanes, in a random slot order
            if len(mine) + len(rest) == 16:
                break
            rest.append(Row(int(s), pos[int(s)], int(others[int(s)][pos[int(s)]])))
        at = int(rng.integers(0, len(rest) + 1))  # the target's rows land on varying lanes
        plan = rest[:at] + mine + rest[at:]
        res = crowd.step(StepPlan.from_rows(plan))
        got += [lg for r, lg in zip(plan, res.logits) if r.slot == target]
        for r in plan:
            pos[r.slot] += 1
        i += n
    assert len(got) == len(want)
    for p, (a, b) in enumerate(zip(got, want)):
        assert np.array_equal(a, b), f"position {p}: logits differ alone vs among 16 (max {np.abs(a - b).max():.2e})"


# ---------------------------------------------------------------------------
# (d) one capture across boundaries, joins and leaves
# ---------------------------------------------------------------------------


def test_one_capture_across_boundaries(model, rt):
    rng = np.random.default_rng(3)
    b, ref = hip(model, rt), NumpyBackend(model.reference)
    for x in (b, ref):
        x.configure(8, 32)
    pos = {}
    passes = 0
    for step in range(48):  # slot 0 lives throughout: 12 ratio-4 boundaries, others come and go
        if step % 7 == 0:  # lanes leave, others join
            leave = [s for s in pos if s and rng.random() < 0.5]
            for s in leave:
                del pos[s]
            for s in [s for s in range(8) if s not in pos][: 1 + step % 3]:
                for x in (b, ref):
                    x.reset_slot(s)
                    x.set_block_table(s, [4 * s, 4 * s + 1])
                pos[s] = 0
        rows = [Row(s, p, int(rng.integers(0, 512))) for s, p in pos.items()]
        res_b, res_r = b.step(StepPlan.from_rows(rows)), ref.step(StepPlan.from_rows(rows))
        passes += 1
        assert_rows_bitwise(res_b.logits, res_r.logits, f"pass {step}")
        for s in pos:
            pos[s] += 1
    assert pos[0] == 48
    print(f"\n{passes} passes, capture_count {b.capture_count}, replays {b.replay_count}")
    assert b.capture_count == 1
    assert b.replay_count == passes


# ---------------------------------------------------------------------------
# (e) golden continuations through the Engine on the HIP backend
# ---------------------------------------------------------------------------


def test_golden_greedy_on_hip(model, rt):
    g = json.loads((GOLDEN / f"tiny_{model.numerics}.json").read_text())
    reqs = [Request(c["prompt"], len(c["greedy"]), ignore_eos=True) for c in g["cases"]]
    outs = Engine(model, max_concurrency=16, backend=hip(model, rt)).run(reqs)
    want = [model.reference.generate(c["prompt"], len(c["greedy"])) for c in g["cases"]]
    assert outs == want, "greedy tokens differ from the float32 reference's"


# ---------------------------------------------------------------------------
# (f) prompt passes: every bucket up to LARGEST_PASS (4096) lanes
# ---------------------------------------------------------------------------


@st.composite
def prompt_passes(draw):
    """A prompt and the pass sizes it is fed in, with the other slots' rows per pass."""
    length = draw(st.integers(300, 1100))
    sizes, left = [], length
    while left > 0:
        n = min(left, draw(st.sampled_from([1, 3, 16, 17, 100, 129, 255, 256, 257, 700, 1024, LONG_PASS_ROWS])))
        crowd = draw(st.integers(0, LARGEST_PASS - n))
        sizes.append((n, crowd))
        left -= n
    return length, sizes, draw(st.integers(0, 2**32 - 1))


@pytest.mark.parametrize("shard", range(PREFILL_SHARDS))
@settings(max_examples=PREFILL_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=prompt_passes())
def test_prompt_pass_rows_equal_one_row_a_pass(model, rt, shard, case):
    """A prompt fed in passes of up to LARGEST_PASS (4096) rows, among other slots' prompt rows and
    decode rows on random lanes and pages, gives every row the logits of decode_logits (one row a
    pass) and leaves the same stored bytes as NumpyBackend fed one row a pass."""
    length, sizes, seed = case
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, model.config.vocab_size, length)
    want = model.reference.decode_logits(ids)
    n_slots, n_pages, target, n_table = 6, 128, 4, 18
    b = hip(model, rt, LARGEST_PASS)
    b.configure(n_slots, n_pages)
    pages = [int(p) for p in rng.permutation(n_pages)]
    tables = {s: [pages.pop() for _ in range(n_table)] for s in range(n_slots)}  # 2304 positions each
    for s in range(n_slots):
        b.reset_slot(s)
        b.set_block_table(s, tables[s])
    others = {s: rng.integers(0, 512, n_table * 128) for s in range(n_slots) if s != target}
    pos = {s: 0 for s in range(n_slots)}
    got, i, passes = [], 0, 0
    for n, crowd in sizes:
        mine = [Row(target, i + j, int(t)) for j, t in enumerate(ids[i:i + n])]
        rest = []
        for s in rng.permutation(sorted(others)):
            s = int(s)
            k = min(int(rng.integers(1, crowd + 2)), crowd - len(rest), n_table * 128 - pos[s])
            rest += [Row(s, pos[s] + j, int(others[s][pos[s] + j]), False, j == k - 1) for j in range(max(k, 0))]
        at = int(rng.integers(0, len(rest) + 1))
        plan = rest[:at] + mine + rest[at:]
        res = b.step(StepPlan.from_rows(plan, b.max_pass_rows))
        passes += 1
        got += [lg for r, lg in zip(plan, res.logits) if r.slot == target]
        for r in plan:
            pos[r.slot] += 1
        i += n
    assert len(got) == length
    assert_rows_bitwise(got, want, f"[{model.numerics}] prompt passes of up to {LARGEST_PASS} rows vs decode_logits")
    assert b.capture_count <= len(b.buckets) and b.replay_count == passes

    ref = NumpyBackend(model.reference)
    ref.configure(n_slots, n_pages)
    ref.reset_slot(target)
    ref.set_block_table(target, tables[target])
    feed(ref, target, ids, [1] * length)
    st_ = b.state
    for (il, kind), buf in st_.pages.items():
        want_b = np.ascontiguousarray(ref.pages[(il, kind)]).view(np.uint8).reshape(n_pages, -1)
        got_b = rt.download(buf, want_b.shape, np.uint8)
        for page in tables[target][: -(-length // 128)]:
            assert np.array_equal(got_b[page], want_b[page]), f"layer {il} {kind}, page {page}: bytes differ"
    ring = rt.download(st_.rings, (n_slots, st_.ring_slot_bytes), np.uint8)
    want_r = np.ascontiguousarray(ref.rings).view(np.uint8).reshape(n_slots, -1)
    b.close()
    assert np.array_equal(ring[target], want_r[target]), "raw window rings differ"


def test_prefix_cache_turns_equal_numpy_from_scratch(model, rt):
    """The prefix cache on the device: three turns of one conversation, each later turn
    resuming from cached pages and a device snapshot of the slot's ring and compressors,
    give NumpyBackend's tokens and logprobs computed from token 0, bit for bit."""
    V = model.config.vocab_size
    rng = np.random.default_rng(7)
    cached = Engine(model, max_concurrency=2, backend=hip(model, rt))
    cached.seq_engine.snapshot_every = 1

    def bits(engine, req):
        out = engine.run([req])[0]
        lps = [np.float32(e.logprob).view(np.uint32).item() for e in engine.events if isinstance(e, TokenEvent)]
        return out, lps, engine.finishes[0].reason

    prompt = rng.integers(2, V, 300).tolist()
    for turn in range(3):
        req = lambda: Request(list(prompt), 20, sampling=Sampling(temperature=0.8, seed=turn, logprobs=1),  # noqa: E731
                              ignore_eos=True)
        got = bits(cached, req())
        assert (cached.finishes[0].cached_tokens > 0) == (turn > 0)
        want = bits(Engine(model, max_concurrency=1, backend=NumpyBackend(model.reference), prefix_cache=False),
                    req())
        assert got == want, f"turn {turn}"
        prompt = prompt + got[0] + rng.integers(2, V, 150).tolist()
    assert cached.seq_engine.stats()["prefix_hits"] == 2
    assert cached.seq_engine.stats()["prefix_tail_hits"] == 2  # each turn ended mid-page: copy_page on the device
