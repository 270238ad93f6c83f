"""Greedy generation from the command line.

    python -m ds4ref.generate [--model PATH] --prompt-ids 1,2,3 -n 32
    python -m ds4ref.generate --prompt "Hello" -n 16
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from .model import BACKENDS, load


def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise SystemExit(f"--prompt-ids must be comma-separated integers, got {text!r}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ds4ref.generate", description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="deepseek4 GGUF (default: the embedded tiny model)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-ids", help="comma-separated token ids")
    src.add_argument("--prompt", help="text, tokenized with the model's tokenizer (BOS prepended)")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=32)
    ap.add_argument("--backend", choices=BACKENDS, default="numpy")
    ap.add_argument("--numerics", choices=("official", "plain"), default="official")
    ap.add_argument("--float64", action="store_true", help="compute in float64")
    args = ap.parse_args(argv)
    try:
        model = load(args.model, backend=args.backend, numerics=args.numerics,
                     dtype=np.float64 if args.float64 else np.float32)
        if args.prompt is not None:
            ids = [model.config.bos_id] + model.tokenizer.encode(args.prompt)
        else:
            ids = parse_ids(args.prompt_ids)
        new = model.generate(ids, args.max_new_tokens)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(",".join(map(str, new)))
    if args.prompt is not None:
        print(model.tokenizer.decode(new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
