"""DS4 <-> transformers (`deepseek_v4`) checkpoints: names, config.json, export.

Three spellings of the same tensors exist:

* GGUF (`ds4ref.gguf.tensors`, the truth here): `blk.3.attn_q_a.weight`, experts stacked;
* official DeepSeek safetensors: `layers.3.attn.wq_a.weight`, one tensor per expert
  (`layers.3.ffn.experts.7.w1.weight`);
* transformers: `model.layers.3.self_attn.q_a_proj.weight`, routed experts fused
  into `mlp.experts.gate_up_proj` (E, 2F, D; gate rows first, then up) and
  `mlp.experts.down_proj` (E, D, F).

transformers' `save_pretrained` (default `save_original_format=True`) writes a
hybrid: official per-layer names under a `model.` prefix, but
`model.embed_tokens.weight`, `model.hc_head.hc_*`, `model.norm.weight`,
`head.weight`, and the attention KV norm as `attn.norm.weight` (its rename
rules are not invertible there). The reader accepts every one of these.

config.json comes in two key styles, both read by `config_from_hf`:
modern (`layer_types` + `compress_rates`, `mlp_layer_types`, nested
`rope_parameters` {main, compress}) and legacy (`compress_ratios`,
`num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`).

Only this module and tests import torch/transformers, and only lazily.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import numpy as np

from ..gguf.config import DS4Config
from ..gguf.tensors import layer_tensor_shapes
from ..gguf.version import DSPARK_STAGES, ORIGINAL, V0731


class HFError(ValueError):
    """A transformers/DeepSeek checkpoint or config that ds4ref cannot represent."""


# --------------------------------------------------------------------------------------------
# Tensor names
# --------------------------------------------------------------------------------------------

# GGUF global name -> (official name, transformers name without the `model.` prefix rule:
# lm_head sits outside `model.`, so names here are the full transformers names).
GLOBAL_NAMES: dict[str, tuple[str, str]] = {
    "token_embd.weight": ("embed.weight", "model.embed_tokens.weight"),
    "output_hc_fn.weight": ("hc_head_fn", "model.hc_head.hc_fn"),
    "output_hc_base.weight": ("hc_head_base", "model.hc_head.hc_base"),
    "output_hc_scale.weight": ("hc_head_scale", "model.hc_head.hc_scale"),
    "output_norm.weight": ("norm.weight", "model.norm.weight"),
    "output.weight": ("head.weight", "lm_head.weight"),
}

# GGUF layer suffix -> (official suffix after `layers.L.`, transformers suffix after `model.layers.L.`).
# Routed experts are absent: their layouts differ, see expert_sources().
LAYER_NAMES: dict[str, tuple[str, str]] = {
    "hc_attn_fn.weight": ("hc_attn_fn", "attn_hc.fn"),
    "hc_attn_base.weight": ("hc_attn_base", "attn_hc.base"),
    "hc_attn_scale.weight": ("hc_attn_scale", "attn_hc.scale"),
    "hc_ffn_fn.weight": ("hc_ffn_fn", "ffn_hc.fn"),
    "hc_ffn_base.weight": ("hc_ffn_base", "ffn_hc.base"),
    "hc_ffn_scale.weight": ("hc_ffn_scale", "ffn_hc.scale"),
    "attn_norm.weight": ("attn_norm.weight", "input_layernorm.weight"),
    "attn_q_a.weight": ("attn.wq_a.weight", "self_attn.q_a_proj.weight"),
    "attn_q_a_norm.weight": ("attn.q_norm.weight", "self_attn.q_a_norm.weight"),
    "attn_q_b.weight": ("attn.wq_b.weight", "self_attn.q_b_proj.weight"),
    "attn_kv.weight": ("attn.wkv.weight", "self_attn.kv_proj.weight"),
    "attn_kv_a_norm.weight": ("attn.kv_norm.weight", "self_attn.kv_norm.weight"),
    "attn_sinks.weight": ("attn.attn_sink", "self_attn.sinks"),
    "attn_output_a.weight": ("attn.wo_a.weight", "self_attn.o_a_proj.weight"),
    "attn_output_b.weight": ("attn.wo_b.weight", "self_attn.o_b_proj.weight"),
    "attn_compressor_ape.weight": ("attn.compressor.ape", "self_attn.compressor.position_bias"),
    "attn_compressor_kv.weight": ("attn.compressor.wkv.weight", "self_attn.compressor.kv_proj.weight"),
    "attn_compressor_gate.weight": ("attn.compressor.wgate.weight", "self_attn.compressor.gate_proj.weight"),
    "attn_compressor_norm.weight": ("attn.compressor.norm.weight", "self_attn.compressor.kv_norm.weight"),
    "indexer.attn_q_b.weight": ("attn.indexer.wq_b.weight", "self_attn.compressor.indexer.q_b_proj.weight"),
    "indexer.proj.weight": ("attn.indexer.weights_proj.weight",
                            "self_attn.compressor.indexer.scorer.weights_proj.weight"),
    "indexer_compressor_ape.weight": ("attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias"),
    "indexer_compressor_kv.weight": ("attn.indexer.compressor.wkv.weight",
                                     "self_attn.compressor.indexer.kv_proj.weight"),
    "indexer_compressor_gate.weight": ("attn.indexer.compressor.wgate.weight",
                                       "self_attn.compressor.indexer.gate_proj.weight"),
    "indexer_compressor_norm.weight": ("attn.indexer.compressor.norm.weight",
                                       "self_attn.compressor.indexer.kv_norm.weight"),
    "ffn_norm.weight": ("ffn_norm.weight", "post_attention_layernorm.weight"),
    "ffn_gate_inp.weight": ("ffn.gate.weight", "mlp.gate.weight"),
    "exp_probs_b.bias": ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
    "ffn_gate_tid2eid.weight": ("ffn.gate.tid2eid", "mlp.gate.tid2eid"),
    "ffn_gate_shexp.weight": ("ffn.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight"),
    "ffn_up_shexp.weight": ("ffn.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight"),
    "ffn_down_shexp.weight": ("ffn.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight"),
}

# Spellings that only transformers' save_pretrained(save_original_format=True) produces
# (names after stripping a leading `model.`): alias -> GGUF global name / layer suffix.
GLOBAL_ALIASES = {"embed_tokens.weight": "token_embd.weight", "hc_head.hc_fn": "output_hc_fn.weight",
                  "hc_head.hc_base": "output_hc_base.weight", "hc_head.hc_scale": "output_hc_scale.weight"}
LAYER_ALIASES = {"attn.norm.weight": "attn_kv_a_norm.weight"}

EXPERT_OFFICIAL = {"ffn_gate_exps.weight": "w1", "ffn_up_exps.weight": "w3", "ffn_down_exps.weight": "w2"}
EXPERT_TENSORS = tuple(EXPERT_OFFICIAL)
HF_GATE_UP = "mlp.experts.gate_up_proj"
HF_DOWN = "mlp.experts.down_proj"


def strip_model_prefix(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


# --------------------------------------------------------------------------------------------
# config.json <-> DS4Config
# --------------------------------------------------------------------------------------------

_RATIO_OF_TYPE_DEFAULT = {"sliding_attention": 0, "compressed_sparse_attention": 4,
                          "heavily_compressed_attention": 128}


def _compress_ratios(d: dict, n_layer: int) -> list[int]:
    """Per-layer ratios from either key style; never transformers' V4-Pro default schedule."""
    if d.get("layer_types") is not None:
        rates = dict(d.get("compress_rates") or {})
        # Legacy scalar overrides, folded in the way transformers folds them.
        for key, lt in (("compress_rate_csa", "compressed_sparse_attention"),
                        ("compress_rate_hca", "heavily_compressed_attention")):
            if d.get(key) is not None:
                rates[lt] = d[key]
        ratios = []
        for i, lt in enumerate(d["layer_types"][:n_layer]):
            if lt not in _RATIO_OF_TYPE_DEFAULT:
                raise HFError(f"layer_types[{i}] = {lt!r} is not a DeepSeek-V4 attention type")
            ratios.append(0 if lt == "sliding_attention" else int(rates.get(lt, _RATIO_OF_TYPE_DEFAULT[lt])))
    elif d.get("compress_ratios") is not None:
        ratios = [int(r) for r in d["compress_ratios"][:n_layer]]  # may carry an extra MTP entry
    else:
        # transformers would silently use the V4-Pro schedule here (wrong for Flash).
        raise HFError("config.json has neither `layer_types` nor `compress_ratios`; "
                      "refusing to guess the per-layer compression schedule")
    if len(ratios) != n_layer:
        raise HFError(f"compression schedule has {len(ratios)} entries for {n_layer} layers")
    return ratios


