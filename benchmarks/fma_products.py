"""Float products with each term fused, fma(w, x, partial) (the canonical product), against two
roundings a term (partial + w * x), side by side in one run, on the embedded tiny model and the
three policy files: the measurement behind docs/exactness.md's choice (issue K, item 1: fused
multiply-add in a fixed order for float weights).

    python benchmarks/fma_products.py [--len 203] [--repeats 3]

First the products alone (random f16 weights, float32 inputs): each output's relative error from
the exact dot. Then per model, in official numerics: the deviation of float32 logits from float64 (plain NumPy maths),
as the relative L2 error per position of one prompt (median and max over positions), with the
float products as they are and fused (the quantised weights' integer products are the same
both ways), the positions whose greedy token differs from float64's, and the reference's speed
(score() of the prompt), best of --repeats. Prints numbers; it is not a test.
"""
from __future__ import annotations

import argparse

import numpy as np

from quantised_products import deviation, rate  # which also puts the repository on sys.path

import ds4ref
from ds4ref.numerics import canon
from tests.golden.make_golden import POLICIES, policy_model

CANONICAL = canon._matmul_for


def fused(n_rows: int):
    """canon's product for n_rows rows, every term fused (the canonical product)."""
    product = CANONICAL(n_rows)
    return lambda x, wb, rows, ks: product(x, wb, rows, ks, True)


def two_roundings(n_rows: int):
    """The same order of terms, each as partial + w * x."""
    product = CANONICAL(n_rows)
    return lambda x, wb, rows, ks: product(x, wb, rows, ks, False)


def products(rows: int = 16, n: int = 1024, k: int = 4096) -> None:
    """The products alone, where nothing else rounds: f16 weights (as the q2 policy's float
    matrices are stored) against float32 inputs, each output's relative error from the exact
    (float64) dot of the same float32 values, median and max over the outputs."""
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((n, k)) * 0.02).astype(np.float16).astype(np.float32)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    for kind, product in (("two roundings", two_roundings), ("fused", fused)):
        canon._matmul_for = product
        try:
            y = canon.linear(x, w)
        finally:
            canon._matmul_for = CANONICAL
        err = np.abs(y - exact) / np.maximum(np.abs(exact), 1e-30)
        print(f"products  {kind:13s} {rows} x {n} outputs of K = {k}: relative error vs the exact dot "
              f"median {np.median(err):.3e}, 99th percentile {np.percentile(err, 99):.3e}")


def run(label: str, path, length: int, repeats: int) -> None:
    m64 = ds4ref.load(path, numerics="official", dtype=np.float64)
    m32 = ds4ref.load(path, numerics="official")
    ids = np.random.default_rng(7).integers(0, m64.config.vocab_size, length).tolist()
    l64 = m64.score(ids)
    out = {}
    for kind, product in (("two roundings", two_roundings), ("fused", fused)):
        canon._matmul_for = product
        try:
            l32 = m32.score(ids)
            best = max(rate(lambda: m32.score(ids), length) for _ in range(repeats))
        finally:
            canon._matmul_for = CANONICAL
        out[kind] = (*deviation(l32, l64), int((l32.argmax(1) != l64.argmax(1)).sum()), best, l32)
    same = np.array_equal(out["fused"][4], out["two roundings"][4])
    for kind, (med, mx, flips, speed, _) in out.items():
        print(f"{label:9s} {kind:13s} rel L2 vs float64: median {med:.3e} max {mx:.3e}; "
              f"greedy tokens unlike float64's {flips}/{length}; score {speed:7.1f} tok/s")
    print(f"{label:9s} fused logits equal the two-rounding ones bit for bit: {same}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--len", type=int, default=203, help="prompt length (default 203)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    products()
    run("embedded", None, args.len, args.repeats)
    for p in POLICIES:
        run(p, policy_model(p), args.len, args.repeats)


if __name__ == "__main__":
    main()
