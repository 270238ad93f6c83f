"""A random DSpark draft for a tiny target, written as llama.cpp's dflash file (gguf.dspark):

    python -m ds4ref.gguf.tiny_dspark --out dspark-ds4-tiny.gguf [--model ds4-tiny.gguf] [--seed N]

Its shape follows the 0731 release at the target's sizes: three stages, block size 5, the
target's last three layers tapped (the release taps 40, 41, 42 of 43), the last token id as the
noise token; the Markov rank is 32 (256 in the release), a multiple of Q8_0's 32-wide blocks.
"""
from __future__ import annotations

import argparse
import os

import numpy as np

from ..console import HelpFormatter
from .config import DS4Config
from .dspark import DSparkConfig, dspark_config, dspark_tensor_shapes, write_dflash_gguf
from .tiny import _DTYPE_BY_SUFFIX, _linear, _normal, _random_tensor

DSPARK_SEED_OFFSET = 2 << 20  # after the main tensors' and the MTP block's generators
TINY_RANK = 32


def tiny_dspark_config(config: DS4Config, block_size: int = 5, n_stages: int = 3, markov_rank: int = TINY_RANK,
                       target_layers=None) -> DSparkConfig:
    n = config.n_layer
    taps = tuple(range(max(0, n - 3), n)) if target_layers is None else tuple(target_layers)
    return dspark_config(config, block_size, config.vocab_size - 1, markov_rank, taps, n_stages)


def random_dspark(config: DS4Config, dc: DSparkConfig, seed: int = 0) -> tuple[dict, dict[str, str]]:
    """(tensors by ds4ref's DSpark names, their stored types), each from its own generator."""
    tensors, dtypes = {}, {}
    for i, (name, shape) in enumerate(dspark_tensor_shapes(dc).items()):
        rng = np.random.default_rng([seed, DSPARK_SEED_OFFSET + i])
        suffix = name.split(".", 2)[2]
        if suffix == "markov_head.markov_w1.weight":
            tensors[name], dtypes[name] = _normal(rng, shape), "f16"
        elif suffix == "markov_head.markov_w2.weight":  # a bias of std ~2: it moves the argmax
            tensors[name], dtypes[name] = _linear(rng, shape, 2.0), "q8_0"
        elif suffix in ("main_proj.weight", "confidence_head.proj.weight"):
            tensors[name], dtypes[name] = _linear(rng, shape), "q8_0" if suffix == "main_proj.weight" else "f32"
        else:
            tensors[name] = _random_tensor(rng, dc.stages, suffix, tuple(shape))
            if suffix in _DTYPE_BY_SUFFIX or suffix == "hc_head_fn.weight":
                dtypes[name] = _DTYPE_BY_SUFFIX.get(suffix, "f16")
    return tensors, dtypes


def write_tiny_dspark(path: str | os.PathLike, config: DS4Config, seed: int = 0, dc: DSparkConfig | None = None,
                      tokenizer_meta=None, dtypes: dict[str, str] | None = None) -> DSparkConfig:
    """Write a random DSpark draft for a target of `config` to `path` (llama.cpp's dflash file);
    `dtypes` overrides the stored types (`{}`: every tensor f32)."""
    dc = tiny_dspark_config(config) if dc is None else dc
    tensors, stored = random_dspark(config, dc, seed)
    dtypes = stored if dtypes is None else dtypes
    write_dflash_gguf(path, config, dc, tensors, tokenizer_meta, dtypes)
    return dc


def main(argv: list[str] | None = None) -> None:
    from .file import open_gguf
    from .tiny import default_model_path
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--out", required=True, metavar="FILE", help="the dflash GGUF to write")
    ap.add_argument("--model", default=None, metavar="FILE", help="the target (default: the embedded tiny model)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    target = open_gguf(args.model or default_model_path())
    tok = {k: v for k, v in target.metadata.items() if k.startswith("tokenizer.")}
    dc = write_tiny_dspark(args.out, target.config, args.seed, tokenizer_meta=tok)
    print(f"wrote {args.out}: {dc.n_stages} stages, block size {dc.block_size}, taps {list(dc.target_layers)}, "
          f"{os.path.getsize(args.out)} bytes")


if __name__ == "__main__":
    main()
