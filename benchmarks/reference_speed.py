"""Reference speed: tokens/s on the embedded tiny model, and one Flash-dims layer step.

    python benchmarks/reference_speed.py [--flash-steps 8]

Prints numbers; it is not a test. Flash-dims weights are random and generated
lazily (routed experts one at a time), so a layer step needs ~1 GB, not 26 GB.
"""
from __future__ import annotations

import argparse
import copy
import time
import zlib

import numpy as np

import ds4ref
from ds4ref.config import DS4Config
from ds4ref.reference.decode import attention_block
from ds4ref.reference.layers import LayerWeights, ffn_block
from ds4ref.reference.model import Model
from ds4ref.tensors import tensor_shapes
from ds4ref.weights import Weights


def flash_config(ratios=(0, 0, 4, 128)) -> DS4Config:
    n = len(ratios)
    return DS4Config(
        n_layer=n, n_embd=4096, vocab_size=129280, n_head=64, head_dim=512, n_rot=64, q_lora_rank=1024,
        o_lora_rank=1024, o_groups=8, n_expert=256, n_expert_used=6, n_expert_shared=1, expert_ff=2048,
        n_hash_layers=3, expert_weights_scale=1.5, sliding_window=128, indexer_heads=64, indexer_head_dim=128,
        indexer_top_k=512, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_eps=1e-6,
        compress_ratios=ratios, swiglu_clamp=(10.0,) * n, rope_freq_base=10000.0,
        compress_rope_freq_base=160000.0, yarn_factor=16.0, yarn_orig_ctx=65536, yarn_beta_fast=32.0,
        yarn_beta_slow=1.0)


class LazyRandomWeights(Weights):
    """Random tensors made on first use from a per-name seed (experts per slice)."""

    def _rng(self, key: str) -> np.random.Generator:
        return np.random.default_rng(zlib.crc32(key.encode()))

    def _make(self, key: str, shape) -> np.ndarray:
        rng = self._rng(key)
        if key.endswith("tid2eid.weight"):
            return np.stack([rng.choice(self.config.n_expert, shape[1], replace=False) for _ in range(shape[0])])
        if len(shape) == 1 or key.endswith("ape.weight") or "_scale" in key or "_base" in key:
            return 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
        return rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[-1]))

    def _load(self, name):
        return self._make(name, self.shape(name))

    def _load_expert(self, name, e):
        return self._make(f"{name}#{e}", self.shape(name)[1:])

    def with_dtype(self, dtype):
        return LazyRandomWeights(self.config, dtype)


def tiny_tokens_per_second(n_prompt: int = 64, n_new: int = 128) -> dict:
    model = ds4ref.load()
    ids = list(range(1, n_prompt + 1))
    model.generate(ids[:4], 2)  # warm up Numba and the weight cache
    t = time.perf_counter()
    model.generate(ids, n_new)
    decode = (n_prompt + n_new) / (time.perf_counter() - t)
    t = time.perf_counter()
    model.score([i % model.config.vocab_size for i in range(512)])
    prefill = 512 / (time.perf_counter() - t)
    return {"decode tok/s (streamed, prompt+new)": decode, "prefill tok/s (score, 512)": prefill}


def flash_layer_step(steps: int) -> dict:
    cfg = flash_config()
    model = Model(LazyRandomWeights(cfg, np.float32))
    state = model.new_state()
    out = {}
    for il in (2, 3):  # a ratio-4 layer (compressors + indexer) and a ratio-128 layer
        lw = LayerWeights(model.weights, il)
        times = []
        for pos in range(steps):
            streams = np.random.default_rng(pos).standard_normal((1, cfg.hc_mult, cfg.n_embd), dtype=np.float32)
            warm = copy.deepcopy(state)  # first run makes this step's experts; time the second
            ffn_block(lw, cfg, il, attention_block(lw, cfg, model.tables, model.numerics, warm, il, streams, pos),
                      [pos + 1])
            t = time.perf_counter()
            s = attention_block(lw, cfg, model.tables, model.numerics, state, il, streams, pos)
            ffn_block(lw, cfg, il, s, [pos + 1])
            times.append(time.perf_counter() - t)
        out[f"layer {il} (ratio {cfg.ratio(il)}) step, median ms"] = 1e3 * float(np.median(times[1:]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flash-steps", type=int, default=8)
    args = ap.parse_args()
    rows = {**tiny_tokens_per_second(), **flash_layer_step(args.flash_steps)}
    print("| measure | value |\n|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v:.1f} |")


if __name__ == "__main__":
    main()
