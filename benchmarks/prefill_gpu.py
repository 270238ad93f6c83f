"""Prompt passes of HipBackend (chunked prefill) on Flash-shaped models with random weights.

    python benchmarks/prefill_gpu.py --out /tmp/perf_prefill_gpu.md            # 8 layers, bf16
    python benchmarks/prefill_gpu.py --full --prompts 4096,32768 --out ...     # 43 layers, q2 policy

The models are decode_gpu.py's (same shapes, random weights made on the device). Three
measures, every pass a real one (the prompt builds its own history, nothing synthetic):

1. Prompt throughput and time to first token: one prompt of N tokens fed alone in passes
   of `--chunk` rows (default: the server's lone-prompt pass, LONG_PASS_ROWS = 2048, within
   what the kernels run: hip.launch.largest_pass, 4096); TTFT is the wall time of all its passes
   (host side included: lane upload, the last pass's argmax download), tok/s = N / TTFT.
2. Inter-token latency under prefill: 15 sequences decode while one long prompt arrives;
   the server's Scheduler runs every pass: decode rows first, then the prompt rows whose
   pass its measured cost model predicts within `--max-itl-ms` (docs/scheduler.md), and
   each pass's wall time is the ITL every decoder sees in it. Every bucket's graph is
   captured before the decoders start. Reported per budget: ITL p50/p99 before the prompt
   and while it runs, the prompt's TTFT and tok/s, its rows a pass, the fitted cost.
3. The per-kernel profile of one full prompt pass, with its memory floor (weights every
   pass reads + the distinct experts the rows choose + history, over the copy bandwidth)
   and its FMA rate (2 x the multiply-adds the rows' matrices need, in TFLOP/s).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode_gpu import copy_bandwidth, history_bytes, make_model, profile, weight_bytes  # noqa: E402

from ds4ref.backend import Row, StepPlan  # noqa: E402
from ds4ref.hip.launch import largest_pass  # noqa: E402
from ds4ref.scheduler.pass_cost import DEFAULT_MAX_ITL_MS, LONG_PASS_ROWS  # noqa: E402
from ds4ref.reference.state import ATTN, INDEX  # noqa: E402


def feed_prompt(backend, cfg, slot: int, n: int, chunk: int, seed: int) -> list[float]:
    """Wall ms of every pass that feeds an n-token prompt to a fresh slot, chunk rows a pass."""
    st = backend.state
    per_slot = st.n_pages // st.n_slots
    backend.reset_slot(slot)
    backend.set_block_table(slot, list(range(slot * per_slot, slot * per_slot + -(-n // st.page_tokens))))
    toks = np.random.default_rng(seed).integers(0, cfg.vocab_size, n)
    times = []
    for p0 in range(0, n, chunk):
        p1 = min(n, p0 + chunk)
        rows = [Row(slot, p, int(toks[p]), want_logits=False, emit=p == n - 1) for p in range(p0, p1)]
        t0 = time.perf_counter()
        backend.step(StepPlan.from_rows(rows, backend.max_pass_rows))
        times.append(1e3 * (time.perf_counter() - t0))
    return times


def pass_flops(dw, cfg, rows: int, emitting: int) -> float:
    """2 x multiply-adds of one pass: every dense matrix per row (the head per emitting row),
    the routed experts for the n_expert_used choices of each row."""
    dense, head, expert = 0, 0, 0
    for name, t in dw.mats.items():
        n = int(np.prod(t.shape))
        if "_exps." in name:
            expert += n // cfg.n_expert
        elif name == "output.weight":
            head += n
        elif name != "token_embd.weight":
            dense += n
    return 2.0 * (rows * (dense + cfg.n_expert_used * expert) + emitting * head)


def itl_under_prefill(backend, cfg, decoders: int, prompt: int, max_itl_ms: float) -> dict:
    """Decoders decode, then one prompt of `prompt` tokens arrives; ms per pass before and during,
    under the server's Scheduler with an inter-token budget of max_itl_ms."""
    from ds4ref.scheduler.request import Request, TokenEvent
    from ds4ref.scheduler.scheduler import Scheduler
    from ds4ref.scheduler.seq_engine import SeqEngine
    max_new = 2048  # the decoders outlast the prompt's passes at any budget here
    eng = SeqEngine(backend, cfg, max_concurrency=decoders + 1,
                    kv_pool_tokens=decoders * (32 + max_new + 128) + prompt + 512)
    sch = Scheduler(eng, max_itl_ms=max_itl_ms)
    rng = np.random.default_rng(5)
    for L in backend.buckets:  # capture every bucket's graph now (configure dropped them), not mid-run:
        sch.submit(Request([int(t) for t in rng.integers(0, cfg.vocab_size, L)], 1, req_id=10_000 + L))
        while sch.has_work():  # a lone prompt of L tokens runs in one pass of L rows
            sch.step()
    for i in range(decoders):
        sch.submit(Request([int(t) for t in rng.integers(0, cfg.vocab_size, 32)], max_new, ignore_eos=True,
                           req_id=i + 1))
    before, during, chunks, first, warm = [], [], [], None, 0
    while len(before) < 24:  # the decoders' prompts, then plain decode passes (the first few dropped:
        t0 = time.perf_counter()  # the last prompt pass can already yield every decoder's token)
        evs = sch.step()
        ms = 1e3 * (time.perf_counter() - t0)
        if sum(isinstance(e, TokenEvent) for e in evs) == decoders:
            warm += 1
            if warm > 4:
                before.append(ms)
    big = Request([int(t) for t in rng.integers(0, cfg.vocab_size, prompt)], 1, ignore_eos=True, req_id=999)
    t_submit = time.perf_counter()
    sch.submit(big)
    while first is None:
        fed = {s.request.req_id: s.fed for s in eng.live()}.get(999, 0)
        t0 = time.perf_counter()
        evs = sch.step()
        ms = 1e3 * (time.perf_counter() - t0)
        got = {e.req_id for e in evs if isinstance(e, TokenEvent)}
        if 999 in got:
            first = 1e3 * (time.perf_counter() - t_submit)
        else:
            chunks.append({s.request.req_id: s.fed for s in eng.live()}[999] - fed)
        assert len(got - {999}) == decoders, "a decoder missed a pass while the prompt ran"
        during.append(ms)
    knots = sch.pass_cost.knots
    for r in range(1, decoders + 1):
        sch.cancel(r)
    while sch.has_work():
        sch.step()
    return dict(before=before, during=during, ttft_ms=first, max_itl_ms=max_itl_ms, prompt=prompt,
                decoders=decoders, prompt_rows=chunks, pass_ms=knots)


