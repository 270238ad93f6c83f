"""HipBackend's host side without a GPU: the whole pass is recorded on a runtime that only
counts buffers and launches (each checked against the kernel's parameters, parsed from its
source, as the real runtime does), so a Python error in building the program, a kernel argument
list that does not match its kernel, or a state sized wrong fails here, in CI, instead of
on the lent GPU. (The kernels themselves are compiled by test_kernels_compile.py and run
bit for bit against the reference by tests/gpu/.)"""
from __future__ import annotations

import re
import types

import numpy as np
import pytest

from ds4ref.hip import buffers
from ds4ref.hip import launch as K
from ds4ref.hip.layouts import QUANT_WTYPES
from ds4ref.hip.backend import HipBackend
from ds4ref.hip.device_state import DeviceState
from ds4ref.paging.compact import index_row_bytes as compact_index_bytes, kv_row_bytes as compact_kv_bytes
from ds4ref.hip.device_weights import DeviceWeights
from ds4ref.hip.runtime import DeviceBuffer, Kernel, launch_handle
from ds4ref.hip.signatures import KernelArgumentError, file_signatures
from ds4ref.numerics.tables import Tables
from ds4ref.reference.state import ATTN, INDEX
from ds4ref.gguf.tiny import POLICY_DIMS, tiny_config


class Buf(DeviceBuffer):
    """A buffer of nbytes at no address (a launch may pass it where a pointer goes)."""

    def __init__(self, nbytes: int):
        super().__init__(None, 0, nbytes)


_SIGNATURES: dict[str, dict] = {}


class RecordingRuntime:
    """Allocations and launches are recorded; nothing runs."""
    kind = "recording"
    info = types.SimpleNamespace(name="none", arch="sm_90", vendor="nvidia", multiprocessors=4)

    def __init__(self):
        self.allocated, self.launches = 0, []

    def compile_file(self, filename, options=()):
        if filename not in _SIGNATURES:  # parsed once: a pass records hundreds of launches per bucket
            _SIGNATURES[filename] = file_signatures(filename)
        sigs = _SIGNATURES[filename]
        return types.SimpleNamespace(kernel=lambda name, f=filename: Kernel((f, name), name, sigs[name]))

    def upload(self, arr):
        return self.malloc(np.asarray(arr).nbytes)

    def malloc(self, n):
        self.allocated += n
        return Buf(n)

    def launch(self, kernel, grid, block, args, shared=0, stream=None):
        self.launches.append((launch_handle(kernel, args), args))

    def memset32(self, buf, value, n):
        assert 4 * n <= buf.nbytes, "memset past the end of a buffer"

    def h2d(self, buf, arr):
        assert np.asarray(arr).nbytes <= buf.nbytes

    def d2d(self, dst, src, n):
        assert n <= dst.nbytes and n <= src.nbytes, "copy past the end of a buffer"

    def synchronize(self):
        pass

    def bind_thread(self):
        pass

    def mem_info(self):
        return (1 << 40, 1 << 40)

    def download(self, buf, shape, dtype):
        assert int(np.prod(shape)) * np.dtype(dtype).itemsize <= buf.nbytes, "download past the end of a buffer"
        return np.arange(int(np.prod(shape))).astype(dtype).reshape(shape)  # row e reads e: the order shows

    # graphs: a capture records the launches made while it is open; a replay counts them again
    def begin_capture(self):
        self._capture_from = len(self.launches)

    def end_capture(self):  # captured launches do not run: take them back out
        graph = self.launches[self._capture_from:]
        del self.launches[self._capture_from:]
        return graph

    def replay(self, graph):
        self.launches += graph


@pytest.fixture
def rt(monkeypatch):
    def view(buf, off, n):
        if off + n > buf.nbytes:
            pytest.fail(f"view [{off}, {off + n}) past a buffer of {buf.nbytes} bytes")
        return Buf(n)
    monkeypatch.setattr(buffers, "view", view)
    return RecordingRuntime()


@pytest.mark.parametrize("numerics,weights", [("official", "bf16"), ("plain", "bf16"), ("official", "q2"),
                                               ("plain", "q2")])
