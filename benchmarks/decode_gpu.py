"""Decode step time of HipBackend on Flash-shaped models with random weights.

    python benchmarks/decode_gpu.py --out /tmp/perf_decode_gpu.md          # 8 layers, bf16
    python benchmarks/decode_gpu.py --full --out /tmp/perf_full.md          # 43 layers, q2 policy

The model: hidden 4096, 64 heads x 512 (64 rotary), q_lora 1024, 8 output groups x 1024,
indexer 64 heads x 128 top-512, window 128, hc 4, 256 experts top-6 (ff 2048) + 1 shared,
vocab 129280. Default: 8 layers with ratios 0,0,4,128,4,128,4,128, every matrix bf16.
--full: Flash itself, 43 layers (0,0, then 4/128 alternating), stored as the published q2
files store it: IQ2_XXS gate/up and Q2_K down experts, Q8_0 attention, shared expert and
output, F16 embedding, HC, compressor, indexer and router (tiny.POLICIES, tiny_dtypes).
The weights are generated on the GPU (never on the host; the q2 blocks are tiled from
host-made templates of valid blocks). History: the slots' positions are set to the context length over
zeroed pages, so every step reads the full visible history (timing does not depend on
the values). Times: one decode pass of C rows (one per slot), graph replay, GPU events,
median of the repeats; "step" adds the host side (lane upload, argmax download).

Floor: bytes a pass must read (weights touched: everything but the routed experts, plus
the distinct experts C rows choose, expected under uniform routing; plus the visible
KV/indexer history) divided by the measured device copy bandwidth (read + write counted,
as in docs/results/ops_gpu.md). The gfx1151 column is the same bytes over 212 GB/s.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4ref.gguf.config import CSA  # noqa: E402
from ds4ref.backend import Row, StepPlan  # noqa: E402
from ds4ref.reference.state import ATTN, INDEX  # noqa: E402
from ds4ref.hip.synthetic import flash_config, make_model  # noqa: E402,F401 - the benchmarks' models

GFX1151_GBS = 212.0
# The upstream PR's own decode figures on Strix Halo (gfx1151), q2 Flash, tok/s at C = 1, 8, 16.
SEED_STRIX_TOKS = {1: 10.50, 8: 25.88, 16: 24.43}


def copy_bandwidth(rt, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy, bytes read + written per second."""
    a, b = rt.malloc(nbytes), rt.malloc(nbytes)
    e0, e1 = rt.event(), rt.event()
    rt.d2d(b, a, nbytes)
    rt.record(e0)
    for _ in range(5):
        rt.d2d(b, a, nbytes)
    rt.record(e1)
    ms = rt.elapsed_ms(e0, e1) / 5
    a.free()
    b.free()
    return 2 * nbytes / (ms * 1e-3)


def weight_bytes(dw, cfg, C: int) -> int:
    """Weight bytes one pass of C rows reads: all but routed experts, plus expected distinct experts."""
    fixed, per_expert = 0, 0
    for name, t in dw.mats.items():
        nb = t.buf.nbytes
        if "_exps." in name:
            per_expert += nb // cfg.n_expert
        elif name == "token_embd.weight":
            fixed += C * t.shape[-1] * 2  # C rows gathered
        else:
            fixed += nb
    fixed += sum(v.nbytes for v in dw.vecs.values() if v.nbytes < (1 << 22))
    distinct = cfg.n_expert * (1 - (1 - cfg.n_expert_used / cfg.n_expert) ** C)
    # per_expert summed the 3 matrices of one expert over all layers
    return int(fixed + distinct * per_expert)


def history_bytes(cfg, ctx: int, C: int, kv_row: int, index_row: int) -> int:
    """Raw window, compressed and indexer rows one pass reads for C rows at position ctx, as
    stored (kv_row / index_row bytes a row: float32, or the compact FP8/FP4 form)."""
    n = 0
    for r in cfg.compress_ratios:
        n += min(ctx + 1, cfg.sliding_window) * kv_row
        if r == CSA:
            n += (ctx + 1) // r * index_row + min((ctx + 1) // r, cfg.indexer_top_k) * kv_row
        elif r:
            n += (ctx + 1) // r * kv_row
    return n * C


