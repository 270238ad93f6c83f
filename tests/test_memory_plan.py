"""The memory plan (ds4ref/paging/plan.py), the server's --dry-run and its refusals."""
from __future__ import annotations

import os
import sys
import types

import gguf
import numpy as np
import pytest

import ds4ref.serve as serve
from ds4ref import settings
from ds4ref.gguf import file as gguf_file
from ds4ref.scheduler.pass_cost import LONG_PASS_ROWS
from ds4ref.paging.layout import PageLayout
from ds4ref.paging.prefix import SNAPSHOTS_PER_SLOT
from ds4ref.paging.plan import PlanError, check_fits, flash_config, flash_report, make_plan, size, weight_bytes
from ds4ref.serve.__main__ import byte_size, main

# ---- Flash, from the spec's formulas (DS4_SPEC §1, §7.2) -----------------------------------------------------
# 43 layers: ratios 0, 0, then 4 on even and 128 on odd layers: 21 ratio-4 (CSA), 20 ratio-128 (HCA).
CSA, HCA, LAYERS, D, NOPE, ROT, DI, WINDOW = 21, 20, 43, 512, 448, 64, 128, 128
KV_ROW = NOPE + NOPE // 64 + 1 + 4 * ROT     # E4M3 codes, 7 exponents, 1 pad byte, f32 RoPE = 712
INDEX_ROW = DI // 2 + DI // 32               # E2M1 pairs, 4 exponents = 68
PAGE_F32 = 1_761_280                         # §7.2: 440,320 elements per 128-token page
PAGE_COMPACT = CSA * 32 * (KV_ROW + INDEX_ROW) + HCA * 1 * KV_ROW
RING_ELEMENTS = 2_818_048                    # §7.2: 43 x 128 x 512
COMPRESSOR_ELEMENTS = CSA * (2 * 8 * 1024 + 2 * 8 * 256) + HCA * 2 * 128 * 512  # DS4C layout, "3.05 M"


def test_flash_sizes_follow_the_spec():
    lay = PageLayout(flash_config())
    assert flash_config().compress_ratios.count(4) == CSA and flash_config().compress_ratios.count(128) == HCA
    assert (KV_ROW, INDEX_ROW, COMPRESSOR_ELEMENTS) == (712, 68, 3_051_520)
    assert lay.page_bytes("f32") == PAGE_F32 and PAGE_F32 / 128 == 13_760  # §7.2: 13,760 B/token
    assert lay.page_bytes("compact") == PAGE_COMPACT == 538_400
    assert lay.slot_bytes("f32") == 4 * (RING_ELEMENTS + COMPRESSOR_ELEMENTS)
    assert lay.slot_bytes("compact") == LAYERS * WINDOW * KV_ROW + 4 * COMPRESSOR_ELEMENTS
    assert lay.page_bytes("f64") == 2 * PAGE_F32


@pytest.mark.parametrize("lanes, context, pool, pages", [(1, 1 << 20, None, 8192), (16, 4096, None, 16 * 32),
                                                         (8, 65536, 262_144, 2048), (8, 65536, 1000, 8)])
def test_flash_plan_totals(lanes, context, pool, pages):
    weights = 86_000_000_000  # any figure: the plan adds it as it is
    plan = make_plan(flash_config(), weights, lanes, context, pool, "compact")
    assert plan.n_pages == pages  # a full context per lane unless --kv-pool-tokens, in whole pages
    assert plan.paged == pages * PAGE_COMPACT
    assert plan.slots == lanes * (LAYERS * WINDOW * KV_ROW + 4 * COMPRESSOR_ELEMENTS)
    # the prefix cache's snapshots, one slot's fixed state each, SNAPSHOTS_PER_SLOT per lane
    assert plan.snapshot_bytes == SNAPSHOTS_PER_SLOT * plan.slots
    assert plan.total == weights + pages * PAGE_COMPACT + plan.slots + plan.snapshot_bytes
    off = make_plan(flash_config(), weights, lanes, context, pool, "compact", prefix_cache=False)
    assert off.snapshot_bytes == 0 and off.total == plan.total - plan.snapshot_bytes
    assert plan.bytes_per_token("f32") == 13_760 and plan.bytes_per_token("compact") == PAGE_COMPACT / 128
    check_fits(plan, plan.total, "the budget is")
    with pytest.raises(PlanError, match="lower --max-context, --kv-pool-tokens or --max-concurrency"):
        check_fits(plan, plan.total - 1, "the budget is")


def test_flash_report_prints_the_documented_figures():
    text = flash_report()
    assert "13,760.00" in text and "4,206.25" in text and "23,478,272" in text and "16,124,928" in text