def test_pass_records_with_matching_argument_lists(rt, numerics, weights):
    """Both numerics over float weights, and over the q2 policy's block quants (official numerics
    record the quantised products: a quantise launch before each, repacked weights)."""
    # 512 wide: an unpacked IQ2_XXS row of 256 is 66 bytes, which the tiling kernel cannot copy
    cfg = tiny_config(**({} if weights == "bf16" else dict(POLICY_DIMS, n_embd=512)))
    dw = (DeviceWeights.random_flash(rt, cfg, big=1 << 30) if weights == "bf16" else
          DeviceWeights.random_policy(rt, cfg, "q2", quantised_products=numerics == "official"))
    model = types.SimpleNamespace(config=cfg, numerics=numerics, tables=Tables.build(cfg, np.float32), weights=None)
    backend = HipBackend(model.config, model.weights, model.numerics, model.tables, runtime=rt, device_weights=dw)
    backend.configure(4, 64)
    assert sorted(backend.programs) == [16, 32, 64, 128, 256] and backend.max_pass_rows == 256
    for L, program in backend.programs.items():
        ops = program.ops
        assert len(ops) > 10 * cfg.n_layer
        for kernel, _grid, _block, args, _shared in ops:  # the Recorder checked them; again, to be sure
            kernel.signature.check(args)
        names = {kernel.name for kernel, *_ in ops}
        assert {"step_attention_split", "step_comp_store", "step_ring_commit", "step_expert_list",
                "step_gather_rows", "ds4_rmsnorm"} <= names and len(names) >= 15
    # one pass, two capacities: the same kernels in the same order (rows per warp, and the tiled
    # GEMMs for the prompt pass's quantised products with the routed experts' row tiles, aside),
    # per-lane grids scaled
    small, big = backend.programs[16].ops, backend.programs[256].ops
    family = lambda ops: [re.sub(r"_r\d", "", k.name.replace("ds4_qexperts_gemm_", "ds4_qexperts_")  # noqa: E731
                                 .replace("ds4_qgemm_", "ds4_qmatvec_"))
                          for k, *_ in ops if k.name != "step_expert_tiles"]
    assert family(small) == family(big)
    grouped = [i for i, op in enumerate(big) if op[0].name.startswith("ds4_qexperts_gemm_")]
    if weights == "q2" and numerics == "official":
        # the tiny model's 8 experts, top 2: past 32 rows an expert averages more than
        # launch.EXPERT_GEMM_PAIRS pairs, so the 256-row pass runs its routed experts as the grouped
        # GEMM, each over the row tiles step_expert_tiles made of that layer's expert list
        E, kk = cfg.n_expert, cfg.n_expert_used
        assert K.EXPERT_GEMM_PAIRS * E // kk == 32
        assert not K.qexperts_gemm(16, kk, E) and not K.qexperts_gemm(32, kk, E) and K.qexperts_gemm(64, kk, E)
        assert len(grouped) == 3 * cfg.n_layer
        for i in grouped:
            _k, grid, _block, args, _shared = big[i]
            tiles = [op for op in big[:i] if op[0].name == "step_expert_tiles"][-1][3]
            assert args[6] is tiles[0] is backend._ws["elist"] and args[7] is tiles[1] is backend._ws["etiles"]
            assert grid[1] == K.expert_tiles(E, kk, 256) and 4 * K.expert_tiles_ints(E, kk, 256) <= args[7].nbytes
    else:
        assert not grouped
    embed = [i for i, op in enumerate(small) if op[0].name == "step_embed"][0]
    assert small[embed][1] == (16,) and big[embed][1] == (256,)
    assert backend.compact == (numerics == "official")
    quantised = [k.name for k, *_ in small if k.name.startswith(("ds4_qmatvec", "ds4_qexperts"))]
    # int8 rows come from the quantiser, or from the norm / activation / attention combine that
    # produced the input (the argument position of their codes buffer)
    producers = {"ds4_quantize_q8": 4, "ds4_rmsnorm_q8": 6, "ds4_swiglu_act_q8": 5, "step_attention_combine": 18}
    quantise = [op for op in small if op[0].name in producers and op[3][producers[op[0].name]] is not None]
    if weights == "q2" and numerics == "official":
        # every quantised product reads int8 rows some earlier launch of the pass wrote
        for ops in (small, big):
            written: set[int] = set()
            for k, _grid, _block, args, _shared in ops:
                name = k.name
                if name in producers and args[producers[name]] is not None:
                    written.add(id(args[producers[name]]))
                elif name.startswith(("ds4_qmatvec", "ds4_qexperts", "ds4_qgemm")):
                    assert id(args[2]) in written, f"{name} reads int8 rows nothing wrote before it"
        # activations that several products read are quantised once, by their producer
        assert quantised and len(quantise) < len(quantised)
        assert sum(op[0].name == "ds4_quantize_q8" for op in quantise) < len(quantise)
        assert all(t.packed for n, t in dw.mats.items() if t.wtype in QUANT_WTYPES and n != "token_embd.weight")
    else:
        assert not quantised and not quantise


