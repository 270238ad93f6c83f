"""HipBackend's MTP drafts without a GPU (hip/mtp.py): the MTP pass recorded on a runtime that
runs nothing (every launch checked against its kernel's parameters), the weights it reads, the
pure planning of a draft call into passes, and the bookkeeping of draft / snapshots. The drafts'
bits against the reference: tests/gpu/test_hip_mtp.py."""
from __future__ import annotations

import fnmatch

import numpy as np
import pytest

import ds4ref
from ds4ref.backend import DraftRequest, Row, StepPlan
from ds4ref.gguf.mtp import mtp_tensor_shapes
from ds4ref.hip.backend import HipBackend
from ds4ref.hip.device_state import LANE_FIELDS
from ds4ref.hip.device_weights import mtp_device_names
from ds4ref.hip.mtp import first_pass, last_position, next_pass
from ds4ref.harness.op_cases import CASES
from test_hip_program import rt  # noqa: F401 - the fixture
from test_op_cases import END_TO_END


@pytest.fixture(scope="module", params=["official", "plain"])
def model(request):
    return ds4ref.load(numerics=request.param)


def backend_with_mtp(model, rt, n_slots=4, n_pages=16):
    b = HipBackend(model.config, model.weights, model.numerics, model.tables, runtime=rt, mtp=model.mtp_weights)
    b.configure(n_slots, n_pages)
    return b


def test_device_names_cover_the_block(model):
    mcfg = model.mtp.config
    names = mtp_device_names(mcfg)
    assert sorted(names.values()) == sorted(mtp_tensor_shapes(mcfg))
    assert names["output_hc_fn.weight"] == "mtp.0.hc_head_fn.weight" and names["blk.0.attn_kv.weight"] == \
        "mtp.0.attn_kv.weight" and names["output_norm.weight"] == "mtp.0.norm.weight"


def test_mtp_pass_records_one_sliding_window_layer(model, rt):
    b = backend_with_mtp(model, rt)
    m = b.mtp
    assert sorted(m.programs) == list(b.buckets) == [16, 32, 64, 128, 256]
    for L, program in m.programs.items():
        for kernel, _grid, _block, args, _shared in program.ops:
            kernel.signature.check(args)
        names = [k.name for k, *_ in program.ops]
        assert names[0] == "step_gather_rows" and "step_add_rows" in names and "step_ring_commit" in names
        assert not any(n.startswith(("step_comp_", "step_indexer", "ds4_topk", "step_hash")) for n in names), \
            "the MTP layer is ratio 0, routed by scores"
        assert names[-1] == "ds4_argmax"
    ops = m.programs[16].ops
    # the head: the MTP's own hc head and norm, the main model's output matrix and embedding
    assert id(m.w.mat("output_hc_fn.weight").buf) in {id(a) for *_, args, _s in ops for a in args}
    assert m.w.mat("output_hc_fn.weight").buf is not b.w.mat("output_hc_fn.weight").buf
    assert m.w.tensor("output.weight") is b.w.tensor("output.weight")
    assert m.w.tensor("token_embd.weight") is b.w.tensor("token_embd.weight")
    embed = [args for k, *_, args, _s in ops if k.name == "step_embed"]
    assert len(embed) == 1 and int(embed[0][3]) == 1  # one embedding row a lane, not hc streams
    # every kernel it runs has an op twin or is among the end-to-end ones
    ran = {k.name for p in m.programs.values() for k, *_ in p.ops}
    twinned = {n for n in ran if any(fnmatch.fnmatch(n, pat) for c in CASES for pat in c.kernels)}
    assert ran - twinned <= END_TO_END, sorted(ran - twinned - END_TO_END)
    assert "step_add_rows" in twinned


def test_draft_plans():
    streams_at = {(0, 5): 3, (0, 6): 4, (0, 7): 5, (2, 0): 0}
    reqs = [DraftRequest(0, (6, 7), (11, 12), 3), DraftRequest(2, (0,), (13,), 0)]
    p = first_pass(reqs, streams_at, 4, 100)
    assert [(r.slot, r.position, r.token, r.emit) for r in p.rows] == \
        [(0, 6, 11, False), (0, 7, 12, True), (2, 0, 13, False)]
    assert p.src == [4, 5, 0] and p.owner == [0] and p.emitting_lanes() == [1]
    q = next_pass(reqs, 1, [[40], []], p)
    assert [(r.slot, r.position, r.token, r.emit) for r in q.rows] == [(0, 8, 40, True)]
    assert q.src == [1] and q.owner == [0]
    r = next_pass(reqs, 2, [[40, 41], []], q)
    assert [(x.position, x.token) for x in r.rows] == [(9, 41)] and r.src == [0]
    assert not next_pass(reqs, 3, [[40, 41, 42], []], r).rows
    assert last_position(reqs) == 9
    bad = [([DraftRequest(0, (6, 7), (1,), 1)], "positions and"),
           ([DraftRequest(0, (6, 8), (1, 2), 1)], "not consecutive"),
           ([DraftRequest(0, (4, 5), (1, 2), 1)], "not a row of the last step"),
           ([DraftRequest(0, (6,), (100,), 1)], "out of range"),
           ([DraftRequest(0, (6,), (1,), 1), DraftRequest(0, (7,), (1,), 1)], "two requests"),
           ([DraftRequest(9, (6,), (1,), 1)], "slot 9 out of range"),
           ([DraftRequest(0, (), (), 1)], "0 positions"),
           ([DraftRequest(0, (6,), (1,), -1)], "k = -1")]
    for requests, match in bad:
        with pytest.raises(ValueError, match=match):
            first_pass(requests, streams_at, 4, 100)


