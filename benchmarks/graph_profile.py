"""Where a captured pass spends its GPU time, kernel by kernel, measured inside the graph.

    python3 benchmarks/graph_profile.py --full --lanes 1,16 --prompt 1024 --out /tmp/graph_profile.md

decode_gpu.py's per-kernel profile launches the recorded kernels eagerly between events,
which times launch gaps as kernel time. Here the graph itself is replayed under CUPTI
(torch.profiler's CUDA activity, the same process: CUPTI sees every kernel of the process,
whichever API launched it), so each kernel's time is its own execution inside the replay,
and the pass time minus the kernels' sum is what the graph loses between kernels.

Cases: C decode rows at --ctx (decode_gpu.bench_case's synthetic history), and one
256-row prompt pass (the last pass of a --prompt-token prompt fed alone).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode_gpu import bench_case, make_model  # noqa: E402
from prefill_gpu import feed_prompt  # noqa: E402


def op_label(op) -> str:
    """A recorded launch as the per-op table names it: the kernel and its grid (which tells a
    matrix's rows, groups and lane groups apart)."""
    kernel, grid, *_ = op
    return f"{kernel.name} {'x'.join(str(g) for g in grid)}"


def by_op(durations: list[float], ops, reps: int) -> dict[str, tuple[int, float]]:
    """{label: (launches per pass, µs per pass)} from the kernel times of `reps` replays in the
    order they ran: a captured pass runs its recorded launches in order, one kernel each."""
    if len(durations) != reps * len(ops):
        raise ValueError(f"{len(durations)} kernel times for {reps} replays of {len(ops)} launches")
    out: dict[str, list] = {}
    for i, us in enumerate(durations):
        n = out.setdefault(op_label(ops[i % len(ops)]), [0, 0.0])
        n[0] += 1
        n[1] += us
    return {k: (round(v[0] / reps), v[1] / reps) for k, v in out.items()}


def cupti_profile(rt, graph, reps: int, ops=None) -> tuple[dict[str, tuple[int, float]], float]:
    """{kernel: (launches per pass, µs per pass)} and the pass's wall µs, over reps replays;
    with ops (the pass's recorded launches), keyed by op_label instead of by kernel name."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    e0, e1 = rt.event(), rt.event()
    for _ in range(3):
        rt.replay(graph)
    rt.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        rt.record(e0)
        for _ in range(reps):
            rt.replay(graph)
        rt.record(e1)
        rt.synchronize()
        torch.cuda.synchronize()
    wall = rt.elapsed_ms(e0, e1) * 1e3 / reps
    kernels = [ev for ev in prof.events() if ev.device_type.name == "CUDA" and ev.device_time > 0]
    if ops is not None:
        kernels.sort(key=lambda ev: ev.time_range.start)
        return by_op([ev.device_time for ev in kernels], ops, reps), wall
    per: dict[str, list] = {}
    for ev in kernels:
        n = per.setdefault(ev.name, [0, 0.0])
        n[0] += 1
        n[1] += ev.device_time
    return {k: (round(v[0] / reps), v[1] / reps) for k, v in per.items()}, wall


def table(title: str, kernels: dict, wall_us: float, top: int) -> list[str]:
    total = sum(us for _, us in kernels.values())
    launches = sum(n for n, _ in kernels.values())
    rows = sorted(kernels.items(), key=lambda kv: -kv[1][1])
    out = [f"### {title}", "",
           f"pass {wall_us / 1e3:.2f} ms (graph replay); kernels {total / 1e3:.2f} ms over {launches} launches; "
           f"between kernels {(wall_us - total) / 1e3:.2f} ms ({(wall_us - total) / max(launches, 1):.2f} µs a launch)",
           "", "| kernel | launches | ms | µs each | share |", "|---|---|---|---|---|"]
    out += [f"| {k} | {n} | {us / 1e3:.3f} | {us / max(n, 1):.1f} | {us / total:.1%} |" for k, (n, us) in rows[:top]]
    return out + [""]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--full", action="store_true", help="43 layers in the q2 policy")
    ap.add_argument("--lanes", default="1,16")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens before the profiled 256-row pass (0: none)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", default="graph_profile.md")
    ap.add_argument("--by-op", action="store_true",
                    help="one row per launch shape (kernel and grid) instead of per kernel")
    args = ap.parse_args()
    from ds4ref.hip.backend import HipBackend
    rt, cfg, dw, model, what = make_model(args.full)
    backend = HipBackend(model.config, model.weights, model.numerics, model.tables, runtime=rt, device_weights=dw)
    pages = -(-(max(args.ctx, args.prompt) + 64) // 128)
    backend.configure(16, 16 * pages, max_context=128 * pages)
    lines = [f"{what}; {rt.info.name}; CUPTI kernel times inside the graph replay, mean of {args.reps} replays", ""]
    for C in [int(c) for c in args.lanes.split(",") if c]:  # --lanes "": the prompt pass only
        bench_case(backend, cfg, C, args.ctx, 2)
        L = backend.bucket(C)
        kernels, wall = cupti_profile(rt, backend._graphs[L], args.reps,
                                      backend.programs[L].ops if args.by_op else None)
        lines += table(f"decode, C = {C}, context {args.ctx}", kernels, wall, args.top)
        print("\n".join(lines[-args.top - 6:]), flush=True)
    if args.prompt:
        for s in range(16):
            backend.reset_slot(s)
        feed_prompt(backend, cfg, 0, args.prompt, backend.max_pass_rows, seed=3)
        L = backend.max_pass_rows
        kernels, wall = cupti_profile(rt, backend._graphs[L], args.reps, backend.programs[L].ops if args.by_op else None)
        lines += table(f"prompt pass, {backend.max_pass_rows} rows (last of a {args.prompt}-token prompt)",
                       kernels, wall, args.top)
        print("\n".join(lines[-args.top - 6:]), flush=True)
    Path(args.out).write_text("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    np.set_printoptions(linewidth=160)
    main()
