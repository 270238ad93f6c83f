"""A tiny random deepseek4 model with every structural feature of Flash.

Six layers cover the whole schedule (two sliding-window layers, ratio-4 CSA
with the indexer, ratio-128 HCA, three hash-routed layers, biased routing),
with small windows and top-k so tests reach compression, indexer selection
and clamping within a few hundred tokens. Weights are random but scaled so
that activations stay O(1) through the layers and the logits are far from
flat, which makes argmax comparisons between implementations meaningful.

    python -m ds4ref.gguf.tiny --out model.gguf [--mtp-out mtp.gguf] [--seed N] [--layers N]
                               [--policy q2|q4|mxfp4] [--version 0731 --dspark-out draft.gguf]

The packaged model and its MTP block are
`--out ds4ref/data/ds4-tiny.gguf --mtp-out ds4ref/data/mtp-ds4-tiny.gguf`. `--version 0731`
writes the same weights as a DeepSeek-V4-Flash-0731 model, whose draft is a random DSpark draft
(`--dspark-out`, llama.cpp's dflash file; docs/mtp.md "Files and names").

`--policy` writes the published files' type policy (spec §2): routed experts as
IQ2_XXS gate/up + Q2_K down (q2), Q4_K (q4) or MXFP4 (mxfp4); Q8_0 attention, shared
expert and output; F16 HC, compressor, indexer, router and embedding. The 256-value
blocks of the K-quants and IQ2_XXS need rows that are multiples of 256, so the policy
files are 256 wide with 256-wide experts (POLICY_DIMS); the expert blocks are random
but valid bytes (random_blocks), since gguf-py cannot quantise to these types.
"""
from __future__ import annotations

import argparse
import importlib.resources
import math
import os
from pathlib import Path
from ..console import HelpFormatter

import numpy as np

from .config import DS4Config
from .dspark import DSparkConfig, dspark_tensor_shapes, stage_config
from .tensors import tensor_shapes
from .version import ORIGINAL, V0731, VERSIONS

# Clamp limits low enough that the SwiGLU clamp acts on a good share of
# random activations (the gate/up projections below have std ~2).
_CLAMPS = (1.5, 2.0, 2.5, 3.0, 1.75, 2.25)

_TINY = dict(
    n_layer=6, n_embd=128, vocab_size=512, n_head=4, head_dim=96, n_rot=32,
    q_lora_rank=64, o_lora_rank=64, o_groups=2, n_expert=8, n_expert_used=2,
    n_expert_shared=1, expert_ff=64, n_hash_layers=3, expert_weights_scale=1.5,
    sliding_window=16, indexer_heads=8, indexer_head_dim=64, indexer_top_k=8,
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_eps=1e-6,
    rope_freq_base=10000.0, compress_rope_freq_base=160000.0, yarn_factor=16.0,
    yarn_orig_ctx=65536, yarn_beta_fast=32.0, yarn_beta_slow=1.0,
    context_length=4096, name="ds4-tiny",
)

# Stored types, after the published files' policy (F16 embedding / HC /
# compressor / indexer / router, Q8_0 attention, shared experts and output).
# Routed experts are Q8_0 too (published: Q4_K, whose 256-blocks do not fit
# 128-wide rows) so the embedded model exercises quantised expert slicing.
_DTYPE_BY_SUFFIX = {
    "token_embd.weight": "f16", "output.weight": "q8_0", "output_hc_fn.weight": "f16",
    "hc_attn_fn.weight": "f16", "hc_ffn_fn.weight": "f16",
    "attn_q_a.weight": "q8_0", "attn_q_b.weight": "q8_0", "attn_kv.weight": "q8_0",
    "attn_output_a.weight": "q8_0", "attn_output_b.weight": "q8_0",
    "attn_compressor_ape.weight": "f16", "attn_compressor_kv.weight": "f16",
    "attn_compressor_gate.weight": "f16",
    "indexer.attn_q_b.weight": "f16", "indexer.proj.weight": "f16",
    "indexer_compressor_ape.weight": "f16", "indexer_compressor_kv.weight": "f16",
    "indexer_compressor_gate.weight": "f16",
    "ffn_gate_inp.weight": "f16",
    "ffn_gate_exps.weight": "q8_0", "ffn_up_exps.weight": "q8_0", "ffn_down_exps.weight": "q8_0",
    "ffn_gate_shexp.weight": "q8_0", "ffn_up_shexp.weight": "q8_0", "ffn_down_shexp.weight": "q8_0",
}


