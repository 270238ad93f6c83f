"""The quantised products of official float32 numerics (canon.qlinear) against the float path
they replaced, side by side in one run, on the embedded tiny model and the three policy files.

    python benchmarks/quantised_products.py [--len 203] [--repeats 3]

Per model: the deviation of float32 logits from float64 (plain NumPy maths), as the relative
L2 error per position of one prompt (median and max over positions), for the integer path
("after") and for the same weights with their codes hidden, which is the float path every
product took before ("before"); and the reference's speed both ways: score() of the prompt
and the streamed decode (generate, 32 prompt + 32 new), best of --repeats, taking turns.
Prints numbers; it is not a test.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the policy files' maker, tests/golden
import ds4ref  # noqa: E402
from tests.golden.make_golden import POLICIES, policy_model  # noqa: E402


def float_path(model):
    """The same model with its weights' codes hidden: every product on the float path."""
    w = model.reference.weights
    w.codes = lambda name: None
    w.expert_codes = lambda name, e: None
    return model


def deviation(l32: np.ndarray, l64: np.ndarray) -> tuple[float, float]:
    r = np.linalg.norm(l32.astype(np.float64) - l64, axis=1) / np.linalg.norm(l64, axis=1)
    return float(np.median(r)), float(r.max())


def rate(fn, n: int) -> float:
    t = time.perf_counter()
    fn()
    return n / (time.perf_counter() - t)


def run(label: str, path, length: int, repeats: int) -> None:
    m64 = ds4ref.load(path, numerics="official", dtype=np.float64)
    after = ds4ref.load(path, numerics="official")
    before = float_path(ds4ref.load(path, numerics="official"))
    ids = np.random.default_rng(7).integers(0, m64.config.vocab_size, length).tolist()
    l64 = m64.score(ids)
    dev = {k: deviation(m.score(ids), l64) for k, m in (("before", before), ("after", after))}
    speed = {k: [0.0, 0.0] for k in dev}
    for _ in range(repeats):
        for k, m in (("before", before), ("after", after)):
            speed[k][0] = max(speed[k][0], rate(lambda: m.score(ids), length))
            speed[k][1] = max(speed[k][1], rate(lambda: m.generate(ids[:32], 32), 63))
    for k in ("before", "after"):
        print(f"{label:9s} {k:6s} rel L2 vs float64: median {dev[k][0]:.2e} max {dev[k][1]:.2e}; "
              f"score {speed[k][0]:7.1f} tok/s, streamed decode {speed[k][1]:6.1f} tok/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--len", type=int, default=203, help="prompt length (default 203)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    run("embedded", None, args.len, args.repeats)
    for p in POLICIES:
        run(p, policy_model(p), args.len, args.repeats)


if __name__ == "__main__":
    main()
