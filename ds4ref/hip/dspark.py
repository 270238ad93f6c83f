"""The DSpark draft on the device: speculation's drafts (backend.Backend.draft) for a
DeepSeek-V4-Flash-0731 model. reference/dspark.py is the arithmetic and docs/mtp.md "DSpark"
the formulas; every product, norm and attention here is the main layers' kernel, so a row's
bits are the reference's.

Taps. With a draft, HipBackend's pass also writes each lane's stream mean after every target
layer (step_stream_mean) into its workspace's `taps` rows, T x d a lane.

Two programs a capacity bucket, built by HipBackend's own builders in a view whose config,
weights and state are the draft's (HipBackend._layer_view):
  feed   one row per fed position: h = taps[src[row]] (step_gather_rows), m = main_norm(main_proj h),
         then per stage s kv = fp8(rope(kv_norm_s(W_kv,s m))) into stage s's ring (the main
         layers' kv path and ring commit).
  draft  B rows per drafting request at the positions P .. P + B - 1 after its last fed row,
         tokens [anchor, noise, ..., noise]: the embedding, the three stages without their commit
         (a draft leaves no state behind), the head with the last stage's hc head and norm and the
         target's output matrix: the base logits. Then the Markov chain over request lanes,
         i = 0 .. B - 1: e = markov_w1[d_i] (step_markov_gather), logits = base_i + markov_w2 e
         (step_markov_add), d_{i+1} = argmax (ds4_argmax: lower index on ties, as np.argmax).
The window. A block row sees the W context rows before its block and all B block rows: the last
W + B positions up to the block's last row. So the draft's rings hold W + B rows (its state's
config has sliding_window W + B) and a block row's attention is the main layers' sliding window
of W + B keys ending at its block's last row (lane field `last`, HipBackend._attend's key_end).
The fed rows' keys are never read past W rows back, so the longer ring changes no bit.
The confidence head is not run: the official code does not cut drafts by it (docs/mtp.md).

The host-side planning (`feed_pass`, `block_pass`) is pure and checked on the CPU.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..backend import DraftRequest, Row, check_draft_requests
from ..gguf.dspark import PREFIX, own_name
from ..gguf.tensors import layer_tensor_shapes
from . import buffers
from . import launch as K
from .device_state import DeviceState, lane_fields
from .device_weights import MTP_HEAD, WTYPE_CODE, DeviceWeights
from .draft import DraftDevice

I32 = np.int32
MARKOV_W1, MARKOV_W2 = "markov_head.markov_w1.weight", "markov_head.markov_w2.weight"
MAIN_PROJ, MAIN_NORM = "main_proj.weight", "main_norm.weight"
GATHER_WTYPES = ("f32", "f16", "bf16", "q8_0")  # what step_markov_gather reads


def dspark_device_names(stages, dcfg) -> dict[str, str]:
    """Device name -> DSparkWeights name (`mtp.S.*`): stage s's block under layer s's names, the
    last stage's hc head and norm under the head's, the draft's own input and Markov tensors
    under their own names (the embedding and output matrix are the target's)."""
    out = {f"blk.{s}.{suffix}": f"{PREFIX}{s}.{suffix}" for s in range(dcfg.n_stages)
           for suffix in layer_tensor_shapes(stages, s)}
    out.update({dev: own_name(own, -1, dcfg) for dev, own in MTP_HEAD.items()})
    for suffix, stage in ((MAIN_PROJ, 0), (MAIN_NORM, 0), (MARKOV_W1, -1), (MARKOV_W2, -1)):
        out[own_name(suffix, stage, dcfg)] = own_name(suffix, stage, dcfg)
    return out


# ---------------------------------------------------------------------------
# Pure host-side logic: requests -> the feed pass and the block pass
# ---------------------------------------------------------------------------


@dataclass
class FeedPass:
    rows: list[Row] = field(default_factory=list)   # in lane order, a request's consecutive
    src: list[int] = field(default_factory=list)    # per lane: the last step's lane holding its taps


@dataclass
class BlockPass:
    rows: list[Row] = field(default_factory=list)   # B rows a drafting request, in request order
    slots: list[int] = field(default_factory=list)  # per request lane: its slot
    anchors: list[int] = field(default_factory=list)
    owner: list[int] = field(default_factory=list)  # per request lane: its index in the requests


def feed_pass(requests: Sequence[DraftRequest], streams_at: dict, fed: np.ndarray, n_slots: int,
              vocab: int) -> FeedPass:
    """Every request's rows (streams_at: (slot, position) -> its lane in the last step), each
    request's first row at the next position its slot's draft state feeds (fed[slot]), as
    reference/dspark.py's feed requires. Raises ValueError before anything runs."""
    check_draft_requests(requests, n_slots, vocab)
    out = FeedPass()
    for q in requests:
        pos = [int(p) for p in q.positions]
        if pos and pos[0] != fed[q.slot]:
            raise ValueError(f"DSpark context row at position {pos[0]}, but slot {q.slot}'s draft state is at "
                             f"{int(fed[q.slot])}")
        for p in pos:
            if (q.slot, p) not in streams_at:
                raise ValueError(f"draft: slot {q.slot} position {p} was not a row of the last step()")
            out.rows.append(Row(q.slot, p, 0))
            out.src.append(streams_at[(q.slot, p)])
    return out


def block_pass(requests: Sequence[DraftRequest], fed: np.ndarray, block_size: int, noise: int) -> BlockPass:
    """A block of block_size rows for each request with k >= 1, after its slot's fed rows
    (fed: the positions fed so far, after the feed pass); its anchor is its last next token."""
    out = BlockPass()
    for i, q in enumerate(requests):
        if not q.k:
            continue
        if q.k > block_size:
            raise ValueError(f"slot {q.slot}: {q.k} drafts asked, DSpark proposes at most {block_size} "
                             f"(its block size) a round")
        start = int(fed[q.slot])
        if start == 0:
            raise ValueError("DSpark drafts after at least one context row (the official code asserts start_pos > 0)")
        anchor = int(q.next_tokens[-1])
        for j in range(block_size):
            out.rows.append(Row(q.slot, start + j, anchor if j == 0 else noise, want_logits=True, emit=True))
        out.slots.append(q.slot)
        out.anchors.append(anchor)
        out.owner.append(i)
    return out


def request_lanes(L: int, block_size: int, most: int) -> int:
    """The Markov chain's lanes in bucket L's draft program: its blocks (L // block_size, at
    least one) in whole lane groups of 16, at most `most` (request_capacity)."""
    return min(most, K.lane_groups(max(1, L // block_size)) * K.DECODE_LANES)


def request_capacity(n_slots: int, max_pass_rows: int, block_size: int) -> int:
    """Request lanes the Markov buffers hold: one per slot, at most a block of each the largest
    pass holds, in whole lane groups."""
    return K.lane_groups(max(1, min(n_slots, max_pass_rows // block_size))) * K.DECODE_LANES


# ---------------------------------------------------------------------------
# Device side
# ---------------------------------------------------------------------------


def state_config(stages, dcfg):
    """The draft state's config: the stages with a window of W + B (module docstring)."""
    return dataclasses.replace(stages, sliding_window=stages.sliding_window + dcfg.block_size)


def device_bytes(stages, dcfg, n_slots: int, n_pages: int, page_tokens: int, max_pass_rows: int, compact: bool,
                 max_context: int | None = None) -> int:
    """What DSparkDevice.configure allocates: the rings (DeviceState of state_config), the lane
    fields, the feed buffers, the Markov buffers and the taps rows of the backend's workspace."""
    n, d, T = max_pass_rows, stages.n_embd, len(dcfg.target_layers)
    R, V = request_capacity(n_slots, n, dcfg.block_size), stages.vocab_size
    return (DeviceState.bytes_needed(state_config(stages, dcfg), n_slots, n_pages, page_tokens, compact, max_context)
            + 4 * n * (2 * T * d + 2 * d + 1) + 5 * n * T * d // 4  # main_proj's int8 rows
            + 4 * R * (2 + dcfg.block_size + dcfg.markov_rank + (1 + dcfg.block_size) * V))


class DSparkDevice(DraftDevice):
    """The draft's weights, per-slot state (its stages' rings: a DeviceState of state_config),
    pass buffers and recorded programs (`feed` and `draft`, one per capacity bucket)."""

    def __init__(self, backend, dspark, device_weights: DeviceWeights | None = None):
        """dspark: what the reference draft is built from (gguf.dspark_file.DSparkWeights: its
        `config` the stages, `dspark` the DSparkConfig), or a stand-in with those two (benchmarks)."""
        self.rt, self.stages, self.dcfg = backend.rt, dspark.config, dspark.dspark
        if self.stages.hc_mult != backend.cfg.hc_mult or self.stages.n_embd != backend.cfg.n_embd:
            raise ValueError("DSpark stages of another width than the model's")
        self.cfg = state_config(self.stages, self.dcfg)
        self.taps = tuple(self.dcfg.target_layers)
        bad = [t for t in self.taps if not 0 <= t < backend.cfg.n_layer]
        if bad:
            raise ValueError(f"DSpark taps layers {bad}; the model has {backend.cfg.n_layer}")
        self.names = dspark_device_names(self.stages, self.dcfg)
        self.w = device_weights if device_weights is not None else DeviceWeights.from_draft(
            backend.rt, dspark, self.names, backend.w, backend.quantised_products)
        self.w1, self.w2 = own_name(MARKOV_W1, -1, self.dcfg), own_name(MARKOV_W2, -1, self.dcfg)
        self.proj, self.norm = own_name(MAIN_PROJ, 0, self.dcfg), own_name(MAIN_NORM, 0, self.dcfg)
        w1 = self.w.tensor(self.w1)
        if w1.wtype not in GATHER_WTYPES or w1.packed:
            raise ValueError(f"DSpark {self.w1} stored as {w1.wtype}: the device reads its rows in "
                             f"{', '.join(GATHER_WTYPES)} only")
        self._init_buffers()
        self._reset_programs()
        self.R = 0
        self.fed = np.zeros(0, np.int64)  # per slot: the positions fed to its rings so far
        self._fed_at: dict[int, int] = {}  # snapshot id -> the slot's fed positions then

    def _reset_programs(self) -> None:
        self.feed_programs: dict[int, object] = {}
        self.draft_programs: dict[int, object] = {}
        self.graphs: dict[str, dict] = {"feed": {}, "draft": {}}

    @property
    def max_draft_tokens(self) -> int:
        return self.dcfg.block_size

    def bytes_needed(self, n_slots: int, n_pages: int, page_tokens: int, max_pass_rows: int, compact: bool,
                     max_context: int | None = None) -> int:
        return device_bytes(self.stages, self.dcfg, n_slots, n_pages, page_tokens, max_pass_rows, compact,
                            max_context)

    def configure(self, backend, n_slots: int, n_pages: int, page_tokens: int,
                  max_context: int | None = None) -> None:
        self.free_state()
        rt, n, d = self.rt, backend.max_pass_rows, self.stages.n_embd
        T, V, B = len(self.taps), self.stages.vocab_size, self.dcfg.block_size
        self.state = DeviceState(rt, self.cfg, n_slots, n_pages, page_tokens, (), backend.compact, n_lanes=n,
                                 max_context=max_context)
        self.fed, self._fed_at = np.zeros(n_slots, np.int64), {}
        self.R = R = request_capacity(n_slots, n, B)
        for name, size in (("taps", n * T * d), ("hidden", n * T * d), ("main", n * d), ("mnorm", n * d),
                           ("src", n), ("req", 2 * R), ("dtok", B * R), ("e", R * self.dcfg.markov_rank),
                           ("mk", R * V), ("mlog", B * R * V)):
            self._bufs[name] = self._zeros(size)
        proj = self.w.mat(self.proj)
        if proj.packed:  # main_proj's input is T x d a lane: maybe wider than the backend's scratch
            self._q8 = K.Q8Rows.alloc(rt, n * T * d)
        # the K-split scratch, where main_proj's (or markov_w2's) is wider than the main model's
        split = max(K.ksplit_floats(proj.rows, proj.cols, n), K.ksplit_floats(V, self.dcfg.markov_rank, R))
        self._bufs["part"] = self._zeros(split) if 4 * split > backend._ws["ksplit"].nbytes else None
        self._reset_programs()
        rt.synchronize()

    @property
    def taps_rows(self):
        """The rows the backend's pass writes its stream means into (T x d a lane)."""
        return self._bufs["taps"]

    def record_taps(self, backend, rec, il: int) -> None:
        """In the backend's pass after layer il: its stream means into their columns of taps_rows."""
        if il not in self.taps:
            return
        c = backend.cfg
        rec.launch(rec.compile_file("step_ops.hip").kernel("step_stream_mean"), (rec.L,), (256,),
                   (backend._ws["s0"], backend.state.lane("slot"), I32(c.hc_mult), I32(c.n_embd), self.taps_rows,
                    I32(len(self.taps) * c.n_embd), I32(self.taps.index(il) * c.n_embd)))

    def build(self, backend, buckets) -> None:
        """Record the feed and draft programs of every bucket (after configure)."""
        view = backend._layer_view(self.cfg, self.w, self.state)
        if self._bufs["part"] is not None:
            view._ws = {**backend._ws, "ksplit": self._bufs["part"]}
        for L in buckets:
            rec = backend.recorder(L)
            self._record_feed(view, rec)
            self.feed_programs[L] = rec
            rec = backend.recorder(L)
            self._record_draft(view, rec)
            self.draft_programs[L] = rec

    def _record_feed(self, view, rec) -> None:
        L, c, ws, st, b = rec.L, view.cfg, view._ws, view.state, self._bufs
        T, d = len(self.taps), c.n_embd
        ko = rec.compile_file("step_ops.hip").kernel
        rec.launch(ko("step_gather_rows"), (L,), (256,), (self.taps_rows, b["src"], b["hidden"], I32(T * d)))
        q8 = None
        if self._q8 is not None:
            q8 = self._q8
            K.launch_quantize_q8(rec, b["hidden"], q8, L, T * d)
        view._mv(rec, self.proj, b["hidden"], b["main"], q8=q8)
        view._norm(rec, b["main"], self.norm, b["mnorm"], L, d)
        for s in range(self.dcfg.n_stages):
            view._mv(rec, f"blk.{s}.attn_kv.weight", b["mnorm"], ws["kv_raw"])
            view._norm_rope(rec, ws["kv_raw"], f"blk.{s}.attn_kv_a_norm.weight", ws["kv"], st.lane("pos"), 0, 1,
                            c.head_dim, fp8=view.numerics == "official")
            view._commit(rec, s)

    def _record_draft(self, view, rec) -> None:
        L, c, ws, st, b = rec.L, view.cfg, view._ws, view.state, self._bufs
        V, B, rank = c.vocab_size, self.dcfg.block_size, self.dcfg.markov_rank
        ko = rec.compile_file("step_ops.hip").kernel
        emb = view.w.tensor("token_embd.weight")
        rec.launch(ko("step_embed"), (L,), (256,), (emb.buf, I32(WTYPE_CODE[emb.wtype]), I32(c.n_embd),
                                                    I32(c.hc_mult), st.lane("tok"), ws["s0"]))
        for s in range(self.dcfg.n_stages):
            view._attention_layer(rec, s, commit=False, key_end="last")
            view._ffn_layer(rec, s)
        view._head(rec)  # every block row emits: head row r * B + i is request r's block row i
        R = request_lanes(L, B, self.R)
        slots, anchors, w1, w2 = b["req"], buffers.view(b["req"], 4 * self.R, 4 * self.R), \
            self.w.tensor(self.w1), self.w.mat(self.w2)
        for i in range(B):
            tok = anchors if i == 0 else buffers.view(b["dtok"], 4 * (i - 1) * self.R, 4 * self.R)
            rec.launch(ko("step_markov_gather"), (R,), (256,),
                       (w1.buf, I32(WTYPE_CODE[w1.wtype]), I32(rank), I32(V), slots, tok, b["e"]))
            if w2.packed:
                K.launch_quantize_q8(rec, b["e"], view._q8, R, rank)
                K.launch_qmatvec(rec, w2, view._q8, b["mk"], R, lane_slot=slots)
            else:
                K.launch_matvec(rec, w2, b["e"], b["mk"], R, lane_slot=slots, part=ws["ksplit"])
            mlog = buffers.view(b["mlog"], 4 * i * self.R * V, 4 * self.R * V)  # kept: the tests read them
            rec.launch(ko("step_markov_add"), (-(-R * V // 256),), (256,),
                       (ws["logits"], b["mk"], slots, I32(B), I32(i), I32(R), I32(V), mlog))
            K.launch_argmax(rec, mlog, buffers.view(b["dtok"], 4 * i * self.R, 4 * self.R), R, V, lane_slot=slots)

    # ---- the slots' draft state: its rings (DeviceState) and fed positions -----------
    def reset_slot(self, slot: int) -> None:
        super().reset_slot(slot)
        self.fed[slot] = 0

    def save_state(self, slot: int) -> int:
        sid = super().save_state(slot)
        self._fed_at[sid] = int(self.fed[slot])
        return sid

    def restore_state(self, slot: int, snapshot: int) -> None:
        super().restore_state(slot, snapshot)
        self.fed[slot] = self._fed_at[snapshot]

    def drop_state(self, snapshot: int) -> None:
        super().drop_state(snapshot)
        del self._fed_at[snapshot]

    # ---- running -------------------------------------------------------------------
    def write_feed(self, p: FeedPass) -> None:
        self._write_rows(p.rows, p.src)

    def write_block(self, p: BlockPass) -> None:
        st = self.state
        st.write_lanes(lane_fields(p.rows, (), st.n_lanes))
        req = np.full((2, self.R), -1, I32)
        req[0, : len(p.slots)] = p.slots
        req[1, : len(p.anchors)] = p.anchors
        self.rt.h2d(self._bufs["req"], req)

    def drafts(self, n: int) -> np.ndarray:
        """(n, B) the last draft program's tokens of its first n request lanes."""
        tok = self.rt.download(self._bufs["dtok"], (self.dcfg.block_size, self.R), I32)
        return np.ascontiguousarray(tok[:, :n].T)

    def logits(self, n: int) -> np.ndarray:
        """(n, B, vocab) the logits the last draft program's tokens are the argmax of (reference/
        dspark.py's DraftBlock.logits), of its first n request lanes."""
        V = self.stages.vocab_size
        out = self.rt.download(self._bufs["mlog"], (self.dcfg.block_size, self.R, V), np.float32)
        return np.ascontiguousarray(out[:, :n].transpose(1, 0, 2))
