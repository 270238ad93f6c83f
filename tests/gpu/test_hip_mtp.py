"""HipBackend's speculation methods on the embedded tiny model (its random MTP block), bitwise
against the NumPy reference, in both numerics (marker gpu):

(a) draft(): every draft token and every draft's logits equal reference/mtp.py's MTP.rows fed
    the reference model's final streams (Model.step_rows(hidden=True)), over rounds of several
    slots with several rows each (a 40-row prompt chunk among them: the 64-lane bucket), k up
    to 4, past several sliding windows of the MTP layer;
(b) restore_state(): save_state, passes across ratio-4 and ratio-128 boundaries, restore_state,
    then other tokens give the logits of never having fed the first ones; restore_state keeping
    a round's first rows gives those of having fed only them (hypothesis); and a slot loaded from
    a snapshot (the prefix cache) drafts as the slot it was taken from (the MTP ring travels with it);
(c) the property behind (a): hypothesis draws slots, row counts and k per round.
Skipped with the reason when no GPU runtime opens (tests/gpu/conftest.py).
"""
from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ds4ref
from ds4ref.backend import DraftRequest, Row, StepPlan
from tests.test_speculative import draw_kept_rows_case, kept_rows_against_fed_rows, kept_rows_cases

pytestmark = pytest.mark.gpu
EXAMPLES = int(os.environ.get("DS4REF_GPU_EXAMPLES", "8"))


@pytest.fixture(scope="module", params=["official", "plain"])
def model(request):
    m = ds4ref.load(numerics=request.param)
    assert m.mtp is not None, "the embedded tiny model carries a random MTP block"
    return m


def hip(model, rt, n_slots=4, n_pages=24):
    from ds4ref.hip.backend import HipBackend
    b = HipBackend(model.config, model.weights, model.numerics, model.tables, runtime=rt, mtp=model.mtp_weights)
    b.configure(n_slots, n_pages)
    return b


def assert_bitwise(got, want, what: str) -> None:
    a, b = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert a.shape == b.shape, f"{what}: shapes {a.shape} vs {b.shape}"
    bad = np.flatnonzero(a.view(np.uint32).ravel() != b.view(np.uint32).ravel())
    assert bad.size == 0, f"{what}: {bad.size} values differ, first at {bad[0]}: hip {a.ravel()[bad[0]]!r} " \
                          f"numpy {b.ravel()[bad[0]]!r}"


