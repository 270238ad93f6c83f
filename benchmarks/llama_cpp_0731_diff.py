"""The figures tests/test_llama_cpp_0731.py holds to its bounds, as a Markdown table
(docs/results/llama_cpp_diff.md): ds4ref's 0731 model files and their DSpark drafts in the
llama.cpp that llama-cpp-python 0.3.36 vendors, against ds4ref (plain numerics, float64).

Usage: python benchmarks/llama_cpp_0731_diff.py   (needs llama-cpp-python 0.3.36 installed)"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from test_llama_cpp_0731 import DSparkLlamaCpp, _agreement, _aligned, _run, write_0731_files  # noqa: E402


def main() -> None:
    llama = DSparkLlamaCpp()
    print("| files | target logits: median rel. diff / argmax | layer inputs at target_layers: median rel. diff "
          "| draft rows (P <= W - B): median rel. diff / argmax | confidence: median / max abs. diff "
          "| blocks drafted alike | draft rows (W - B < P <= W + 1): median rel. diff / argmax |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as d:
        for kind, files in write_0731_files(Path(d)).items():
            run = _run(llama, *files)
            ours, theirs = run.hidden
            taps = np.median(np.abs(ours - theirs).max(axis=1) / np.abs(ours).max(axis=1))
            inside, past = run.blocks[:run.window], run.blocks[run.window:]
            o, t, conf, same = _aligned(inside)
            rows = "{:.2e} / {:.0%}".format(*_agreement(o, t))
            later = "{:.2e} / {:.0%}".format(*_agreement(*_aligned(past)[:2]))
            print(f"| {kind} | " + "{:.2e} / {:.0%}".format(*_agreement(*run.logits)) + f" | {taps:.2e} | {rows} "
                  f"({len(o)} rows) | {np.median(conf):.1e} / {conf.max():.1e} | {same} of {len(inside)} | {later} |")


if __name__ == "__main__":
    main()