def test_weights_are_the_files_stored_tensor_bytes(tiny_model_path):
    f = gguf_file.open_gguf(tiny_model_path)
    assert weight_bytes(f) == sum(int(t.n_bytes) for t in gguf.GGUFReader(tiny_model_path).tensors)


def test_the_plan_is_what_numpy_backend_allocates(tiny_model_path):
    """Paged bytes and ring bytes exactly; compressor state at most the plan's (DS4C's layout)."""
    for numerics in ("official", "plain"):
        _, plan = serve.plan_start(str(tiny_model_path), "numpy", numerics, 3, None, 300)
        state = serve.build_state(str(tiny_model_path), max_concurrency=3, max_context=300, numerics=numerics)
        engine = state.runner.scheduler.engine
        b = engine.backend
        assert engine.pool.n_pages == plan.n_pages == 3 * 3
        assert sum(p.nbytes for p in b.pages.values()) == plan.paged
        comps = sum(a.nbytes for c in b.comps for s in c.values() for a in vars(s).values()
                    if isinstance(a, np.ndarray))
        ring_row = {"official": 64 + 1 + 3 + 4 * 32, "plain": 4 * 96}[numerics]  # tiny: D 96, 32 RoPE dims
        assert b.rings.nbytes == 3 * 6 * 16 * ring_row == plan.lanes * plan.layout.ring_rows() * ring_row
        assert 0 < comps <= plan.lanes * plan.layout.compressor_elements() * 4
        # the tiny model carries an MTP block: its window rings, a lane each, in the working float
        assert b.mtp is not None and plan.draft > 0
        assert sum(m.rings.nbytes for m in b.draft_states) == plan.draft
        assert "memory plan: " in state.plan and b.storage == plan.storage
        state.runner.stop()


# ---- the command line -----------------------------------------------------------------------------------


@pytest.fixture
def no_tensor_data(monkeypatch):
    """Reading any tensor's data, building a model or allocating a backend fails the test."""
    def refuse(*a, **k):
        raise AssertionError("the dry run touched tensor data or allocated")
    monkeypatch.setattr(gguf_file, "decode_tensor", refuse)
    monkeypatch.setattr(gguf_file.GGUFModelFile, "read", refuse)
    monkeypatch.setattr(gguf_file.GGUFModelFile, "read_expert", refuse)
    monkeypatch.setattr("ds4ref.model.DS4Model.__init__", refuse)
    monkeypatch.setattr("ds4ref.reference.numpy_backend.NumpyBackend.configure", refuse)


def test_dry_run_prints_the_plan_and_exits_0(no_tensor_data, capsys):
    assert main(["--dry-run", "--max-concurrency", "4", "--max-context", "1000"]) == 0
    out = capsys.readouterr().out
    _, plan = serve.plan_start(None, "numpy", "official", 4, None, 1000)
    for line in ("weights", "paged history", "per-slot state", "total", "available", "bytes/token", "bytes/slot"):
        assert line in out
    assert f"{plan.total:,}" in out and "host RAM" in out
    assert f"{4 * 8} pages x {plan.layout.page_bytes('compact'):,} B (compact KV rows)" in out
    assert f"prefix cache    on: cached prefixes live in the paged history's {4 * 8} pages" in out
    assert main(["--dry-run", "--no-prefix-cache"]) == 0
    assert "prefix cache    off (--no-prefix-cache)" in capsys.readouterr().out


def test_dry_run_of_the_hip_backend_opens_no_device(no_tensor_data, capsys, monkeypatch):
    """The pass workspace is sized by hip/workspace.py (plain arithmetic over the config); no
    runtime is made, so no GPU library is loaded."""
    import ds4ref.hip.runtime as runtime

    def no_device():
        raise AssertionError("the dry run opened a GPU runtime")
    monkeypatch.setattr(runtime, "get_runtime", no_device)
    monkeypatch.setitem(sys.modules, "ds4ref.hip.backend", None)  # importing it raises ImportError
    assert main(["--dry-run", "--backend", "hip"]) == 0
    out = capsys.readouterr().out
    assert "device memory: checked at start" in out and "pass workspace" in out