class Twin:
    """The HIP backend and the reference fed the same rows: per slot the reference keeps a main
    SeqState and an MTPState, and the final streams of the last step's rows."""

    def __init__(self, model, rt, slots, pages_per_slot=5):
        n = max(slots) + 1
        self.model, self.b = model, hip(model, rt, n_slots=n, n_pages=n * pages_per_slot)
        self.states, self.mstates, self.pos = {}, {}, {}
        for s in slots:
            self.b.reset_slot(s)
            self.b.set_block_table(s, list(range(s * pages_per_slot, (s + 1) * pages_per_slot)))
            self.states[s], self.mstates[s], self.pos[s] = model.reference.new_state(), model.mtp.new_state(), 0
        self.streams: dict[tuple[int, int], np.ndarray] = {}

    def step(self, feed: dict[int, list[int]]) -> None:
        """feed: slot -> its tokens this pass (consecutive rows from where it is)."""
        rows = [Row(s, self.pos[s] + j, int(t)) for s, toks in feed.items() for j, t in enumerate(toks)]
        res = self.b.step(StepPlan.from_rows(rows, self.b.max_pass_rows))
        want, hidden = self.model.reference.step_rows([self.states[r.slot] for r in rows], [r.token for r in rows],
                                                      [r.position for r in rows], hidden=True)
        for i, r in enumerate(rows):
            assert_bitwise(res.logits[i], want[i], f"main logits, slot {r.slot} position {r.position}")
        self.streams = {(r.slot, r.position): hidden[i] for i, r in enumerate(rows)}
        for s, toks in feed.items():
            self.pos[s] += len(toks)

    def reference_drafts(self, requests):
        """Per request (k drafts, their logits (k, vocab)), by MTP.rows: all requests' rows in one
        call, then one call per further draft step, as the device runs them."""
        mtp = self.model.mtp
        rows = [(q, j) for q in requests for j in range(len(q.positions))]
        logits, out = mtp.rows([self.mstates[q.slot] for q, _ in rows],
                               np.stack([self.streams[(q.slot, q.positions[j])] for q, j in rows]),
                               [q.next_tokens[j] for q, j in rows], [q.positions[j] for q, j in rows])
        last = dict(zip([q.slot for q in requests], np.cumsum([len(q.positions) for q in requests]) - 1))
        drafts = {q.slot: [] for q in requests}
        dlogits = {q.slot: [] for q in requests}
        prev = {q.slot: (logits[last[q.slot]], out[last[q.slot]]) for q in requests if q.k >= 1}
        # chained steps leave the MTP window as the fed rows left it (backend.DraftRequest)
        kept = {q.slot: self.mstates[q.slot].save() for q in requests if q.k > 1}
        for step in range(max(q.k for q in requests)):
            active = [q for q in requests if q.k > step]
            for q in active:
                lg = prev[q.slot][0]
                drafts[q.slot].append(int(np.argmax(lg)))  # lower index wins ties
                dlogits[q.slot].append(lg)
            nxt = [q for q in active if q.k > step + 1]
            if not nxt:
                break
            lg, st_out = mtp.rows([self.mstates[q.slot] for q in nxt], np.stack([prev[q.slot][1] for q in nxt]),
                                  [drafts[q.slot][-1] for q in nxt], [q.positions[-1] + step + 1 for q in nxt])
            prev = {q.slot: (lg[i], st_out[i]) for i, q in enumerate(nxt)}
        for slot, snap in kept.items():
            self.mstates[slot].load(snap)
        return [(drafts[q.slot], dlogits[q.slot]) for q in requests]

    def draft_and_compare(self, requests, what: str):
        got, got_logits = self.b.draft_with_logits(requests, want_logits=True)
        want = self.reference_drafts(requests)
        for q, d, lg, (wd, wlg) in zip(requests, got, got_logits, want):
            assert d.dtype == np.int32 and len(d) == q.k
            for j in range(q.k):
                assert_bitwise(lg[j], wlg[j], f"{what}: slot {q.slot} draft {j} logits")
            assert d.tolist() == wd, f"{what}: slot {q.slot} drafts {d.tolist()} vs reference {wd}"
        return got


def run_rounds(model, rt, rounds, seed: int) -> None:
    """rounds: list of {slot: (n rows, k)}; each round one pass of those rows, then one draft
    call over them with the given k (the slot's next token teacher-forced from a random stream)."""
    rng = np.random.default_rng(seed)
    V = model.config.vocab_size
    slots = sorted({s for r in rounds for s in r})
    tw = Twin(model, rt, slots)
    nxt = {s: int(rng.integers(0, V)) for s in slots}  # the token each slot feeds next
    for i, rnd in enumerate(rounds):
        feed = {}
        for s, (n, _k) in rnd.items():
            feed[s] = [nxt[s]] + [int(t) for t in rng.integers(0, V, n - 1)]
        tw.step(feed)
        requests = []
        for s, (n, k) in rnd.items():
            nxt[s] = int(rng.integers(0, V))
            start = tw.pos[s] - n
            requests.append(DraftRequest(s, tuple(range(start, start + n)), tuple(feed[s][1:]) + (nxt[s],), k))
        tw.draft_and_compare(requests, f"[{model.numerics}] round {i}")


# ---------------------------------------------------------------------------
# (a) drafts and their logits
# ---------------------------------------------------------------------------