def test_compact_state_is_what_the_rows_need(rt):
    cfg = tiny_config()
    st = DeviceState(rt, cfg, 3, 10, 128, sorted({r for r in cfg.compress_ratios if r}), compact=True)
    nope = cfg.head_dim - cfg.n_rot
    assert st.row_bytes[ATTN] == compact_kv_bytes(cfg.head_dim, cfg.n_rot) == \
        -(-(nope + nope // 64) // 4) * 4 + 4 * cfg.n_rot
    assert st.row_bytes[INDEX] == compact_index_bytes(cfg.indexer_head_dim) == \
        -(-(cfg.indexer_head_dim // 2 + cfg.indexer_head_dim // 32) // 4) * 4
    assert compact_kv_bytes(512, 64) == 712 and compact_index_bytes(128) == 68  # Flash
    per4, per128 = 128 // 4, 128 // 128
    n4, n128 = cfg.compress_ratios.count(4), cfg.compress_ratios.count(128)
    paged = sum(b.nbytes for b in st.pages.values())
    assert paged == 10 * (n4 * per4 * (st.row_bytes[ATTN] + st.row_bytes[INDEX]) + n128 * per128 * st.row_bytes[ATTN])
    assert st.rings.nbytes == 3 * cfg.n_layer * cfg.sliding_window * st.row_bytes[ATTN]
    assert DeviceState.bytes_needed(cfg, 3, 10, 128, compact=True) < DeviceState.bytes_needed(cfg, 3, 10, 128)


def test_each_pass_runs_the_program_of_its_bucket(rt):
    """A decode pass replays the 16-lane graph, a pass of 129..256 rows the 256-lane one (and
    17..32, 33..64, 65..128 rows the buckets between); each bucket is captured once, and the
    host reads the head's rows in emit order."""
    from ds4ref.backend import Row, StepPlan
    cfg = tiny_config()
    dw = DeviceWeights.random_flash(rt, cfg, big=1 << 30)
    model = types.SimpleNamespace(config=cfg, numerics="official", tables=Tables.build(cfg, np.float32), weights=None)
    backend = HipBackend(model.config, model.weights, model.numerics, model.tables, runtime=rt, device_weights=dw)
    backend.configure(4, 64)
    for s in range(3):
        backend.reset_slot(s)
        backend.set_block_table(s, list(range(8 * s, 8 * s + 8)))
    pos = [0, 0, 0]

    def step(plan_rows):
        before = len(rt.launches)
        res = backend.step(StepPlan.from_rows(plan_rows, backend.max_pass_rows))
        for r in plan_rows:
            pos[r.slot] += 1
        return res, rt.launches[before:]

    res, ran = step([Row(0, 0, 5)])
    assert [k for k, _ in ran] == [op[0].handle for op in backend.programs[16].ops]
    prompt = [Row(1, p, 7, False, p == 199) for p in range(200)]
    res, ran = step([Row(0, pos[0], 3, False)] + prompt + [Row(2, p, 9, p == 39, p == 39) for p in range(40)])
    assert [k for k, _ in ran] == [op[0].handle for op in backend.programs[256].ops]
    assert res.argmax[[0, 200, 240]].tolist() == [0, 1, 2]  # head row e holds the e-th emitting lane
    assert (res.argmax[1:200] == -1).all() and res.logits[-1] is not None and res.logits[0] is None
    step([Row(s, pos[s], 1) for s in range(3)])
    assert backend.capture_count == 2 and backend.replay_count == 3
    res, ran = step([Row(0, pos[0] + i, 2) for i in range(20)] + [Row(1, pos[1] + i, 2) for i in range(13)])
    assert [k for k, _ in ran] == [op[0].handle for op in backend.programs[64].ops]
    assert backend.capture_count == 3 and [backend.bucket(n) for n in (1, 16, 17, 32, 33, 65, 128, 129, 256)] == \
        [16, 16, 32, 32, 64, 128, 128, 256, 256]
    with pytest.raises(ValueError, match="at most 256"):
        backend.step(StepPlan.from_rows([Row(0, pos[0] + i, 1) for i in range(256)] + [Row(1, pos[1], 1)], 257))


def test_configure_counts_the_prompt_pass_workspace(rt):
    """The 256-row pass's workspace is part of what configure checks against free memory, so a
    device that holds the state but not the workspace refuses before allocating anything."""
    from ds4ref.hip.guards import DeviceMemoryError
    cfg = tiny_config()
    dw = DeviceWeights.random_flash(rt, cfg, big=1 << 30)
    model = types.SimpleNamespace(config=cfg, numerics="official", tables=Tables.build(cfg, np.float32), weights=None)
    backend = HipBackend(model.config, model.weights, model.numerics, model.tables, runtime=rt, device_weights=dw)
    state = DeviceState.bytes_needed(cfg, 4, 64, 128, compact=True)
    rt.mem_info = lambda: (int(2 * state), 1 << 40)
    before = rt.allocated
    with pytest.raises(DeviceMemoryError, match="256-row pass"):
        backend.configure(4, 64)
    assert rt.allocated == before


class ArenaRuntime:
    """Host bytes behind device pointers: allocation k lives at k << 32, so a view's pointer
    names its allocation and offset. Copies and fills really happen."""

    def __init__(self):
        self.mem: dict[int, np.ndarray] = {}

    def malloc(self, n):
        k = len(self.mem) + 1
        self.mem[k] = np.zeros(n, np.uint8)
        return DeviceBuffer(self, k << 32, n)

    def bytes(self, buf):
        off = buf.ptr & 0xFFFFFFFF
        return self.mem[buf.ptr >> 32][off:off + buf.nbytes]

    def memset32(self, buf, value, n):
        self.bytes(buf)[:4 * n].view(np.uint32)[:] = value

    def h2d(self, buf, arr):
        raw = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
        self.bytes(buf)[:raw.size] = raw

    def d2d(self, dst, src, n):
        self.bytes(dst)[:n] = self.bytes(src)[:n]

    def synchronize(self):
        pass

    def upload(self, arr):
        buf = self.malloc(np.asarray(arr).nbytes)
        self.h2d(buf, arr)
        return buf

    def compile_file(self, filename, options=()):
        return types.SimpleNamespace(kernel=lambda name: name)

    def launch(self, kernel, grid, block, args, shared=0, stream=None):
        """step_slot_copy, as its source (kernels/step_state.hip) reads: region y of the table
        copies its slot's bytes to or from the snapshot at the region's offset."""
        assert kernel == "step_slot_copy", f"{kernel} has no host twin here"
        desc, slot, snap, to_snapshot = args
        table = self.bytes(desc).view(np.int64).reshape(-1, 3)
        assert grid[1] == len(table)
        for base, nb, at in table:
            live = self.bytes(DeviceBuffer(self, int(base) + int(slot) * int(nb), int(nb)))
            copy = self.bytes(DeviceBuffer(self, snap.ptr + int(at), int(nb)))
            if to_snapshot:
                copy[:] = live
            else:
                live[:] = copy


@pytest.mark.parametrize("compact", [True, False])
def test_snapshot_moves_the_slots_own_state_and_reuses_dropped_copies(compact):
    """save_state/restore_state: one launch each, taking back exactly the slot's rings and
    compressor windows (no other slot's byte, no page); a dropped snapshot's memory serves the
    next save."""
    cfg = tiny_config()
    rt = ArenaRuntime()
    st = DeviceState(rt, cfg, 3, 6, 128, sorted({r for r in cfg.compress_ratios if r}), compact=compact)
    rng = np.random.default_rng(1)
    stores = [st.rings] + [b for cs in st.comps.values() for b in (cs.cur_kv, cs.cur_sc, cs.prev_kv, cs.prev_sc)
                           if b is not None] + list(st.pages.values())

    def scramble():
        for b in stores:
            rt.bytes(b)[:] = rng.integers(0, 256, b.nbytes, dtype=np.uint8)
        return [rt.bytes(b).copy() for b in stores]

    saved = scramble()
    st.set_block_table(1, [0])
    st.next_pos[1] = 5
    sid = st.save_state(1)
    later = scramble()
    st.next_pos[1] = 9
    st.restore_state(1, sid)
    assert st.next_pos[1] == 5
    restored = set()
    for buf, per_slot in st._regions():
        i = next(j for j, b in enumerate(stores) if b is buf)
        want = later[i].copy()
        want[per_slot:2 * per_slot] = saved[i][per_slot:2 * per_slot]
        np.testing.assert_array_equal(rt.bytes(buf), want)
        restored.add(i)
    for i, b in enumerate(stores):  # the pages: untouched
        if i not in restored:
            np.testing.assert_array_equal(rt.bytes(b), later[i])
    copy = st.snapshots[sid][0]
    n_alloc = len(rt.mem)
    st.drop_state(sid)
    sid2 = st.save_state(2)
    assert st.snapshots[sid2][0] is copy and len(rt.mem) == n_alloc


@pytest.mark.parametrize("compact", [True, False])
def test_copy_page_copies_one_page_of_every_store(compact):
    """The prefix cache's tail copy: page dst of every page store becomes page src's, bit for
    bit, and no other byte moves."""
    cfg = tiny_config()
    rt = ArenaRuntime()
    st = DeviceState(rt, cfg, 2, 6, 128, sorted({r for r in cfg.compress_ratios if r}), compact=compact)
    rng = np.random.default_rng(0)
    for buf in st.pages.values():
        rt.bytes(buf)[:] = rng.integers(0, 256, buf.nbytes, dtype=np.uint8)
    before = {k: rt.bytes(b).copy().reshape(6, -1) for k, b in st.pages.items()}
    st.copy_page(1, 4)
    for k, b in st.pages.items():
        after = rt.bytes(b).reshape(6, -1)
        want = before[k].copy()
        want[4] = want[1]
        assert after.shape[1] == st.layout.rows_per_page(cfg.compress_ratios[k[0]]) * st.row_bytes[k[1]]
        np.testing.assert_array_equal(after, want)
    with pytest.raises(ValueError):
        st.copy_page(2, 6)


class HostBytesRuntime:
    """Device memory as one host bytearray: malloc hands out addresses in it, copies move bytes,
    free records what it was given (only allocations, each once)."""

    def __init__(self, size: int = 1 << 16):
        self.mem, self.top, self.live, self.freed = bytearray(size), 64, set(), []

    def malloc(self, n):
        ptr, self.top = self.top, self.top + -(-n // 64) * 64
        self.live.add(ptr)
        return DeviceBuffer(self, ptr, n)

    def upload(self, arr):
        raw = np.ascontiguousarray(arr).tobytes()
        buf = self.malloc(len(raw))
        self.mem[buf.ptr:buf.ptr + len(raw)] = raw
        return buf

    def d2d(self, dst, src, n):
        self.mem[dst.ptr:dst.ptr + n] = self.mem[src.ptr:src.ptr + n]

    def free(self, buf):
        assert buf.ptr in self.live, f"free of {buf.ptr}, which is no live allocation"
        self.live.remove(buf.ptr)
        self.freed.append(buf.ptr)

    def bytes(self, buf):
        return bytes(self.mem[buf.ptr:buf.ptr + buf.nbytes])


def test_join_lays_matrices_end_to_end_and_frees_each_buffer_once():
    """DeviceWeights.join: one buffer holding the matrices' bytes in order, each name a view of
    its part (so _mv_joint's grouped launch reads matrix g at g * rows); matrices of another shape
    or encoding are refused and left where they were; free() releases the joint buffer once and no
    view, and join freed the originals."""
    rt = HostBytesRuntime()
    dw = DeviceWeights(rt, tiny_config())
    rng = np.random.default_rng(0)
    mats = {n: rng.standard_normal(s).astype(np.float16) for n, s in
            (("a", (8, 32)), ("b", (8, 32)), ("c", (16, 32)))}
    for n, m in mats.items():
        dw._put_mat(n, m, "f16", m.shape)
    before = {n: dw.mats[n].buf.ptr for n in mats}
    assert not dw.join(["a", "c"]) and not dw.join(["a", "missing"])
    assert {n: dw.mats[n].buf.ptr for n in mats} == before and dw.joint(["a", "c"]) is None
    assert dw.join(["a", "b"]) and dw.join(["a", "b"])  # a second call finds it joined
    joint = dw.joint(["a", "b"])
    assert (joint.rows, joint.cols, joint.wtype) == (16, 32, "f16")
    assert rt.bytes(joint.buf) == mats["a"].tobytes() + mats["b"].tobytes()
    assert dw.mats["a"].buf.ptr == joint.buf.ptr and dw.mats["b"].buf.ptr == joint.buf.ptr + mats["a"].nbytes
    assert rt.bytes(dw.mats["b"].buf) == mats["b"].tobytes()
    assert sorted(rt.freed) == sorted([before["a"], before["b"]])
    dw.free()
    assert sorted(rt.freed) == sorted([before["a"], before["b"], before["c"], joint.buf.ptr]) and not rt.live


def policy_backend(numerics: str):
    """(config, device weights, configured backend) of the q2 policy at 512 wide, recorded only."""
    rt = RecordingRuntime()
    cfg = tiny_config(**dict(POLICY_DIMS, n_embd=512))
    dw = DeviceWeights.random_policy(rt, cfg, "q2", quantised_products=numerics == "official")
    model = types.SimpleNamespace(config=cfg, numerics=numerics, tables=Tables.build(cfg, np.float32), weights=None)
    backend = HipBackend(model.config, model.weights, model.numerics, model.tables, runtime=rt, device_weights=dw)
    backend.configure(4, 64)
    return cfg, dw, backend


@pytest.mark.parametrize("numerics", ["official", "plain"])
def test_joined_products_run_once_a_pass_into_their_own_outputs(numerics):
    """Each joined pair (DeviceWeights.join) is one grouped launch a pass, whose second output
    starts where JOINT_OUTPUTS puts it: the group stride gs is the first output's whole buffer,
    in buckets the round log covers the layer's own part of the log for the compressors' pairs."""
    from ds4ref.hip.workspace import COMMIT_INPUTS, JOINT_OUTPUTS, workspace_sizes
    cfg, dw, backend = policy_backend(numerics)
    st, L = backend.state, backend.max_pass_rows
    sizes = workspace_sizes(cfg, L, st.maxp, st.page_tokens, backend.quantised_products)
    R = backend._log_lanes
    assert dw.joints and 0 < R < L
    for bucket, program in backend.programs.items():
        strides = {(R if bucket <= R and a in COMMIT_INPUTS else L) * sizes[a] for a, _ in JOINT_OUTPUTS}
        joint = []
        for k, grid, _block, args, _shared in program.ops:
            if k.name.startswith("ds4_matvec3_") and not k.name.endswith(("_ks", "_ksum")):
                n, gs = int(args[3]), int(args[9])
            elif k.name.startswith(("ds4_qmatvec_", "ds4_qgemm_")):
                n, gs = int(args[6]), int(args[12])
            else:
                continue
            if gs != n:
                joint.append(gs)
        assert len(joint) == len(dw.joints) and set(joint) <= strides


def test_graph_profile_maps_kernel_times_to_the_recorded_launches(rt):
    """benchmarks/graph_profile.py --by-op: the kernel times of a replayed pass, in the order they
    ran, are the recorded launches' in order, so each launch shape (kernel and grid) gets the
    times of its own launches, and a count that is not replays x launches is refused."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "graph_profile.py"
    spec = importlib.util.spec_from_file_location("graph_profile", path)
    gp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gp)
    from ds4ref import load
    m = load(numerics="official")
    b = HipBackend(m.config, m.weights, m.numerics, m.tables, runtime=rt)
    b.configure(4, 16)
    ops = b.programs[16].ops
    times = [float(i % len(ops)) for i in range(3 * len(ops))]  # launch i takes i µs, every replay
    table = gp.by_op(times, ops, 3)
    assert sum(n for n, _ in table.values()) == len(ops)
    want: dict[str, float] = {}
    for i, op in enumerate(ops):
        want[gp.op_label(op)] = want.get(gp.op_label(op), 0.0) + i
    assert {k: us for k, (_, us) in table.items()} == want
    assert any(k.startswith("step_ring_commit ") for k in table)
    with pytest.raises(ValueError, match="kernel times"):
        gp.by_op(times[:-1], ops, 3)


@pytest.mark.parametrize("numerics", ["official", "plain"])
def test_the_hc_finish_adds_the_split_projection_itself(numerics):
    """A K-split hc projection (24 x 2048 here) runs its slices and then ds4_hc_pre_finish, which
    adds them from the K-split scratch (in slice order, as ds4_matvec3_ksum would): no ksum launch
    between them, and the finish's slice count is the split's."""
    cfg, dw, backend = policy_backend(numerics)
    w = dw.mat("blk.0.hc_attn_fn.weight")
    assert not w.packed and K.matvec_ksplit(w.rows, w.cols) == 512
    for program in backend.programs.values():
        ops = program.ops
        finishes = [i for i, op in enumerate(ops) if op[0].name == "ds4_hc_pre_finish"]
        assert len(finishes) == 2 * cfg.n_layer
        for i in finishes:
            split, finish = ops[i - 1], ops[i]
            assert split[0].name.endswith("_ks") and split[3][2] is backend._ws["ksplit"]
            part, nsplit = finish[3][14], int(finish[3][15])
            assert part is backend._ws["ksplit"] and nsplit == split[1][2] == w.cols // 512


def test_a_row_the_argmax_kernel_finds_not_finite_ends_only_its_slot(rt):
    """ds4_argmax answers ops.NON_FINITE_ROW for a row holding a NaN or an infinity: step()
    reports that row's slot in StepResult.non_finite, fetches none of its logits, and hands the
    other rows their argmax and logits as before. (The kernel's own answer on such rows, and a
    whole server, run on the GPU: tests/gpu/test_serve_hip.py.)"""
    from ds4ref import load
    from ds4ref.backend import Row, StepPlan
    m = load(numerics="official")
    backend = HipBackend(m.config, m.weights, m.numerics, m.tables, runtime=rt)
    backend.configure(4, 16)
    for s in range(3):
        backend.reset_slot(s)
        backend.set_block_table(s, [s])
    amax_buf, recorded = backend._ws["amax"], rt.download
    fetched = []

    def download(buf, shape, dtype):
        out = recorded(buf, shape, dtype)  # head row e reads e
        if buf is amax_buf:
            out[1] = K.NON_FINITE_ROW
        else:
            fetched.append(shape)
        return out

    rt.download = download
    res = backend.step(StepPlan.from_rows([Row(0, 0, 5), Row(1, 0, 6), Row(2, 0, 7, want_logits=False)],
                                          backend.max_pass_rows))
    assert res.non_finite == {1}
    assert res.argmax.tolist() == [0, -1, 2] and res.logits[1] is None and res.logits[0] is not None
    assert fetched == [(backend.cfg.vocab_size,)]  # slot 0's logits only: slot 2 wanted none
    assert backend.state.next_pos[:3].tolist() == [1, 1, 1]  # its rows ran: retire resets the slot
