"""The op-case table (ds4ref/harness/op_cases.py) without a GPU: every case builds its inputs, runs
its reference twin, and launches only kernels it names, each launch checked against the
kernel's parameters on a recording runtime; and the table covers every kernel the backend's
pass launches, except the few checked end to end only (tests/gpu/test_hip_backend.py)."""
from __future__ import annotations

import fnmatch
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4ref.hip import buffers
from ds4ref.hip import launch as K
from ds4ref.hip.launch import EL_PAIRS
from ds4ref.harness.op_cases import (BY_NAME, CASES, PASS_ROWS, make_expert_list, ref_expert_list, ref_expert_tiles,
                                     run_case)
from test_hip_program import RecordingRuntime

# kernels of the pass whose twin would be the whole reference layer: checked end to end
END_TO_END = {"step_embed", "step_hash_ids", "step_moe_combine", "step_hc_head", "step_gather_rows",
              "step_comp_gather", "step_comp_store", "step_comp_commit", "step_ring_commit"}


def some_params(case, rng):
    """One value of each parameter, small ones for the ranges (row counts, widths)."""
    return {k: v[int(rng.integers(min(len(v), 40)))] for k, v in case.params.items()}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_case_builds_checked_launches(case):
    rt = RecordingRuntime()
    out = None
    rng = np.random.default_rng(0)
    for seed in range(40):  # a few draws: some cases reject some shapes
        params = some_params(case, rng)
        out = run_case(case, seed, 16 if case.rows != "one" else 1, rt, **params)
        if out is not None:
            break
    assert out is not None, f"{case.name}: every draw rejected"
    got, want = out
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert np.shape(a) == np.shape(b), (case.name, np.shape(a), np.shape(b))
    names = {k[1] for k, _ in rt.launches}
    assert names and all(any(fnmatch.fnmatch(n, p) for p in case.kernels) for n in names), (names, case.kernels)


def test_table_covers_the_backends_kernels(monkeypatch):
    from ds4ref.hip.backend import HipBackend
    from ds4ref.hip.device_weights import DeviceWeights
    from ds4ref.numerics.tables import Tables
    from ds4ref.gguf.tiny import tiny_config
    from test_hip_program import Buf
    monkeypatch.setattr(buffers, "view", lambda buf, off, n: Buf(n))
    rt = RecordingRuntime()
    for numerics in ("official", "plain"):
        cfg = tiny_config()
        dw = DeviceWeights.random_flash(rt, cfg, big=1 << 30)
        model = types.SimpleNamespace(config=cfg, numerics=numerics, tables=Tables.build(cfg, np.float32), weights=None)
        backend = HipBackend(model.config, model.weights, model.numerics, model.tables,
                             runtime=rt, device_weights=dw)
        backend.configure(2, 16)
        ran = {k.name for program in backend.programs.values() for k, *_ in program.ops}
        twinned = {n for n in ran if any(fnmatch.fnmatch(n, p) for c in CASES for p in c.kernels)}
        assert ran - twinned == END_TO_END & ran, sorted(ran - twinned - END_TO_END)
        assert {"step_attention_split", "step_indexer_paged", "step_rope_pos"} <= twinned


@pytest.mark.parametrize("rows", PASS_ROWS)
def test_the_expert_list_case_takes_whole_passes(rows):
    """The expert_list case at the whole-pass sizes the GPU twins draw, up to launch.LARGEST_PASS
    rows of Flash's 256 experts: one checked launch of step_expert_list over the pass's lanes, and a
    reference list that holds every valid lane's distinct choices once, experts ascending, at most
    EL_PAIRS pairs an entry and an expert's pairs in lane order."""
    rt = RecordingRuntime()
    case = BY_NAME["expert_list"]
    (ids, slots, E), _ = case.make(3, rows, E=256, kk=6, padding=0.3, repeats=False)
    got, want = run_case(case, 3, rows, rt, E=256, kk=6, padding=0.3, repeats=False)
    assert [(k[1], int(a[2])) for k, a in rt.launches] == [("step_expert_list", rows)]
    entries = want[0][want[0][:, 0] >= 0]
    assert got[0].shape == want[0].shape and len(entries) < len(want[0])
    assert np.all(np.diff(entries[:, 0]) >= 0) and np.all((1 <= entries[:, 1]) & (entries[:, 1] <= EL_PAIRS))
    pairs = [(e, lt) for e, n, *lts in entries.tolist() for lt in lts[:n]]
    assert sorted(pairs) == sorted((int(ids[lt // 6, lt % 6]), lt) for lt in range(rows * 6) if slots[lt // 6] >= 0)
    assert all(a < b for (e, a), (f, b) in zip(pairs, pairs[1:]) if e == f)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.sampled_from([1, 16, 17, 300, *PASS_ROWS]),
       E=st.sampled_from([4, 16, 256]), kk=st.sampled_from([1, 2, 6]), padding=st.sampled_from([0.0, 0.3]),
       repeats=st.booleans())
def test_the_expert_tiles_reference_cuts_each_experts_entries(seed, rows, E, kk, padding, repeats):
    """op_cases.ref_expert_tiles, the layout the GPU twins hold step_expert_tiles to: the tiles take
    the list's entries once each, in order, a tile up to EL_TILE_ENTRIES entries of one expert from
    its first (so up to 64 pairs, all entries full but the expert's last) with its pairs counted,
    and there are no more than launch.expert_tiles, the grouped GEMM's grid."""
    (ids, slots, _), _ = make_expert_list(seed, rows, E, kk, padding, repeats)
    entries = ref_expert_list(ids, slots, E)
    entries = entries[entries[:, 0] >= 0]
    tiles = ref_expert_tiles(ids, slots, E)
    assert len(tiles) == K.expert_tiles(E, kk, rows)
    used = tiles[tiles[:, 0] >= 0]
    assert np.all(tiles[len(used):] == -1)
    ends = np.append(used[1:, 0], len(entries))
    assert used[0, 0] == 0 if len(entries) else len(used) == 0
    for (u0, n), u1 in zip(used.tolist(), ends.tolist()):
        run = entries[u0:u1]
        assert 1 <= len(run) <= K.EL_TILE_ENTRIES and np.all(run[:, 0] == run[0, 0])
        assert n == run[:, 1].sum() <= K.TILE_ROWS and np.all(run[:-1, 1] == EL_PAIRS)
        first = np.flatnonzero(entries[:, 0] == run[0, 0])[0]
        assert (u0 - first) % K.EL_TILE_ENTRIES == 0


def test_the_grouped_experts_case_takes_whole_passes():
    """The grouped expert GEMM's case at launch.LARGEST_PASS rows: the list, the int8 rows, the row
    tiles of the list and one GEMM launch (checked against its signature), and a reference for
    every pair."""
    rt = RecordingRuntime()
    rows, E, kk, N = K.LARGEST_PASS, 16, 6, 70
    got, want = run_case(BY_NAME["qrouted_experts_gemm"], 5, rows, rt, E=E, kk=kk, shape=(N, 1280), down=True,
                         wtype="q2_k")
    assert [k[1] for k, _ in rt.launches] == ["step_expert_list", "ds4_quantize_q8", "step_expert_tiles",
                                              "ds4_qexperts_gemm_q2_k"]
    (_, gemm_args), = [(k, a) for k, a in rt.launches if k[1] == "ds4_qexperts_gemm_q2_k"]
    assert got[0].shape == want[0].shape == (rows, kk, N) and not np.isnan(want[0]).any()
    assert int(gemm_args[5]) == 1 and int(gemm_args[9]) == N and int(gemm_args[11]) == kk