def bench_case(backend, cfg, C: int, ctx: int, reps: int) -> tuple[float, float]:
    """(median ms of the graph replay, median ms of a whole step()) for C decode rows at ctx."""
    st = backend.state
    pages = -(-(ctx + reps + 8) // st.page_tokens)
    for s in range(16):
        backend.reset_slot(s)
    for s in range(C):
        backend.set_block_table(s, list(range(s * pages, (s + 1) * pages)))
        st.next_pos[s] = ctx  # synthetic history: zeroed pages, full visible length
    steps = []
    for i in range(reps):
        rows = [Row(s, ctx + i, (17 * s + i) % cfg.vocab_size, want_logits=False) for s in range(C)]
        t0 = time.perf_counter()
        backend.step(StepPlan.from_rows(rows))
        steps.append(time.perf_counter() - t0)
    rt = backend.rt
    gpu = []
    for _ in range(reps):
        e0, e1 = rt.event(), rt.event()
        rt.record(e0)
        rt.replay(backend._graphs[backend.bucket(C)])
        rt.record(e1)
        gpu.append(rt.elapsed_ms(e0, e1))
    return float(np.median(gpu)), 1e3 * float(np.median(steps[1:]))


def kernel_names(rt) -> dict:
    """repr(kernel handle) -> kernel name, from the runtime's compiled-module cache."""
    names = {}
    for mod in rt.__dict__.get("_module_cache", {}).values():
        for fn, handle in mod._kernels.items():
            names[repr(handle)] = fn
    return names


def profile(backend, top: int = 18, L: int = 16) -> list[str]:
    """GPU time per kernel of one pass of the L-lane bucket (its graph captured, its lanes set by
    the last step): the recorded launches run eagerly between events.
    A few graph replays are queued first so the GPU is still busy while the host enqueues
    (otherwise launch gaps would be timed as kernel time)."""
    rt, ops = backend.rt, backend.programs[L].ops
    names = kernel_names(rt)
    evs = [rt.event() for _ in range(len(ops) + 1)]
    for _ in range(6):
        rt.replay(backend._graphs[L])
    for ev, (kernel, grid, block, args, shared) in zip(evs, ops):
        rt.record(ev)
        rt.launch(kernel, grid, block, args, shared)
    rt.record(evs[-1])
    rt.synchronize()
    tot: dict[str, list[float]] = {}
    for i, (kernel, *_rest) in enumerate(ops):
        ms = rt.elapsed_ms(evs[i], evs[i + 1])
        tot.setdefault(names.get(repr(kernel), getattr(kernel, "name", repr(kernel)[:40])), []).append(ms)
    rows = sorted(tot.items(), key=lambda kv: -sum(kv[1]))
    total = sum(sum(v) for v in tot.values())
    out = [f"one pass, kernels run back to back: {total:.2f} ms over {len(ops)} launches", "",
           "| kernel | launches | total ms | share |", "|---|---|---|---|"]
    out += [f"| {k} | {len(v)} | {sum(v):.3f} | {sum(v) / total:.1%} |" for k, v in rows[:top]]
    return out


def transformers_note() -> str:
    try:
        import transformers
        from transformers.models import deepseek_v4  # noqa: F401
        return (f"transformers {transformers.__version__} has deepseek_v4; its eager decode is timed by "
                f"benchmarks/hf_eager_gpu.py (in its own process, after this one)")
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        return f"transformers' eager DeepseekV4 not importable here: {type(exc).__name__}: {str(exc)[:120]}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="perf_decode_gpu.md")
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--ctx", default="256,4096")
    ap.add_argument("--lanes", default="1,4,8,16")
    ap.add_argument("--full", action="store_true", help="43 layers in the q2 policy (about 87 GB)")
    ap.add_argument("--experts", type=int, default=256, help="routed experts of the 8-layer bf16 model")
    ap.add_argument("--json", default=None, help="also write the rows as JSON (for docs/ plots)")
    args = ap.parse_args()
    from ds4ref.hip.backend import HipBackend
    t0 = time.time()
    rt, cfg, dw, model, what = make_model(args.full, args.experts)
    bw = copy_bandwidth(rt)
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    backend = HipBackend(model.config, model.weights, model.numerics, model.tables, runtime=rt, device_weights=dw)
    ctxs = [int(x) for x in args.ctx.split(",")]
    lanes = [int(x) for x in args.lanes.split(",")]
    pages_per_slot = -(-(max(ctxs) + args.reps + 8) // 128)
    backend.configure(16, 16 * pages_per_slot, max_context=128 * pages_per_slot)
    lines, records = [], []
    for ctx in ctxs:
        for C in lanes:
            gpu_ms, step_ms = bench_case(backend, cfg, C, ctx, args.reps)
            rows = backend.state.row_bytes
            nbytes = weight_bytes(dw, cfg, C) + history_bytes(cfg, ctx, C, rows[ATTN], rows[INDEX])
            floor_ms = nbytes / bw * 1e3
            gfx_ms = nbytes / (GFX1151_GBS * 1e9) * 1e3
            seed = f"{SEED_STRIX_TOKS[C]:.2f}" if args.full and C in SEED_STRIX_TOKS and ctx == ctxs[0] else ""
            line = (f"| {ctx} | {C} | {gpu_ms:.2f} | {step_ms:.2f} | {C / (step_ms * 1e-3):.0f} | "
                    f"{nbytes / 1e9:.2f} | {floor_ms:.3f} | {floor_ms / gpu_ms:.1%} | {gfx_ms:.1f} | "
                    f"{C / (gfx_ms * 1e-3):.0f} | {seed} |")
            print(line, flush=True)
            lines.append(line)
            records.append(dict(ctx=ctx, C=C, pass_ms=gpu_ms, step_ms=step_ms, tok_s=C / (step_ms * 1e-3),
                                bytes=nbytes, floor_ms=floor_ms, gfx1151_floor_ms=gfx_ms))
    prof = []
    for C in sorted({lanes[0], lanes[-1]}):  # per-kernel profile at the smallest and largest C
        try:
            bench_case(backend, cfg, C, ctxs[-1], 2)  # sets the lanes: C rows at the last context
            p = profile(backend)
            prof += ["", f"C = {C}, context {ctxs[-1]}:", ""] + p
            print("\n".join(p), flush=True)
        except Exception as exc:  # noqa: BLE001 - the timings above stand without it
            print(f"profile failed: {type(exc).__name__}: {exc}")
    note = transformers_note()
    print(note)
    if args.json:
        import json
        Path(args.json).write_text(json.dumps(dict(model=what, gib=dw.bytes / 2**30, copy_gbs=bw / 1e9,
                                                   device=rt.info.name, rows=records), indent=1))
    text = "\n".join([
        f"{what} ({cfg.n_embd} hidden, 64x512 heads, vocab 129280), "
        f"random weights made on the GPU ({dw.bytes / 2**30:.1f} GiB); {rt.info.name}; "
        f"KV and indexer rows stored {'compact (FP8/FP4 codes + exponents)' if backend.compact else 'float32'}; "
        f"copy bandwidth {bw / 1e9:.0f} GB/s (read + write). One graph capture served every row "
        f"(capture_count = {backend.capture_count}). Generated by `benchmarks/decode_gpu.py` in "
        f"{time.time() - t0:.0f} s.",
        "",
        "| context | C | pass ms (graph, GPU) | step ms (host incl.) | tok/s | GB read | floor ms | floor / pass | "
        "gfx1151 floor ms (212 GB/s) | gfx1151 tok/s at floor | seed PR, Strix Halo tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *lines, "", note, "",
        f"Where the time goes (per-kernel GPU time, kernels run back to back):", *prof, ""])
    Path(args.out).write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