# Routed-expert types of each published policy: (gate and up, down).
POLICIES: dict[str, tuple[str, str]] = {"q2": ("IQ2_XXS", "Q2_K"), "q4": ("Q4_K", "Q4_K"),
                                        "mxfp4": ("MXFP4", "MXFP4")}
# Dimensions of the policy files: expert rows (n_embd for gate/up, expert_ff for down)
# must be multiples of 256 for Q2_K / Q4_K / IQ2_XXS. Everything else is the tiny model's.
POLICY_DIMS = dict(n_embd=256, expert_ff=256)
_EXPERTS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


def flash_ratio(layer: int) -> int:
    """Flash's schedule: two sliding layers, then CSA (4) on even, HCA (128) on odd layers."""
    if layer < 2:
        return 0
    return 4 if layer % 2 == 0 else 128


def flash_config(n_layer: int = 43, **overrides) -> DS4Config:
    """DeepSeek V4 Flash's dimensions (spec §1) over n_layer layers of its schedule: what memory
    plans and the GPU benchmarks' random models are sized by."""
    return DS4Config(**{**dict(
        n_layer=n_layer, n_embd=4096, vocab_size=129280, n_head=64, head_dim=512, n_rot=64, q_lora_rank=1024,
        o_lora_rank=1024, o_groups=8, n_expert=256, n_expert_used=6, n_expert_shared=1, expert_ff=2048,
        n_hash_layers=3, expert_weights_scale=1.5, sliding_window=128, indexer_heads=64, indexer_head_dim=128,
        indexer_top_k=512, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_eps=1e-6,
        compress_ratios=tuple(flash_ratio(i) for i in range(n_layer)), swiglu_clamp=(10.0,) * n_layer,
        rope_freq_base=10000.0, compress_rope_freq_base=160000.0, yarn_factor=16.0, yarn_orig_ctx=65536,
        yarn_beta_fast=32.0, yarn_beta_slow=1.0, name="DeepSeek V4 Flash (dimensions)"), **overrides})


def tiny_config(**overrides) -> DS4Config:
    """The embedded tiny config; n_layer overrides extend ratios and clamps by Flash's pattern."""
    kw = dict(_TINY)
    kw.update(overrides)
    n = int(kw["n_layer"])
    kw.setdefault("compress_ratios", [flash_ratio(i) for i in range(n)])
    kw.setdefault("swiglu_clamp", [_CLAMPS[i % len(_CLAMPS)] for i in range(n)])
    return DS4Config(**kw)


def tiny_dtypes(config: DS4Config) -> dict[str, str]:
    """Stored type per tensor for the embedded file (f32 where not listed)."""
    out = {}
    for name in tensor_shapes(config):
        suffix = name.split(".", 2)[-1] if name.startswith("blk.") else name
        if suffix in _DTYPE_BY_SUFFIX:
            out[name] = _DTYPE_BY_SUFFIX[suffix]
    return out


# ---------------------------------------------------------------------------
# random weights
# ---------------------------------------------------------------------------
def _linear(rng: np.random.Generator, shape: tuple[int, ...], gain: float = 1.0) -> np.ndarray:
    """N(0, gain²/in): unit-RMS inputs give outputs of RMS ~gain."""
    return (rng.standard_normal(shape) * (gain / np.sqrt(shape[-1]))).astype(np.float32)