def pct(xs, q):
    return float(np.percentile(np.asarray(xs), q))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="perf_prefill_gpu.md")
    ap.add_argument("--full", action="store_true", help="43 layers in the q2 policy")
    ap.add_argument("--prompts", default="4096,16384", help="prompt lengths fed alone (TTFT, tok/s)")
    ap.add_argument("--chunk", type=int, default=None,
                    help=f"prompt rows a pass, the backend's largest (default: {LONG_PASS_ROWS} within the kernels' "
                         f"limit, hip.launch.largest_pass)")
    ap.add_argument("--itl-prompt", type=int, default=16384, help="the prompt that arrives beside decoders (0: skip)")
    ap.add_argument("--max-itl-ms", default=f"{DEFAULT_MAX_ITL_MS:g}",
                    help="inter-token budgets for the ITL run, comma-separated (the server's --max-itl-ms)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.max_itl_ms = [float(x) for x in args.max_itl_ms.split(",") if x]
    if not args.max_itl_ms or min(args.max_itl_ms) <= 0:
        ap.error(f"--max-itl-ms needs budgets > 0 ms, got {args.max_itl_ms}")
    return args


def main() -> None:
    args = parse_args()
    from ds4ref.hip.backend import HipBackend
    t0 = time.time()
    rt, cfg, dw, model, what = make_model(args.full)
    bw = copy_bandwidth(rt)
    if args.chunk is None:
        args.chunk = min(LONG_PASS_ROWS, largest_pass(model.config))
    backend = HipBackend(model.config, model.weights, model.numerics, model.tables,
                         runtime=rt, device_weights=dw, prefill_rows=args.chunk)
    prompts = [int(x) for x in args.prompts.split(",") if x]
    longest = max(prompts + [args.itl_prompt + 512])
    backend.configure(16, 16 * -(-longest // 128), max_context=longest)  # the workspace a lane of `longest` needs
    lines, rec = [], dict(model=what, device=rt.info.name, copy_gbs=bw / 1e9, chunk=args.chunk, prompts=[], itl=[])
    feed_prompt(backend, cfg, 0, 2 * args.chunk, args.chunk, 0)  # capture both buckets' graphs first
    for n in prompts:
        ms = feed_prompt(backend, cfg, 0, n, args.chunk, n)
        total = sum(ms)
        full = ms[:-1] or ms  # the last pass may be partial
        line = (f"| {n} | {len(ms)} | {total / 1e3:.2f} | {n / (total * 1e-3):.0f} | {np.median(full):.1f} | "
                f"{max(ms):.1f} |")
        print(line, flush=True)
        lines.append(line)
        rec["prompts"].append(dict(tokens=n, passes=len(ms), ttft_ms=total, tok_s=n / (total * 1e-3), pass_ms=ms))
    itl_lines = []
    if args.itl_prompt:
        for budget in args.max_itl_ms:
            r = itl_under_prefill(backend, cfg, 15, args.itl_prompt, budget)
            line = (f"| {budget:g} | {r['decoders']} | {r['prompt']} | {pct(r['before'], 50):.1f} | "
                    f"{pct(r['before'], 99):.1f} | {pct(r['during'], 50):.1f} | {pct(r['during'], 99):.1f} | "
                    f"{len(r['during'])} | {np.median(r['prompt_rows']):.0f} | {r['ttft_ms'] / 1e3:.2f} | "
                    f"{r['prompt'] / (r['ttft_ms'] * 1e-3):.0f} | "
                    f"{', '.join(f'{lanes}: {ms:.1f}' for lanes, ms in r['pass_ms'])} |")
            print(line, flush=True)
            itl_lines.append(line)
            rec["itl"].append(r)
    # one full prompt pass at a few thousand tokens of history: floor, FMA rate, kernels
    P = args.chunk
    ms = feed_prompt(backend, cfg, 1, 8 * P, P, 1)
    pass_ms = float(np.median(ms[2:-1]))
    rows_b = backend.state.row_bytes
    nbytes = weight_bytes(dw, cfg, P) + history_bytes(cfg, 6 * P, P, rows_b[ATTN], rows_b[INDEX])
    floor_ms = nbytes / bw * 1e3
    tflops = pass_flops(dw, cfg, P, 0) / (pass_ms * 1e-3) / 1e12
    summary = (f"A full {P}-row prompt pass (history {6 * P}..{7 * P}): {pass_ms:.1f} ms wall "
               f"({P / (pass_ms * 1e-3):.0f} tok/s); it must read {nbytes / 1e9:.1f} GB (floor {floor_ms:.1f} ms "
               f"at {bw / 1e9:.0f} GB/s, floor / pass {floor_ms / pass_ms:.1%}) and do "
               f"{pass_flops(dw, cfg, P, 0) / 1e12:.2f} TFLOP ({tflops:.1f} TFLOP/s achieved).")
    print(summary, flush=True)
    rec.update(pass_ms=pass_ms, floor_ms=floor_ms, bytes=nbytes, tflops=tflops)
    prof = profile(backend, L=backend.bucket(P))
    print("\n".join(prof), flush=True)
    if args.json:
        import json
        Path(args.json).write_text(json.dumps(rec, indent=1))
    text = "\n".join([
        f"{what}, random weights made on the GPU ({dw.bytes / 2**30:.1f} GiB); {rt.info.name}; prompt passes "
        f"of {P} rows (capacity buckets {backend.buckets}; {backend.capture_count} graph captures in all, one "
        f"per bucket used per configure: the ITL runs configure the backend again). "
        f"Generated by `benchmarks/prefill_gpu.py` in {time.time() - t0:.0f} s.", "",
        "Prompt fed alone:", "",
        "| prompt tokens | passes | TTFT s | prompt tok/s | median pass ms | slowest pass ms |",
        "|---|---|---|---|---|---|", *lines, "",
        "Decoders' inter-token latency while a long prompt arrives (the Scheduler sizes its chunks so each "
        "pass's predicted time stays within the budget, from the smoothed times of the pass sizes it timed):",
        "",
        "| max_itl_ms | decoders | prompt | ITL p50 ms before | ITL p99 before | ITL p50 during | "
        "ITL p99 during | passes during | prompt rows a pass (median) | prompt TTFT s | prompt tok/s | "
        "timed pass ms by lanes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|", *itl_lines, "",
        summary, "", f"Per-kernel GPU time of one {P}-row prompt pass:", *prof, ""])
    Path(args.out).write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