def test_dry_run_refuses_a_plan_over_the_budget(no_tensor_data, capsys):
    assert main(["--dry-run", "--memory-budget", "4M"]) == 2
    out, err = capsys.readouterr()
    assert "total" in out  # the table still shows what it would take
    (line,) = err.strip().splitlines()
    # 14.7 MiB of weights (the MTP block's included) and state, 16 lanes x the MTP block's ring
    # (16 rows x 96 floats, 6 KiB), 16 lanes x 8 prefix-cache snapshots of 250.4 KiB + that ring, and
    # speculation's round snapshot (the same size) a lane
    assert line.startswith("ds4ref.serve: error: the memory plan needs 50.9 MiB but --memory-budget is 4.0 MiB:")
    assert "paged history" in line and "per-lane state" in line and "--max-concurrency" in line
    assert "32.0 MiB of prefix-cache snapshots (--no-prefix-cache drops them)" in line
    assert f"{size(16 * 16 * 96 * 4)} of MTP block state" in line
    assert "4.0 MiB of speculation's round snapshots" in line
    assert main(["--dry-run", "--memory-budget", "1M"]) == 2
    assert "the weights alone need 3.4 MiB but --memory-budget is 1.0 MiB" in capsys.readouterr().err


def test_start_refuses_before_allocating(monkeypatch, tiny_model_path):
    def refuse(*a, **k):
        raise AssertionError("allocated before the plan was checked")
    monkeypatch.setattr("ds4ref.reference.numpy_backend.NumpyBackend.configure", refuse)
    with pytest.raises(PlanError, match="--memory-budget is 4.0 MiB"):
        serve.build_state(str(tiny_model_path), memory_budget=4 << 20)
    assert main(["--memory-budget", "4M", "--port", "0"]) == 2


@pytest.mark.parametrize("text, n", [("128G", 128 << 30), ("512M", 512 << 20), ("1.5GiB", 3 << 29), ("4096", 4096),
                                     ("2t", 2 << 40), ("64KB", 64 << 10)])
def test_memory_budget_sizes(text, n):
    assert byte_size(text) == n


@pytest.mark.parametrize("text", ["12X", "", "-1G", "0"])
def test_bad_memory_budgets(text):
    import argparse
    with pytest.raises(argparse.ArgumentTypeError):
        byte_size(text)


# ---- the hip backend: the plan counts what HipBackend.configure allocates ----------------------------------

class _Buffer:
    rt, ptr = None, 0  # what buffers.view reads

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def free(self) -> None:
        pass


class _Recorded(Exception):
    """configure got past its allocations to recording the pass."""


class HostRuntime:
    """Enough of a GPU runtime for HipBackend to upload and configure on the host: buffers are
    byte counts, and recording the pass (the first kernel looked up) stops configure."""
    info = types.SimpleNamespace(vendor="nvidia", arch="sm_90", name="host", warp_size=32)
    kind = "host"

    def __init__(self, free: int = 1 << 40) -> None:
        self.free, self.allocated = free, 0

    def bind_thread(self) -> None:
        pass

    def compile_file(self, filename, options=()):
        def kernel(name):
            raise _Recorded(name)
        return types.SimpleNamespace(kernel=kernel)

    def malloc(self, nbytes: int) -> _Buffer:
        self.allocated += nbytes
        return _Buffer(nbytes)

    def upload(self, arr) -> _Buffer:
        return self.malloc(max(np.asarray(arr).nbytes, 4))

    def memset32(self, buf, bits, n) -> None:
        pass

    def d2d(self, dst, src, nbytes) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def mem_info(self):
        return self.free, 1 << 40


# (numerics, DS4REF_COMPACT_KV, --max-context, --kv-pool-tokens) of the tiny model (4,096 positions):
# the pool (3 lanes' contexts, or --kv-pool-tokens) larger than one lane's context, the pool
# smaller than it (a lane reaches the pool's 1,024 positions), and the model's whole context
HIP_PLANS = [("official", "1", 300, None), ("official", "0", 300, None), ("plain", "1", 300, None),
             ("official", "1", 1000, 3000), ("official", "1", 2500, 1024), ("official", "1", None, None)]


