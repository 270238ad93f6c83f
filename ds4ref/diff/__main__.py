"""python -m ds4ref.diff dump | llama-cpp | compare (docs/diff.md)."""
from __future__ import annotations

import argparse
import sys

import numpy as np

from ..console import HelpFormatter


def _tokens(args) -> list[int]:
    if args.tokens:
        return [int(t) for t in args.tokens.split(",")]
    from ..gguf.file import open_gguf
    from ..gguf.tokenizer import Tokenizer
    f = open_gguf(args.model)
    if args.random:  # as benchmarks/llama_cpp_diff.py feeds both engines
        ids = np.random.default_rng(args.seed).integers(10, f.config.vocab_size - 10, args.random - 1)
        return [f.config.bos_id] + ids.tolist()
    tok = Tokenizer.from_gguf(f.metadata)
    return [f.config.bos_id] + list(tok.encode(args.prompt, special=False))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ds4ref.diff", formatter_class=HelpFormatter,
                                 description="Where a foreign engine leaves ds4ref, layer by layer and op by op.")
    sub = ap.add_subparsers(dest="job", required=True)
    for job, what in (("dump", "ds4ref's intermediates (the NumPy reference)"),
                      ("llama-cpp", "llama.cpp's intermediates (llama-cpp-python, CPU)")):
        p = sub.add_parser(job, help=what, formatter_class=HelpFormatter)
        p.add_argument("model", help="deepseek4 GGUF file")
        p.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog.",
                       help="text, tokenised with the model's tokenizer after BOS")
        p.add_argument("--tokens", default="", help="comma-separated token ids instead of --prompt")
        p.add_argument("--random", type=int, default=0, help="BOS and N-1 random ids instead of --prompt")
        p.add_argument("--seed", type=int, default=0, help="seed of --random")
        p.add_argument("--out", required=True, help="folder for the dump files (one a step)")
        if job == "dump":
            p.add_argument("--numerics", default="official", choices=("official", "plain"))
            p.add_argument("--dtype", default="float32", choices=("float32", "float64"))
            p.add_argument("--pass-rows", type=int, default=512, help="rows a pass (one dump file a pass)")
            p.add_argument("--driver", default="decode", choices=("decode", "prefill"),
                           help="the streamed pass (decode.py) or the whole-sequence forward (prefill.py)")
    p = sub.add_parser("compare", help="rank the first divergence of B from A", formatter_class=HelpFormatter)
    p.add_argument("a", help="dump folder of the reference side")
    p.add_argument("b", help="dump folder of the engine under test")
    args = ap.parse_args(argv)
    if args.job == "compare":
        from .compare import compare, first_divergence, report
        from .dumpfile import read_dump
        a, b = read_dump(args.a), read_dump(args.b)
        results = compare(a, b)
        print(report(args.a, args.b, a, b, results))
        return 1 if first_divergence(results) else 0
    tokens = _tokens(args)
    if args.job == "dump":
        from .recorder import dump_reference
        files = dump_reference(args.model, tokens, args.out, args.numerics, np.dtype(args.dtype), args.pass_rows,
                               args.driver)
    else:
        from .llama_cpp import dump_llama_cpp
        files = dump_llama_cpp(args.model, tokens, args.out)
    print(f"{len(tokens)} tokens, {len(files)} dump files in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
