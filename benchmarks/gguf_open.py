"""How long does opening a large deepseek4 GGUF take, and what does it cost in memory?

Writes a ~2 GB file with Flash's dimensions (hidden 4096, 64 heads of 512,
q/o ranks 1024, expert width 2048, HC 4) but only 3 layers, 6 experts and a
32k vocabulary, all f16, into a temporary directory; then measures:

  * open_gguf (header parse + every check): wall time and RSS,
  * the first get() of one attention projection,
  * the first expert() of one routed expert (only its slice is dequantised).

    PYTHONPATH=. python benchmarks/gguf_open.py [--dir DIR] [--keep] [--vs-gguf-reader]

RSS is read from /proc/self/statm (current) and getrusage (peak). Pages of
the memory map that were read count towards RSS as file-backed memory. The
file was just written, so it sits in the page cache: these are warm-cache
figures; a cold 150 GB file adds disk time only for the tensors touched.
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import tempfile
import time

import gguf
import numpy as np

from ds4ref.gguf.file import open_gguf, write_gguf
from ds4ref.gguf.tensors import is_int_tensor, tensor_shapes
from ds4ref.gguf.tiny import tiny_config


class LazyTensor:
    """Shape now, values when the writer asks: never more than one tensor in memory."""

    def __init__(self, name: str, shape: tuple[int, ...], seed: int):
        self.name, self.shape, self.seed = name, shape, seed

    def __array__(self, dtype=None, copy=None):
        if is_int_tensor(self.name):
            return np.zeros(self.shape, np.int32)
        # a repeated random row: realistic bytes without generating 2 GB of normals
        row = np.random.default_rng(self.seed).standard_normal(self.shape[-1]).astype(np.float32)
        return np.broadcast_to(row / np.sqrt(self.shape[-1]), self.shape)


def flash_like_config():
    return tiny_config(n_layer=3, compress_ratios=[0, 4, 128], n_embd=4096, vocab_size=32768, n_head=64,
                       head_dim=512, n_rot=64, q_lora_rank=1024, o_lora_rank=1024, o_groups=8, n_expert=6,
                       n_expert_used=6, expert_ff=2048, n_hash_layers=1, sliding_window=128,
                       indexer_heads=64, indexer_head_dim=128, indexer_top_k=512, name="flash-dims-bench")


def synthetic_tokenizer(vocab: int) -> dict:
    # Header parsing cost grows with the string arrays, so give them a realistic size.
    tokens = [f"tok{i}" for i in range(vocab)]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "joyai-llm", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * vocab, "tokenizer.ggml.merges": ["t o"] * (vocab - 300),
            "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1}


def rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return float("nan")


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def report(label: str, seconds: float) -> None:
    print(f"{label:<40} {seconds * 1e3:9.1f} ms   RSS {rss_mb():8.1f} MiB   peak {peak_mb():8.1f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None, help="where to write the file (default: a new temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the file afterwards")
    ap.add_argument("--vs-gguf-reader", action="store_true",
                    help="also time gguf-py's GGUFReader on the same file (why ds4ref parses headers itself)")
    args = ap.parse_args()
    cfg = flash_like_config()
    work = args.dir or tempfile.mkdtemp(prefix="ds4ref-bench-")
    path = os.path.join(work, "flash-dims.gguf")
    print(f"writing {path}")
    tensors = {n: LazyTensor(n, s, i) for i, (n, s) in enumerate(tensor_shapes(cfg).items())}
    t0 = time.perf_counter()
    write_gguf(path, cfg, tensors, tokenizer_meta=synthetic_tokenizer(cfg.vocab_size), default_dtype="f16")
    print(f"wrote {os.path.getsize(path) / 2**30:.2f} GiB in {time.perf_counter() - t0:.1f} s")
    try:
        measure(path)
        if args.vs_gguf_reader:
            t = time.perf_counter()
            gguf.GGUFReader(path)
            report("gguf.GGUFReader (same file, for scale)", time.perf_counter() - t)
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(work)
        else:
            print(f"kept {path}")


def measure(path: str) -> None:
    report("before open", 0.0)
    t = time.perf_counter()
    f = open_gguf(path)
    report("open_gguf (header, checks)", time.perf_counter() - t)
    w = f.weights()
    t = time.perf_counter()
    q_b = w.get("blk.1.attn_q_b.weight")
    report(f"get attn_q_b {q_b.shape} f16->f32", time.perf_counter() - t)
    t = time.perf_counter()
    e = w.expert("blk.2.ffn_gate_exps.weight", 3)
    report(f"expert gate_exps[3] {e.shape}", time.perf_counter() - t)
    t = time.perf_counter()
    w.expert("blk.2.ffn_gate_exps.weight", 3)
    report("same expert again (cached)", time.perf_counter() - t)


if __name__ == "__main__":
    main()