def _n_hash_layers(d: dict, n_layer: int) -> int:
    types = d.get("mlp_layer_types")
    if types is None:
        return int(d.get("num_hash_layers", 3))  # 3 is transformers' default too
    types = list(types[:n_layer])
    n = sum(t == "hash_moe" for t in types)
    if types != ["hash_moe"] * n + ["moe"] * (len(types) - n):
        raise HFError(f"mlp_layer_types must be hash_moe layers first, then moe; got {types}")
    return n


def _rope(d: dict) -> tuple[float, float, dict]:
    """(main theta, compress theta, YaRN params of the compress rope or {})."""
    rp = d.get("rope_parameters") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, comp = rp["main"], rp["compress"]
        main_theta = float(main.get("rope_theta", d.get("rope_theta", 10000.0)))
        comp_theta = float(comp.get("rope_theta", d.get("compress_rope_theta", 160000.0)))
        if main.get("rope_type", main.get("type", "default")) != "default":
            raise HFError(f"main rope must be plain (rope_type 'default'), got {main}")
        yarn = comp
    else:
        main_theta = float(d.get("rope_theta", 10000.0))
        comp_theta = float(d.get("compress_rope_theta", 160000.0))
        yarn = d.get("rope_scaling") or rp or {}
    kind = yarn.get("rope_type", yarn.get("type", "default"))
    if kind == "default":
        return main_theta, comp_theta, {}
    if kind != "yarn":
        raise HFError(f"compress rope type {kind!r} is not supported (only yarn or none)")
    af = yarn.get("attention_factor")
    if af is not None and float(af) != 1.0:
        # DS4 does not scale cos/sin; the spec's decision, and transformers forces 1.0 too.
        raise HFError(f"YaRN attention_factor {af} != 1.0 is not DS4")
    return main_theta, comp_theta, yarn


