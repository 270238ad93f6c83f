"""Produce the golden files for the embedded tiny model.

    python -m tests.golden.make_golden          # rewrites tests/golden/*.json

For each numeric mode, in float64: greedy continuations of several prompts
(lengths 1 to 600, drawn from fixed seeds) with the reference's top-2 logit gap
at each generated token, and logit fingerprints (per-position argmax, max logit
and logsumexp; the last position's top-16) from the whole-sequence score().
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import ds4ref

HERE = Path(__file__).parent
PROMPT_LENGTHS = (1, 7, 64, 203, 600)
NEW_TOKENS = 16
TOP = 16


def golden_prompts(vocab: int) -> list[list[int]]:
    return [np.random.default_rng(1000 + n).integers(0, vocab, n).tolist() for n in PROMPT_LENGTHS]


def fingerprint(logits: np.ndarray) -> dict:
    mx = logits.max(axis=1)
    lse = mx + np.log(np.exp(logits - mx[:, None]).sum(axis=1))
    top = np.argsort(-logits[-1], kind="stable")[:TOP]
    return {"argmax": logits.argmax(axis=1).tolist(), "max": mx.tolist(), "logsumexp": lse.tolist(),
            "last_top_ids": top.tolist(), "last_top_values": logits[-1, top].tolist()}


def top2_gaps(model, ids: list[int], new: list[int]) -> list[float]:
    logits = model.score(ids + new)[len(ids) - 1: len(ids) - 1 + len(new)]
    part = -np.sort(-logits, axis=1)[:, :2]
    return (part[:, 0] - part[:, 1]).tolist()


def make(numerics: str) -> dict:
    model = ds4ref.load(numerics=numerics, dtype=np.float64)
    cases = []
    for ids in golden_prompts(model.config.vocab_size):
        new = model.generate(ids, NEW_TOKENS)
        cases.append({"prompt": ids, "greedy": new, "top2_gap": top2_gaps(model, ids, new),
                      "fingerprint": fingerprint(model.score(ids))})
    return {"model": "embedded ds4-tiny", "numerics": numerics, "dtype": "float64",
            "regenerate": "python -m tests.golden.make_golden", "cases": cases}


def main() -> None:
    for numerics in ("official", "plain"):
        path = HERE / f"tiny_{numerics}.json"
        path.write_text(json.dumps(make(numerics)) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
