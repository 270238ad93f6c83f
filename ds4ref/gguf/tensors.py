"""The deepseek4 GGUF tensor directory: every name and its NumPy shape.

NumPy shapes are the reverse of GGUF `ne` (so 2-D weights are (out, in), the
PyTorch Linear layout, and experts are (n_expert, out, in)). This table is the
one source of truth for the reader's checks, the tiny-model writer and the
checkpoint converter.
"""
from __future__ import annotations

from .config import CSA, DS4Config

GLOBAL = ("token_embd.weight", "output_hc_fn.weight", "output_hc_base.weight",
          "output_hc_scale.weight", "output_norm.weight", "output.weight")

# Integer tensors (not dequantised, read as int32).
INT_TENSORS = ("ffn_gate_tid2eid.weight",)


def layer_tensor_shapes(cfg: DS4Config, il: int) -> dict[str, tuple[int, ...]]:
    """Suffix (after `blk.{il}.`) -> NumPy shape, for one layer."""
    d, hd, hc = cfg.n_embd, cfg.head_dim, cfg.hc_dim
    kind, ratio = cfg.layer_kind(il), cfg.ratio(il)
    s: dict[str, tuple[int, ...]] = {}
    for part in ("attn", "ffn"):
        s[f"hc_{part}_fn.weight"] = (cfg.hc_mix, hc)
        s[f"hc_{part}_base.weight"] = (cfg.hc_mix,)
        s[f"hc_{part}_scale.weight"] = (3,)
    s["attn_norm.weight"] = (d,)
    s["attn_q_a.weight"] = (cfg.q_lora_rank, d)
    s["attn_q_a_norm.weight"] = (cfg.q_lora_rank,)
    s["attn_q_b.weight"] = (cfg.n_head * hd, cfg.q_lora_rank)
    s["attn_kv.weight"] = (hd, d)
    s["attn_kv_a_norm.weight"] = (hd,)
    s["attn_sinks.weight"] = (cfg.n_head,)
    s["attn_output_a.weight"] = (cfg.o_groups * cfg.o_lora_rank, cfg.heads_per_group * hd)
    s["attn_output_b.weight"] = (d, cfg.o_groups * cfg.o_lora_rank)
    if kind.compressed:
        coff = kind.lanes
        s["attn_compressor_ape.weight"] = (ratio, coff * hd)
        s["attn_compressor_kv.weight"] = (coff * hd, d)
        s["attn_compressor_gate.weight"] = (coff * hd, d)
        s["attn_compressor_norm.weight"] = (hd,)
    if kind is CSA:
        ihd = cfg.indexer_head_dim
        s["indexer.attn_q_b.weight"] = (cfg.indexer_heads * ihd, cfg.q_lora_rank)
        s["indexer.proj.weight"] = (cfg.indexer_heads, d)
        s["indexer_compressor_ape.weight"] = (4, 2 * ihd)
        s["indexer_compressor_kv.weight"] = (2 * ihd, d)
        s["indexer_compressor_gate.weight"] = (2 * ihd, d)
        s["indexer_compressor_norm.weight"] = (ihd,)
    s["ffn_norm.weight"] = (d,)
    s["ffn_gate_inp.weight"] = (cfg.n_expert, d)
    if cfg.is_hash_layer(il):
        s["ffn_gate_tid2eid.weight"] = (cfg.vocab_size, cfg.n_expert_used)
    else:
        s["exp_probs_b.bias"] = (cfg.n_expert,)
    s["ffn_gate_exps.weight"] = (cfg.n_expert, cfg.expert_ff, d)
    s["ffn_up_exps.weight"] = (cfg.n_expert, cfg.expert_ff, d)
    s["ffn_down_exps.weight"] = (cfg.n_expert, d, cfg.expert_ff)
    if cfg.n_expert_shared:
        s["ffn_gate_shexp.weight"] = (cfg.expert_ff, d)
        s["ffn_up_shexp.weight"] = (cfg.expert_ff, d)
        s["ffn_down_shexp.weight"] = (d, cfg.expert_ff)
    return s


def tensor_shapes(cfg: DS4Config) -> dict[str, tuple[int, ...]]:
    """Full GGUF name -> NumPy shape for every tensor a model must have."""
    d = cfg.n_embd
    out = {
        "token_embd.weight": (cfg.vocab_size, d),
        "output_hc_fn.weight": (cfg.hc_mult, cfg.hc_dim),
        "output_hc_base.weight": (cfg.hc_mult,),
        "output_hc_scale.weight": (1,),
        "output_norm.weight": (d,),
        "output.weight": (cfg.vocab_size, d),
    }
    for il in range(cfg.n_layer):
        for suffix, shape in layer_tensor_shapes(cfg, il).items():
            out[f"blk.{il}.{suffix}"] = shape
    return out


def is_int_tensor(name: str) -> bool:
    return name.endswith(INT_TENSORS)


# An MTP block's nextn projection (gguf.mtp, docs/mtp.md): separate e_proj / h_proj (ds4ref's
# former in-file layout) or one fused [e_proj | h_proj] (llama.cpp's).
NEXTN_PROJ = ("nextn.e_proj.weight", "nextn.eh_proj.weight")


def has_in_file_mtp_block(shapes, block: int) -> bool:
    """Whether block `block` is an MTP block (llama.cpp's probe: its nextn projection)."""
    return any(f"blk.{block}.{n}" in shapes for n in NEXTN_PROJ)
