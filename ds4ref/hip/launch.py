"""Device launchers (`launch_*`) and the shape arithmetic they share: DeviceBuffers in, one
kernel launch out. HipBackend records them into its graphs (backend.py, mtp.py); the op twins
(twins.py) wrap them numpy in, numpy out for the tests. Weights: f32 / f16 arrays as they are;
bf16 as raw uint16 with wtype="bf16"; block quants as raw uint8 rows (layouts.py)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backend import DECODE_LANES
from ..numerics import canon
from ..settings import getenv, getenv_int
from .buffers import DeviceBuffer
from .builds import qgemm_options
from .layouts import _need, DeviceWeight, K_QUANTS, packed_row_bytes, QUANT_WTYPES, UnsupportedShapeError
from .runtime import Runtime

I32, F32 = np.int32, np.float32
_SOURCES = {
    "norm": "norm.hip", "quant": "quant.hip", "matvec": "matvec.hip",
    "pool": "pool.hip", "indexer": "indexer.hip", "moe": "moe.hip",
    "hc": "hc.hip", "qdot": "qdot.hip", "qgemm": "qgemm.hip", "step_ops": "step_ops.hip", "step_state": "step_state.hip",
}


def kernel(rt: Runtime, family: str, name: str):
    return rt.compile_file(_SOURCES[family]).kernel(name)


def _blocks(n: int, per: int) -> int:
    return max(1, -(-int(n) // per))


# ---------------------------------------------------------------------------
# Norms, RoPE
# ---------------------------------------------------------------------------


def launch_rmsnorm(rt, x: DeviceBuffer, w: DeviceBuffer | None, y: DeviceBuffer, rows: int, D: int, eps: float,
                   lane_slot=None, rows_per_lane: int = 1):
    rt.launch(kernel(rt, "norm", "ds4_rmsnorm"), (rows,), (256,),
              (x, w, y, I32(D), F32(eps), lane_slot, I32(rows_per_lane)))


def launch_rmsnorm_q8(rt, x: DeviceBuffer, w: DeviceBuffer | None, y: DeviceBuffer, rows: int, D: int, eps: float,
                      q: "Q8Rows", lane_slot=None):
    """ds4_rmsnorm, and y's rows quantised into q (D wide) for the products that read them."""
    _need(D % 32 == 0, f"rmsnorm_q8: width {D} is not a multiple of 32")
    _need(rows * D <= q.capacity, f"rmsnorm_q8: {rows} x {D} exceeds the scratch ({q.capacity})")
    rt.launch(kernel(rt, "norm", "ds4_rmsnorm_q8"), (rows, _blocks(D, 256)), (256,),
              (x, w, y, I32(D), F32(eps), lane_slot, q.xq, q.dx, q.xs))


def launch_norm_rope(rt, x: DeviceBuffer, w: DeviceBuffer | None, y: DeviceBuffer, L: int, rows_per_lane: int,
                     D: int, eps: float, pos: DeviceBuffer, cs: DeviceBuffer, half: int, inverse: bool = False,
                     fp8: bool = False, lane_slot=None) -> None:
    """y <- rmsnorm of x's L * rows_per_lane rows, RoPE'd at their lanes' positions and, with
    fp8, the other dims FP8 round-tripped (reference ops.fp8sim): launch_rmsnorm, step_rope_pos and
    the round trip in one launch."""
    _need(2 * half <= D, f"norm_rope: {2 * half} rotated dims exceed the row length {D}")
    _need(not fp8 or (D - 2 * half) % 64 == 0, f"norm_rope: non-RoPE dims {D - 2 * half} must be a multiple of 64")
    rt.launch(kernel(rt, "norm", "ds4_norm_rope"), (L * rows_per_lane,), (256,),
              (x, w, y, I32(D), F32(eps), lane_slot, I32(rows_per_lane), pos, cs, I32(half),
               I32(1 if inverse else 0), I32(1 if fp8 else 0)))


# ---------------------------------------------------------------------------
# FP8 / FP4 numerics
# ---------------------------------------------------------------------------