def _rope_dims(d: dict) -> int:
    head_dim = int(d["head_dim"])
    if d.get("qk_rope_head_dim") is not None:
        return int(d["qk_rope_head_dim"])
    prf = d.get("partial_rotary_factor")
    if prf is None:
        rp = d.get("rope_parameters") or {}
        prf = (rp.get("main") or {}).get("partial_rotary_factor", 64 / 512)
    return int(round(head_dim * float(prf)))


def config_from_hf(d: dict, name: str | None = None) -> DS4Config:
    """DS4Config from a deepseek_v4 config.json dict (modern or legacy keys)."""
    if d.get("model_type", "deepseek_v4") != "deepseek_v4":
        raise HFError(f"model_type is {d.get('model_type')!r}, expected 'deepseek_v4'")
    if d.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
        raise HFError(f"scoring_func {d['scoring_func']!r} is not DS4 (sqrtsoftplus)")
    for key in ("n_group", "topk_group"):
        if d.get(key) not in (None, 0, 1):
            raise HFError(f"{key}={d[key]}: group-limited routing is not DS4")
    n_layer = int(d["num_hidden_layers"])
    main_theta, comp_theta, yarn = _rope(d)
    limit = d.get("swiglu_limit", 10.0)
    clamps = [float(x) for x in limit] if isinstance(limit, (list, tuple)) else [float(limit)] * n_layer
    eos = d.get("eos_token_id", 1)
    return DS4Config(
        n_layer=n_layer,
        n_embd=int(d["hidden_size"]),
        vocab_size=int(d["vocab_size"]),
        n_head=int(d["num_attention_heads"]),
        n_head_kv=int(d.get("num_key_value_heads", 1)),
        head_dim=int(d["head_dim"]),
        n_rot=_rope_dims(d),
        q_lora_rank=int(d["q_lora_rank"]),
        o_lora_rank=int(d["o_lora_rank"]),
        o_groups=int(d["o_groups"]),
        n_expert=int(d["n_routed_experts"]),
        n_expert_used=int(d["num_experts_per_tok"]),
        n_expert_shared=int(d.get("n_shared_experts", 1)),
        expert_ff=int(d["moe_intermediate_size"]),
        n_hash_layers=_n_hash_layers(d, n_layer),
        expert_weights_scale=float(d.get("routed_scaling_factor", 1.5)),
        expert_weights_norm=bool(d.get("norm_topk_prob", True)),
        sliding_window=int(d["sliding_window"]),
        indexer_heads=int(d["index_n_heads"]),
        indexer_head_dim=int(d["index_head_dim"]),
        indexer_top_k=int(d["index_topk"]),
        hc_mult=int(d.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(d.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(d.get("hc_eps", 1e-6)),
        rms_eps=float(d.get("rms_norm_eps", 1e-6)),
        compress_ratios=tuple(_compress_ratios(d, n_layer)),
        swiglu_clamp=tuple(clamps),
        rope_freq_base=main_theta,
        compress_rope_freq_base=comp_theta,
        # No YaRN is factor 1: the interpolated and extrapolated frequencies coincide.
        yarn_factor=float(yarn.get("factor", 1.0)),
        yarn_orig_ctx=int(yarn.get("original_max_position_embeddings",
                                   d.get("max_position_embeddings", 1 << 20))),
        yarn_beta_fast=float(yarn.get("beta_fast") or 32.0),
        yarn_beta_slow=float(yarn.get("beta_slow") or 1.0),
        context_length=int(d.get("max_position_embeddings", 1 << 20)),
        bos_id=int(d.get("bos_token_id") or 0),
        eos_id=int(eos[0] if isinstance(eos, list) else (eos if eos is not None else 1)),
        name=name or "deepseek4",
        version=hf_version(d, n_layer),
    )


def hf_version(d: dict, n_layer: int) -> str:
    """0731 when config.json carries the DSpark keys or a compress ratio per DSpark stage after the
    layers' (gguf.version); otherwise the original."""
    from ..gguf.dspark import HF_KEYS
    ratios = d.get("compress_ratios")
    if any(k in d for k in HF_KEYS) or (isinstance(ratios, list) and len(ratios) == n_layer + DSPARK_STAGES):
        return V0731
    return ORIGINAL


def _check_hf_representable(cfg: DS4Config) -> None:
    """transformers' DeepseekV4 hard-wires a few things DS4Config leaves open."""
    if len(set(cfg.swiglu_clamp)) != 1:
        raise HFError("transformers has one swiglu_limit for all layers; per-layer clamps differ")
    if cfg.n_expert_shared != 1:
        raise HFError("transformers always builds exactly one shared expert")
    if not cfg.expert_weights_norm:
        raise HFError("transformers always renormalises the top-k weights (it ignores norm_topk_prob)")
    prf = cfg.n_rot / cfg.head_dim
    if int(cfg.head_dim * prf) != cfg.n_rot:  # transformers recomputes rope dims as int(head_dim * factor)
        raise HFError(f"n_rot {cfg.n_rot} / head_dim {cfg.head_dim} does not survive transformers' float round trip")


def config_to_hf(cfg: DS4Config, style: str = "modern") -> dict:
    """config.json dict for transformers' DeepseekV4Config (`style` 'modern' or 'legacy')."""
    _check_hf_representable(cfg)
    d = {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.n_embd, "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_head_kv, "head_dim": cfg.head_dim,
        "q_lora_rank": cfg.q_lora_rank, "o_lora_rank": cfg.o_lora_rank, "o_groups": cfg.o_groups,
        "n_routed_experts": cfg.n_expert, "num_experts_per_tok": cfg.n_expert_used,
        "n_shared_experts": cfg.n_expert_shared, "moe_intermediate_size": cfg.expert_ff,
        "scoring_func": "sqrtsoftplus", "norm_topk_prob": cfg.expert_weights_norm,
        "routed_scaling_factor": cfg.expert_weights_scale, "swiglu_limit": cfg.swiglu_clamp[0],
        "sliding_window": cfg.sliding_window, "index_n_heads": cfg.indexer_heads,
        "index_head_dim": cfg.indexer_head_dim, "index_topk": cfg.indexer_top_k,
        "hc_mult": cfg.hc_mult, "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps,
        "rms_norm_eps": cfg.rms_eps, "max_position_embeddings": cfg.context_length,
        "rope_theta": cfg.rope_freq_base, "compress_rope_theta": cfg.compress_rope_freq_base,
        "bos_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id, "tie_word_embeddings": False,
        "num_nextn_predict_layers": 0,
    }
    yarn = {"factor": cfg.yarn_factor, "original_max_position_embeddings": cfg.yarn_orig_ctx,
            "beta_fast": cfg.yarn_beta_fast, "beta_slow": cfg.yarn_beta_slow}
    if style == "legacy":
        d["compress_ratios"] = list(cfg.compress_ratios)
        d["num_hash_layers"] = cfg.n_hash_layers
        d["qk_rope_head_dim"] = cfg.n_rot
        d["rope_scaling"] = {"type": "yarn", **yarn}
    elif style == "modern":
        rev = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
        d["layer_types"] = [rev[r] for r in cfg.compress_ratios]
        d["compress_rates"] = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
        d["mlp_layer_types"] = ["hash_moe" if cfg.is_hash_layer(i) else "moe" for i in range(cfg.n_layer)]
        prf = cfg.n_rot / cfg.head_dim
        d["partial_rotary_factor"] = prf
        d["rope_parameters"] = {
            "main": {"rope_type": "default", "rope_theta": cfg.rope_freq_base, "partial_rotary_factor": prf},
            "compress": {"rope_type": "yarn", "rope_theta": cfg.compress_rope_freq_base,
                         "partial_rotary_factor": prf, "attention_factor": 1.0, **yarn},
        }
    else:
        raise ValueError(f"config style must be 'modern' or 'legacy', got {style!r}")
    return d


# --------------------------------------------------------------------------------------------
# GGUF-named tensors -> checkpoint tensors
# --------------------------------------------------------------------------------------------

def to_checkpoint_tensors(cfg: DS4Config, tensors: Mapping[str, np.ndarray], names: str = "hf",
                          prefix: bool = True) -> dict[str, np.ndarray]:
    """Rename (and re-lay-out experts of) GGUF-named tensors for a safetensors file.

    names='hf': transformers' names (fused experts); names='official': DeepSeek's names
    (one tensor per expert). prefix=False drops transformers' leading `model.`.
    tid2eid is written as int64, as both official and transformers checkpoints hold it.
    """
    if names not in ("hf", "official"):
        raise ValueError(f"names must be 'hf' or 'official', got {names!r}")
    col = 1 if names == "hf" else 0
    out: dict[str, np.ndarray] = {}

    def put(key: str, arr) -> None:
        if names == "hf" and not prefix:
            key = strip_model_prefix(key)
        out[key] = np.ascontiguousarray(arr)

    for g, pair in GLOBAL_NAMES.items():
        put(pair[col], tensors[g])
    for il in range(cfg.n_layer):
        base = f"model.layers.{il}." if names == "hf" else f"layers.{il}."
        for suffix in layer_tensor_shapes(cfg, il):
            arr = tensors[f"blk.{il}.{suffix}"]
            if suffix in EXPERT_TENSORS:
                continue
            if suffix == "ffn_gate_tid2eid.weight":
                arr = np.asarray(arr).astype(np.int64)
            put(base + LAYER_NAMES[suffix][col], arr)
        gate, up, down = (np.asarray(tensors[f"blk.{il}.{s}"]) for s in EXPERT_TENSORS)
        if names == "hf":
            put(base + HF_GATE_UP, np.concatenate([gate, up], axis=1))  # gate rows first, then up
            put(base + HF_DOWN, down)
        else:
            for e in range(cfg.n_expert):
                for s, arr in zip(EXPERT_TENSORS, (gate, up, down)):
                    put(f"{base}ffn.experts.{e}.{EXPERT_OFFICIAL[s]}.weight", arr[e])
    return out


def official_dspark_names(cfg: DS4Config, dcfg) -> dict[str, str]:
    """Our name (`mtp.S.*`, gguf.dspark) -> the official checkpoint's, of every DSpark
    tensor but the routed experts (one official tensor per expert: `mtp.S.ffn.experts.E.wN`)."""
    from ..gguf.dspark import PREFIX, dspark_tensor_shapes, official_suffix
    out = {}
    for name in dspark_tensor_shapes(cfg, dcfg):
        stage, suffix = name[len(PREFIX):].split(".", 1)
        if suffix in EXPERT_OFFICIAL:
            continue
        own = official_suffix(suffix)
        out[name] = f"{PREFIX}{stage}.{own if own is not None else LAYER_NAMES[suffix][0]}"
    return out


def official_dspark_tensors(cfg: DS4Config, dcfg, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The draft's tensors (ours) by the official checkpoint's names, experts one per expert."""
    from ..gguf.dspark import PREFIX
    names = official_dspark_names(cfg, dcfg)
    out = {}
    for name, arr in tensors.items():
        if name in names:
            out[names[name]] = np.ascontiguousarray(arr)
            continue
        stage, suffix = name[len(PREFIX):].split(".", 1)
        for e in range(cfg.n_expert):
            out[f"{PREFIX}{stage}.ffn.experts.{e}.{EXPERT_OFFICIAL[suffix]}.weight"] = np.ascontiguousarray(arr[e])
    return out


def export_checkpoint(path, cfg: DS4Config, tensors: Mapping[str, np.ndarray], names: str = "hf",
                      config_style: str = "modern", prefix: bool = True, dtype=np.float32) -> Path:
    """Write `path/config.json` + `path/model.safetensors`; float tensors cast to `dtype`."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config_to_hf(cfg, config_style), indent=2))
    ck = to_checkpoint_tensors(cfg, tensors, names, prefix)
    ck = {k: (v if np.issubdtype(v.dtype, np.integer) else v.astype(dtype)) for k, v in ck.items()}
    save_file(ck, str(path / "model.safetensors"))
    return path


# --------------------------------------------------------------------------------------------
# transformers objects
# --------------------------------------------------------------------------------------------

def hf_config(cfg: DS4Config):
    """transformers.DeepseekV4Config for `cfg`, set up for exact CPU comparisons.

    Eager attention (the only one DeepseekV4 supports) and eager experts: the grouped
    expert kernel has no float64 path.
    """
    from transformers import DeepseekV4Config

    hc = DeepseekV4Config(**{k: v for k, v in config_to_hf(cfg, "modern").items()
                             if k not in ("architectures", "model_type")})
    hc._attn_implementation = "eager"
    hc._experts_implementation = "eager"
    return hc


def hf_model(cfg: DS4Config, tensors: Mapping[str, np.ndarray], dtype=None):
    """DeepseekV4ForCausalLM in eval mode holding exactly `tensors` (GGUF names).

    dtype: a torch dtype, default torch.float64. Loaded with load_state_dict(strict=True),
    so a naming mistake here fails loudly instead of leaving random weights.
    """
    import torch
    from transformers import DeepseekV4ForCausalLM

    dtype = dtype or torch.float64
    model = DeepseekV4ForCausalLM(hf_config(cfg))
    sd = {k: torch.from_numpy(np.array(v)) for k, v in to_checkpoint_tensors(cfg, tensors, "hf").items()}
    missing, unexpected = model.load_state_dict(sd, strict=True)
    if missing or unexpected:  # strict=True raises first; belt and braces
        raise HFError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    # .to() keeps integer buffers (tid2eid) integer and casts every float tensor,
    # including the ones transformers keeps in fp32 for bf16 runs.
    return model.to(dtype).eval()



def load_hf_model(path, dtype=None):
    """DeepseekV4ForCausalLM.from_pretrained(path), cast to `dtype` (default float64), eager paths.

    Loaded in float32 first and cast afterwards: asking from_pretrained for float64
    directly would leave transformers' `_keep_in_fp32_modules_strict` in float32.
    """
    import torch
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager",
                                                  experts_implementation="eager")
    model.config._experts_implementation = "eager"
    return model.to(dtype or torch.float64).eval()
