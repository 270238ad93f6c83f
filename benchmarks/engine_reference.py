"""Aggregate tokens/s of the reference engine at several concurrency levels.

    python benchmarks/engine_reference.py [--new 64] [--quantum 1] [--levels 1 4 8 16]

C clients arrive together with short ragged prompts (disjoint token ids),
greedy, forced to produce --new tokens each (ignore_eos), on the embedded tiny
model through Engine -> Scheduler -> SeqEngine -> NumpyBackend. Prints one row
per level and the C16/C1 ratio. Not a test; the NumPy reference computes a pass
as one batch (each weight's product once for all its rows, the state updates row
by row), so the ratio measures that batching on the CPU.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import ds4ref
from ds4ref.scheduler.engine import Engine
from ds4ref.scheduler.request import Request


def requests(model, c: int, n_new: int, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    v = model.config.vocab_size
    out = []
    for i in range(c):
        n = int(rng.integers(8, 41))  # ragged prompts, 8..40 tokens
        out.append(Request([model.config.bos_id] + rng.integers(2, v, n - 1).tolist(), n_new, ignore_eos=True))
    return out


def measure(model, c: int, n_new: int, quantum: int) -> dict:
    eng = Engine(model, max_concurrency=c, prompt_quantum=quantum)
    eng.run(requests(model, c, 2, seed=99))  # warm-up (first-touch allocations, caches)
    steps0 = eng.scheduler.stats()["steps"]
    reqs = requests(model, c, n_new)
    t0 = time.perf_counter()
    outs = eng.run(reqs)
    dt = time.perf_counter() - t0
    toks = sum(map(len, outs))
    rows = sum(len(r.prompt_ids) for r in reqs) + toks - len(reqs)
    passes = eng.scheduler.stats()["steps"] - steps0
    return {"C": c, "tokens": toks, "seconds": dt, "tok_s": toks / dt, "rows_s": rows / dt, "passes": passes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--quantum", type=int, default=1, help="prompt_quantum (1 = upstream exact mode)")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 4, 8, 16])
    args = ap.parse_args()
    model = ds4ref.load()
    print(f"model {model.config.name}: {model.config.n_layer} layers, vocab {model.config.vocab_size}; "
          f"{args.new} new tokens per request, prompt_quantum {args.quantum}")
    print(f"{'C':>3} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'rows/s':>8} {'passes':>7}")
    res = []
    for c in args.levels:
        r = measure(model, c, args.new, args.quantum)
        res.append(r)
        print(f"{r['C']:>3} {r['tokens']:>7} {r['seconds']:>8.2f} {r['tok_s']:>8.1f} {r['rows_s']:>8.1f} "
              f"{r['passes']:>7}")
    by = {r["C"]: r for r in res}
    if 1 in by and 16 in by:
        print(f"C16/C1 aggregate tokens/s: {by[16]['tok_s'] / by[1]['tok_s']:.2f}x")


if __name__ == "__main__":
    main()
