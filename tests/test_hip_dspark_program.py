"""HipBackend's DSpark drafts without a GPU (hip/dspark.py): the feed and draft programs recorded
on a runtime that runs nothing (every launch checked against its kernel's parameters), the
weights they read, the taps the main pass writes, and the pure planning of a draft call. The
drafts' bits against the reference: tests/gpu/test_hip_dspark.py."""
from __future__ import annotations

import fnmatch

import numpy as np
import pytest

import ds4ref
from ds4ref.backend import DraftRequest, Row, StepPlan
from ds4ref.gguf.dspark import dspark_tensor_shapes
from ds4ref.harness.op_cases import CASES
from ds4ref.hip.backend import HipBackend
from ds4ref.hip.dspark import (block_pass, dspark_device_names, feed_pass, request_capacity, request_lanes,
                               state_config)
from ds4ref.hip import buffers
from test_hip_program import Buf, RecordingRuntime
from test_op_cases import END_TO_END


class View(Buf):
    """A view that remembers where it looks (its buffer and offset), so launches can be told apart."""

    def __init__(self, buf, off: int, n: int):
        super().__init__(n)
        self.at = (id(getattr(buf, "base", buf)), getattr(buf, "off", 0) + off)
        self.base, self.off = getattr(buf, "base", buf), getattr(buf, "off", 0) + off


@pytest.fixture
def rt(monkeypatch):
    def view(buf, off, n):
        if off + n > buf.nbytes:
            pytest.fail(f"view [{off}, {off + n}) past a buffer of {buf.nbytes} bytes")
        return View(buf, off, n)
    monkeypatch.setattr(buffers, "view", view)
    return RecordingRuntime()


def at(buf):
    return getattr(buf, "at", None)


@pytest.fixture(scope="module", params=["official", "plain"])
def model(request, tiny_0731):
    return ds4ref.load(tiny_0731[0], numerics=request.param, dspark=tiny_0731[1])


def backend_with_dspark(model, rt, n_slots=4, n_pages=16):
    b = HipBackend(model.config, model.weights, model.numerics, model.tables, runtime=rt,
                   mtp=model.mtp_weights, dspark=model.dspark.weights)
    b.configure(n_slots, n_pages)
    return b


def test_device_names_cover_the_draft(model):
    """Every draft tensor the device runs is one of the draft's; the confidence head is the
    only one it leaves (the official code does not cut drafts by it)."""
    stages, dcfg = model.dspark.stages, model.dspark.config
    names = dspark_device_names(stages, dcfg)
    left = set(dspark_tensor_shapes(model.config, dcfg)) - set(names.values())
    assert left == {"mtp.2.confidence_head.proj.weight"}
    assert names["blk.1.attn_kv.weight"] == "mtp.1.attn_kv.weight" and names["output_norm.weight"] == \
        "mtp.2.norm.weight" and names["output_hc_fn.weight"] == "mtp.2.hc_head_fn.weight"


def test_programs_record_the_draft(model, rt):
    b = backend_with_dspark(model, rt)
    ds, W, B = b.dspark, model.config.sliding_window, model.dspark.config.block_size
    assert b.mtp is None and b.drafter is ds and b.max_draft_tokens == B
    assert ds.cfg.sliding_window == W + B and ds.cfg.n_layer == 3 and set(ds.cfg.compress_ratios) == {0}
    assert ds.state.cfg.sliding_window == W + B  # its rings hold the window and a block
    for programs in (ds.feed_programs, ds.draft_programs):
        assert sorted(programs) == list(b.buckets)
        for program in programs.values():
            for kernel, _grid, _block, args, _shared in program.ops:
                kernel.signature.check(args)
    feed = [k.name for k, *_ in ds.feed_programs[16].ops]
    assert feed[0] == "step_gather_rows" and feed.count("step_ring_commit") == 3
    assert "step_attention_split" not in feed and "ds4_argmax" not in feed
    draft = ds.draft_programs[16].ops
    names = [k.name for k, *_ in draft]
    assert names[0] == "step_embed" and "step_ring_commit" not in names, "a draft leaves no state"
    assert names.count("step_attention_split") == 3 and names.count("step_markov_add") == B
    assert names.count("ds4_argmax") == B + 1  # the head's, then the chain's
    # a block row's keys end at its slot's last row: split's `pos` and combine's `kend` are `last`
    last, pos = at(ds.state.lane("last")), at(ds.state.lane("pos"))
    assert last != pos
    splits = [args for k, _g, _b, args, _s in draft if k.name == "step_attention_split"]
    combines = [args for k, _g, _b, args, _s in draft if k.name == "step_attention_combine"]
    assert len(splits) == len(combines) == 3
    assert all(at(a[13]) == last for a in splits)
    assert all(at(a[5]) == pos and at(a[6]) == last for a in combines)
    main = b.programs[16].ops
    assert all(args[6] is None for k, _g, _b, args, _s in main if k.name == "step_attention_combine")
    assert all(at(args[13]) == at(b.state.lane("pos")) for k, _g, _b, args, _s in main
               if k.name == "step_attention_split")
    # the main pass writes the stream means after each tapped layer into the draft's taps rows
    taps = [args for k, _g, _b, args, _s in b.programs[16].ops if k.name == "step_stream_mean"]
    d = model.config.n_embd
    assert [int(a[6]) for a in taps] == [0, d, 2 * d] and all(a[4] is ds.taps_rows for a in taps)
    assert [i for i, (k, *_) in enumerate(b.programs[16].ops) if k.name == "step_stream_mean"] == sorted(
        i for i, (k, *_) in enumerate(b.programs[16].ops) if k.name == "step_stream_mean")
    # the shared tensors are the main model's buffers; the hc head is the draft's own
    assert ds.w.tensor("output.weight") is b.w.tensor("output.weight")
    assert ds.w.tensor("token_embd.weight") is b.w.tensor("token_embd.weight")
    assert ds.w.mat("output_hc_fn.weight").buf is not b.w.mat("output_hc_fn.weight").buf
    assert not ds.w.tensor("mtp.2.markov_head.markov_w1.weight").packed  # read by rows
    ran = {k.name for p in (*ds.feed_programs.values(), *ds.draft_programs.values()) for k, *_ in p.ops}
    twinned = {n for n in ran if any(fnmatch.fnmatch(n, pat) for c in CASES for pat in c.kernels)}
    assert ran - twinned <= END_TO_END, sorted(ran - twinned - END_TO_END)
    assert {"step_markov_gather", "step_markov_add"} <= twinned
    assert any(c.kernels == ("step_stream_mean",) for c in CASES)


