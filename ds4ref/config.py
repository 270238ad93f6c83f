"""Typed DS4 model configuration, built from `deepseek4.*` GGUF metadata.

Everything the forward pass needs comes from here; nothing is hard-coded to
Flash's values, so tiny test models with small windows run the same code.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

ARCH = "deepseek4"

# config field -> (GGUF key suffix after "deepseek4.", required)
_KEYS: dict[str, tuple[str, bool]] = {
    "n_layer": ("block_count", True),
    "context_length": ("context_length", False),
    "n_embd": ("embedding_length", True),
    "vocab_size": ("vocab_size", True),
    "n_head": ("attention.head_count", True),
    "n_head_kv": ("attention.head_count_kv", False),
    "head_dim": ("attention.key_length", True),
    "value_dim": ("attention.value_length", False),
    "n_rot": ("rope.dimension_count", True),
    "q_lora_rank": ("attention.q_lora_rank", True),
    "o_lora_rank": ("attention.output_lora_rank", True),
    "o_groups": ("attention.output_group_count", True),
    "n_expert": ("expert_count", True),
    "n_expert_used": ("expert_used_count", True),
    "n_expert_shared": ("expert_shared_count", True),
    "expert_ff": ("expert_feed_forward_length", True),
    "n_hash_layers": ("hash_layer_count", True),
    "expert_weights_scale": ("expert_weights_scale", True),
    "expert_weights_norm": ("expert_weights_norm", False),
    "sliding_window": ("attention.sliding_window", True),
    "indexer_heads": ("attention.indexer.head_count", True),
    "indexer_head_dim": ("attention.indexer.key_length", True),
    "indexer_top_k": ("attention.indexer.top_k", True),
    "hc_mult": ("hyper_connection.count", True),
    "hc_sinkhorn_iters": ("hyper_connection.sinkhorn_iterations", True),
    "hc_eps": ("hyper_connection.epsilon", True),
    "rms_eps": ("attention.layer_norm_rms_epsilon", True),
    "compress_ratios": ("attention.compress_ratios", True),
    "swiglu_clamp": ("swiglu_clamp_exp", True),
    "rope_freq_base": ("rope.freq_base", True),
    "compress_rope_freq_base": ("attention.compress_rope_freq_base", True),
    "yarn_factor": ("rope.scaling.factor", True),
    "yarn_orig_ctx": ("rope.scaling.original_context_length", True),
    "yarn_beta_fast": ("rope.scaling.yarn_beta_fast", True),
    "yarn_beta_slow": ("rope.scaling.yarn_beta_slow", True),
}


class ConfigError(ValueError):
    """The GGUF metadata does not describe a model ds4ref can run."""


@dataclass(frozen=True)
class DS4Config:
    n_layer: int
    n_embd: int
    vocab_size: int
    n_head: int
    head_dim: int
    n_rot: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    n_expert: int
    n_expert_used: int
    n_expert_shared: int
    expert_ff: int
    n_hash_layers: int
    expert_weights_scale: float
    sliding_window: int
    indexer_heads: int
    indexer_head_dim: int
    indexer_top_k: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_eps: float
    compress_ratios: tuple[int, ...]
    swiglu_clamp: tuple[float, ...]
    rope_freq_base: float
    compress_rope_freq_base: float
    yarn_factor: float
    yarn_orig_ctx: int
    yarn_beta_fast: float
    yarn_beta_slow: float
    expert_weights_norm: bool = True
    n_head_kv: int = 1
    value_dim: int = 0  # 0 = same as head_dim
    context_length: int = 1 << 20
    bos_id: int = 0
    eos_id: int = 1
    name: str = "deepseek4"
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "compress_ratios", tuple(int(r) for r in self.compress_ratios[: self.n_layer]))
        object.__setattr__(self, "swiglu_clamp", tuple(float(c) for c in self.swiglu_clamp[: self.n_layer]))
        if self.value_dim == 0:
            object.__setattr__(self, "value_dim", self.head_dim)
        self.validate()

    # ---- derived sizes -------------------------------------------------
    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.n_rot

    @property
    def heads_per_group(self) -> int:
        return self.n_head // self.o_groups

    @property
    def hc_dim(self) -> int:
        return self.hc_mult * self.n_embd

    @property
    def hc_mix(self) -> int:
        return 2 * self.hc_mult + self.hc_mult * self.hc_mult

    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.n_hash_layers

    # ---- checks --------------------------------------------------------
    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        need(self.n_layer >= 1, f"block_count must be >= 1, got {self.n_layer}")
        need(len(self.compress_ratios) == self.n_layer,
             f"attention.compress_ratios has {len(self.compress_ratios)} entries for {self.n_layer} layers")
        need(len(self.swiglu_clamp) == self.n_layer,
             f"swiglu_clamp_exp has {len(self.swiglu_clamp)} entries for {self.n_layer} layers")
        for i, r in enumerate(self.compress_ratios):
            need(r in (0, 4, 128), f"layer {i}: compress ratio {r} is not 0, 4 or 128")
        need(self.n_head_kv == 1, f"attention.head_count_kv must be 1 (one shared K=V head), got {self.n_head_kv}")
        need(self.value_dim == self.head_dim, "attention.value_length must equal key_length (K and V are one vector)")
        need(self.n_rot % 2 == 0 and 0 < self.n_rot <= self.head_dim,
             f"rope.dimension_count {self.n_rot} must be even and <= key_length {self.head_dim}")
        need(self.n_rot <= self.indexer_head_dim, "rope.dimension_count exceeds the indexer key_length")
        need(self.n_head % self.o_groups == 0,
             f"head_count {self.n_head} is not a multiple of output_group_count {self.o_groups}")
        need(1 <= self.n_expert_used <= self.n_expert, "expert_used_count must be in 1..expert_count")
        need(self.n_expert_shared in (0, 1), f"expert_shared_count must be 0 or 1, got {self.n_expert_shared}")
        need(self.sliding_window >= 1, "attention.sliding_window must be >= 1")
        need(self.indexer_top_k >= 1, "attention.indexer.top_k must be >= 1")
        need(self.hc_mult >= 1 and self.hc_sinkhorn_iters >= 1, "hyper_connection count/iterations must be >= 1")

    def check_official_numerics(self) -> None:
        """The FP8 and FP4 block shapes of `official` numerics; `plain` needs none of them."""
        ihd, plain = self.indexer_head_dim, "; numerics='plain' takes this file"
        if not (ihd >= 32 and ihd & (ihd - 1) == 0):
            raise ConfigError(f"{ARCH}.attention.indexer.key_length is {ihd}: official numerics need a power of "
                              f"two >= 32 (Hadamard rotation, FP4 blocks of 32){plain}")
        if self.nope_dim % 64:
            raise ConfigError(f"{ARCH}.attention.key_length - {ARCH}.rope.dimension_count = {self.nope_dim}: official "
                              f"numerics need a multiple of 64 (FP8 blocks of 64){plain}")

    # ---- GGUF metadata --------------------------------------------------
    @classmethod
    def from_metadata(cls, meta: dict) -> "DS4Config":
        """Build from a {key: python value} dict of GGUF fields."""
        arch = meta.get("general.architecture")
        if arch != ARCH:
            raise ConfigError(f"general.architecture is {arch!r}, expected {ARCH!r}")
        kw = {}
        for fname, (suffix, required) in _KEYS.items():
            key = f"{ARCH}.{suffix}"
            if key in meta:
                kw[fname] = meta[key]
            elif required:
                raise ConfigError(f"missing GGUF metadata key {key!r}")
        for g in ("expert_group_count", "expert_group_used_count"):
            if meta.get(f"{ARCH}.{g}", 0) not in (0, None):
                raise ConfigError(f"{ARCH}.{g} must be absent or 0 (no group-limited routing)")
        kw["bos_id"] = int(meta.get("tokenizer.ggml.bos_token_id", 0))
        kw["eos_id"] = int(meta.get("tokenizer.ggml.eos_token_id", 1))
        kw["name"] = str(meta.get("general.name", ARCH))
        ints = {f.name for f in dataclasses.fields(cls) if f.type in ("int", int)}
        for k in list(kw):
            if k in ints:
                kw[k] = int(kw[k])
        if "expert_weights_norm" in kw:
            kw["expert_weights_norm"] = bool(kw["expert_weights_norm"])
        return cls(**kw)

    def to_metadata(self) -> dict:
        """{GGUF key: python value}, the inverse of from_metadata (tokenizer keys excluded)."""
        meta = {"general.architecture": ARCH, "general.name": self.name}
        for fname, (suffix, _) in _KEYS.items():
            v = getattr(self, fname)
            meta[f"{ARCH}.{suffix}"] = list(v) if isinstance(v, tuple) else v
        return meta
