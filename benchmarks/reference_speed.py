"""Reference speed: the embedded tiny model, beside transformers' CPU DeepseekV4, and one
Flash-dims layer step.

    python benchmarks/reference_speed.py [--flash-steps 8] [--no-hf] [--repeats 3]

Prints numbers; it is not a test. Embedded tiny model (float32, official numerics):
* NumpyBackend decode at C = 1 and C = 16 (C slots, one row each per pass), after a
  64-token prompt per slot, 64 timed passes;
* streamed decode through Model.generate (64-token prompt + 128 new), as before;
* `score` of a 512-token prompt.
transformers' DeepseekV4ForCausalLM on the same config and the same (dequantised) weights,
float32 on the CPU, eager: cached decode one token per sequence at batch 1 and 16 after the
same 64-token prompts, and the prefill of 512 tokens. transformers has one SwiGLU clamp for
all layers, so its model takes layer 0's everywhere (speed does not depend on it). Each
figure is the best of --repeats runs, the measures of both engines taking turns within each
repeat; ratios are taken within this run.

Flash-dims weights are random and generated lazily (routed experts one at a time), so a
layer step needs ~1 GB, not 26 GB.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import time
import zlib

import numpy as np

import ds4ref
from ds4ref.backend import Row, StepPlan
from ds4ref.gguf.config import DS4Config
from ds4ref.reference.model import Model
from ds4ref.reference.numpy_backend import NumpyBackend
from ds4ref.gguf.weights import Weights

PROMPT, STEPS, SCORE_LEN = 64, 64, 512


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


def prompts(c: int, n: int, vocab: int) -> np.ndarray:
    return np.random.default_rng(c).integers(2, vocab, (c, n))


def backend_decode(model, c: int) -> float:
    """NumpyBackend tok/s: c slots, each fed a PROMPT-token prompt, then STEPS timed passes
    of c rows (one per slot, greedy)."""
    b = NumpyBackend(model.reference)
    pages = -(-(PROMPT + STEPS) // 128)
    b.configure(n_slots=c, n_pages=c * pages)
    ids = prompts(c, PROMPT, model.config.vocab_size)
    for s in range(c):
        b.reset_slot(s)
        b.set_block_table(s, list(range(s * pages, (s + 1) * pages)))
    per = max(1, b.max_pass_rows // c)  # prompt rows of each slot per pass
    for p in range(0, PROMPT - 1, per):
        span = range(p, min(p + per, PROMPT - 1))
        b.step(StepPlan.from_rows([Row(s, q, int(ids[s, q]), False, False) for s in range(c) for q in span]))
    tok = ids[:, -1].tolist()
    t = time.perf_counter()
    for p in range(PROMPT - 1, PROMPT - 1 + STEPS):
        res = b.step(StepPlan.from_rows([Row(s, p, tok[s], want_logits=False) for s in range(c)]))
        tok = res.argmax.tolist()
    return c * STEPS / (time.perf_counter() - t)


def streamed_decode(model, n_prompt: int = 64, n_new: int = 128) -> float:
    ids = list(range(1, n_prompt + 1))
    t = time.perf_counter()
    model.generate(ids, n_new)
    return (n_prompt + n_new) / (time.perf_counter() - t)


def score(model) -> float:
    ids = [i % model.config.vocab_size for i in range(SCORE_LEN)]
    t = time.perf_counter()
    model.score(ids)
    return SCORE_LEN / (time.perf_counter() - t)


def tiny_measures(model) -> dict:
    """name -> a function that runs the measure once and returns tok/s."""
    model.score(list(range(1, 40)))  # warm up Numba and the weight caches
    return {"NumpyBackend decode C=1, tok/s": lambda: backend_decode(model, 1),
            "NumpyBackend decode C=16, tok/s": lambda: backend_decode(model, 16),
            "streamed decode (generate, 64 prompt + 128 new), tok/s": lambda: streamed_decode(model),
            f"score of {SCORE_LEN} tokens, tok/s": lambda: score(model)}


def hf_model(model):
    import torch
    from ds4ref.convert.hf import hf_model as build
    from ds4ref.gguf.tensors import tensor_shapes
    cfg = dataclasses.replace(model.config, swiglu_clamp=(model.config.swiglu_clamp[0],) * model.config.n_layer)
    tensors = {n: model.weights.get(n) for n in tensor_shapes(cfg)}
    return build(cfg, tensors, torch.float32)


def hf_decode(hf, c: int, vocab: int) -> float:
    import torch
    ids = torch.from_numpy(prompts(c, PROMPT, vocab))
    with torch.no_grad():
        out = hf(input_ids=ids[:, :-1], use_cache=True)
        past, nxt = out.past_key_values, ids[:, -1:]
        t = time.perf_counter()
        for _ in range(STEPS):
            out = hf(input_ids=nxt, past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    return c * STEPS / (time.perf_counter() - t)


def hf_prefill(hf, vocab: int) -> float:
    import torch
    ids = torch.tensor([[i % vocab for i in range(SCORE_LEN)]])
    with torch.no_grad():
        t = time.perf_counter()
        hf(input_ids=ids)
    return SCORE_LEN / (time.perf_counter() - t)


def hf_measures(model) -> dict:
    import warnings

    import torch
    import transformers
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    hf, v = hf_model(model), model.config.vocab_size
    hf_prefill(hf, v)  # warm up
    label = f"transformers {transformers.__version__} (torch {torch.__version__}, {torch.get_num_threads()} threads)"
    return {f"{label} decode C=1, tok/s": lambda: hf_decode(hf, 1, v),
            f"{label} decode C=16, tok/s": lambda: hf_decode(hf, 16, v),
            f"{label} prefill of {SCORE_LEN} tokens, tok/s": lambda: hf_prefill(hf, v)}


def best_interleaved(measures: dict, repeats: int) -> dict:
    """The best of `repeats` runs of every measure, the measures taking turns within each
    repeat, so a busy spell of a shared machine hits both engines alike."""
    best = {k: 0.0 for k in measures}
    for _ in range(repeats):
        for k, run in measures.items():
            best[k] = max(best[k], run())
    return best


def ratios(ours: dict, hf: dict) -> dict:
    o, h = list(ours.values()), list(hf.values())
    return {"ratio decode C=1, ours / transformers": o[0] / h[0],
            "ratio decode C=16, ours / transformers": o[1] / h[1],
            "ratio score / transformers prefill": o[3] / h[2],
            "ratio ours C=16 / C=1": o[1] / o[0]}


def flash_layer_step(steps: int) -> dict:
    from ds4ref.reference.decode import Rows, attention_block
    from ds4ref.reference.layers import LayerWeights, ffn_block
    cfg = flash_config()
    model = Model(LazyRandomWeights(cfg, np.float32))
    state = model.new_state()
    out = {}

    def step(lw, il, st, streams, pos):
        rows = Rows.of([st], [pos + 1], [pos])
        s = attention_block(lw, cfg, model.tables, model.numerics, rows, il, streams)
        return ffn_block(lw, cfg, il, s, rows.tokens)

    for il in (2, 3):  # a ratio-4 layer (compressors + indexer) and a ratio-128 layer
        lw = LayerWeights(model.weights, il, model.numerics)
        times = []
        for pos in range(steps):
            streams = np.random.default_rng(pos).standard_normal((1, cfg.hc_mult, cfg.n_embd), dtype=np.float32)
            step(lw, il, copy.deepcopy(state), streams, pos)  # first run makes this step's experts; time the second
            t = time.perf_counter()
            step(lw, il, state, streams, pos)
            times.append(time.perf_counter() - t)
        out[f"Flash-dims layer {il} (ratio {cfg.ratio(il)}) decode step, median ms"] = \
            1e3 * float(np.median(times[1:]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flash-steps", type=int, default=8, help="0 skips the Flash-dims layer step")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model = ds4ref.load()
    mine = tiny_measures(model)
    theirs = {} if args.no_hf else hf_measures(model)
    best = best_interleaved({**mine, **theirs}, args.repeats)
    ours, hf = {k: best[k] for k in mine}, {k: best[k] for k in theirs}
    rows = {**ours, **hf, **(ratios(ours, hf) if hf else {})}
    if args.flash_steps:
        rows = {**rows, **flash_layer_step(args.flash_steps)}
    print("| measure | value |\n|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v:.2f} |" if k.startswith("ratio") else f"| {k} | {v:.1f} |")


if __name__ == "__main__":
    main()