def test_draft_runs_a_pass_then_one_per_further_draft(model, rt):
    b = backend_with_mtp(model, rt)
    for s in range(3):
        b.reset_slot(s)
        b.set_block_table(s, [4 * s, 4 * s + 1])
    b.step(StepPlan.from_rows([Row(0, p, 5) for p in range(30)] + [Row(1, 0, 3), Row(2, 0, 4)], b.max_pass_rows))
    before = len(rt.launches)
    drafts = b.draft([DraftRequest(0, tuple(range(30)), (7,) * 30, 3), DraftRequest(1, (0,), (8,), 0),
                      DraftRequest(2, (0,), (9,), 2)])
    ran = [k for k, _ in rt.launches[before:]]
    # 32 rows: the 32-lane program, then two one-row-per-request passes in the 16-lane one,
    # between them the MTP windows of slots 0 and 2 (k > 1) saved, and restored after them
    copy = [("step_state.hip", "step_slot_copy")] * 2
    want = ([op[0].handle for op in b.mtp.programs[32].ops] + copy
            + 2 * [op[0].handle for op in b.mtp.programs[16].ops] + copy)
    assert ran == want
    # the recording runtime's download of row e reads e: emitting rows in lane order
    assert [d.tolist() for d in drafts] == [[0, 0, 0], [], [1, 1]]  # pass 2 holds slots 0 and 2
    assert all(d.dtype == np.int32 for d in drafts)
    with pytest.raises(RuntimeError, match="once after each step"):
        b.draft([DraftRequest(1, (0,), (8,), 1)])
    assert b.draft([]) == []
    b.step(StepPlan.from_rows([Row(1, 1, 8)], b.max_pass_rows))
    with pytest.raises(ValueError, match="RoPE table"):
        b.draft([DraftRequest(1, (1,), (8,), b._rope_rows)])
    assert b._streams_at is not None  # a refused call leaves the streams for the next one


def test_snapshots_carry_the_mtp_ring_and_restore_leaves_it(model, rt):
    b = backend_with_mtp(model, rt)
    b.reset_slot(0)
    b.set_block_table(0, [0, 1])
    b.step(StepPlan.from_rows([Row(0, p, 5) for p in range(10)], b.max_pass_rows))
    sid = b.save_state(0)
    assert set(b.mtp.state.snapshots) == {b._draft_snapshots[sid]}
    b.step(StepPlan.from_rows([Row(0, 10, 5)], b.max_pass_rows))
    def copies():  # the region tables of the step_slot_copy launches since the last call
        out = [args[0] for k, args in rt.launches[seen[0]:] if k[1] == "step_slot_copy"]
        seen[0] = len(rt.launches)
        return out
    seen = [len(rt.launches)]
    b.restore_state(0, sid)
    assert b.state.next_pos[0] == 10 and b.state.tables[0].tolist() == [0, 1]
    assert copies() == [b.state._region_table]  # the main state only
    b.reset_slot(1)
    copies()
    b.load_state(1, sid, [0])
    assert copies() == [b.state._region_table, b.mtp.state._region_table]
    assert b.mtp.state.snapshot_bytes == b.mtp.state.ring_slot_bytes
    b.drop_state(sid)
    assert not b.mtp.state.snapshots and not b._draft_snapshots


