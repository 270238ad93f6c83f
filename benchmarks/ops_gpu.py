"""Per-op GPU time at DS4 Flash dims, 1 and 16 lanes, against the memory-bandwidth floor.

floor = bytes the op must move (each input read once, each output written once)
        / measured device-to-device copy bandwidth (read + write bytes / time).
Times: each op's launches captured N times into one graph, replayed; events around
the replays; warm-up first; median of repeats; weights rotated among copies where
one copy would sit in L2. Writes a markdown table to --out (and prints it).

    python3 benchmarks/ops_gpu.py --out docs/results/ops_gpu.md
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import numpy as np

from ds4ref.hip import ops as g
from ds4ref.hip.runtime import get_runtime

F32, I32 = np.float32, np.int32
L2_BYTES = 64 << 20   # rotate inputs until a replay touches more than ~4x L2
VERSIONS = os.environ.get("DS4REF_BENCH_VERSIONS", "v3,v3 r1,v3 r2,v3 r4").split(",")


def median_ms(rt, fn, repeats=15):
    a, b = rt.event(), rt.event()
    ts = []
    for _ in range(repeats):
        rt.record(a)
        fn()
        rt.record(b)
        ts.append(rt.elapsed_ms(a, b))
    return statistics.median(ts)


def copy_bandwidth(rt, nbytes=1 << 30):
    src, dst = rt.malloc(nbytes), rt.malloc(nbytes)
    rt.memset32(src, 0x3F800000, nbytes // 4)
    for _ in range(3):
        rt.d2d(dst, src, nbytes)
    ms = median_ms(rt, lambda: rt.d2d(dst, src, nbytes), 10)
    src.free(); dst.free()
    return 2 * nbytes / (ms * 1e-3)


def time_op(rt, variants, reps=20):
    """variants: list of zero-arg launchers over rotating input copies. Returns µs per call."""
    for v in variants:  # eager warm-up: compiles, loads modules, checks launches
        v()
    rt.synchronize()
    rt.begin_capture()
    for i in range(reps):
        variants[i % len(variants)]()
    graph = rt.end_capture()
    for _ in range(3):
        rt.replay(graph)
    ms = median_ms(rt, lambda: rt.replay(graph))
    return ms * 1e3 / reps


class Bench:
    def __init__(self, rt, bw):
        self.rt, self.bw, self.rows, self.keep = rt, bw, [], []
        self.rng = np.random.default_rng(0)

    def up(self, arr):
        b = self.rt.upload(arr)
        self.keep.append(b)
        return b

    def out(self, shape, dtype=F32):
        b = g.poisoned(self.rt, shape, dtype)
        self.keep.append(b)
        return b

    def rnd(self, *shape, scale=1.0):
        return (self.rng.standard_normal(shape) * scale).astype(F32)

    def add(self, name, L, nbytes, variants, note=""):
        try:
            us = time_op(self.rt, variants)
        except Exception as e:  # noqa: BLE001 - report and keep benchmarking the rest
            print(f"FAILED {name} L={L}: {e}", file=sys.stderr)
            self.rows.append((name, L, float("nan"), nbytes, nbytes / self.bw * 1e6, "FAILED: " + str(e)[:60]))
            return
        floor = nbytes / self.bw * 1e6
        self.rows.append((name, L, us, nbytes, floor, note))
        print(f"{name:34s} L={L:2d} {us:9.2f} us  floor {floor:8.2f} us  {floor / us * 100:5.1f}%", flush=True)

    def free(self):
        for b in self.keep:
            b.free()
        self.keep = []


_HOST_WEIGHTS: dict = {}


def host_weight(b, rows, cols, wtype):
    key = (rows, cols, wtype)
    if key not in _HOST_WEIGHTS:  # made once, reused for every lane count
        w = b.rnd(rows, cols, scale=1 / math.sqrt(cols))
        if wtype == "bf16":
            w = g.f32_to_bf16_bits(w)
        elif wtype == "f16":
            w = w.astype(np.float16)
        elif wtype == "q8_0":
            w = g.quantize_q8_0(w)
        _HOST_WEIGHTS[key] = w
    return _HOST_WEIGHTS[key]


def weights(b, rows, cols, wtype, total_cap=512 << 20):
    """Rotating device copies of one random weight, enough to defeat L2."""
    w = host_weight(b, rows, cols, wtype)
    n = max(1, min(8, -(-4 * L2_BYTES // w.nbytes), total_cap // w.nbytes))
    out = []
    for _ in range(n):
        dw = g.DeviceWeight.upload(b.rt, w, wtype)
        b.keep.append(dw.buf)
        out.append(dw)
    return out, w.nbytes


def bench_matvecs(b, L):
    rt = b.rt
    cases = [("matvec bf16 4096x4096", 4096, 4096, "bf16"),
             ("attn_q_a q8_0 1024x4096", 1024, 4096, "q8_0"),
             ("attn_q_b q8_0 32768x1024", 32768, 1024, "q8_0"),
             ("attn_kv q8_0 512x4096", 512, 4096, "q8_0"),
             ("attn_output_b q8_0 4096x8192", 4096, 8192, "q8_0"),
             ("compressor_kv f16 1024x4096", 1024, 4096, "f16"),
             ("router f16 256x4096", 256, 4096, "f16"),
             ("shexp gate q8_0 2048x4096", 2048, 4096, "q8_0"),
             ("output q8_0 129280x4096", 129280, 4096, "q8_0")]
    for name, n, k, wt in cases:
        ws, wbytes = weights(b, n, k, wt)
        x, y = b.up(b.rnd(L, k)), b.out((L, n))
        for ver in VERSIONS:  # v3 rN: rows per warp forced; v3: the shipped policy
            g.KERNELS = ver.split()[0]
            if " r" in ver:
                os.environ["DS4REF_MATVEC_RPW"] = ver.split(" r")[1]
            b.add(f"{name} [{ver}]", L, wbytes + 4 * L * (k + n),
                  [lambda w=w: g.launch_matvec(rt, w, x, y, L) for w in ws], f"{len(ws)} weight copies")
            os.environ.pop("DS4REF_MATVEC_RPW", None)
        g.KERNELS = "v3"
    # grouped output A: 8 groups x 1024 rows, 4096 inputs each
    ws, wbytes = weights(b, 8 * 1024, 4096, "q8_0")
    x, y = b.up(b.rnd(L, 8 * 4096)), b.out((L, 8 * 1024))
    b.add("attn_output_a grouped q8_0 8x1024x4096", L, wbytes + 4 * L * (8 * 4096 + 8192),
          [lambda w=w: g.launch_matvec(rt, w, x, y, L, groups=8, ldx=8 * 4096, xg=4096, ldy=8192) for w in ws])


def bench_experts(b, L):
    """The routed-expert kernels (the backend's step_expert_list + step_experts3) at Flash dims:
    256 experts of 2048 x 4096 (gate/up) and 4096 x 2048 (down), bf16, top-6 distinct random
    ids per lane; only the chosen experts' bytes are counted."""
    rt = b.rt
    E, kk, ff, d = 256, 6, 2048, 4096
    ids = np.stack([b.rng.choice(E, kk, replace=False) for _ in range(16)]).astype(I32)
    slot = np.where(np.arange(16) < L, np.arange(16), -1).astype(I32)
    ko = rt.compile_file("step_ops.hip").kernel
    idb, slb = b.up(ids), b.up(slot)
    elist = b.out((g.expert_list_ints(E, kk),), I32)
    one = g.f32_to_bf16_bits(b.rnd(ff, d, scale=1 / math.sqrt(d)))
    for name, N, K, per_choice in (("experts gate bf16 256x2048x4096", ff, d, 0),
                                   ("experts down bf16 256x4096x2048", d, ff, 1)):
        wb = b.up(np.tile(one.reshape(-1), E))  # E copies of one matrix: the bytes are what count
        x = b.up(b.rnd(16 * kk if per_choice else 16, K))
        y = b.out((16 * kk, N))
        touched = len(np.unique(ids[:L]))
        for r in EXPERT_RPWS:
            def run(r=r, N=N, K=K, pc=per_choice, x=x, y=y, wb=wb):
                rt.launch(ko("step_expert_list"), (1,), (256,), (idb, slb, I32(kk), I32(E), elist))
                g.launch_routed_experts(rt, wb, "bf16", r, x, pc, elist, y, N, K, kk)
            b.add(f"{name} [v3 r{r}]", L, touched * N * K * 2 + 4 * L * kk * (K + N), [run],
                  f"{touched} experts touched")


EXPERT_RPWS = [int(r) for r in os.environ.get("DS4REF_BENCH_EXPERT_RPW", "1,2").split(",")]


def bench_small(b, L):
    rt = b.rt
    d, hc, D, H = 4096, 4, 512, 64
    # rmsnorm
    x, y, w = b.up(b.rnd(L, d)), b.out((L, d)), b.up(b.rnd(d))
    b.add("rmsnorm 4096", L, 4 * (2 * L * d + d), [lambda: g.launch_rmsnorm(rt, x, w, y, L, d, 1e-6)])
    # hc_pre: projection (24 x 16384 f32) + finish
    mixn = 2 * hc + hc * hc
    fws, fbytes = weights(b, mixn, hc * d, "f32", total_cap=64 << 20)
    st, mix = b.up(b.rnd(L, hc, d)), b.out((L, mixn))
    base, scale = b.up(b.rnd(mixn)), b.up(np.ones(3, F32))
    u, post, comb = b.out((L, d)), b.out((L, hc)), b.out((L, hc, hc))
    k_fin = g.kernel(rt, "hc", "ds4_hc_pre_finish")

    part = b.out((g.ksplit_floats(mixn, hc * d) or 1,))

    def hc_pre(fw):
        g.launch_matvec(rt, fw, st, mix, L, part=part)
        rt.launch(k_fin, (L,), (256,), (st, mix, base, scale, I32(hc), I32(d), F32(1e-6), np.float64(1e-6),
                                        I32(20), u, post, comb))
    b.add("hc_pre (K-split proj + sinkhorn) hc=4", L, fbytes + 4 * L * (2 * hc * d + d),
          [lambda fw=fw: hc_pre(fw) for fw in fws])
    # attention: 64 heads x 512, ring 128 + 512 selected compressed rows
    Wc, Cc = 128, 512
    q, out, sinks = b.up(b.rnd(L, H, D, scale=0.1)), b.out((L, H, D)), b.up(b.rnd(H))
    ring, comp = b.up(b.rnd(L, Wc, D)), b.up(b.rnd(L, Cc, D))
    rm, cm = b.up(np.ones((L, Wc), np.uint8)), b.up(np.ones((L, Cc), np.uint8))
    for ver in ("v2",):
        g.KERNELS = ver
        scr = g.attention_scratch(rt, L, H, D, Wc + Cc)
        b.keep.extend(scr or ())
        b.add(f"attention 64h x 512, 128 ring + 512 comp [{ver}]", L, 4 * L * ((Wc + Cc) * D + 2 * H * D),
              [lambda scr=scr: g.launch_attention(rt, q, ring, rm, Wc, comp, cm, Cc, sinks, out, L, H, D, scr)])
    g.KERNELS = "v3"
    # indexer over 8192 compressed rows (32K tokens), 64 heads x 128, then top-512
    n, Hi, Di = 8192, 64, 128
    qi, wi, keys = b.up(b.rnd(L, Hi, Di)), b.up(b.rnd(L, Hi)), b.up(b.rnd(L, n, Di))
    nv, sc, ids = b.up(np.full(L, n, I32)), b.out((L, n)), b.out((L, 512), I32)
    k_ix, k_tk = g.kernel(rt, "indexer", "ds4_indexer_scores"), g.kernel(rt, "indexer", "ds4_topk")
    b.add("indexer scores 8192 rows, 64h x 128", L, 4 * L * (n * Di + n + Hi * Di),
          [lambda: rt.launch(k_ix, (n // 64, L), (256,), (qi, wi, keys, nv, sc, I32(Hi), I32(Di), I32(n)))])
    b.add("top-512 of 8192", L, 4 * L * (n + 512),
          [lambda: rt.launch(k_tk, (L,), (512,), (sc, nv, I32(n), I32(512), ids))])
    # compressor pooling: ratio 4 (8 candidates, 512 wide), ratio 128
    k_pool = g.kernel(rt, "pool", "ds4_pool_window")
    for C in (8, 128):
        kv, s, o = b.up(b.rnd(L, C, D)), b.up(b.rnd(L, C, D)), b.out((L, D))
        b.add(f"pool_window C={C} D=512", L, 4 * L * (2 * C * D + D),
              [lambda kv=kv, s=s, o=o, C=C: rt.launch(k_pool, (g._blocks(L * D, 256),), (256,),
                                                      (kv, s, o, I32(L), I32(C), I32(D)))])
    # fp8sim of KV rows, qat of indexer q (64 heads x 128)
    kvr, kvo = b.up(b.rnd(L, D)), b.out((L, D))
    k_fp8 = g.kernel(rt, "quant", "ds4_fp8sim")
    b.add("fp8sim 512 (rope 64)", L, 8 * L * D, [lambda: rt.launch(k_fp8, (L,), (256,), (kvr, kvo, I32(L), I32(D), I32(64)))])
    from ds4ref.reference.ops import hadamard
    hq, hr, ho, hh = b.up(b.rnd(L * Hi, Di)), b.out((L * Hi, Di)), b.out((L * Hi, Di)), b.up(hadamard(Di, F32))
    k_had, k_e2 = g.kernel(rt, "quant", "ds4_hadamard_rows"), g.kernel(rt, "quant", "ds4_e2m1_blocks")
    R = L * Hi

    def qat():
        rt.launch(k_had, (g._blocks(R * Di, 256),), (256,), (hq, hh, hr, I32(R), I32(Di), None, I32(1)))
        rt.launch(k_e2, (g._blocks(R * Di // 32, 8),), (256,), (hr, ho, np.int64(R * Di // 32)))
    b.add("qat 64h x 128 (hadamard + e2m1)", L, 4 * (2 * R * Di + Di * Di), [qat])
    # router 256 experts, top 6
    lg, bias, rid, rw = b.up(b.rnd(L, 256)), b.up(b.rnd(256, scale=0.1)), b.out((L, 6), I32), b.out((L, 6))
    k_rt = g.kernel(rt, "moe", "ds4_route")
    b.add("route 256 -> 6", L, 4 * L * (256 + 12),
          [lambda: rt.launch(k_rt, (L,), (256,), (lg, bias, None, I32(256), I32(6), F32(1.5), I32(1), rid, rw))])
    # SwiGLU activation 2048 and argmax over the vocabulary
    ga, ua, ha = b.up(b.rnd(L, 2048)), b.up(b.rnd(L, 2048)), b.out((L, 2048))
    k_act = g.kernel(rt, "moe", "ds4_swiglu_act")
    b.add("swiglu act 2048", L, 12 * L * 2048,
          [lambda: rt.launch(k_act, (g._blocks(L * 2048, 256),), (256,), (ga, ua, ha, np.int64(L * 2048), F32(7.0)))])
    V = 129280
    lo, am = b.up(b.rnd(L, V)), b.out((L,), I32)
    b.add("argmax 129280", L, 4 * L * V, [lambda: g.launch_argmax(rt, lo, am, L, V)])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/results/ops_gpu.md")
    ap.add_argument("--lanes", default="1,16")
    args = ap.parse_args(argv)
    rt = get_runtime()
    t0 = time.time()
    bw = copy_bandwidth(rt)
    print(f"device {rt.info.name} ({rt.info.arch}, {rt.info.multiprocessors} SMs); copy bandwidth "
          f"{bw / 1e9:.0f} GB/s (read + write)", flush=True)
    b = Bench(rt, bw)
    for L in [int(s) for s in args.lanes.split(",")]:
        bench_matvecs(b, L)
        b.free()
        bench_experts(b, L)
        b.free()
        if os.environ.get("DS4REF_BENCH_SMALL", "1") != "0":
            bench_small(b, L)
            b.free()
    lines = [f"# GPU op timings ({rt.info.name}, {rt.info.arch})", "",
             f"Copy bandwidth (device-to-device, read + write): {bw / 1e9:.0f} GB/s. "
             f"floor = bytes / that bandwidth. Times: graph replay of 20 calls, median of 15, µs per call.",
             f"Generated by `benchmarks/ops_gpu.py` in {time.time() - t0:.0f} s.", "",
             "| op | lanes | µs | MB moved | floor µs | floor / time | note |", "|---|---|---|---|---|---|---|"]
    for name, L, us, nbytes, floor, note in b.rows:
        lines.append(f"| {name} | {L} | {us:.2f} | {nbytes / 1e6:.2f} | {floor:.2f} | "
                     f"{floor / us * 100:.1f}% | {note} |")
    text = "\n".join(lines) + "\n"
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