def _normal(rng: np.random.Generator, shape: tuple[int, ...], mean: float = 0.0, std: float = 1.0) -> np.ndarray:
    return (mean + std * rng.standard_normal(shape)).astype(np.float32)


def _hash_table(rng: np.random.Generator, vocab: int, n_expert: int, k: int) -> np.ndarray:
    # argsort of independent uniforms = a random permutation per token, so ids are distinct
    return np.argsort(rng.random((vocab, n_expert)), axis=1)[:, :k].astype(np.int32)


def _gain(suffix: str) -> float:
    if suffix in ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight"):
        return 2.0  # SwiGLU inputs of RMS ~2 so the small clamps bite
    if suffix == "output.weight":
        return 3.0  # logits of std ~3: clearly peaked softmax over 512 tokens
    if suffix.endswith("compressor_gate.weight"):
        return 2.0  # pooling scores that actually prefer some tokens
    return 1.0


def _random_tensor(rng: np.random.Generator, cfg: DS4Config, suffix: str, shape: tuple[int, ...]) -> np.ndarray:
    if suffix.endswith("norm.weight"):
        return _normal(rng, shape, 1.0, 0.1)
    if suffix == "ffn_gate_tid2eid.weight":
        return _hash_table(rng, cfg.vocab_size, cfg.n_expert, cfg.n_expert_used)
    if suffix.endswith("_base.weight"):  # HC biases
        return _normal(rng, shape, 0.0, 0.5)
    if suffix.endswith("_scale.weight"):  # HC scalars (s_pre, s_post, s_comb)
        return rng.uniform(0.5, 1.5, shape).astype(np.float32)
    if suffix in ("attn_sinks.weight", "exp_probs_b.bias") or suffix.endswith("_ape.weight"):
        return _normal(rng, shape, 0.0, 0.5)
    if suffix == "token_embd.weight":
        return _normal(rng, shape)
    return _linear(rng, shape, _gain(suffix))


def random_tensors(config: DS4Config, seed: int = 0) -> dict[str, np.ndarray]:
    """Every tensor of tensor_shapes(config), float32 (int32 tid2eid), from one seed.

    Each tensor draws from its own generator keyed by (seed, index), so the
    values of a tensor do not depend on how many draws came before it.
    """
    out = {}
    for i, (name, shape) in enumerate(tensor_shapes(config).items()):
        rng = np.random.default_rng([seed, i])
        suffix = name.split(".", 2)[-1] if name.startswith("blk.") else name
        out[name] = _random_tensor(rng, config, suffix, tuple(shape))
    return out


# ---------------------------------------------------------------------------
# random but valid quantised blocks
# ---------------------------------------------------------------------------
def _set_f16(blocks: np.ndarray, offset: int, value) -> None:
    blocks[:, offset:offset + 2] = np.asarray(value, np.float16).reshape(-1, 1).view(np.uint8).reshape(-1, 2)


def _dequant(blocks: np.ndarray, qtype) -> np.ndarray:
    import gguf
    return gguf.quants.dequantize(blocks, qtype).reshape(-1)


# The generated files must be the same bytes on every machine, so no statistic that feeds a
# stored byte may come from a NumPy reduction (its rounding follows the CPU's SIMD width and
# the NumPy build) or a vectorised transcendental. exact_sum is the correctly rounded sum (what
# math.fsum returns) and the element-wise float64 operations are IEEE-exact, so these two are
# machine-independent.
_RUN = 1 << 15  # values a step: the step's arrays stay in the CPU's caches


