"""Produce the golden files for the embedded tiny model and the published-policy variants.

    python -m tests.golden.make_golden          # rewrites tests/golden/*.json
    python -m tests.golden.make_golden q2 q4    # only those

tiny_{official,plain}.json: the embedded ds4-tiny. tiny_{q2,q4,mxfp4}_official.json: the
tiny files of `python -m ds4ref.gguf.tiny --policy P` (seed 0), which are generated, not
packaged (each is 7-10 MB): policy_model(P) writes them to a cache directory, and the
golden records the file's sha256, so a change in the generator is told apart from a
change in the math. The variants use official numerics and prompts up to 203 tokens
(the 256-wide files cost ~4x the embedded model per token).

For each numeric mode, from fixed prompts (lengths 1 to 600, drawn from fixed seeds):
* float64, plain NumPy maths: greedy continuations, and logit fingerprints (per-position
  argmax, max logit and logsumexp; the last position's top-16) from the whole-sequence
  score();
* float32, the canonical arithmetic (docs/exactness.md): greedy continuations, and the
  sha256 of the logits' bits at every position of prompt + continuation, fed through a
  backend's slot 16 rows a pass. Every backend must reproduce these bit for bit.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np

import ds4ref
from ds4ref.backend import Row, StepPlan

HERE = Path(__file__).parent
PROMPT_LENGTHS = (1, 7, 64, 203, 600)
POLICIES = ("q2", "q4", "mxfp4")
POLICY_PROMPT_LENGTHS = (1, 7, 64, 203)
POLICY_SEED = 0


def policy_model(policy: str) -> Path:
    """The tiny file of `python -m ds4ref.gguf.tiny --policy POLICY --seed 0`, written once per cache."""
    from ds4ref.gguf.tiny import write_tiny
    cache = Path(os.environ.get("DS4REF_GOLDEN_CACHE", Path(tempfile.gettempdir()) / "ds4ref-golden"))
    path = cache / f"tiny_{policy}_seed{POLICY_SEED}.gguf"
    if not path.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # parallel test workers: write, then rename
        write_tiny(tmp, seed=POLICY_SEED, policy=policy)
        os.replace(tmp, path)
    return path


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
NEW_TOKENS = 16
TOP = 16
ROWS_PER_PASS = 16


def golden_prompts(vocab: int, lengths=PROMPT_LENGTHS) -> list[list[int]]:
    return [np.random.default_rng(1000 + n).integers(0, vocab, n).tolist() for n in lengths]


def fingerprint(logits: np.ndarray) -> dict:
    mx = logits.max(axis=1)
    lse = mx + np.log(np.exp(logits - mx[:, None]).sum(axis=1))
    top = np.argsort(-logits[-1], kind="stable")[:TOP]
    return {"argmax": logits.argmax(axis=1).tolist(), "max": mx.tolist(), "logsumexp": lse.tolist(),
            "last_top_ids": top.tolist(), "last_top_values": logits[-1, top].tolist()}


def backend_logits(backend, ids: list[int], page_tokens: int = 128) -> np.ndarray:
    """Logits (T, vocab) of every position of ids, fed to one slot of `backend`."""
    pages = -(-len(ids) // page_tokens)
    backend.configure(1, pages, page_tokens)
    backend.reset_slot(0)
    backend.set_block_table(0, list(range(pages)))
    out = []
    for p0 in range(0, len(ids), ROWS_PER_PASS):
        rows = [Row(0, p, int(t)) for p, t in enumerate(ids[p0:p0 + ROWS_PER_PASS], start=p0)]
        out += backend.step(StepPlan.from_rows(rows)).logits
    return np.stack(out)


def logits_sha256(logits: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(logits, np.float32).tobytes()).hexdigest()


def float32_case(model, ids: list[int]) -> dict:
    new = model.generate(ids, NEW_TOKENS)
    logits = backend_logits(model.make_backend("numpy"), ids + new[:-1])
    return {"greedy": new, "logits_sha256": logits_sha256(logits)}


def make(numerics: str, model_path=None, lengths=PROMPT_LENGTHS, model: str = "embedded ds4-tiny") -> dict:
    m64 = ds4ref.load(model_path, numerics=numerics, dtype=np.float64)
    m32 = ds4ref.load(model_path, numerics=numerics, dtype=np.float32)
    cases = []
    for ids in golden_prompts(m64.config.vocab_size, lengths):
        cases.append({"prompt": ids, "greedy": m64.generate(ids, NEW_TOKENS), "fingerprint": fingerprint(m64.score(ids)),
                      "float32": float32_case(m32, ids)})
    return {"model": model, "numerics": numerics, "dtype": "float64",
            "float32": "canonical arithmetic, docs/exactness.md",
            "regenerate": "python -m tests.golden.make_golden", "cases": cases}


def make_policy(policy: str) -> dict:
    path = policy_model(policy)
    g = make("official", path, POLICY_PROMPT_LENGTHS,
             model=f"python -m ds4ref.gguf.tiny --policy {policy} --seed {POLICY_SEED}")
    g.update(policy=policy, model_sha256=file_sha256(path))
    return g


def main(argv: list[str] | None = None) -> None:
    import argparse
    ap = argparse.ArgumentParser(description="Rewrite tests/golden/*.json.")
    ap.add_argument("only", nargs="*", help="official, plain, q2, q4, mxfp4 (default: all)")
    only = set(ap.parse_args(argv).only) or {"official", "plain", *POLICIES}
    for numerics in ("official", "plain"):
        if numerics in only:
            path = HERE / f"tiny_{numerics}.json"
            path.write_text(json.dumps(make(numerics)) + "\n")
            print(f"wrote {path}")
    for policy in POLICIES:
        if policy in only:
            path = HERE / f"tiny_{policy}_official.json"
            path.write_text(json.dumps(make_policy(policy)) + "\n")
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
