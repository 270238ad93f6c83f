"""Peak memory of the FP8/FP4 converter on a checkpoint much larger than the bound.

    python benchmarks/convert_rss.py [--layers 4] [--experts 64] [--work /tmp/ds4ref-rss]

Writes a checkpoint in the official layout at Flash's widths (DeepSeek's names: FP8 E4M3
attention and shared-expert weights with 128x128 E8M0 scales, FP4 routed experts with E8M0
scales per 32, BF16 embedding, F32 small tensors), tensor by tensor so the writer never holds
it, then runs `python -m ds4ref.convert --dtype bf16` on it in a child process and prints the
child's peak RSS (getrusage) beside the checkpoint and output sizes. Prints numbers; not a test.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ds4ref.convert.hf import config_to_hf, to_checkpoint_tensors  # noqa: E402
from ds4ref.gguf.tensors import tensor_shapes  # noqa: E402
from ds4ref.gguf.tiny import tiny_config  # noqa: E402

FP8 = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight",
       "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight", "ffn.shared_experts.w3.weight")


def layout(name: str, shape) -> list[tuple[str, str, tuple]]:
    """(name, safetensors dtype, shape) entries one tensor becomes in the official layout."""
    if name.endswith(FP8) or name == "head.weight":
        return [(name, "F8_E4M3", shape), (name[:-len(".weight")] + ".scale", "F8_E8M0",
                                           (-(-shape[0] // 128), -(-shape[1] // 128)))]
    if ".ffn.experts." in name:
        return [(name, "I8", (shape[0], shape[1] // 2)),
                (name[:-len(".weight")] + ".scale", "F8_E8M0", (shape[0], shape[1] // 32))]
    if name.endswith("tid2eid"):
        return [(name, "I64", shape)]
    return [(name, "BF16" if np.prod(shape) > 1 << 20 else "F32", shape)]


SIZE = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "I64": 8, "BF16": 2, "F32": 4}


def payload(rng, dtype: str, shape, name: str, n_expert: int) -> bytes:
    n = int(np.prod(shape))
    if dtype == "F8_E4M3":
        codes = rng.integers(0, 256, n, dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x38  # no NaN codes
        return codes.tobytes()
    if dtype == "F8_E8M0":
        return rng.integers(118, 125, n, dtype=np.uint8).tobytes()
    if dtype == "I8":
        return rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    if dtype == "I64":
        return (np.arange(n) % n_expert).astype("<i8").tobytes()  # each token: 6 distinct experts
    values = (rng.standard_normal(n, dtype=np.float32) * 0.02
              + (1.0 if name.endswith("norm.weight") else 0.0)).astype(np.float32)
    if dtype == "BF16":
        return (values.view(np.uint32) >> 16).astype("<u2").tobytes()
    return values.astype("<f4").tobytes()


def write_checkpoint(path: Path, cfg) -> int:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config_to_hf(cfg, "legacy")))
    # names and shapes only: np.empty does not touch its pages, and renaming keeps views
    probe = {n: np.empty(s, np.float32) for n, s in tensor_shapes(cfg).items()}
    entries = [e for n, a in to_checkpoint_tensors(cfg, probe, names="official").items() for e in layout(n, a.shape)]
    header, at = {}, 0
    for name, dtype, shape in entries:
        nbytes = int(np.prod(shape)) * SIZE[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + nbytes]}
        at += nbytes
    head = json.dumps(header).encode()
    rng = np.random.default_rng(0)
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for name, dtype, shape in entries:
            f.write(payload(rng, dtype, shape, name, cfg.n_expert))
    return 8 + len(head) + at


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--work", type=Path, default=Path("/tmp/ds4ref-rss"))
    args = ap.parse_args()
    cfg = dataclasses.replace(
        tiny_config(n_layer=args.layers), n_embd=4096, vocab_size=129280, n_head=64, head_dim=512, value_dim=512,
        n_rot=64, q_lora_rank=1024, o_lora_rank=1024, o_groups=8, n_expert=args.experts, n_expert_used=6,
        n_expert_shared=1, expert_ff=2048, sliding_window=128, indexer_heads=64, indexer_head_dim=128,
        indexer_top_k=512, n_hash_layers=min(3, args.layers), swiglu_clamp=(10.0,) * args.layers,
        name="rss-probe")
    t = time.time()
    size = write_checkpoint(args.work / "ck", cfg)
    print(f"checkpoint: {size / 2**30:.2f} GiB ({args.layers} layers, {args.experts} experts) written in "
          f"{time.time() - t:.0f} s", flush=True)
    out = args.work / "m.gguf"
    t = time.time()
    subprocess.run([sys.executable, "-m", "ds4ref.convert", "--hf", str(args.work / "ck"), "--out", str(out),
                    "--dtype", "bf16"], check=True, cwd=ROOT)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB -> GiB
    print(f"convert --dtype bf16: {time.time() - t:.0f} s, peak RSS {peak:.2f} GiB, output "
          f"{out.stat().st_size / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
