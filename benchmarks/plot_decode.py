"""Decode tok/s against the lane count C, drawn from the device run's JSON files.

    python benchmarks/plot_decode.py docs/results/ --out docs/decode_tok_s.png

Reads perf_decode_gpu.json (8-layer bf16), perf_full_gpu.json (43-layer q2) and, when
present, hf_eager_gpu.json (transformers, same 8-layer config) from the folder, as
benchmarks/gpu_check.sh writes them (docs/results/ holds those of docs/results/decode_gpu.md). One panel per model: ds4ref's tok/s at each context,
the floor (bytes a pass must read over the measured copy bandwidth), and transformers.
"""
from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path


def load(folder: Path, name: str):
    p = folder / name
    return json.loads(p.read_text()) if p.exists() else None


def panel(ax, run: dict, title: str, hf: dict | None = None) -> None:
    for ctx in sorted({r["ctx"] for r in run["rows"]}):
        rows = sorted((r for r in run["rows"] if r["ctx"] == ctx), key=lambda r: r["C"])
        cs = [r["C"] for r in rows]
        line, = ax.plot(cs, [r["tok_s"] for r in rows], "o-", label=f"ds4ref, context {ctx}")
        ax.plot(cs, [r["C"] / (r["floor_ms"] * 1e-3) for r in rows], "--", color=line.get_color(),
                label=f"floor, context {ctx}")
    if hf:
        rows = sorted(hf["rows"], key=lambda r: r["C"])
        ax.plot([r["C"] for r in rows], [r["tok_s"] for r in rows], "s-", color="black",
                label=f"transformers eager, context {rows[0]['ctx']}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("lanes C (one decode row each)")
    ax.set_ylabel("tok/s")
    ax.set_title("\n".join(textwrap.wrap(title, 70)), fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder", type=Path)
    ap.add_argument("--out", default="docs/decode_tok_s.png")
    args = ap.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = [(load(args.folder, "perf_decode_gpu.json"), load(args.folder, "hf_eager_gpu.json")),
            (load(args.folder, "perf_full_gpu.json"), None)]
    runs = [(r, hf) for r, hf in runs if r]
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4.5), squeeze=False)
    for ax, (run, hf) in zip(axes[0], runs):
        panel(ax, run, f"{run['model']}; {run['device']}, copy {run['copy_gbs']:.0f} GB/s", hf)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
