"""HipBackend: the whole gathered pass on the GPU, as one graph per capacity bucket.

Design (docs/hip_backend.md has the long form):
* Buckets. A pass runs in the smallest capacity bucket that holds its rows: 16 lanes
  (decode, the 16-lane gathered pass), the powers of two above it (decode rows with their
  drafts: speculation; prompt chunks beside decoders, sized by the Scheduler's inter-token
  budget) and `prefill_rows` lanes (PREFILL_ROWS by default; the server's lone-prompt pass,
  up to `largest_pass`). Each bucket is its own recorded program and captured graph over
  the same state and workspace; a lane's arithmetic does not depend on the bucket, so a
  prompt fed 2048 rows a pass gives the bits of one row a pass.
* Lanes. A pass is always a bucket's lanes; padding lanes carry slot -1. The host writes
  per-lane ints (slot, position, token, where the slot's rows start and end in the
  pass, visible compressed rows per ratio) into one fixed device buffer before
  every replay; block tables live in a fixed device buffer too. Nothing else
  changes between passes, so one captured graph serves every pass: lanes joining
  or leaving, ratio-4/128 boundaries, growing history (kernels loop to the
  visible lengths they read from device memory; grids cover the capacity).
* Several rows of one slot. Within a layer every state-reading kernel reads the
  state as it was before the pass plus this pass's per-lane buffers, and the
  state is written back by commit kernels at the end of the layer. Row i of a
  slot therefore sees rows < i of the same pass (from the pass buffers) and the
  older history (from the state), exactly what feeding the tokens one at a time
  would give, without splitting the pass. Rows are reordered so that a slot's
  rows sit on consecutive lanes.
* Weights are read once per pass for all lanes (batched matvec; routed experts
  read once for all lanes that chose them). Past 16 lanes the matvecs run in lane
  groups of 16, one per grid z, each with the 16-lane kernel's arithmetic.
* The head (hc head, norm, lm head, argmax) runs only on the rows that emit, gathered
  to the front: intermediate prompt rows skip the largest single weight read.
* Speculation: draft() runs the MTP block (hip/mtp.py) by the same builders, as a
  one-layer model over the last step's final streams, or a 0731 model's DSpark draft
  (hip/dspark.py) over the stream means the pass taps; restore_state rolls a slot back to
  a prefix-cache snapshot.
"""
from __future__ import annotations

import copy
import math

import numpy as np

from ..backend import DECODE_LANES, PAGE_TOKENS, PREFILL_ROWS, StepPlan, StepResult, check_kept_rows, check_rows
from ..numerics import canon
from ..numerics.tables import Tables
from ..paging.layout import kv_storage
from ..settings import getenv, getenv_int
from ..gguf.config import ATTN, CSA, INDEX, DS4Config, row_kinds
from . import launch as K
from . import buffers
from .launch import largest_pass
from .layouts import QUANT_WTYPES
from .device_state import LANE_FIELDS, DeviceState, lane_fields, lane_order
from .device_weights import WTYPE_CODE, DeviceWeights
from .guards import check_fits_device, open_device
from .dspark import DSparkDevice, block_pass, feed_pass
from .mtp import MTPDevice, MTPPass, first_pass, last_position, next_pass
from .signatures import check_launch
from .workspace import (COMMIT_INPUTS, JOINT_OUTPUTS, JOINT_WEIGHTS, attention_slices, check_pass_fits, device_bytes,
                        q8_width, rope_positions, round_log_lanes, score_capacity, shared_q8_inputs, workspace_sizes)

I32, F32, F64 = np.int32, np.float32, np.float64
# rows per warp of the v3 routed-expert kernel (1, 2; 4 for bf16), in a decode pass and in a
# prompt pass (whose entries carry more lanes: more rows per block stage their inputs less often)
EXPERT_RPW = getenv_int("DS4REF_EXPERT_RPW")
PREFILL_EXPERT_RPW = getenv_int("DS4REF_PREFILL_EXPERT_RPW")