def test_drafts_bitwise_equal_reference(model, rt):
    rng = np.random.default_rng(11)
    rounds = [{0: (40, 0), 1: (3, 2), 2: (1, 4)}]  # a prompt chunk: the 64-lane bucket
    for _ in range(24):  # ~70 positions a slot: the MTP layer's window (16) wraps several times
        rnd = {s: (int(rng.integers(1, 6)), int(rng.integers(0, 5))) for s in (0, 1, 2) if rng.random() < 0.8}
        rounds.append(rnd or {0: (1, 4)})
    run_rounds(model, rt, rounds, seed=12)


def test_draft_once_per_step_and_absent_without_mtp(model, rt):
    from ds4ref.hip.backend import HipBackend
    tw = Twin(model, rt, [0])
    tw.step({0: [5, 6, 7]})
    req = [DraftRequest(0, (1, 2), (7, 9), 2)]
    tw.draft_and_compare(req, "first draft")
    with pytest.raises(RuntimeError, match="once after each step"):
        tw.b.draft(req)
    tw.step({0: [9]})
    with pytest.raises(ValueError, match="not a row of the last step"):
        tw.b.draft([DraftRequest(0, (2, 3), (9, 1), 1)])
    plain = HipBackend(model.config, model.weights, model.numerics, model.tables,
                       runtime=rt, device_weights=tw.b.w)
    assert not hasattr(plain, "draft") and hasattr(plain, "restore_state")


# ---------------------------------------------------------------------------
# (b) restore_state, and the MTP ring in prefix-cache snapshots
# ---------------------------------------------------------------------------


def test_restore_state_equals_never_having_fed(model, rt):
    """Slot 0 feeds a prompt, snapshots at 126, feeds 7 tokens (past ratio-4 and ratio-128
    boundaries), restores, feeds 6 others; slot 1 feeds the prompt and the 6 others only."""
    rng = np.random.default_rng(5)
    V = model.config.vocab_size
    prompt, detour, other = (rng.integers(0, V, n).tolist() for n in (126, 7, 6))
    b = hip(model, rt, n_slots=2, n_pages=8)
    for s in (0, 1):
        b.reset_slot(s)
        b.set_block_table(s, [4 * s, 4 * s + 1])
    for s in (0, 1):
        b.step(StepPlan.from_rows([Row(s, p, t, False, False) for p, t in enumerate(prompt)], b.max_pass_rows))
    snap = b.save_state(0)
    at = 126
    for n in (1, 1, 1, 1, 3):  # positions 126..132, one row a pass then a 3-row pass
        b.step(StepPlan.from_rows([Row(0, at + j, detour[at - 126 + j]) for j in range(n)], b.max_pass_rows))
        at += n
    b.restore_state(0, snap)
    got = b.step(StepPlan.from_rows([Row(0, 126 + j, t) for j, t in enumerate(other)], b.max_pass_rows)).logits
    want = b.step(StepPlan.from_rows([Row(1, 126 + j, t) for j, t in enumerate(other)], b.max_pass_rows)).logits
    for j, (a, w) in enumerate(zip(got, want)):
        assert_bitwise(a, w, f"[{model.numerics}] position {126 + j} after restore_state")
    b.drop_state(snap)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kept_rows_cases)
def test_restore_state_keeping_rows_equals_feeding_only_them(model, rt, case):
    """A round's snapshot, its pass (a 16-lane bucket, which the round log covers), restore_state
    keeping the accepted rows by committing them again: the slot is as feeding only those rows
    left it, bit for bit in the logits that follow (tests/test_speculative.py: the reference)."""
    prompt, detour, keep, other = draw_kept_rows_case(case, model.config.vocab_size)
    kept, got, want = kept_rows_against_fed_rows(hip(model, rt, n_slots=2, n_pages=6), prompt, detour, keep, other)
    assert kept == keep
    for j, (a, w) in enumerate(zip(got, want)):
        assert_bitwise(a, w, f"[{model.numerics}] row {j} after keeping {keep} of {len(detour)} rows")


