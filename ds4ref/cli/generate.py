"""Greedy generation from the command line.

    python -m ds4ref.cli.generate [--model PATH] --prompt-ids 1,2,3 -n 32
    python -m ds4ref.cli.generate --prompt "Hello" -n 16
"""
from __future__ import annotations

import argparse
import sys
from ..console import HelpFormatter

import numpy as np

from ..model import BACKENDS, load


def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise SystemExit(f"--prompt-ids must be comma-separated integers, got {text!r}")


def generate(model, ids: list[int], n: int) -> list[int]:
    """Greedy tokens through the engine, one progress tick per token (the same tokens as
    model.generate: the engine's passes equal the reference's steps)."""
    from ..scheduler.engine import Engine
    from ..console import progress
    from ..scheduler.request import Request, TokenEvent

    scheduler = Engine(model, max_concurrency=1).scheduler
    scheduler.submit(Request(list(ids), n, ignore_eos=True))
    out: list[int] = []
    with progress(desc="generating", total=n, unit="tok") as bar:
        while scheduler.has_work():
            for ev in scheduler.step():
                if isinstance(ev, TokenEvent):
                    out.append(ev.token)
                    bar.update(1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ds4ref.cli.generate", description=__doc__.splitlines()[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--model", help="deepseek4 GGUF (default: the embedded tiny model)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-ids", help="comma-separated token ids")
    src.add_argument("--prompt", help="text, tokenized with the model's tokenizer (BOS prepended)")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=32, help="tokens to generate")
    ap.add_argument("--backend", choices=BACKENDS, default="numpy", help="numpy reference or the hip GPU path")
    ap.add_argument("--numerics", choices=("official", "plain"), default="official",
                    help="FP8/FP4 simulation on (official) or off (plain)")
    ap.add_argument("--float64", action="store_true", help="compute in float64")
    args = ap.parse_args(argv)
    try:
        model = load(args.model, backend=args.backend, numerics=args.numerics,
                     dtype=np.float64 if args.float64 else np.float32)
        if args.prompt is not None:
            ids = [model.config.bos_id] + model.tokenizer.encode(args.prompt)
        else:
            ids = parse_ids(args.prompt_ids)
        new = generate(model, ids, args.max_new_tokens)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(",".join(map(str, new)))
    if args.prompt is not None:
        print(model.tokenizer.decode(new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
