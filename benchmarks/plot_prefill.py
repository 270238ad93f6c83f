"""Prompt tok/s against the prompt's length, drawn from prefill_gpu.py --full's JSON files.

    python benchmarks/plot_prefill.py docs/results/perf_prefill_full_gpu.json \
        docs/results/perf_prefill_full_gpu_1024.json --out docs/prefill_tok_s.png

Per file (one device run, labelled by its pass size): each prompt's tok/s so far after every pass
(rows fed over the time taken, against the rows fed: where the TTFT of a prompt of that length
stands), the floor (a pass's rows over the time its bytes take at the measured copy bandwidth, for
the pass the run profiled) and issue S's targets (3,000 tok/s at 4k, 2,500 at 32k).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

TARGETS = {4096: 3000, 32768: 2500}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="+", type=Path)
    ap.add_argument("--out", default="prefill_tok_s.png")
    args = ap.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for path in args.json:
        run = json.loads(path.read_text())
        chunk = run["chunk"]
        longest = max(run["prompts"], key=lambda p: p["tokens"])
        fed, ms, xs, ys = 0, 0.0, [], []
        for t in longest["pass_ms"]:
            fed, ms = min(fed + chunk, longest["tokens"]), ms + t
            xs.append(fed)
            ys.append(fed / (ms * 1e-3))
        line, = ax.plot(xs, ys, "o-", ms=3, label=f"ds4ref, {chunk}-row passes")
        for p in run["prompts"]:
            ax.plot([p["tokens"]], [p["tok_s"]], "s", color=line.get_color())
        ax.axhline(chunk / (run["floor_ms"] * 1e-3), ls="--", color=line.get_color(),
                   label=f"floor of a {chunk}-row pass ({run['copy_gbs']:.0f} GB/s)")
    ax.plot(list(TARGETS), list(TARGETS.values()), "*", color="black", ms=10, label="targets (issue S)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens fed")
    ax.set_ylabel("prompt tok/s (tokens over time so far)")
    ax.set_title("Flash, 43 layers, q2 policy, a lone prompt on the H200", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