def launch_qat(rt, v: DeviceBuffer, ht: DeviceBuffer, out: DeviceBuffer, rows: int, n: int,
               lane_slot=None, rows_per_lane: int = 1) -> None:
    """out <- the indexer's QAT of rows of n: the Hadamard rotation (ht: the table transposed),
    then FP4 E2M1 in blocks of 32."""
    _need(n % 32 == 0, f"qat: row length {n} must be a multiple of 32")
    rt.launch(kernel(rt, "quant", "ds4_qat_rows"), (_blocks(rows * n, 256),), (256,),
              (v, ht, out, I32(rows), I32(n), lane_slot, I32(rows_per_lane)))


def lane_groups(L: int) -> int:
    """Groups of DECODE_LANES a pass of L lanes runs in (matvec v3 and the routed experts)."""
    return -(-int(L) // DECODE_LANES)


def launch_matvec(rt, w: DeviceWeight, x: DeviceBuffer, y: DeviceBuffer, L: int, *, groups: int = 1,
                  ldx: int | None = None, xg: int = 0, ldy: int | None = None, gs: int | None = None,
                  lane_slot: DeviceBuffer | None = None, part: DeviceBuffer | None = None) -> None:
    """y[l*ldy + g*gs + r] = W[g*N + r] . x[l, g*xg : g*xg + K] for l < L, N = rows / groups
    (gs = N by default: the groups side by side in each lane's row).

    Any L, in lane groups of 16 (a prompt pass). `lane_slot` (int32[L] slot ids, -1 =
    padding after the rows) limits the work to lanes up to the last one with a slot (later
    lanes' y is left as it was); `part` is scratch for the fixed K-split of few-row matrices
    (matvec_ksplit); without it they run unsplit."""
    _need(1 <= L, f"matvec: {L} lanes")
    n = w.rows // groups
    ldx = ldx if ldx is not None else w.cols
    ldy = ldy if ldy is not None else w.rows
    nlg = lane_groups(L)
    ks = matvec_ksplit(w.rows, w.cols) if groups == 1 else 0
    if ks and part is not None:
        nsplit = launch_matvec_slices(rt, w, x, part, L, ldx=ldx, lane_slot=lane_slot)
        rt.launch(kernel(rt, "matvec", "ds4_matvec3_ksum"), (_blocks(nlg * DECODE_LANES * n, 256),), (256,),
                  (part, y, I32(n), I32(L), I32(ldy), I32(nsplit), lane_slot))
        return
    rpw = matvec_rows_per_warp(rt, n * groups, L)
    if w.wtype in K_QUANTS:
        rpw = min(rpw, 2)  # r1 and r2 are built for the K-quants and MXFP4
    rt.launch(kernel(rt, "matvec", f"ds4_matvec3_{w.wtype}_r{rpw}"), (_blocks(n, 8 * rpw), groups, nlg),
              (256,), (w.buf, x, y, I32(n), I32(w.cols), I32(L), I32(ldx), I32(xg), I32(ldy),
                       np.int64(n if gs is None else gs), lane_slot))


def launch_matvec_slices(rt, w: DeviceWeight, x: DeviceBuffer, part: DeviceBuffer, L: int, *,
                         ldx: int | None = None, lane_slot: DeviceBuffer | None = None) -> int:
    """The K-split's first half for a matrix matvec_ksplit splits: slice z of lane l's product into
    part[(z * LS + l) * N + r] (LS = lane_groups(L) * DECODE_LANES). Returns the slice count; the
    slices are added in order by ds4_matvec3_ksum, or by the kernel that reads the product."""
    ks = matvec_ksplit(w.rows, w.cols)
    _need(ks > 0 and part is not None, f"matvec: a {w.rows} x {w.cols} matrix is not K-split")
    _need(part.nbytes >= 4 * ksplit_floats(w.rows, w.cols, L), "matvec: K-split scratch too small")
    nsplit = -(-w.cols // ks)
    rt.launch(kernel(rt, "matvec", f"ds4_matvec3_{w.wtype}_r1_ks"), (_blocks(w.rows, 8), lane_groups(L), nsplit),
              (256,), (w.buf, x, part, I32(w.rows), I32(w.cols), I32(L), I32(ldx if ldx is not None else w.cols),
                       lane_slot, I32(ks)))
    return nsplit


# K-split: few-row, long-row matrices (hc projections 24 x 16384, router, indexer
# weights) are cut into column slices summed in order, so they occupy more blocks. The
# rule is part of the canonical arithmetic (canon.ksplit): the reference slices the same.


def matvec_ksplit(rows: int, cols: int) -> int:
    """Columns per slice of the fixed K-split for this shape, 0 = not split (canon.ksplit)."""
    return canon.ksplit(rows, cols)


def ksplit_floats(rows: int, cols: int, L: int = DECODE_LANES) -> int:
    """Scratch floats the K-split of this shape needs (L lanes in whole groups x rows x slices)."""
    ks = matvec_ksplit(rows, cols)
    return lane_groups(L) * DECODE_LANES * rows * -(-cols // ks) if ks else 0


def matvec_rows_per_warp(rt, rows: int, L: int = DECODE_LANES) -> int:
    """Rows per warp: by the matrix's row count (RPW3_POLICY: the smallest row count
    from which each R is used), and for a prompt pass (L > 16) PREFILL_RPW for every matrix;
    DS4REF_MATVEC_RPW forces one for experiments. The choice never changes a result."""
    forced = getenv("DS4REF_MATVEC_RPW")
    if forced:
        if forced not in ("1", "2", "4"):
            raise UnsupportedShapeError(f"DS4REF_MATVEC_RPW={forced!r} is not 1, 2 or 4")
        return int(forced)
    if L > DECODE_LANES:
        return PREFILL_RPW
    r = 1
    for rpw, min_rows in RPW3_POLICY:
        if rows >= min_rows:
            r = rpw
    return r


# measured on the H200 (docs/results/ops_gpu.md): r1 wins up to 2048 rows,
# r2 above at 1 and 16 lanes; r4 (208 registers, one block per SM) never won
RPW3_POLICY = ((2, 2049),)
# a prompt pass's dense matvecs: r2 for every matrix (r1 would stage each lane group's inputs
# for 8 rows only; r4 measured slower: 208 registers, one block per multiprocessor; H200,
# docs/results/prompt_passes.md)
PREFILL_RPW = getenv_int("DS4REF_PREFILL_RPW")


def ksplit_scratch(rt, dw: DeviceWeight, L: int = DECODE_LANES) -> DeviceBuffer | None:
    """A K-split scratch buffer for this weight at L lanes, or None when it is not split."""
    n = ksplit_floats(dw.rows, dw.cols, L)
    return rt.malloc(4 * n) if n else None


# ---------------------------------------------------------------------------
# Hyper-connections
# ---------------------------------------------------------------------------

HC_MAX = 8
HC_COLS = 512  # ds4_hc_pre_finish: the columns of u a block forms in a decode pass


def launch_hc_pre_finish(rt, streams, mix, base, scale, hc: int, d: int, rms_eps: float, hc_eps: float,
                         iters: int, u, post, comb, rows: int, lane_slot=None, slices=None) -> None:
    """u, post and comb of rows mixes (hc.hip): per row a block for post and comb and blocks over
    u's columns, HC_COLS a block in decode passes and all of them in prompt passes (each block
    re-reads the row for its norm, which only a few rows can afford). lane_slot: padding rows
    (negative entries) are skipped, their outputs left as they were. slices: (part, nsplit) of a
    K-split projection (launch_matvec_slices), whose slices the finish adds in place of mix."""
    cols = HC_COLS if rows <= DECODE_LANES else d
    part, nsplit = slices or (None, 0)
    rt.launch(kernel(rt, "hc", "ds4_hc_pre_finish"), (max(rows, 1), 1 + _blocks(d, cols)), (256,),
              (streams, mix, base, scale, I32(hc), I32(d), F32(rms_eps), F32(hc_eps), I32(iters), I32(cols),
               u, post, comb, lane_slot, part, I32(nsplit), I32(lane_groups(rows) * DECODE_LANES if part else 0)))


def launch_add_rows(rt, a: DeviceBuffer, b: DeviceBuffer, out: DeviceBuffer, L: int, hc: int, d: int) -> None:
    """out[l, k] = a[l, k] + b[l] for hc rows of d per lane (the MTP block's input streams)."""
    rt.launch(kernel(rt, "step_ops", "step_add_rows"), (_blocks(L * hc * d, 256),), (256,),
              (a, b, out, I32(L), I32(hc), I32(d)))


# ---------------------------------------------------------------------------
# Paged state: attention with sinks and indexer scores over a slot's ring and pages
# ---------------------------------------------------------------------------

AT_SPLIT = 32  # keys per slice: canon.ATTN_SLICE, and step_state.hip's AT3_SPLIT
AT3_SPLIT = AT_SPLIT
AT_CT = 128  # step_attention_combine's threads (step_state.hip's AT_CT)


def launch_attention_split(rt, H: int, L: int, nz: int, args: tuple) -> None:
    """step_attention_split over (head sets of 8, lanes, key slices), a warp a head."""
    rt.launch(kernel(rt, "step_state", "step_attention_split"), (_blocks(H, 8), L, nz), (256,), args)


@dataclass
class PagedLanes:
    """One pass over a small paged state, as the backend lays it out (device_state.py):
    per-lane slot (-1 = padding), position, the slot's first position and lane in the pass,
    visible compressed rows; block table (slots, maxp) of pages of `per` rows each."""
    slot: np.ndarray
    pos: np.ndarray
    pstart: np.ndarray
    flane: np.ndarray
    nvis: np.ndarray
    btab: np.ndarray
    per: int


def launch_attention_combine(rt, m, den, acc, sinks, slot, pos, store, nvis, sel, ksel: int, W: int, H: int,
                             D: int, nz: int, out, L: int, rope=None, half: int = 0, q8: "Q8Rows | None" = None,
                             kend=None):
    """out <- each (head, lane)'s slices merged in order with the sink; with rope (the (P, half, 2)
    table) the last 2 * half dims inverse-RoPE'd at the lane's position; with q8 the rows (H * D
    wide) quantised into it as well, for the output product. kend: per lane the position its raw
    keys end at, the `pos` its split ran with (None: pos)."""
    _need(rope is not None or not half, "attention combine: RoPE dims without a table")
    _need(q8 is None or D % 32 == 0, f"attention combine: head dim {D} is not a multiple of 32")
    _need(q8 is None or L * H * D <= q8.capacity, f"attention combine: {L} x {H * D} exceeds the int8 scratch")
    rt.launch(kernel(rt, "step_state", "step_attention_combine"), (H, L), (AT_CT,),
              (m, den, acc, sinks, slot, pos, kend, store, nvis, sel, I32(ksel), I32(W), I32(H), I32(D), I32(nz), out,
               rope, I32(half), *((q8.xq, q8.dx, q8.xs) if q8 is not None else (None, None, None))))


def launch_swiglu_act(rt, g: DeviceBuffer, u: DeviceBuffer, h: DeviceBuffer, n: int, clamp: float,
                      q: "Q8Rows | None" = None) -> None:
    """h = the clamped SwiGLU activation of g and u (n values); with q, h's rows (a multiple of
    32 wide) are also quantised into q for the down product."""
    if q is None:
        rt.launch(kernel(rt, "moe", "ds4_swiglu_act"), (_blocks(n, 256),), (256,),
                  (g, u, h, np.int64(n), F32(clamp)))
        return
    _need(n % 32 == 0 and n <= q.capacity, f"swiglu_act_q8: {n} values do not fit the scratch ({q.capacity})")
    rt.launch(kernel(rt, "moe", "ds4_swiglu_act_q8"), (_blocks(n, 256),), (256,),
              (g, u, h, np.int64(n // 32), F32(clamp), q.xq, q.dx, q.xs))


EL_PAIRS = DECODE_LANES  # step_expert_list's entry: expert id, pair count, up to 16 (lane, choice) pairs
EL_STRIDE = 2 + EL_PAIRS
EL_BITS, EL_EXPERTS = 8192, 1024  # step_expert_list's bit words a chunk of lanes, and its most experts
# The most rows of one pass. The kernels have no cap of their own below it (step_expert_list takes
# the lanes in chunks; every index past 2^31 elements is 64-bit), and what a pass of it needs is the
# memory plan's to allow: the workspace grows with the rows, for Flash's 16 lanes of 64K 9.8 GiB at
# 2,048 rows and 19.4 GiB at 4,096 (docs/paging.md), more than half of it attention partials.
# 8,192 rows would take 38.8 GiB, two thirds of what an H200 (139 GiB) has beside Flash's q2 weights
# (80.8 GiB) and before its KV pages, for experts that hold about 96 (lane, choice) pairs each at 4,096.
LARGEST_PASS = 4096


def launch_expert_list(rt, ids, slots, L: int, kk: int, n_expert: int, elist) -> None:
    """elist <- step_expert_list's work entries for the routing ids (L, kk) of a pass of L lanes."""
    _need(1 <= n_expert <= EL_EXPERTS, f"expert list: {n_expert} experts exceed the kernel's {EL_EXPERTS}")
    rt.launch(rt.compile_file("step_ops.hip").kernel("step_expert_list"), (1,), (256,),
              (ids, slots, I32(L), I32(kk), I32(n_expert), elist))


def largest_pass(cfg) -> int:
    """The most rows one pass of this model can hold: LARGEST_PASS for a model of up to EL_EXPERTS
    experts (step_expert_list's shared memory holds two counts an expert), else none."""
    return LARGEST_PASS if cfg.n_expert <= EL_EXPERTS else 0


def expert_list_ints(n_expert: int, kk: int, L: int = DECODE_LANES) -> int:
    """int32s of step_expert_list's output for a pass of L lanes: the count, then the entries.
    An expert with c pairs takes ceil(c / 16) entries, so the chosen experts (at most
    min(E, L*kk)) take at most that many plus L*kk / 16."""
    return 1 + (min(n_expert, L * kk) + L * kk // EL_PAIRS) * EL_STRIDE


# encodings with a 4-rows-per-warp routed-expert kernel (step_ops.hip). bf16 only: in a prompt
# pass it took bf16 experts from 114.6 to 85.3 ms, but IQ2_XXS from 330.8 to 342.2 and Q2_K from
# 154.9 to 171.0 ms (H200, docs/results/prompt_passes.md), so the others stop at 2
EXPERT_R4 = ("bf16",)


def expert_rows_per_warp(wtype: str, want: int) -> int:
    """The rows per warp a routed-expert launch of this encoding gets when `want` is asked."""
    return want if want <= 2 or wtype in EXPERT_R4 else 2


def expert_blocks(rt) -> int:
    """The routed-expert kernel's fixed grid: a few resident blocks per multiprocessor, each
    walking work items, so the grid never depends on how many experts exist."""
    return 4 * max(1, int(getattr(rt.info, "multiprocessors", 0) or 32))


def launch_routed_experts(rt, wbuf, wtype: str, r: int, x, per_choice: int, elist, y, N: int, K: int,
                          kk: int) -> None:
    kern = rt.compile_file("step_ops.hip").kernel(f"step_experts3_{wtype}_r{r}")
    rt.launch(kern, (expert_blocks(rt),), (256,), (wbuf, x, I32(per_choice), elist, y, I32(N), I32(K), I32(kk)))


NON_FINITE_ROW = -2  # ds4_argmax's answer for a row holding a NaN or an infinity (DS4_NON_FINITE_ROW)


def launch_argmax(rt, x: DeviceBuffer, out: DeviceBuffer, L: int, V: int, lane_slot=None) -> None:
    rt.launch(kernel(rt, "moe", "ds4_argmax"), (max(L, 1),), (1024,), (x, I32(V), out, lane_slot))


@dataclass
class Q8Rows:
    """Device buffers of quantised activation rows: codes (rows, W) int8, block scales
    (rows, W/32) f32 and half sums (rows, W/16) int16, for up to `capacity` elements."""
    xq: DeviceBuffer
    dx: DeviceBuffer
    xs: DeviceBuffer
    capacity: int

    @classmethod
    def alloc(cls, rt, elements: int) -> "Q8Rows":
        n = -(-int(elements) // 32) * 32
        return cls(rt.malloc(n), rt.malloc(4 * (n // 32)), rt.malloc(2 * (n // 16)), n)

    def free(self) -> None:
        for b in (self.xq, self.dx, self.xs):
            b.free()

    def get(self, rt, rows: int, W: int) -> tuple[np.ndarray, np.ndarray]:
        """(codes (rows, W) int8, block scales (rows, W/32) f32) of the first rows."""
        rt.synchronize()
        return rt.download(self.xq, (rows, W), np.int8), rt.download(self.dx, (rows, W // 32), F32)


def launch_quantize_q8(rt, x: DeviceBuffer, q: Q8Rows, rows: int, W: int, ldx: int | None = None) -> None:
    """q <- the rows of x (rows x W floats, ldx apart) quantised per 32-column block."""
    _need(W % 32 == 0, f"quantize_q8: width {W} is not a multiple of 32")
    _need(rows * W <= q.capacity, f"quantize_q8: {rows} x {W} exceeds the scratch ({q.capacity})")
    rt.launch(kernel(rt, "qdot", "ds4_quantize_q8"), (_blocks(rows * W, 256),), (256,),
              (x, np.int64(ldx or W), I32(W), I32(rows), q.xq, q.dx, q.xs))


# Passes of more rows than MMA_ROWS run dense quantised products as the tiled int8 GEMM
# (qgemm.hip): 1.5x (Q2_K) to 2.0x (Q8_0, IQ2_XXS) the dp4a kernel on 4096 x 4096 at 256 rows on the H200
# (docs/results/prompt_gemm.md), the same bits.
MMA_ROWS = 16


def qmatvec_rows_per_warp(rows: int) -> int:
    """Rows a warp of the decode products (rows: the launch's, all groups). Measured on the H200
    (docs/results/decode_layouts.md): one row a warp up to 1,024 rows (Flash's attn_q_a, attn_kv), where
    the grid is otherwise too small to keep the memory busy; two from there on."""
    return 2 if rows > 1024 else 1


# Blocks a multiprocessor of the decode products' grid (0: one block a row block). A block then
# walks row blocks and stages its inputs once where all of K fits (qdot.hip's mq_body): at 2,
# Flash's attn_q_b (32768 x 1024) took 15 % less at 1 and at 16 lanes, the others the same.
QMATVEC_BLOCKS_PER_SM = 2


def qmatvec_grid(rt, row_blocks: int, per_sm: int | None = None) -> int:
    per_sm = QMATVEC_BLOCKS_PER_SM if per_sm is None else per_sm
    cap = per_sm * max(1, int(getattr(rt.info, "multiprocessors", 0) or 32))
    return min(row_blocks, cap) if cap else row_blocks


def launch_qmatvec(rt, w: DeviceWeight, q: Q8Rows, y: DeviceBuffer, L: int, *, groups: int = 1,
                   Wx: int | None = None, xg: int = 0, ldy: int | None = None, gs: int | None = None,
                   lane_slot: DeviceBuffer | None = None, gemm: bool = True, max_blocks: int = 0,
                   rows_per_warp: int | None = None, blocks_per_sm: int | None = None) -> None:
    """y[l*ldy + g*gs + r] = W[g*N + r] . x[l, g*xg : g*xg + K] (gs = N by default) with x quantised
    in q (rows Wx wide); past MMA_ROWS rows the tiled GEMM (qgemm.hip) unless gemm is off (the
    decode kernel, for timing them side by side). max_blocks caps the decode kernel's grid (the op
    twins' check of its row-block loop); rows_per_warp and blocks_per_sm override the policy
    (qmatvec_rows_per_warp, QMATVEC_BLOCKS_PER_SM; 0 blocks: uncapped) for the op table."""
    _need(w.packed and w.wtype in QUANT_WTYPES, f"qmatvec: {w.wtype} weights not in pack_qrows' layout")
    n = w.rows // groups
    if L > MMA_ROWS and gemm:
        module = rt.compile_file(_SOURCES["qgemm"], qgemm_options(w.wtype))
        grid, fn = (_blocks(n, 64), _blocks(L, 64), groups), module.kernel(f"ds4_qgemm_{w.wtype}")
    else:
        r = rows_per_warp or qmatvec_rows_per_warp(w.rows)
        row_blocks = _blocks(n, 8 * r)
        blocks = min(row_blocks, max_blocks) if max_blocks else qmatvec_grid(rt, row_blocks, blocks_per_sm)
        grid, fn = (blocks, groups, lane_groups(L)), kernel(rt, "qdot", f"ds4_qmatvec_{w.wtype}_r{r}")
    rt.launch(fn, grid, (256,), (w.buf, np.int64(packed_row_bytes(w.wtype, w.cols)), q.xq, q.dx, q.xs, y, I32(n),
                                 I32(w.cols), I32(L), I32(Wx or w.cols), I32(xg), I32(ldy or w.rows),
                                 np.int64(n if gs is None else gs), lane_slot))


# The routed experts of a pass run as the grouped tiled GEMM (qgemm.hip's ds4_qexperts_gemm_*) when
# the chosen experts hold more than EXPERT_GEMM_PAIRS pairs each on average (L * kk > 8 E: Flash's
# 256 experts, top 6, from 342 rows, so the 512-row bucket on). A tile costs about the same for 6
# pairs as for 64 (it decodes its 64 weight rows once either way), the dp4a walk about in
# proportion to its pairs: at 256 rows (~6 pairs an expert) GEMM forms of 64 weight rows measured
# 1.25x the dp4a walk's 1.2-1.7 ms (docs/results/prompt_gemm.md, "The routed experts stay on dp4a"),
# at 1,024 rows (~24 pairs) the walk took 3.5 ms a launch (IQ2_XXS gate/up, 301 ms over 86 launches:
# docs/results/prefill_gpu.md). The same bits either way; benchmarks/ops_gpu.py times both.
EXPERT_GEMM_PAIRS = 8


def qexperts_gemm(L: int, kk: int, n_expert: int) -> bool:
    """Whether a pass of L rows runs its quantised routed experts as the grouped GEMM."""
    return L * kk > EXPERT_GEMM_PAIRS * n_expert


TILE_ROWS = 64  # qgemm.hip's QG_TILE: pairs of one expert a grouped tile holds
EL_TILE_ENTRIES = TILE_ROWS // EL_PAIRS  # list entries a tile (ds4_hip.h)


def expert_tiles(n_expert: int, kk: int, L: int) -> int:
    """The most grouped tiles of a pass of L rows: an expert of c pairs takes ceil(c / 64), so the
    chosen experts (at most min(E, L*kk)) take at most that many plus L*kk / 64."""
    return min(n_expert, L * kk) + -(-L * kk // TILE_ROWS)


def expert_tiles_ints(n_expert: int, kk: int, L: int) -> int:
    """int32s of step_expert_tiles' output: the count, then (first entry, pairs) a tile."""
    return 1 + 2 * expert_tiles(n_expert, kk, L)


def launch_expert_tiles(rt, elist, tiles) -> None:
    """tiles <- step_expert_tiles' row tiles of step_expert_list's entries (elist)."""
    rt.launch(kernel(rt, "step_ops", "step_expert_tiles"), (1,), (256,), (elist, tiles))


def launch_qexperts_gemm(rt, wbuf, wtype: str, q: Q8Rows, per_choice: int, elist, tiles, y, N: int, K: int,
                         kk: int, L: int, n_expert: int) -> None:
    """The routed experts of step_expert_list's entries (elist) as the grouped GEMM over the row
    tiles step_expert_tiles wrote to tiles (for a pass of L rows): the grid holds the most tiles a
    pass can have, and blocks past the count leave."""
    module = rt.compile_file(_SOURCES["qgemm"], qgemm_options(wtype))
    rt.launch(module.kernel(f"ds4_qexperts_gemm_{wtype}"), (_blocks(N, TILE_ROWS), expert_tiles(n_expert, kk, L)),
              (256,), (wbuf, np.int64(packed_row_bytes(wtype, K)), q.xq, q.dx, q.xs, I32(per_choice), elist, tiles,
                       y, I32(N), I32(K), I32(kk)))


def launch_qexperts(rt, wbuf, wtype: str, q: Q8Rows, per_choice: int, elist, y, N: int, K: int, kk: int) -> None:
    """The routed experts of step_expert_list's entries, inputs quantised in q (rows K wide)."""
    rt.launch(kernel(rt, "qdot", f"ds4_qexperts_{wtype}_r{qmatvec_rows_per_warp(N)}"), (expert_blocks(rt),), (256,),
              (wbuf, np.int64(packed_row_bytes(wtype, K)), q.xq, q.dx, q.xs, I32(per_choice), elist, y,
               I32(N), I32(K), I32(kk)))