def exact_sum(values: np.ndarray) -> float:
    """math.fsum(values) (float64), vectorised: the exact sum, rounded once to nearest even.

    A finite float64 is (-1)**s * M * 2**(max(f, 1) - 1075), its top 12 bits (s, f) naming the
    scale and M = the 52 fraction bits, plus 2**52 when f > 0. Per (s, f), bincount sums the
    fraction's low 27 and high 25 bits and counts the values, each an exact integer in float64
    (a step's sums stay below 2**42), added up in int64 (exact for 2**36 values); Python's
    integers then add the scaled terms, and one correctly rounded division by 2**1074 gives the
    float. Zero and non-finite sums are math.fsum's own (its sign of zero, its inf, nan and
    errors), and a sum past the float range raises its OverflowError; where only math.fsum's
    running partials overflow (addends near the float range whose exact sum is a float),
    exact_sum returns that float where math.fsum raises."""
    x = np.ascontiguousarray(values, np.float64).reshape(-1)
    if not np.isfinite(x).all():
        return math.fsum(x.tolist())
    bits = x.view(np.uint64)
    low_bits, high_bits = np.uint64((1 << 27) - 1), np.uint64((1 << 25) - 1)
    low, high, count = (np.zeros(4096, np.int64) for _ in range(3))
    for start in range(0, x.size, _RUN):
        b = bits[start:start + _RUN]
        top = (b >> np.uint64(52)).view(np.int64)  # s * 2048 + f
        low += np.bincount(top, b & low_bits, 4096).astype(np.int64)
        high += np.bincount(top, (b >> np.uint64(27)) & high_bits, 4096).astype(np.int64)
        count += np.bincount(top, None, 4096)
    total = 0
    for k in map(int, np.flatnonzero(count)):
        f = k & 2047
        m = int(low[k]) + (int(high[k]) << 27) + (int(count[k]) << 52 if f else 0)
        total += (-m if k >> 11 else m) << (max(f, 1) - 1)
    try:
        if total == 0:  # fsum's sign of zero
            raise OverflowError
        return total / (1 << 1074)
    except OverflowError:
        return math.fsum(x.tolist())


def exact_mean(values: np.ndarray) -> float:
    return exact_sum(values) / values.size


def exact_std(values: np.ndarray) -> float:
    x = np.asarray(values, np.float64).reshape(-1)
    d = x - exact_mean(x)
    return math.sqrt(exact_sum(d * d) / x.size)


def nearest_log2(x: float) -> int:
    """round(log2(x)) for x > 0 from frexp (exact), not libm's log2."""
    m, e = math.frexp(x)  # x = m * 2**e, 0.5 <= m < 1, so log2(x) = e + log2(m), log2(m) in [-1, 0)
    return e if m >= math.sqrt(0.5) else e - 1


# Byte offset of the f16 super-block scales (d, dmin) in gguf-py's block layouts.
_F16_SCALES = {"Q2_K": (80, 82), "Q4_K": (0, 2), "IQ2_XXS": (0, None)}


