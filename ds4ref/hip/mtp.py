"""The MTP block on the device: speculation's drafts (backend.Backend.draft, docs/mtp.md).

The block runs as a one-layer model (gguf.mtp.mtp_config: one sliding-window layer, ratio 0)
through HipBackend's own layer and head builders, over a shallow copy of the backend whose
config, weights and state are the MTP's (`HipBackend._layer_view`): same workspace, RoPE
tables, numerics and kernels, so a row's arithmetic is the main layers' and reference/mtp.py's.
What the main pass does not have runs in front of the block:

  hidden = s0[src[lane]]                the streams a row starts from (step_gather_rows): the
                                        last step()'s final streams, or the previous MTP pass's
  h = hnorm(hidden), per stream;  x = h_proj(h) + e_proj(enorm(embed(next token)))  (step_add_rows)

then the block (attention on the MTP's own ring, MoE), then the head with the MTP's hc head
and norm (under the head's names, device_weights.mtp_device_names) and the main output matrix.
A draft call is one pass over every request's rows (rows of a slot on consecutive lanes, as
step() lays them), then k - 1 one-row-per-request passes, each from the previous pass's output
streams (still in s0) and draft token. Each pass replays its bucket's captured graph.

The host-side planning (`first_pass`, `next_pass`) is pure and checked on the CPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..backend import DraftRequest, Row, check_draft_requests
from ..gguf.mtp import PREFIX
from . import launch as K
from .device_state import DeviceState
from .device_weights import WTYPE_CODE, DeviceWeights
from .draft import DraftDevice

I32 = np.int32


# ---------------------------------------------------------------------------
# Pure host-side logic: requests -> MTP passes
# ---------------------------------------------------------------------------


@dataclass
class MTPPass:
    rows: list[Row] = field(default_factory=list)   # in lane order; emit: the row's argmax is a draft
    src: list[int] = field(default_factory=list)    # per lane: the lane of s0 holding its input streams
    owner: list[int] = field(default_factory=list)  # per emitting row, in lane order: its request's index

    def emitting_lanes(self) -> list[int]:
        return [lane for lane, r in enumerate(self.rows) if r.emit]


def first_pass(requests: Sequence[DraftRequest], streams_at: dict, n_slots: int, vocab: int) -> MTPPass:
    """Every request's rows, a request's on consecutive lanes, from the last step's streams
    (streams_at: (slot, position) -> its lane in that step). The last row of a request with
    k >= 1 emits its first draft. Raises ValueError before anything runs."""
    check_draft_requests(requests, n_slots, vocab)
    out = MTPPass()
    for i, q in enumerate(requests):
        pos, nxt = [int(p) for p in q.positions], [int(t) for t in q.next_tokens]
        for p in pos:
            if (q.slot, p) not in streams_at:
                raise ValueError(f"draft: slot {q.slot} position {p} was not a row of the last step()")
        for j, (p, t) in enumerate(zip(pos, nxt)):
            emit = j == len(pos) - 1 and q.k >= 1
            out.rows.append(Row(q.slot, p, t, want_logits=emit, emit=emit))
            out.src.append(streams_at[(q.slot, p)])
            if emit:
                out.owner.append(i)
    return out


def next_pass(requests: Sequence[DraftRequest], step: int, drafts: Sequence[Sequence[int]], prev: MTPPass) -> MTPPass:
    """Draft step `step` (1..k-1): one row per request with k > step, at positions[-1] + step,
    fed its last draft, from the streams its previous row left (that pass's output in s0)."""
    lane_of = dict(zip(prev.owner, prev.emitting_lanes()))
    out = MTPPass()
    for i, q in enumerate(requests):
        if q.k > step:
            out.rows.append(Row(q.slot, int(q.positions[-1]) + step, int(drafts[i][-1])))
            out.src.append(lane_of[i])
            out.owner.append(i)
    return out


def last_position(requests: Sequence[DraftRequest]) -> int:
    """The highest position any MTP row of these requests runs at (its RoPE row must exist)."""
    return max(int(q.positions[-1]) + max(q.k - 1, 0) for q in requests)


# ---------------------------------------------------------------------------
# Device side
# ---------------------------------------------------------------------------


def device_bytes(mcfg, n_slots: int, n_pages: int, page_tokens: int, max_pass_rows: int, compact: bool,
                 max_context: int | None = None) -> int:
    """What MTPDevice.configure allocates for the one-layer MTP config mcfg: the rings, the lane
    fields and the pass buffers (the memory plan's 'MTP block' row on hip, and configure's check)."""
    n = max_pass_rows
    return (DeviceState.bytes_needed(mcfg, n_slots, n_pages, page_tokens, compact, max_context) + 4 * n * 16
            + 4 * n * (4 * mcfg.hc_mult * mcfg.n_embd + 3 * mcfg.n_embd + 1))


class MTPDevice(DraftDevice):
    """The MTP block's weights, per-slot state (its raw window ring: a one-layer DeviceState),
    pass buffers and recorded programs, one per capacity bucket of the backend."""

    def __init__(self, backend, mtp, device_weights: DeviceWeights | None = None):
        self.rt, self.cfg = backend.rt, mtp.config
        self.w = device_weights if device_weights is not None else DeviceWeights.from_mtp(
            backend.rt, mtp, backend.w, backend.quantised_products)
        self._init_buffers()
        self._reset_programs()

    def _reset_programs(self) -> None:
        self.programs: dict[int, object] = {}
        self.graphs: dict[int, object] = {}

    def bytes_needed(self, n_slots: int, n_pages: int, page_tokens: int, max_pass_rows: int, compact: bool,
                     max_context: int | None = None) -> int:
        return device_bytes(self.cfg, n_slots, n_pages, page_tokens, max_pass_rows, compact, max_context)

    def configure(self, backend, n_slots: int, n_pages: int, page_tokens: int,
                  max_context: int | None = None) -> None:
        """State and buffers for `backend`'s slots and largest pass; the backend records the
        programs (`record`, one per bucket) after this."""
        self.free_state()
        rt, c, n = self.rt, self.cfg, backend.max_pass_rows
        self.state = DeviceState(rt, c, n_slots, n_pages, page_tokens, (), backend.compact, n_lanes=n,
                                 max_context=max_context)
        hc, d = c.hc_mult, c.n_embd
        for name, width in (("hidden", hc * d), ("hnorm", hc * d), ("hproj", hc * d), ("e", d), ("enorm", d),
                            ("eproj", d)):
            self._bufs[name] = self._zeros(n * width)
        self._bufs["src"] = self._zeros(n)
        h_proj = self.w.mat(PREFIX + "h_proj.weight")
        if h_proj.packed:  # h_proj's input is hc rows a lane: wider than the backend's scratch holds
            self._q8 = K.Q8Rows.alloc(rt, n * hc * d)
        split = K.ksplit_floats(h_proj.rows, h_proj.cols, n * hc)
        self._bufs["part"] = self._zeros(split) if split else None
        rt.synchronize()

    def build(self, backend, buckets) -> None:
        """Record every bucket's MTP pass (after configure), in a view of the backend's builders."""
        view = backend._layer_view(self.cfg, self.w, self.state)
        for L in buckets:
            rec = backend.recorder(L)
            self.record(view, rec)
            self.programs[L] = rec

    def record(self, view, rec) -> None:
        """One MTP pass of rec.L lanes (module docstring), built by the backend's builders in `view`."""
        L, c, ws, st, b = rec.L, view.cfg, view._ws, view.state, self._bufs
        hc, d = c.hc_mult, c.n_embd
        ko = rec.compile_file("step_ops.hip").kernel
        rec.launch(ko("step_gather_rows"), (L,), (256,), (ws["s0"], b["src"], b["hidden"], I32(hc * d)))
        view._norm(rec, b["hidden"], PREFIX + "hnorm.weight", b["hnorm"], L * hc, d)
        self._streams_product(rec, PREFIX + "h_proj.weight", b["hnorm"], b["hproj"], L * hc)
        emb = view.w.tensor("token_embd.weight")  # one embedding row a lane: step_embed with 1 stream
        rec.launch(ko("step_embed"), (L,), (256,), (emb.buf, I32(WTYPE_CODE[emb.wtype]), I32(d), I32(1),
                                                    st.lane("tok"), b["e"]))
        view._norm(rec, b["e"], PREFIX + "enorm.weight", b["enorm"], L, d)
        view._mv(rec, PREFIX + "e_proj.weight", b["enorm"], b["eproj"])
        K.launch_add_rows(rec, b["hproj"], b["eproj"], ws["s0"], L, hc, d)
        view._attention_layer(rec, 0)
        view._ffn_layer(rec, 0)
        view._head(rec)  # the emitting rows: hc head, norm, output projection, argmax

    def _streams_product(self, rec, name, x, y, rows: int) -> None:
        """y = x @ W.T over rows = lanes x hc stream rows. Every row runs (no lane_slot: the
        slot ids are per lane, not per stream); padding lanes' rows are computed and unused."""
        w = self.w.mat(name)
        if w.packed:
            K.launch_quantize_q8(rec, x, self._q8, rows, w.cols)
            K.launch_qmatvec(rec, w, self._q8, y, rows)
            return
        K.launch_matvec(rec, w, x, y, rows, part=self._bufs["part"])

    # ---- running -------------------------------------------------------------------
    def write(self, p: MTPPass) -> None:
        """The pass's lane fields and source lanes, before its program runs."""
        self._write_rows(p.rows, p.src)