def test_draft_plans():
    streams_at = {(0, 5): 3, (0, 6): 4, (0, 7): 5, (2, 0): 0, (3, 9): 1}
    fed = np.array([6, 0, 0, 9])
    reqs = [DraftRequest(0, (6, 7), (11, 12), 3), DraftRequest(2, (0,), (13,), 0), DraftRequest(3, (9,), (14,), 5)]
    p = feed_pass(reqs, streams_at, fed, 4, 100)
    assert [(r.slot, r.position) for r in p.rows] == [(0, 6), (0, 7), (2, 0), (3, 9)] and p.src == [4, 5, 0, 1]
    after = np.array([8, 0, 1, 10])
    q = block_pass(reqs, after, 5, 99)
    assert [(r.slot, r.position, r.token, r.emit) for r in q.rows] == \
        [(0, 8 + j, 12 if j == 0 else 99, True) for j in range(5)] + [(3, 10 + j, 14 if j == 0 else 99, True)
                                                                        for j in range(5)]
    assert q.slots == [0, 3] and q.anchors == [12, 14] and q.owner == [0, 2]
    with pytest.raises(ValueError, match="context row at position 6, but slot 0's draft state is at 5"):
        feed_pass(reqs, streams_at, np.array([5, 0, 0, 9]), 4, 100)
    with pytest.raises(ValueError, match="position 7 was not a row of the last step"):
        feed_pass([DraftRequest(0, (6, 7), (1, 2), 1)], {(0, 6): 0}, fed, 4, 100)
    with pytest.raises(ValueError, match="6 drafts asked, DSpark proposes at most 5"):
        block_pass([DraftRequest(0, (6,), (1,), 6)], after, 5, 99)
    with pytest.raises(ValueError, match="after at least one context row"):
        block_pass([DraftRequest(1, (), (), 1)], np.zeros(4, int), 5, 99)
    # the Markov chain's lanes: a bucket's blocks in whole lane groups, at most the capacity
    assert request_capacity(4, 1024, 5) == 16 and request_capacity(40, 1024, 5) == 48
    assert request_capacity(300, 256, 5) == 64
    assert [request_lanes(L, 5, 48) for L in (16, 32, 128, 1024)] == [16, 16, 32, 48]


def test_a_draft_call_runs_feed_then_block(model, rt):
    """One step, then draft(): the feed program over the fed rows, then the draft program in the
    bucket of its blocks; the fed positions advance, a snapshot carries them, and a draft before
    any step is refused."""
    b = backend_with_dspark(model, rt)
    for s in range(2):
        b.reset_slot(s)
        b.set_block_table(s, [4 * s, 4 * s + 1])
    with pytest.raises(RuntimeError, match="needs the streams of the last step"):
        b.draft([DraftRequest(0, (0,), (1,), 1)])
    b.step(StepPlan.from_rows([Row(0, p, 5 + p) for p in range(20)] + [Row(1, 0, 7)], b.max_pass_rows))
    ds = b.dspark
    before = len(rt.launches)
    out = b.draft([DraftRequest(0, tuple(range(20)), tuple(range(6, 26)), 4), DraftRequest(1, (0,), (9,), 2)])
    ran = [h for h, _ in rt.launches[before:]]
    assert len(ran) == len(ds.feed_programs[32].ops) + len(ds.draft_programs[16].ops)
    assert [len(d) for d in out] == [4, 2] and all(d.dtype == np.int32 for d in out)
    assert list(ds.fed[:2]) == [20, 1]
    sid = b.save_state(0)
    assert b._draft_snapshots[sid] in ds.state.snapshots and ds.fed[0] == 20
    b.reset_slot(0)
    assert ds.fed[0] == 0
    b.load_state(0, sid, [0, 1])
    assert ds.fed[0] == 20
    b.drop_state(sid)
    assert not ds.state.snapshots
    b.step(StepPlan.from_rows([Row(0, 20, 3)], b.max_pass_rows))
    with pytest.raises(ValueError, match="context row at position 19, but slot 0's draft state is at 20"):
        b.draft([DraftRequest(0, (19,), (3,), 1)])