def test_loaded_snapshot_drafts_as_its_source(model, rt):
    """Slot 0 feeds 128 positions and the MTP block all of them, snapshots; slot 1 loads the
    snapshot with slot 0's page: the same next row and drafts, bit for bit."""
    rng = np.random.default_rng(9)
    V = model.config.vocab_size
    ids = rng.integers(0, V, 130).tolist()
    b = hip(model, rt, n_slots=2, n_pages=6)
    b.reset_slot(0)
    b.set_block_table(0, [0, 1])
    b.reset_slot(1)
    for at in range(0, 128, 32):
        b.step(StepPlan.from_rows([Row(0, at + j, ids[at + j]) for j in range(32)], b.max_pass_rows))
        b.draft([DraftRequest(0, tuple(range(at, at + 32)), tuple(ids[at + 1:at + 33]), 0)])
    snap = b.save_state(0)
    b.load_state(1, snap, [0])
    b.set_block_table(1, [0, 2])
    out = []
    for s in (0, 1):
        res = b.step(StepPlan.from_rows([Row(s, 128, ids[128])], b.max_pass_rows))
        drafts, logits = b.draft_with_logits([DraftRequest(s, (128,), (ids[129],), 3)], want_logits=True)
        out.append((res.logits[0], drafts[0], logits[0]))
    (la, da, ga), (lb, db, gb) = out
    assert_bitwise(la, lb, "main logits at 128, source vs loaded slot")
    assert da.tolist() == db.tolist()
    for j in range(3):
        assert_bitwise(ga[j], gb[j], f"draft {j} logits, source vs loaded slot")


# ---------------------------------------------------------------------------
# (c) the property: random rounds against the reference MTP
# ---------------------------------------------------------------------------


@st.composite
def draft_rounds(draw):
    n_slots = draw(st.integers(1, 3))
    rounds = []
    for _ in range(draw(st.integers(1, 12))):
        rnd = {}
        for s in range(n_slots):
            if draw(st.booleans()) or s == 0:
                rnd[s] = (draw(st.sampled_from([1, 1, 2, 3, 5, 17])), draw(st.integers(0, 4)))
        rounds.append(rnd)
    return rounds, draw(st.integers(0, 2**31 - 1))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=draft_rounds())
def test_drafts_property(model, rt, case):
    rounds, seed = case
    run_rounds(model, rt, rounds, seed)


def test_drafts_equal_numpy_backend(model, rt):
    """The protocol end to end on both backends: the same passes and draft calls (chained steps
    past the MTP window's wrap, so the window they must leave alone is read again) give the same
    main logits and the same drafts."""
    from ds4ref.reference.numpy_backend import NumpyBackend
    rng = np.random.default_rng(21)
    V = model.config.vocab_size
    npb = NumpyBackend(model.reference, mtp=model.mtp)
    npb.configure(2, 12)
    hb = hip(model, rt, n_slots=2, n_pages=12)
    for b in (npb, hb):
        for s in (0, 1):
            b.reset_slot(s)
            b.set_block_table(s, list(range(6 * s, 6 * s + 6)))
    pos, nxt = {0: 0, 1: 0}, {0: 1, 1: 2}
    for i in range(30):
        rows, feed = [], {}
        for s in (0, 1):
            n = int(rng.integers(1, 6))
            feed[s] = [nxt[s]] + rng.integers(0, V, n - 1).tolist()
            rows += [Row(s, pos[s] + j, t) for j, t in enumerate(feed[s])]
        plan = StepPlan.from_rows(rows, 256)
        a, h = npb.step(plan), hb.step(plan)
        for j, r in enumerate(rows):
            assert_bitwise(h.logits[j], a.logits[j], f"[{model.numerics}] round {i} slot {r.slot} position {r.position}")
        requests = []
        for s in (0, 1):
            nxt[s] = int(rng.integers(0, V))
            n = len(feed[s])
            requests.append(DraftRequest(s, tuple(range(pos[s], pos[s] + n)), tuple(feed[s][1:]) + (nxt[s],),
                                         int(rng.integers(0, 5))))
            pos[s] += n
        want, got = npb.draft(requests), hb.draft(requests)
        assert [w.tolist() for w in want] == [g.tolist() for g in got], f"[{model.numerics}] round {i} drafts"