def random_blocks(rng: np.random.Generator, qtype_name: str, shape: tuple[int, ...], std: float):
    """StoredBlocks of `qtype_name` for values of NumPy `shape`: uniformly random bytes
    (every code, grid index, sign pattern and sub-scale is valid) with the block scales
    set so that the values have mean ~0 and standard deviation ~`std`. The scales are
    finite f16 (E8M0 in 1..254 for MXFP4), so every value dequantises to a finite float."""
    import gguf
    from .file import StoredBlocks

    qtype = gguf.GGMLQuantizationType[qtype_name]
    byte_shape = gguf.quants.quant_shape_to_byte_shape(shape, qtype)
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = rng.integers(0, 256, (int(np.prod(byte_shape)) // size, size), dtype=np.uint8)
    if qtype_name == "MXFP4":
        blocks[:, 0] = 127
        exponent = 127 + nearest_log2(std / exact_std(_dequant(blocks, qtype)))
        blocks[:, 0] = np.clip(exponent + rng.integers(-1, 2, len(blocks)), 1, 254)  # per-block jitter
    else:
        d_at, dmin_at = _F16_SCALES[qtype_name]
        d, dmin = 1.0, 0.0
        if dmin_at is not None:  # K-quants subtract dmin*min: pick dmin so the mean is ~0
            _set_f16(blocks, d_at, 1.0); _set_f16(blocks, dmin_at, 0.0)
            scaled = exact_mean(_dequant(blocks, qtype))
            _set_f16(blocks, d_at, 0.0); _set_f16(blocks, dmin_at, 1.0)
            dmin = scaled / -exact_mean(_dequant(blocks, qtype))
            _set_f16(blocks, dmin_at, dmin)
        _set_f16(blocks, d_at, d)
        gain = std / exact_std(_dequant(blocks, qtype))
        _set_f16(blocks, d_at, d * gain)
        if dmin_at is not None:
            _set_f16(blocks, dmin_at, dmin * gain)
    return StoredBlocks(tuple(shape), qtype, blocks.reshape(byte_shape))


def policy_config(**overrides) -> DS4Config:
    """The tiny config at the policy files' widths (POLICY_DIMS)."""
    return tiny_config(**{**POLICY_DIMS, **overrides})


def policy_tensors(config: DS4Config, policy: str, seed: int = 0) -> tuple[dict, dict[str, str]]:
    """(tensors, dtypes) of a tiny file in a published policy: random_tensors, with the routed
    experts replaced by random valid blocks of the policy's types (same std as the floats)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {policy!r}")
    tensors = random_tensors(config, seed)
    gate_up, down = POLICIES[policy]
    for i, (name, arr) in enumerate(tensors.items()):
        suffix = name.split(".", 2)[-1]
        if suffix in _EXPERTS:
            rng = np.random.default_rng([seed, i, 1])
            qtype = down if suffix == "ffn_down_exps.weight" else gate_up
            tensors[name] = random_blocks(rng, qtype, arr.shape, exact_std(arr))
    return tensors, tiny_dtypes(config)


# ---------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------
def write_tiny(path: str | os.PathLike, config: DS4Config | None = None, seed: int = 0,
               dtypes: dict[str, str] | None = None, policy: str | None = None,
               mtp: str | os.PathLike | None = None, dspark: str | os.PathLike | None = None) -> DS4Config:
    """Write a tiny model (weights, config and the embedded tokenizer) to `path`;
    `policy` (q2, q4, mxfp4) writes the published type policy at POLICY_DIMS; `mtp` (a path,
    not with a policy) writes a random MTP block there as llama.cpp's MTP file (gguf.mtp),
    for ds4ref.load(path, mtp=...): the model file itself never carries one. A 0731 config
    (tiny_0731_config) takes `dspark` instead: a random DSpark draft (tiny_dspark, random_dspark)
    written there as llama.cpp's dflash file (gguf.dspark_file), for ds4ref.load(path, dspark=...)."""
    from .file import write_gguf
    from .tokenizer import tiny_tokenizer_meta

    extra = {"ds4ref.tiny_seed": int(seed)}
    version = (config or tiny_config()).version
    if (mtp is not None and version == V0731) or (dspark is not None and version != V0731):
        raise ValueError(f"a {version} model's draft is {'a DSpark draft' if version == V0731 else 'an MTP block'}")
    if policy is not None:
        if mtp is not None:
            raise ValueError("the policy files carry no MTP block: give no mtp path with a policy")
        config = config or policy_config()
        tensors, dtypes = policy_tensors(config, policy, seed)
        extra["ds4ref.tiny_policy"] = policy
    else:
        config = config or tiny_config()
        tensors, dtypes = random_tensors(config, seed), (tiny_dtypes(config) if dtypes is None else dtypes)
    tokenizer = tiny_tokenizer_meta(config.vocab_size)
    write_gguf(path, config, tensors, tokenizer_meta=tokenizer, dtypes=dtypes, extra_meta=extra)
    if dspark is not None:
        from .dspark_file import write_dflash_gguf
        from .draft_target import fingerprint
        dcfg = tiny_dspark(config)
        draft, draft_dtypes = random_dspark(config, dcfg, seed)
        write_dflash_gguf(dspark, config, dcfg, draft, tokenizer, draft_dtypes if dtypes else {}, extra_meta=extra,
                          target_fingerprint=fingerprint(tensors["output_norm.weight"]))
    if mtp is not None:
        from .mtp import SHARED, write_mtp_gguf
        mtp_tensors, mtp_dtypes = random_mtp(config, seed)
        shared = {n: tensors[n] for n in SHARED}
        stored = {**{n: dtypes[n] for n in SHARED if n in dtypes}, **mtp_dtypes} if dtypes else {}
        write_mtp_gguf(mtp, config, mtp_tensors, shared, tokenizer, stored, extra_meta=extra)
    return config


MTP_SEED_OFFSET = 1 << 20  # the MTP's generators come after every main tensor's (seed, index)


def random_mtp(config: DS4Config, seed: int = 0) -> tuple[dict, dict[str, str]]:
    """(tensors by their `mtp.0.*` names, their stored types) of a random MTP block for
    `config`, drawn like the main tensors but from generators of their own, so the main
    tensors are the same with or without it."""
    from .mtp import PREFIX, mtp_config, mtp_tensor_shapes
    mcfg = mtp_config(config)
    tensors, dtypes = {}, {}
    for i, (name, shape) in enumerate(mtp_tensor_shapes(mcfg).items()):
        rng = np.random.default_rng([seed, MTP_SEED_OFFSET + i])
        suffix = name[len(PREFIX):]
        tensors[name] = _random_tensor(rng, mcfg, suffix, tuple(shape))
        if suffix in _DTYPE_BY_SUFFIX or suffix in ("e_proj.weight", "h_proj.weight", "hc_head_fn.weight"):
            dtypes[name] = _DTYPE_BY_SUFFIX.get(suffix, "f16" if suffix == "hc_head_fn.weight" else "q8_0")
    return tensors, dtypes


DSPARK_SEED_OFFSET = 2 << 20  # the DSpark draft's generators come after the MTP's


def tiny_dspark(config: DS4Config) -> DSparkConfig:
    """The tiny model's DSpark settings, 0731's in miniature: a block of 5, the last three
    layers' hidden states (0731 taps 40, 41, 42 of 43), a rank-32 Markov head (256 in 0731; 32
    is one Q8_0 block), the last token id as the noise token."""
    n = config.n_layer
    return DSparkConfig(block_size=5, noise_token_id=config.vocab_size - 1, markov_rank=32,
                        target_layers=tuple(range(max(0, n - 3), n)))


# the draft's own stored types (the stages' follow the tiny layers'; norms and the rest f32)
_DSPARK_DTYPES = {"markov_head.markov_w1.weight": "f16", "markov_head.markov_w2.weight": "q8_0",
                  "main_proj.weight": "q8_0", "hc_head_fn.weight": "f16"}


def random_dspark(config: DS4Config, dcfg: DSparkConfig, seed: int = 0) -> tuple[dict, dict[str, str]]:
    """(tensors by their `mtp.S.*` names, their stored types) of a random DSpark draft for
    `config`, drawn like the main tensors from generators of their own."""
    scfg = stage_config(config, dcfg)
    tensors, dtypes = {}, {}
    for i, (name, shape) in enumerate(dspark_tensor_shapes(config, dcfg).items()):
        rng = np.random.default_rng([seed, DSPARK_SEED_OFFSET + i])
        suffix = name.split(".", 2)[2]  # after mtp.S.
        if suffix == "markov_head.markov_w1.weight":  # an embedding table
            tensors[name] = _normal(rng, shape)
        elif suffix == "markov_head.markov_w2.weight":  # RMS ~2, as the logits': it moves the argmax
            tensors[name] = _linear(rng, shape, 2.0)
        else:
            tensors[name] = _random_tensor(rng, scfg, suffix, tuple(shape))
        if suffix in _DTYPE_BY_SUFFIX or suffix in _DSPARK_DTYPES:
            dtypes[name] = _DTYPE_BY_SUFFIX.get(suffix) or _DSPARK_DTYPES[suffix]
    return tensors, dtypes


def tiny_0731_config(**overrides) -> DS4Config:
    """tiny_config as a 0731 model: the same sizes, named and versioned 0731 (gguf.version)."""
    return tiny_config(**{"name": "ds4-tiny-0731", "version": V0731, **overrides})


def default_model_path() -> Path:
    """Path of the packaged ds4-tiny.gguf."""
    ref = importlib.resources.files("ds4ref").joinpath("data", "ds4-tiny.gguf")
    return Path(str(ref))


def default_mtp_path() -> Path:
    """Path of the packaged tiny model's MTP block, llama.cpp's MTP file named as its
    converter names one (`mtp-` before the model's name)."""
    ref = importlib.resources.files("ds4ref").joinpath("data", "mtp-ds4-tiny.gguf")
    return Path(str(ref))


def packaged_mtp(model_path: str | os.PathLike) -> Path | None:
    """The packaged MTP file when `model_path` is the packaged tiny model (which ships its MTP
    block beside it, as llama.cpp's files do), else None."""
    if Path(model_path).resolve() == default_model_path().resolve():
        return default_mtp_path()
    return None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m ds4ref.gguf.tiny", description="Write a tiny random deepseek4 GGUF.",
                                 formatter_class=HelpFormatter)
    ap.add_argument("--out", required=True, help="output .gguf path")
    ap.add_argument("--seed", type=int, default=0, help="seed of every random tensor")
    ap.add_argument("--layers", type=int, default=None, help="number of layers (Flash ratio pattern)")
    ap.add_argument("--ratios", default=None, help="comma-separated compress ratios, e.g. 0,0,4,128")
    ap.add_argument("--all-f32", action="store_true", help="store every float tensor as f32")
    ap.add_argument("--mtp-out", default=None, metavar="FILE",
                    help="also write a random MTP block to FILE, as llama.cpp's MTP file (not with --policy)")
    ap.add_argument("--version", choices=VERSIONS, default=ORIGINAL,
                    help="the release the tiny model mimics: 0731 adds its signs (gguf.version) and takes "
                         "--dspark-out instead of --mtp-out")
    ap.add_argument("--dspark-out", default=None, metavar="FILE",
                    help="with --version 0731: also write a random DSpark draft to FILE, as llama.cpp's dflash file")
    ap.add_argument("--policy", choices=sorted(POLICIES), default=None,
                    help="published type policy: q2 (IQ2_XXS/Q2_K experts), q4 (Q4_K), mxfp4; 256 wide")
    args = ap.parse_args(argv)
    if args.policy and args.all_f32:
        ap.error("--policy and --all-f32 exclude each other")
    if args.policy and args.mtp_out:
        ap.error("--policy files carry no MTP block: give no --mtp-out")
    overrides = {}
    if args.ratios:
        ratios = [int(r) for r in args.ratios.split(",")]
        overrides.update(compress_ratios=ratios, n_layer=len(ratios))
    if args.layers is not None:
        overrides["n_layer"] = args.layers
    if (args.mtp_out and args.version == V0731) or (args.dspark_out and args.version != V0731):
        ap.error("--mtp-out goes with the original, --dspark-out with --version 0731")
    if args.version == V0731:
        overrides.update(name="ds4-tiny-0731", version=V0731)
    cfg = (policy_config if args.policy else tiny_config)(**overrides)
    write_tiny(args.out, cfg, args.seed, dtypes={} if args.all_f32 else None, policy=args.policy,
               mtp=args.mtp_out, dspark=args.dspark_out)
    print(f"wrote {args.out}: {cfg.n_layer} layers, ratios {list(cfg.compress_ratios)}, "
          f"{os.path.getsize(args.out)} bytes")
    if args.mtp_out:
        print(f"wrote {args.mtp_out}: its MTP block, {os.path.getsize(args.mtp_out)} bytes")
    if args.dspark_out:
        print(f"wrote {args.dspark_out}: its DSpark draft, {os.path.getsize(args.dspark_out)} bytes")


if __name__ == "__main__":
    main()