@pytest.mark.parametrize("numerics, compact_kv, max_context, pool", HIP_PLANS)
def test_the_hip_plan_counts_what_configure_allocates(tiny_model_path, numerics, compact_kv, max_context, pool,
                                                      monkeypatch):
    """The plan's pass workspace is, byte for byte, the block tables, lane fields, RoPE tables and
    pass buffers configure allocates for lanes of the plan's context (what SeqEngine passes as
    max_context); paged history exactly and per-slot state at most the plan's; and configure
    refuses exactly when the plan's state and workspace exceed 95% of free memory. The plan and
    the backend read one storage rule, DS4REF_COMPACT_KV included."""
    from ds4ref.hip.backend import HipBackend
    from ds4ref.hip.guards import DeviceMemoryError
    from ds4ref.model import from_file

    monkeypatch.setenv("DS4REF_COMPACT_KV", compact_kv)
    model_file, plan = serve.plan_start(str(tiny_model_path), "hip", numerics, 3, pool, max_context)
    reach = min(plan.context, plan.n_pages * plan.page_tokens)  # positions one lane can hold
    assert plan.context == (max_context or 4096)
    assert plan.workspace > 0 and plan.workspace_rows == LONG_PASS_ROWS  # the server's lone-prompt pass
    assert plan.storage == ("compact" if (numerics, compact_kv) == ("official", "1") else "f32")
    model = from_file(model_file, numerics=numerics)
    assert model.mtp is not None and plan.draft > 0  # the tiny model's MTP block: its state is counted
    rt = HostRuntime()
    backend = HipBackend(model.config, model.weights, model.numerics, model.tables, runtime=rt, mtp=model.mtp_weights,
                         prefill_rows=plan.workspace_rows)
    assert backend.compact == (plan.storage == "compact")
    assert backend.mtp.bytes_needed(plan.lanes, plan.n_pages, plan.page_tokens, plan.workspace_rows,
                                    backend.compact, plan.context) == plan.draft
    uploaded = rt.allocated
    with pytest.raises(_Recorded):
        backend.configure(plan.lanes, plan.n_pages, plan.page_tokens, max_context=plan.context)
    st = backend.state
    assert st.context == reach and st.maxp == -(-reach // plan.page_tokens) and backend._rope_rows == reach
    beside_state = (st.btab.nbytes + st.lanes.nbytes + sum(b.nbytes for b in backend.rope_cs.values())
                    + sum(b.nbytes for b in backend._ws.values() if getattr(b, "owned", True)))  # views: no bytes
    assert beside_state == plan.workspace
    assert sum(b.nbytes for b in st.pages.values()) == plan.paged
    # the draft module's state is allocated before the pass is recorded (DSpark's taps are its rows)
    assert rt.allocated - uploaded - plan.workspace - plan.paged <= plan.slots + plan.draft

    # prefix-cache and round snapshots are taken later, one at a time, not by configure
    assert backend.state.snapshot_bytes <= plan.per_slot  # what a save_state copies fits what the plan counts
    assert plan.round_snapshots == plan.lanes and plan.round_bytes == plan.lanes * (plan.per_slot + plan.mtp_slot)
    state_and_workspace = plan.total - plan.weights - plan.snapshot_bytes - plan.round_bytes
    free = int(state_and_workspace / 0.95)
    while 0.95 * free < state_and_workspace:
        free += 1
    for fits, have in ((True, free), (False, free - 1)):
        rt = HostRuntime(have)
        backend = HipBackend(model.config, model.weights, model.numerics, model.tables, runtime=rt,
                             mtp=model.mtp_weights, prefill_rows=plan.workspace_rows)
        uploaded = rt.allocated
        with pytest.raises(_Recorded if fits else DeviceMemoryError):
            backend.configure(plan.lanes, plan.n_pages, plan.page_tokens, max_context=plan.context)
        assert (rt.allocated > uploaded) == fits  # a refusal allocates nothing


def test_the_memory_plan_follows_compact_kv(tiny_model_path, monkeypatch):
    """DS4REF_COMPACT_KV=0 keeps official rows float32 on the GPU, and the hip plan counts them so;
    the numpy backend stores official float32 rows compactly whatever it says."""
    plans = {}
    for value in ("1", "0"):
        monkeypatch.setattr(settings, "SETTINGS", {**settings.SETTINGS, "DS4REF_COMPACT_KV": (value, "")})
        monkeypatch.delenv("DS4REF_COMPACT_KV", raising=False)
        for backend in ("hip", "numpy"):
            plans[backend, value] = serve.plan_start(str(tiny_model_path), backend, "official", 4, None, 1000)[1]
    assert [plans["hip", v].storage for v in "10"] == ["compact", "f32"]
    assert plans["hip", "0"].paged > plans["hip", "1"].paged and plans["hip", "0"].slots > plans["hip", "1"].slots
    assert plans["numpy", "0"].storage == plans["numpy", "1"].storage == "compact"


def test_the_dry_run_prints_the_hip_pass_workspace(tiny_model_path, capsys):
    assert main(["--dry-run", "--backend", "hip", "--model", str(tiny_model_path)]) == 0
    _, plan = serve.plan_start(str(tiny_model_path), "hip", "official", 16, None, None)
    out = capsys.readouterr().out
    assert f"pass workspace  {plan.workspace:>14,}" in out and f"total           {plan.total:>14,}" in out