def _blocks(n: int, per: int) -> int:
    return max(1, -(-int(n) // per))


def capacity_buckets(prefill_rows: int) -> tuple[int, ...]:
    """16 lanes (decode), the powers of two between (decode rows with their drafts: 16 lanes of
    k + 1 rows), and prefill_rows: a pass never runs in a program more than twice its rows."""
    out, b = {DECODE_LANES, int(prefill_rows)}, 2 * DECODE_LANES
    while b < prefill_rows:
        out.add(b)
        b *= 2
    return tuple(sorted(out))


class Recorder:
    """Stands in for the runtime while the pass of one bucket (L lanes) is built: launches
    are recorded, not run, so the same list runs eagerly or is captured into a graph."""

    def __init__(self, rt, L: int = DECODE_LANES):
        self.rt, self.ops, self.info, self.L = rt, [], rt.info, L

    def launch(self, kernel, grid, block, args, shared=0, stream=None):
        check_launch(kernel, args)  # at record time: a pass with a bad argument list fails when built
        self.ops.append((kernel, tuple(grid), tuple(block), tuple(args), shared))

    def compile_file(self, filename, options=()):
        return self.rt.compile_file(filename, options)

    def run(self) -> None:
        for kernel, grid, block, args, shared in self.ops:
            self.rt.launch(kernel, grid, block, args, shared)


class HipBackend:
    name = "hip"

    def __init__(self, config: DS4Config, weights, numerics: str, tables: Tables, runtime=None,
                 device_weights: DeviceWeights | None = None, use_graph: bool | None = None,
                 allow_untested_arch: bool = False, prefill_rows: int = PREFILL_ROWS, mtp=None,
                 mtp_device_weights: DeviceWeights | None = None, dspark=None,
                 dspark_device_weights: DeviceWeights | None = None):
        """Built from what the pass needs: the model's config, its host weights (gguf.weights;
        None when device_weights are given), the numerics ("official" or "plain") and the tables
        derived from the config (numerics.tables.Tables: RoPE frequencies, Hadamard).
        mtp: the MTP block's weights (gguf.mtp.MTPWeights, carrying its config; DS4Model.mtp_weights),
        for draft(); or dspark: a DSpark draft's (gguf.dspark_file.DSparkWeights), which draft()
        then runs instead."""
        self.cfg = config
        self.numerics = numerics
        self.tables = tables
        if not DECODE_LANES <= prefill_rows <= largest_pass(config):
            raise ValueError(f"prefill_rows must be in {DECODE_LANES}..{largest_pass(config)} (the most rows a "
                             f"pass of {config.n_expert} experts holds on these kernels), got {prefill_rows}")
        self.buckets = capacity_buckets(prefill_rows)
        self.max_pass_rows = self.buckets[-1]
        if runtime is None:
            runtime = open_device(allow_untested_arch)
        self.rt = runtime
        for f in ("step_ops.hip", "step_state.hip"):  # compile now: fail at load, not mid-request
            self.rt.compile_file(f)
        # official numerics multiply block-quantised weights by int8 activations (qdot.hip)
        self.quantised_products = self.numerics == "official"
        self.w = device_weights if device_weights is not None else DeviceWeights.from_weights(
            runtime, weights, self.quantised_products)
        for name, t in self.w.mats.items():
            if name != "token_embd.weight" and t.wtype in QUANT_WTYPES and t.packed != self.quantised_products:
                raise ValueError(f"{name}: {t.wtype} weights uploaded for {'plain' if t.packed else 'official'} "
                                 f"numerics, the model runs {self.numerics}")
        for il in range(self.cfg.n_layer):  # one launch for each pair (_mv_joint)
            for pair in JOINT_WEIGHTS:
                self.w.join([f"blk.{il}.{n}" for n in pair])
        self.use_graph = (getenv("DS4REF_HIP_GRAPH") != "0") if use_graph is None else use_graph
        self.compact = kv_storage("hip", self.numerics) == "compact"  # the memory plan's rule
        self._tables()
        self.state: DeviceState | None = None
        self.capture_count = 0
        self.replay_count = 0
        self.programs: dict[int, Recorder] = {}
        self._graphs: dict[int, object] = {}
        self._ws: dict[str, object] = {}
        # the round log (workspace.COMMIT_INPUTS): per layer its own views, for buckets of up to
        # _log_lanes lanes, and per such bucket a program of every layer's commit from it
        self._round_log: list[dict[str, object]] = []
        self._log_lanes = 0
        self.commit_programs: dict[int, Recorder] = {}
        self._commit_graphs: dict[int, object] = {}
        self._last_pass = None  # (bucket, lane fields) of the last step
        # (slot, position) -> lane of the last step's rows, whose final streams s0 still holds
        # for draft(); None once an MTP pass has overwritten them
        self._streams_at: dict[tuple[int, int], int] | None = None
        self._draft_snapshots: dict[int, int] = {}  # snapshot id -> the draft state's snapshot id
        self.mtp = MTPDevice(self, mtp, mtp_device_weights) if mtp is not None and dspark is None else None
        self.dspark = DSparkDevice(self, dspark, dspark_device_weights) if dspark is not None else None
        self.drafter = self.dspark or self.mtp  # the draft module draft() runs, whose state slots carry

    def describe(self) -> str:
        """Runtime and memory plan, for the server's start-up banner."""
        i = self.rt.info
        device = f"ROCm {i.name}" if i.vendor == "amd" else i.name
        plan = f"weights {self.w.bytes / 2**20:.1f} MiB"
        if self.state is not None:
            st = self.state
            need = DeviceState.bytes_needed(self.cfg, st.n_slots, st.n_pages, st.page_tokens, st.compact, st.context)
            form = "compact FP8/FP4 rows" if st.compact else "float32 rows"
            plan += f", paged state {need / 2**20:.1f} MiB ({st.n_slots} slots, {st.n_pages} pages, {form})"
        return f"{device} ({i.arch}, {self.rt.kind} runtime); {plan}"

    # ---- protocol ----------------------------------------------------------------
    def configure(self, n_slots: int, n_pages: int, page_tokens: int = PAGE_TOKENS,
                  max_context: int | None = None) -> None:
        """The protocol's; the block tables, RoPE tables and the pass's indexer scores and attention
        partials are sized for lanes of up to max_context positions (None: the model's context)."""
        self.rt.bind_thread()
        self._release_state()
        parts = device_bytes(self.cfg, n_slots, n_pages, page_tokens, self.max_pass_rows, self.compact,
                             self.quantised_products, max_context)
        work = parts["workspace"]
        need = sum(parts.values()) - work
        if self.drafter is not None:
            need += self.drafter.bytes_needed(n_slots, n_pages, page_tokens, self.max_pass_rows, self.compact,
                                              max_context)
        check_fits_device(self.rt, need + work, f"{n_slots} slots and {n_pages} pages ({need / 2**30:.2f} GiB "
                          f"of state) and the {self.max_pass_rows}-row pass's workspace")
        ratios = sorted({r for r in self.cfg.compress_ratios if r})
        self.state = DeviceState(self.rt, self.cfg, n_slots, n_pages, page_tokens, ratios, self.compact,
                                 n_lanes=self.max_pass_rows, max_context=max_context)
        self._rope_tables(rope_positions(self.cfg, n_pages, page_tokens, max_context))
        self._alloc_workspace()
        # the indexer's score capacity and the attention's key slices: the main model's, also in the
        # MTP layer's program (a ratio-0 layer of the main model runs with these very values)
        self.ncap4 = score_capacity(self.cfg, self.state.maxp, page_tokens)
        self.at_nz = attention_slices(self.cfg, self.state.maxp, page_tokens)
        self.holds = {"RoPE rows": self._rope_rows, "indexer scores": self.ncap4, "attention slices": self.at_nz}
        if self.drafter is not None:  # before the pass is recorded: it writes DSpark's taps
            self.drafter.configure(self, n_slots, n_pages, page_tokens, max_context)
        self.programs, self.commit_programs = {}, {}
        for L in self.buckets:
            rec = Recorder(self.rt, L)
            self._build(rec)
            self.programs[L] = rec
            if L <= self._log_lanes:
                rec = Recorder(self.rt, L)
                for il in range(self.cfg.n_layer):
                    self._commit(rec, il)
                self.commit_programs[L] = rec
        self._graphs, self._commit_graphs = {}, {}  # the state moved: capture again on each bucket's next step
        self._streams_at, self._draft_snapshots, self._last_pass = None, {}, None
        if self.drafter is not None:
            self.drafter.build(self, self.buckets)

    def reset_slot(self, slot: int) -> None:
        self.rt.bind_thread()  # the protocol may be driven from any thread (the server's runner)
        self._need_state().reset_slot(slot)
        if self.drafter is not None:
            self.drafter.reset_slot(slot)

    def set_block_table(self, slot: int, pages) -> None:
        self.rt.bind_thread()
        self._need_state().set_block_table(slot, pages)

    # A snapshot holds the draft module's rings too, so a slot loaded from the prefix cache drafts
    # from the draft window of the positions it skips; restore_state leaves them as they are
    # (backend.DraftRequest: no position is fed to the draft module twice).
    def save_state(self, slot: int) -> int:
        self.rt.bind_thread()
        sid = self._need_state().save_state(slot)
        if self.drafter is not None:
            try:
                self._draft_snapshots[sid] = self.drafter.save_state(slot)
            except MemoryError:
                self.state.drop_state(sid)
                raise
        return sid

    def load_state(self, slot: int, snapshot: int, pages) -> None:
        self.rt.bind_thread()
        self._need_state().load_state(slot, snapshot, pages)
        if self.drafter is not None:
            self.drafter.restore_state(slot, self._draft_snapshots[snapshot])

    def drop_state(self, snapshot: int) -> None:
        self.rt.bind_thread()
        self._need_state().drop_state(snapshot)
        if self.drafter is not None:
            self.drafter.drop_state(self._draft_snapshots.pop(snapshot))

    def restore_state(self, slot: int, snapshot: int, rows: int = 0) -> int:
        """Back to the snapshot, then, where the last step ran in a bucket the round log covers,
        each layer's commit again over the slot's first `rows` lanes of that step alone: the
        state a pass of just those rows leaves (the commits read only the pass's logged inputs
        and the state before it, which the snapshot is). Otherwise 0 rows are kept."""
        self.rt.bind_thread()
        st = self._need_state()
        position = st.snapshots[snapshot][1]
        L, fields = self._last_pass or (0, np.full((len(LANE_FIELDS), 1), -1, I32))
        lane_slot, pos = fields[LANE_FIELDS.index("slot")], fields[LANE_FIELDS.index("pos")]
        lanes = np.flatnonzero(lane_slot == slot)  # the slot's rows, consecutive in position order
        span = range(int(pos[lanes[0]]), int(pos[lanes[-1]]) + 1) if lanes.size else range(0)
        check_kept_rows(slot, position, rows, span)
        st.restore_state(slot, snapshot)
        if not rows or L not in self.commit_programs:
            return 0
        keep = fields.copy()
        lane_slot, last = keep[LANE_FIELDS.index("slot")], keep[LANE_FIELDS.index("last")]
        kept = np.zeros(keep.shape[1], bool)
        kept[lanes[:rows]] = True
        lane_slot[~kept] = -1
        last[kept] = position + rows - 1
        st.write_lanes(keep)
        self._run(self.commit_programs, self._commit_graphs, L)
        st.next_pos[slot] = position + rows
        return rows

    def copy_page(self, src: int, dst: int) -> None:
        self.rt.bind_thread()
        self._need_state().copy_page(src, dst)

    def step(self, plan: StepPlan) -> StepResult:
        self.rt.bind_thread()
        st = self._need_state()
        rows = plan.rows()
        check_rows(rows, st.next_pos, [t.size for t in st.tables], st.page_tokens, self.cfg.vocab_size,
                   self.max_pass_rows)
        if rows:  # the block tables bound positions by pages; the workspace, by positions
            check_pass_fits(self.cfg, max(r.position for r in rows), self.holds, st.context)
        order = lane_order([r.slot for r in rows])
        lanes = [rows[i] for i in order]
        fields = lane_fields(lanes, st.ratios, st.n_lanes)
        st.write_lanes(fields)
        L = self.bucket(len(rows))
        self._run(self.programs, self._graphs, L)
        self.rt.synchronize()
        self._streams_at = {(r.slot, r.position): lane for lane, r in enumerate(lanes)}
        self._last_pass = (L, fields)
        emitting = [i for i in order if rows[i].emit]  # head row e holds the e-th emitting lane
        amax = self.rt.download(self._ws["amax"], (max(len(emitting), 1),), I32)
        logits: list[np.ndarray | None] = [None] * len(rows)
        argmax = np.full(len(rows), -1, I32)
        V = self.cfg.vocab_size
        for r in rows:
            st.next_pos[r.slot] += 1
        non_finite = set()
        for e, i in enumerate(emitting):
            if amax[e] == K.NON_FINITE_ROW:  # its request ends (StepResult.non_finite): nothing to fetch
                non_finite.add(rows[i].slot)
                continue
            argmax[i] = amax[e]
            if rows[i].want_logits:
                logits[i] = self.rt.download(buffers.view(self._ws["logits"], e * V * 4, V * 4), (V,), F32)
        return StepResult(logits, argmax, frozenset(non_finite))

    def recorder(self, L: int) -> Recorder:
        """A Recorder of bucket L's launches on this backend's runtime (the draft modules' programs)."""
        return Recorder(self.rt, L)

    def bucket(self, n_rows: int) -> int:
        """The smallest capacity bucket that holds n_rows rows."""
        return next(L for L in self.buckets if n_rows <= L)

    # ---- speculation: the draft module's drafts -----------------------------------------
    @property
    def draft(self):
        """backend.Backend.draft, present only with a draft module: like the prefix cache's methods,
        the engine finds out by hasattr, which is False when this raises AttributeError."""
        if self.drafter is None:
            raise AttributeError("draft: this model has no MTP block or DSpark draft")
        return self._draft

    @property
    def max_draft_tokens(self) -> int | None:
        """DSpark proposes one block a round: at most its block size (SeqEngine checks k)."""
        return self.dspark.max_draft_tokens if self.dspark is not None else None

    def _draft_requests(self, requests) -> list:
        """The requests of a draft call, which reads what the last step() left (the MTP block its
        final streams, DSpark its taps) and overwrites the streams."""
        self.rt.bind_thread()
        requests = list(requests)
        if requests and self._streams_at is None:
            raise RuntimeError("draft() needs the streams of the last step(), and a draft() since has "
                               "overwritten them (call draft once after each step)")
        return requests

    def _draft(self, requests) -> list[np.ndarray]:
        if self.dspark is not None:
            return self.dspark_draft(requests)[0]
        return self.draft_with_logits(requests)[0]

    def dspark_draft(self, requests, want_logits: bool = False):
        """Feed every request's rows to the draft's rings, then one block pass for the requests
        with k >= 1; a request's drafts are its block's first k (hip/dspark.py). With want_logits
        (tests) also each drafting request's (B, vocab) logits, the block's whole chain."""
        st, ds, requests = self._need_state(), self.dspark, self._draft_requests(requests)
        if not requests:
            return [], []
        feed = feed_pass(requests, self._streams_at, ds.fed, st.n_slots, self.cfg.vocab_size)
        fed = ds.fed.copy()
        for q in requests:
            fed[q.slot] += len(q.positions)
        block = block_pass(requests, fed, ds.dcfg.block_size, ds.dcfg.noise_token_id)
        if block.rows and max(r.position for r in block.rows) >= self._rope_rows:
            raise ValueError(f"draft: position {max(r.position for r in block.rows)} is past the RoPE table "
                             f"({self._rope_rows} positions)")
        if len(block.rows) > self.max_pass_rows or len(block.slots) > ds.R:
            raise ValueError(f"draft: {len(block.slots)} blocks of {ds.dcfg.block_size} rows do not fit a pass of "
                             f"{self.max_pass_rows} rows")
        self._streams_at = None
        if feed.rows:
            ds.write_feed(feed)
            self._run(ds.feed_programs, ds.graphs["feed"], self.bucket(len(feed.rows)))
            ds.fed[:] = fed
        out, logits = [np.zeros(0, I32) for _ in requests], [None] * len(requests)
        if block.rows:
            ds.write_block(block)
            self._run(ds.draft_programs, ds.graphs["draft"], self.bucket(len(block.rows)))
            self.rt.synchronize()
            tokens = ds.drafts(len(block.slots))
            chains = ds.logits(len(block.slots)) if want_logits else None
            for lane, i in enumerate(block.owner):
                out[i] = tokens[lane, : requests[i].k].astype(I32)
                if want_logits:
                    logits[i] = chains[lane]
        return out, logits

    def draft_with_logits(self, requests, want_logits: bool = False):
        """draft(), and with want_logits each request's k draft logits (vocab,) too (tests)."""
        if self.mtp is None:
            raise RuntimeError("draft_with_logits: this model has no MTP block")
        st, requests = self._need_state(), self._draft_requests(requests)
        if not requests:
            return [], []
        first = first_pass(requests, self._streams_at, st.n_slots, self.cfg.vocab_size)
        if last_position(requests) >= self._rope_rows:
            raise ValueError(f"draft: position {last_position(requests)} is past the RoPE table "
                             f"({self._rope_rows} positions)")
        self._streams_at = None  # the MTP passes write s0
        drafts: list[list[int]] = [[] for _ in requests]
        logits: list[list[np.ndarray]] = [[] for _ in requests]
        p, step = first, 0
        kept: dict[int, int] = {}
        while p.rows:
            if step == 1:  # chained steps must leave the MTP window as the fed rows left it
                kept = {r.slot: self.mtp.state.save_state(r.slot) for r in requests if r.k > 1}
            amax, rows_logits = self._mtp_pass(p, want_logits)
            for e, i in enumerate(p.owner):
                drafts[i].append(int(amax[e]))
                if want_logits:
                    logits[i].append(rows_logits[e])
            step += 1
            p = next_pass(requests, step, drafts, p)
        for slot, sid in kept.items():
            self.mtp.state.restore_state(slot, sid)
            self.mtp.state.drop_state(sid)
        return [np.asarray(d, I32) for d in drafts], logits

    def _mtp_pass(self, p: MTPPass, want_logits: bool):
        """Run one MTP pass; the argmax (and logits) of its emitting rows, in lane order."""
        self.mtp.write(p)
        self._run(self.mtp.programs, self.mtp.graphs, self.bucket(len(p.rows)))
        self.rt.synchronize()
        n, V = len(p.owner), self.cfg.vocab_size
        amax = self.rt.download(self._ws["amax"], (max(n, 1),), I32)
        # MTP logits that overflowed still make a draft, a valid token the verifying pass refuses
        # unless the model chooses it too: drafts never change the output
        amax = np.where(amax == K.NON_FINITE_ROW, 0, amax).astype(I32)
        rows = [self.rt.download(buffers.view(self._ws["logits"], e * V * 4, V * 4), (V,), F32)
                for e in range(n)] if want_logits else []
        return amax, rows

    def _layer_view(self, cfg, weights: DeviceWeights, state: DeviceState) -> "HipBackend":
        """The builders over another model of the same widths (the MTP block as a one-layer model):
        a shallow copy whose config, weights and state are that model's, sharing this backend's
        workspace, RoPE tables, numerics and the main model's score capacity and key slices."""
        view = copy.copy(self)
        view.cfg, view.w, view.state = cfg, weights, state
        view._round_log = []  # the main layers' round log is not the MTP's
        return view

    # ---- running -------------------------------------------------------------------
    def _run(self, programs: dict, graphs: dict, L: int) -> None:
        """Run bucket L's program: replay its graph, captured on its first use."""
        program = programs[L]
        if not self.use_graph:
            program.run()
            return
        if L not in graphs:
            self.rt.synchronize()
            self.rt.begin_capture()
            try:
                program.run()
            finally:
                graph = self.rt.end_capture()
            graphs[L] = graph
            self.capture_count += 1
        self.rt.replay(graphs[L])
        self.replay_count += 1

    def _need_state(self) -> DeviceState:
        if self.state is None:
            raise RuntimeError("backend not configured: call configure(n_slots, n_pages) first")
        return self.state

    def _release_state(self) -> None:
        if self.drafter is not None:
            self.drafter.free_state()
        if self.state is not None:
            self.state.free()
            for b in self._ws.values():
                b.free()
            self._ws = {}
            self.state = None

    def close(self) -> None:
        self._release_state()
        for b in [*self.rope_cs.values(), self.hadamard]:
            b.free()
        self.rope_cs = {}
        if self.drafter is not None:
            self.drafter.close()
        self.w.free()

    # ---- constants and workspace ---------------------------------------------------------
    def _tables(self) -> None:
        # transposed: ds4_qat_rows reads it a column per thread (its comment says why)
        self.hadamard = self.rt.upload(np.ascontiguousarray(np.asarray(self.tables.hadamard, F32).T))
        self.rope_cs: dict[int, object] = {}

    def _rope_tables(self, positions: int) -> None:
        """cos/sin by position for both RoPE kinds, as the reference forms them
        (canon.rope_cos_sin): the host computes them once, so both backends read the
        same bits. Rows cover every position the pages can hold."""
        for b in self.rope_cs.values():
            b.free()
        t = self.tables
        self._rope_rows = positions
        pos = np.arange(positions)
        for kind, omega in ((0, t.omega_main), (1, t.omega_compress)):
            cos, sin = canon.rope_cos_sin(omega, pos)
            self.rope_cs[kind] = self.rt.upload(np.ascontiguousarray(np.stack([cos, sin], axis=-1)))

    def _alloc_workspace(self) -> None:
        st, L = self.state, self.max_pass_rows  # every bucket's program uses the first lanes of these buffers
        sizes = workspace_sizes(self.cfg, L, st.maxp, st.page_tokens, self.quantised_products)
        first, second = dict(JOINT_OUTPUTS), {b: a for a, b in JOINT_OUTPUTS}
        for name, n in sizes.items():
            if name in second:
                continue
            parts = 2 if name in first else 1
            buf = self.rt.malloc(4 * L * n * parts)
            self.rt.memset32(buf, 0, L * n * parts)
            self._ws[name] = buf
        for b, a in second.items():
            self._ws[b] = buffers.view(self._ws[a], 4 * L * sizes[a], 4 * L * sizes[b])
        self._log_lanes = R = round_log_lanes(L)
        per_layer = 4 * R * sum(sizes[n] for n in COMMIT_INPUTS)
        log = self.rt.malloc(self.cfg.n_layer * per_layer)
        self.rt.memset32(log, 0, log.nbytes // 4)
        self._ws["round_log"] = log
        self._round_log = []
        for il in range(self.cfg.n_layer):
            at, views = il * per_layer, {}
            for name in COMMIT_INPUTS:
                views[name] = buffers.view(log, at, 4 * R * sizes[name])
                at += 4 * R * sizes[name]
            self._round_log.append(views)
        ws = self._ws
        self._q8 = K.Q8Rows(ws["q8_codes"], ws["q8_scales"], ws["q8_sums"],
                            L * q8_width(self.cfg, self.quantised_products))
        # the int8 rows of a, qr and xn, made by their norms and read by every product of them
        # (with float weights only, nothing reads int8 rows)
        any_packed = any(t.packed for t in self.w.mats.values())
        self._q8_of = {name: K.Q8Rows(ws[f"{name}_q8_codes"], ws[f"{name}_q8_scales"], ws[f"{name}_q8_sums"], L * w)
                       for name, w in shared_q8_inputs(self.cfg, self.quantised_products and any_packed).items()}
        self.rt.synchronize()

    # ---- the pass --------------------------------------------------------------------------
    def _build(self, rec: Recorder) -> None:
        """Record the whole pass: embedding, every layer, head, argmax."""
        L = rec.L
        c, ws, st = self.cfg, self._ws, self.state
        k = rec.compile_file("step_ops.hip").kernel
        emb = self.w.tensor("token_embd.weight")
        rec.launch(k("step_embed"), (L,), (256,), (emb.buf, I32(WTYPE_CODE[emb.wtype]), I32(c.n_embd),
                                                    I32(c.hc_mult), st.lane("tok"), ws["s0"]))
        for il in range(c.n_layer):
            self._attention_layer(rec, il)
            self._ffn_layer(rec, il)
            if self.dspark is not None:
                self.dspark.record_taps(self, rec, il)
        self._head(rec)

    def _ws_at(self, rec, il: int) -> dict:
        """The workspace as layer il of bucket rec.L sees it: a bucket the round log covers finds
        the commit's inputs in the layer's own part of it."""
        if rec.L > self._log_lanes or not self._round_log:
            return self._ws
        return {**self._ws, **self._round_log[il]}

    # small launch helpers ---------------------------------------------------------------
    def _mv(self, rec, name, x, y, q8=None, **kw):
        """y = x @ W.T for every lane; q8: x's int8 rows where a producer already made them."""
        self._mv_w(rec, self.w.mat(name), x, y, q8, **kw)

    def _mv_joint(self, rec, names, x, ys, q8=None) -> None:
        """_mv of each of names into ys[i] (which read the same x), as one grouped launch where
        DeviceWeights.join laid the matrices end to end and the ys are one allocation's equal
        parts (JOINT_OUTPUTS). A lane's sums are those of the separate products: the same
        kernel and order, the K-split aside, so split shapes run separately."""
        w = self.w.joint(names)
        rows = w.rows // len(names) if w is not None else 0
        if w is None or K.matvec_ksplit(rows, w.cols):
            for name, y in zip(names, ys):
                self._mv(rec, name, x, y, q8=q8)
            return
        self._mv_w(rec, w, x, ys[0], q8, groups=len(names), ldy=rows, gs=(ys[1].ptr - ys[0].ptr) // 4)

    def _mv_w(self, rec, w, x, y, q8=None, **kw):
        L = rec.L
        # padding lanes past the last row are skipped on the device
        kw.setdefault("lane_slot", self.state.lane("slot"))
        if w.packed:
            width = kw.pop("ldx", None) or w.cols
            if q8 is None:
                q8 = self._q8
                K.launch_quantize_q8(rec, x, q8, L, width)
            K.launch_qmatvec(rec, w, q8, y, L, Wx=width, **kw)
            return
        kw.update(part=self._ws["ksplit"])
        K.launch_matvec(rec, w, x, y, L, **kw)

    def _norm(self, rec, x, wname, y, rows, D, lanes=None, q8=None):
        """rmsnorm of rows of D; with q8 (one row per lane), y's int8 rows too."""
        L = rec.L
        w = None if wname is None else self.w.vec(wname)
        lanes = self.state.lane("slot") if lanes is None else lanes
        if q8 is not None:
            K.launch_rmsnorm_q8(rec, x, w, y, rows, D, self.cfg.rms_eps, q8, lanes)
            return
        K.launch_rmsnorm(rec, x, w, y, rows, D, self.cfg.rms_eps, lanes, rows // L)

    def _norm_rope(self, rec, x, wname, y, posbuf, ratio, rows_per_lane, D, fp8=False):
        """_norm then _rope (then, with fp8, the FP8 round trip of the other dims) in one launch."""
        w = None if wname is None else self.w.vec(wname)
        K.launch_norm_rope(rec, x, w, y, rec.L, rows_per_lane, D, self.cfg.rms_eps, posbuf,
                           self.rope_cs[1 if ratio else 0], self.cfg.n_rot // 2, fp8=fp8,
                           lane_slot=self.state.lane("slot"))

    def _rope(self, rec, v, posbuf, ratio, rows_per_lane, D, inverse=False):
        L = rec.L
        half = self.cfg.n_rot // 2
        k = rec.compile_file("step_ops.hip").kernel("step_rope_pos")
        rec.launch(k, (_blocks(L * rows_per_lane * half, 256),), (256,),
                   (v, posbuf, self.rope_cs[1 if ratio else 0], I32(L), I32(rows_per_lane), I32(D), I32(half),
                    I32(1 if inverse else 0)))

    def _hc_pre(self, rec, il, part, streams):
        L = rec.L
        c, ws = self.cfg, self._ws
        p = f"blk.{il}.hc_{part}_"
        w, lanes, slices = self.w.mat(p + "fn.weight"), self.state.lane("slot"), None
        if not w.packed and K.matvec_ksplit(w.rows, w.cols):  # the finish adds the slices itself
            slices = (ws["ksplit"], K.launch_matvec_slices(rec, w, streams, ws["ksplit"], L, lane_slot=lanes))
        else:
            self._mv(rec, p + "fn.weight", streams, ws["mix"])
        K.launch_hc_pre_finish(rec, streams, ws["mix"], self.w.vec(p + "base.weight"), self.w.vec(p + "scale.weight"),
                               c.hc_mult, c.n_embd, c.rms_eps, c.hc_eps, c.hc_sinkhorn_iters,
                               ws["u"], ws["post"], ws["comb"], L, lane_slot=lanes, slices=slices)

    def _hc_post(self, rec, streams, y, out):
        L = rec.L
        c, ws = self.cfg, self._ws
        rec.launch(K.kernel(rec, "hc", "ds4_hc_post"), (_blocks(L * c.hc_mult * c.n_embd, 256),), (256,),
                   (streams, y, ws["post"], ws["comb"], out, I32(L), I32(c.hc_mult), I32(c.n_embd)))

    # attention half of a layer ---------------------------------------------------------------
    def _attention_layer(self, rec, il: int, commit: bool = True, key_end: str = "pos") -> None:
        """commit: the pass's rows into the state after the layer's readers (a DSpark block
        leaves none); key_end: the lane field where a lane's raw keys end (_attend)."""
        L = rec.L
        c, ws, st = self.cfg, self._ws_at(rec, il), self.state
        ratio, D, H = c.ratio(il), c.head_dim, c.n_head
        p = f"blk.{il}."
        pos = st.lane("pos")
        q8a, q8qr = self._q8_of.get("a"), self._q8_of.get("qr")
        self._hc_pre(rec, il, "attn", ws["s0"])
        self._norm(rec, ws["u"], p + "attn_norm.weight", ws["a"], L, c.n_embd, q8=q8a)
        self._mv(rec, p + "attn_q_a.weight", ws["a"], ws["qa_raw"], q8=q8a)
        self._norm(rec, ws["qa_raw"], p + "attn_q_a_norm.weight", ws["qr"], L, c.q_lora_rank, q8=q8qr)
        self._mv(rec, p + "attn_q_b.weight", ws["qr"], ws["q_raw"], q8=q8qr)
        self._norm_rope(rec, ws["q_raw"], None, ws["q"], pos, ratio, H, D)
        self._mv(rec, p + "attn_kv.weight", ws["a"], ws["kv_raw"], q8=q8a)
        kv = ws["kv"]  # official numerics: FP8 round-tripped
        self._norm_rope(rec, ws["kv_raw"], p + "attn_kv_a_norm.weight", kv, pos, ratio, 1, D,
                        fp8=self.numerics == "official")
        sel = None
        if ratio:
            self._compressor(rec, il, ATTN)
            if ratio == CSA:
                self._compressor(rec, il, INDEX)
                sel = self._indexer(rec, il)
        # the output's inverse RoPE, and its int8 rows where the output product is quantised,
        # are the attention combine's epilogue
        q8o = self._q8 if self.w.mat(p + "attn_output_a.weight").packed else None
        self._attend(rec, il, kv, sel, q8o, key_end)
        hd = H * D
        self._mv(rec, p + "attn_output_a.weight", ws["o"], ws["z"], q8=q8o, groups=c.o_groups, ldx=hd,
                 xg=hd // c.o_groups, ldy=c.o_groups * c.o_lora_rank)
        self._mv(rec, p + "attn_output_b.weight", ws["z"], ws["y"])
        self._hc_post(rec, ws["s0"], ws["y"], ws["s1"])
        if commit:
            self._commit(rec, il)

    def _compressor(self, rec, il: int, kind: str) -> None:
        """Project this pass's inputs, pool the windows lanes complete, store the rows."""
        L = rec.L
        c, ws, st = self.cfg, self._ws_at(rec, il), self.state
        ratio = c.ratio(il)
        cs = st.comps[(il, kind)]
        width, coff = cs.width, (2 if ratio == CSA else 1)
        pre = f"blk.{il}." + ("attn_compressor" if kind == ATTN else "indexer_compressor")
        pkv, psc = (ws["ckv"], ws["csc"]) if kind == ATTN else (ws["ikv"], ws["isc"])
        nkv, nsc = (ws["nprev_a_kv"], ws["nprev_a_sc"]) if kind == ATTN else (ws["nprev_i_kv"], ws["nprev_i_sc"])
        self._mv_joint(rec, (pre + "_kv.weight", pre + "_gate.weight"), ws["a"], (pkv, psc), q8=self._q8_of.get("a"))
        C = 8 if ratio == CSA else ratio
        kso = rec.compile_file("step_state.hip").kernel
        rec.launch(kso("step_comp_gather"), (_blocks(L * C * width, 256),), (256,),
                   (pkv, psc, self.w.vec(pre + "_ape.weight"), cs.cur_kv, cs.cur_sc, cs.prev_kv, cs.prev_sc,
                    I32(ratio), I32(width), I32(coff), I32(L), st.lane("slot"), st.lane("pos"), st.lane("pstart"),
                    st.lane("flane"), ws["cand_kv"], ws["cand_sc"], nkv, nsc, ws["emit_pos"]))
        rec.launch(K.kernel(rec, "pool", "ds4_pool_window"), (_blocks(width, 32), L), (256,),
                   (ws["cand_kv"], ws["cand_sc"], ws["pooled"], I32(L), I32(C), I32(width)))
        # official: the attention rows FP8 round-tripped, the index rows through the QAT
        row = ws["crow"]
        self._norm_rope(rec, ws["pooled"], pre + "_norm.weight", row, ws["emit_pos"], ratio, 1, width,
                        fp8=self.numerics == "official" and kind == ATTN)
        if self.numerics == "official" and kind == INDEX:
            row = self._qat(rec, row, ws["crow2"], L, width)
        per = st.layout.rows_per_page(ratio)
        rec.launch(kso("step_comp_store"), (L,), (128,),
                   (row, st.pages[(il, kind)], st.btab, I32(st.maxp), I32(per), I32(ratio), I32(width),
                    I32(st.row_format(kind)), I32(c.n_rot), st.lane("slot"), st.lane("pos")))

    def _qat(self, rec, x, out, rows, n):
        """Hadamard rotation then FP4 blocks (twins.qat)."""
        K.launch_qat(rec, x, self.hadamard, out, rows, n, self.state.lane("slot"), rows // rec.L)
        return out

    def _indexer(self, rec, il: int):
        """Indexer query, scores over the slot's index rows, top-k -> ws['sel']."""
        L = rec.L
        c, ws, st = self.cfg, self._ws, self.state
        p = f"blk.{il}."
        Hi, Di = c.indexer_heads, c.indexer_head_dim
        self._mv(rec, p + "indexer.attn_q_b.weight", ws["qr"], ws["qi"], q8=self._q8_of.get("qr"))
        self._rope(rec, ws["qi"], st.lane("pos"), 4, Hi, Di)
        qi = ws["qi"]
        if self.numerics == "official":
            qi = self._qat(rec, qi, ws["qi_q"], L * Hi, Di)
        self._mv(rec, p + "indexer.proj.weight", ws["a"], ws["wraw"], q8=self._q8_of.get("a"))
        scale = F32(1.0 / math.sqrt(Hi * Di))
        per = st.layout.rows_per_page(4)
        kso = rec.compile_file("step_state.hip").kernel
        rec.launch(kso("step_indexer_paged"), (min(_blocks(self.ncap4, 8), 128), L), (256,),
                   (qi, ws["wraw"], scale, st.pages[(il, INDEX)], I32(st.row_format(INDEX)), st.btab,
                    I32(st.maxp), I32(per),
                    st.lane("slot"), st.nvis(4), ws["scores"], I32(Hi), I32(Di), I32(self.ncap4)))
        rec.launch(K.kernel(rec, "indexer", "ds4_topk"), (L,), (512,),
                   (ws["scores"], st.nvis(4), I32(self.ncap4), I32(c.indexer_top_k), ws["sel"]))
        return ws["sel"]

    def _attend(self, rec, il: int, kv, sel, q8=None, key_end: str = "pos") -> None:
        """key_end: `pos` (a row sees the window up to itself) or `last` (a DSpark block row
        sees its whole block: up to its slot's last row in the pass)."""
        L = rec.L
        c, ws, st = self.cfg, self._ws, self.state
        ratio, H, D = c.ratio(il), c.n_head, c.head_dim
        store = st.pages[(il, ATTN)] if ratio else None
        per = st.layout.rows_per_page(ratio) if ratio else 1
        nvis = st.nvis(ratio) if ratio else st.lane("slot")  # unused without a store
        sinks = self.w.vec(f"blk.{il}.attn_sinks.weight")
        K.launch_attention_split(rec, H, L, self.at_nz,
                                 (ws["q"], kv, st.ring_layer(il), np.int64(st.ring_slot_bytes), store,
                                  I32(st.row_format(ATTN)), I32(c.n_rot), st.btab, I32(st.maxp), I32(per), sel,
                                  I32(c.indexer_top_k), st.lane("slot"), st.lane(key_end), st.lane("pstart"),
                                  st.lane("flane"), nvis, I32(H), I32(D), I32(c.sliding_window),
                                  F32(1.0 / math.sqrt(D)), ws["at_m"], ws["at_den"], ws["at_acc"]))
        K.launch_attention_combine(rec, ws["at_m"], ws["at_den"], ws["at_acc"], sinks, st.lane("slot"),
                                   st.lane("pos"), store, nvis, sel, c.indexer_top_k, c.sliding_window, H, D,
                                   self.at_nz, ws["o"], L, rope=self.rope_cs[1 if ratio else 0],
                                   half=c.n_rot // 2, q8=q8, kend=None if key_end == "pos" else st.lane(key_end))

    def _commit(self, rec, il: int) -> None:
        """Write the pass into the ring and the compressor state (after every reader)."""
        L = rec.L
        c, ws, st = self.cfg, self._ws_at(rec, il), self.state
        kv = ws["kv"]
        kso = rec.compile_file("step_state.hip").kernel
        lanes = (st.lane("slot"), st.lane("pos"), st.lane("last"))
        rec.launch(kso("step_ring_commit"), (L,), (128,),
                   (kv, st.ring_layer(il), np.int64(st.ring_slot_bytes), I32(c.sliding_window), I32(c.head_dim),
                    I32(st.row_format(ATTN)), I32(c.n_rot), *lanes))
        ratio = c.ratio(il)
        for kind in row_kinds(c.layer_kind(il)):
            cs = st.comps[(il, kind)]
            coff = 2 if ratio == CSA else 1
            pre = f"blk.{il}." + ("attn_compressor" if kind == ATTN else "indexer_compressor")
            pkv, psc = (ws["ckv"], ws["csc"]) if kind == ATTN else (ws["ikv"], ws["isc"])
            nkv, nsc = (ws["nprev_a_kv"], ws["nprev_a_sc"]) if kind == ATTN else (ws["nprev_i_kv"], ws["nprev_i_sc"])
            rec.launch(kso("step_comp_commit"), (_blocks(L * coff * cs.width, 256),), (256,),
                       (pkv, psc, self.w.vec(pre + "_ape.weight"), cs.cur_kv, cs.cur_sc, nkv, nsc, cs.prev_kv,
                        cs.prev_sc, I32(ratio), I32(cs.width), I32(coff), I32(L), *lanes))

    # FFN half of a layer ------------------------------------------------------------------------
    def _ffn_layer(self, rec, il: int) -> None:
        L = rec.L
        c, ws, st = self.cfg, self._ws, self.state
        p = f"blk.{il}."
        kk, clamp = c.n_expert_used, F32(c.swiglu_clamp[il])
        q8xn = self._q8_of.get("xn")
        self._hc_pre(rec, il, "ffn", ws["s1"])
        self._norm(rec, ws["u"], p + "ffn_norm.weight", ws["xn"], L, c.n_embd, q8=q8xn)
        self._mv(rec, p + "ffn_gate_inp.weight", ws["xn"], ws["rlog"], q8=q8xn)
        ko = rec.compile_file("step_ops.hip").kernel
        if c.is_hash_layer(il):
            rec.launch(ko("step_hash_ids"), (_blocks(L * kk, 256),), (256,),
                       (self.w.vec(p + "ffn_gate_tid2eid.weight"), st.lane("tok"), I32(L), I32(kk), ws["hid"]))
            bias, hid = None, ws["hid"]
        else:
            bias, hid = self.w.vec(p + "exp_probs_b.bias"), None
        rec.launch(K.kernel(rec, "moe", "ds4_route"), (L,), (256,),
                   (ws["rlog"], bias, hid, I32(c.n_expert), I32(kk), F32(c.expert_weights_scale),
                    I32(1 if c.expert_weights_norm else 0), ws["ids"], ws["rw"]))
        K.launch_expert_list(rec, ws["ids"], st.lane("slot"), L, kk, c.n_expert, ws["elist"])
        if self._grouped_experts(rec, il):
            K.launch_expert_tiles(rec, ws["elist"], ws["etiles"])
        ff = c.expert_ff
        self._experts(rec, p + "ffn_gate_exps.weight", ws["xn"], 0, ws["eg"], q8=q8xn)
        self._experts(rec, p + "ffn_up_exps.weight", ws["xn"], 0, ws["eu"], q8=q8xn)
        # the activation quantises h itself when the down product takes int8 rows
        q8h = self._q8 if self.w.tensor(p + "ffn_down_exps.weight").packed else None
        K.launch_swiglu_act(rec, ws["eg"], ws["eu"], ws["eh"], L * kk * ff, clamp, q8h)
        self._experts(rec, p + "ffn_down_exps.weight", ws["eh"], 1, ws["ed"], q8=q8h)
        shared = None
        if c.n_expert_shared:
            ffs = self.w.mat(p + "ffn_gate_shexp.weight").rows
            self._mv_joint(rec, (p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight"), ws["xn"],
                           (ws["sg"], ws["su"]), q8=q8xn)
            q8h = self._q8 if self.w.mat(p + "ffn_down_shexp.weight").packed else None
            K.launch_swiglu_act(rec, ws["sg"], ws["su"], ws["sh"], L * ffs, clamp, q8h)
            self._mv(rec, p + "ffn_down_shexp.weight", ws["sh"], ws["sd"], q8=q8h)
            shared = ws["sd"]
        rec.launch(ko("step_moe_combine"), (_blocks(L * c.n_embd, 256),), (256,),
                   (ws["ed"], ws["rw"], shared, ws["ym"], I32(L), I32(kk), I32(c.n_embd)))
        self._hc_post(rec, ws["s1"], ws["ym"], ws["s0"])

    def _grouped_experts(self, rec, il: int) -> bool:
        """Whether layer il's quantised routed experts run as the grouped GEMM in this program
        (launch.qexperts_gemm), over step_expert_tiles' row tiles."""
        c = self.cfg
        return K.qexperts_gemm(rec.L, c.n_expert_used, c.n_expert) and any(
            self.w.tensor(f"blk.{il}.ffn_{m}_exps.weight").packed for m in ("gate", "up", "down"))

    def _experts(self, rec, name, x, per_choice, y, q8=None) -> None:
        """The routed experts' product for the pass's (lane, choice) pairs; q8 as in _mv."""
        t = self.w.tensor(name)
        E, N, Kc = t.shape
        if t.packed:
            kk = self.cfg.n_expert_used
            if q8 is None:
                q8 = self._q8
                K.launch_quantize_q8(rec, x, q8, rec.L * (kk if per_choice else 1), Kc)
            if K.qexperts_gemm(rec.L, kk, self.cfg.n_expert):  # step_expert_tiles ran (_ffn_layer)
                K.launch_qexperts_gemm(rec, t.buf, t.wtype, q8, per_choice, self._ws["elist"], self._ws["etiles"],
                                       y, N, Kc, kk, rec.L, self.cfg.n_expert)
            else:
                K.launch_qexperts(rec, t.buf, t.wtype, q8, per_choice, self._ws["elist"], y, N, Kc, kk)
            return
        r = K.expert_rows_per_warp(t.wtype, PREFILL_EXPERT_RPW if rec.L > DECODE_LANES else EXPERT_RPW)
        K.launch_routed_experts(rec, t.buf, t.wtype, r, x, per_choice, self._ws["elist"], y, N, Kc,
                                self.cfg.n_expert_used)

    def _head(self, rec) -> None:
        """On the emitting rows only, gathered to the front (lane field hsrc): in a prompt
        pass most rows only fill state, and the lm head is the largest single weight."""
        L = rec.L
        c, ws = self.cfg, self._ws
        hsrc = self.state.lane("hsrc")
        ko = rec.compile_file("step_ops.hip").kernel
        rec.launch(ko("step_gather_rows"), (L,), (256,), (ws["s0"], hsrc, ws["hs"], I32(c.hc_mult * c.n_embd)))
        self._mv(rec, "output_hc_fn.weight", ws["hs"], ws["hmix"], lane_slot=hsrc)
        rec.launch(ko("step_hc_head"), (L,), (256,),
                   (ws["hs"], ws["hmix"], self.w.vec("output_hc_base.weight"), self.w.vec("output_hc_scale.weight"),
                    I32(c.hc_mult), I32(c.n_embd), F32(c.rms_eps), F32(c.hc_eps), hsrc, ws["hx"]))
        self._norm(rec, ws["hx"], "output_norm.weight", ws["hn"], L, c.n_embd, lanes=hsrc)
        self._mv(rec, "output.weight", ws["hn"], ws["logits"], lane_slot=hsrc)
        K.launch_argmax(rec, ws["logits"], ws["amax"], L, c.vocab_size, lane_slot=hsrc)