def test_restore_keeps_rows_by_committing_their_lanes_again(model, rt):
    """restore_state(slot, snapshot, rows): the snapshot copied back, then the last step's bucket's
    commit program (every layer's ring and compressor commits, reading the round log) over lane
    fields that hold the slot's first `rows` lanes alone, their `last` the last kept position. A
    step in a bucket past the round log keeps no rows; a request past the slot's rows is refused."""
    b = backend_with_mtp(model, rt)
    fields = []
    write = b.state.write_lanes
    b.state.write_lanes = lambda f: (fields.append(np.array(f)), write(f))
    for s in (0, 1):
        b.reset_slot(s)
        b.set_block_table(s, [4 * s, 4 * s + 1])
    b.step(StepPlan.from_rows([Row(0, p, 5) for p in range(10)] + [Row(1, p, 6) for p in range(3)], b.max_pass_rows))
    snap = b.save_state(1)
    b.step(StepPlan.from_rows([Row(0, 10, 5)] + [Row(1, 3 + j, 7) for j in range(4)], b.max_pass_rows))
    before = len(rt.launches)
    assert b.restore_state(1, snap, 2) == 2 and b.state.next_pos[1] == 5
    ran = [k for k, _ in rt.launches[before:]]
    assert ran == [("step_state.hip", "step_slot_copy")] + [op[0].handle for op in b.commit_programs[16].ops]
    names = {op[0].name for op in b.commit_programs[16].ops}
    assert names == {"step_ring_commit", "step_comp_commit"}
    f = {name: fields[-1][i] for i, name in enumerate(LANE_FIELDS)}
    assert f["slot"][:6].tolist() == [-1, 1, 1, -1, -1, -1] and (f["slot"][6:] == -1).all()
    assert f["last"][1:3].tolist() == [4, 4] and f["pos"][1:3].tolist() == [3, 4]
    snap = b.save_state(1)
    with pytest.raises(ValueError, match="cannot keep"):
        b.restore_state(1, snap, 1)  # the last step ran positions 3..6 of slot 1, not from 5
    b.step(StepPlan.from_rows([Row(1, 5 + j, 7) for j in range(70)], b.max_pass_rows))  # the 128-lane bucket
    before = len(rt.launches)
    assert b.restore_state(1, snap, 3) == 0 and b.state.next_pos[1] == 5
    assert [k for k, _ in rt.launches[before:]] == [("step_state.hip", "step_slot_copy")]
    assert sorted(b.commit_programs) == [L for L in b.buckets if L <= 64]


def test_without_mtp_there_is_no_draft(model, rt):
    b = HipBackend(model.config, model.weights, model.numerics, model.tables, runtime=rt)
    assert not hasattr(b, "draft") and hasattr(b, "restore_state") and b.mtp is None
    b.configure(2, 8)
    sid = b.save_state(0)
    b.drop_state(sid)


@pytest.mark.parametrize("numerics", ["official", "plain"])
def test_random_policy_mtp_block_records_beside_its_model(rt, numerics):  # noqa: F811 - the fixture
    """hip.synthetic's MTP block for the device benchmarks (DeviceWeights.random_policy_mtp): every
    tensor of the block under from_mtp's names, its routed experts in the policy's types, the
    embedding and output projection borrowed from the main model; HipBackend records its passes."""
    import types
    from ds4ref.gguf.mtp import mtp_config
    from ds4ref.gguf.tiny import POLICY_DIMS, tiny_config
    from ds4ref.hip.device_weights import MTP_BORROWED, DeviceWeights
    from ds4ref.numerics.tables import Tables
    cfg = tiny_config(**dict(POLICY_DIMS, n_embd=512))
    q = numerics == "official"
    dw = DeviceWeights.random_policy(rt, cfg, "q2", quantised_products=q)
    mcfg = mtp_config(cfg)
    mdw = DeviceWeights.random_policy_mtp(rt, dw, mcfg, "q2", quantised_products=q)
    assert set(mdw.mats) | set(mdw.vecs) == set(mtp_device_names(mcfg)) | set(MTP_BORROWED)
    assert all(mdw.tensor(n) is dw.tensor(n) for n in MTP_BORROWED) and mdw.borrowed == set(MTP_BORROWED)
    assert (mdw.tensor("blk.0.ffn_gate_exps.weight").wtype, mdw.tensor("blk.0.ffn_down_exps.weight").wtype) == \
        ("iq2_xxs", "q2_k")
    assert mdw.tensor("mtp.0.e_proj.weight").wtype == "q8_0" and mdw.tensor("mtp.0.e_proj.weight").packed == q
    model = types.SimpleNamespace(config=cfg, numerics=numerics, tables=Tables.build(cfg, np.float32), weights=None)
    b = HipBackend(model.config, model.weights, model.numerics, model.tables,
                   runtime=rt, device_weights=dw, mtp=types.SimpleNamespace(config=mcfg, weights=None),
                   mtp_device_weights=mdw)
    b.configure(4, 16)
    assert sorted(b.mtp.programs) == list(b.buckets)
    for program in b.mtp.programs.values():
        for kernel, _grid, _block, args, _shared in program.ops:
            kernel.signature.check(args)


def test_a_draft_from_logits_that_are_not_finite_is_a_valid_token(model, rt):
    """An MTP row whose logits overflowed (ds4_argmax: NON_FINITE_ROW) still drafts a token of
    the vocabulary: drafts are only ever checked by the verifying pass, so any valid one will do."""
    from ds4ref.hip import launch as K
    b = backend_with_mtp(model, rt)
    b.reset_slot(0)
    b.set_block_table(0, [0])
    b.step(StepPlan.from_rows([Row(0, 0, 5)], b.max_pass_rows))
    recorded = rt.download
    rt.download = lambda buf, shape, dtype: (np.full(shape, K.NON_FINITE_ROW, dtype) if buf is b._ws["amax"]
                                             else recorded(buf, shape, dtype))
    (drafts,) = b.draft([DraftRequest(0, (0,), (7,), 2)])
    assert drafts.tolist() == [0, 0] and drafts.dtype == np.int32
