"""Typed DS4 model configuration, built from `deepseek4.*` GGUF metadata.

Everything the forward pass needs comes from here; nothing is hard-coded to
Flash's values, so tiny test models with small windows run the same code.
"""
from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from dataclasses import dataclass, field

from .version import DSPARK_STAGES, ORIGINAL, V0731, VERSIONS, model_version

ARCH = "deepseek4"


class LayerKind(enum.IntEnum):
    """A layer's attention, named by its compress ratio (attention.compress_ratios; spec §3).
    Every kind attends over the raw sliding window; the compressed kinds add compressed rows."""
    SLIDING = 0  # the raw window only
    CSA = 4      # compressed sparse attention: a row per 4 tokens (pooled from two overlapping
                 # windows, lanes A and B), of which the lightning indexer picks the top-k
    HCA = 128    # heavily compressed attention: a row per 128 tokens, all of them visible

    @property
    def compressed(self) -> bool:
        return self is not LayerKind.SLIDING

    @property
    def lanes(self) -> int:
        """Width of the compressor's projections in head_dim units: CSA pools two windows."""
        return 2 if self is LayerKind.CSA else 1


SLIDING, CSA, HCA = LayerKind.SLIDING, LayerKind.CSA, LayerKind.HCA

# the compressed rows a layer keeps: KV rows (attention) and, on CSA layers, indexer rows
ATTN, INDEX = "attn", "index"


def row_kinds(layer_kind: LayerKind) -> list[str]:
    """The compressed rows a layer stores: KV rows on compressed layers, indexer rows too on CSA."""
    return [ATTN, INDEX] if layer_kind is CSA else [ATTN] if layer_kind.compressed else []


# config field -> (GGUF key suffix after "deepseek4.", required, GGUF type written, spec §2.1).
# The reader accepts any integer type for u32/u64, any number for f32 (ds4ref.gguf.metadata).
# The two context lengths are written as u32: llama.cpp reads them into uint32_t and refuses
# u64 ("wrong type u64"); ds4.c reads context_length only for its banner and takes
# original_context_length as u32 or u64, so u32 is the one type all three consumers accept.
KEYS: dict[str, tuple[str, bool, str]] = {
    "n_layer": ("block_count", True, "u32"),
    "context_length": ("context_length", False, "u32"),
    "n_embd": ("embedding_length", True, "u32"),
    "vocab_size": ("vocab_size", True, "u32"),  # required here; gguf/file.py derives it when a file lacks it
    "n_head": ("attention.head_count", True, "u32"),
    "n_head_kv": ("attention.head_count_kv", False, "u32"),
    "head_dim": ("attention.key_length", True, "u32"),
    "value_dim": ("attention.value_length", False, "u32"),
    "n_rot": ("rope.dimension_count", True, "u32"),
    "q_lora_rank": ("attention.q_lora_rank", True, "u32"),
    "o_lora_rank": ("attention.output_lora_rank", True, "u32"),
    "o_groups": ("attention.output_group_count", True, "u32"),
    "n_expert": ("expert_count", True, "u32"),
    "n_expert_used": ("expert_used_count", True, "u32"),
    "n_expert_shared": ("expert_shared_count", True, "u32"),
    "expert_ff": ("expert_feed_forward_length", True, "u32"),
    "n_hash_layers": ("hash_layer_count", True, "u32"),
    "expert_weights_scale": ("expert_weights_scale", True, "f32"),
    "expert_weights_norm": ("expert_weights_norm", False, "bool"),
    "sliding_window": ("attention.sliding_window", True, "u32"),
    "indexer_heads": ("attention.indexer.head_count", True, "u32"),
    "indexer_head_dim": ("attention.indexer.key_length", True, "u32"),
    "indexer_top_k": ("attention.indexer.top_k", True, "u32"),
    "hc_mult": ("hyper_connection.count", True, "u32"),
    "hc_sinkhorn_iters": ("hyper_connection.sinkhorn_iterations", True, "u32"),
    "hc_eps": ("hyper_connection.epsilon", True, "f32"),
    "rms_eps": ("attention.layer_norm_rms_epsilon", True, "f32"),
    "compress_ratios": ("attention.compress_ratios", True, "array of i32"),
    "swiglu_clamp": ("swiglu_clamp_exp", True, "array of f32"),
    "rope_freq_base": ("rope.freq_base", True, "f32"),
    "compress_rope_freq_base": ("attention.compress_rope_freq_base", True, "f32"),
    "yarn_factor": ("rope.scaling.factor", True, "f32"),
    "yarn_orig_ctx": ("rope.scaling.original_context_length", True, "u32"),
    "yarn_beta_fast": ("rope.scaling.yarn_beta_fast", True, "f32"),
    "yarn_beta_slow": ("rope.scaling.yarn_beta_slow", True, "f32"),
}

# Inclusive bounds of the integer sizes, Flash's value in the comment. They are far
# outside any DS4 checkpoint yet small enough that no size derived from them is
# absurd before the server's memory plan looks at it (a 2^40 window once asked
# for petabytes, 2^40 Sinkhorn iterations spun forever). docs/gguf.md lists them.
INT_BOUNDS: dict[str, tuple[int, int]] = {
    "n_layer": (1, 1024),                 # 43
    "context_length": (2, 1 << 24),       # 1048576
    "n_embd": (1, 1 << 16),               # 4096
    "vocab_size": (1, 1 << 24),           # 129280
    "n_head": (1, 1024),                  # 64
    "head_dim": (1, 1 << 13),             # 512
    "value_dim": (0, 1 << 13),            # 512 (0 = key_length)
    "n_rot": (2, 1 << 13),                # 64
    "q_lora_rank": (1, 1 << 16),          # 1024
    "o_lora_rank": (1, 1 << 16),          # 1024
    "o_groups": (1, 1024),                # 8
    "n_expert": (1, 1 << 12),             # 256
    "n_expert_used": (1, 1 << 12),        # 6
    "n_expert_shared": (0, 1),            # 1
    "expert_ff": (1, 1 << 18),            # 2048
    "n_hash_layers": (0, 1024),           # 3
    "sliding_window": (1, 1 << 16),       # 128
    "indexer_heads": (1, 1024),           # 64
    "indexer_head_dim": (1, 1 << 13),     # 128 (official numerics need a power of two >= 32)
    "indexer_top_k": (1, 1 << 20),        # 512
    "hc_mult": (1, 64),                   # 4
    "hc_sinkhorn_iters": (1, 1000),       # 20
    "yarn_orig_ctx": (1, 1 << 24),        # 65536
}
# Floats that must be finite and > 0; the epsilons must also be < 1.
POSITIVE_FLOATS = ("expert_weights_scale", "rope_freq_base", "compress_rope_freq_base", "yarn_factor",
                   "yarn_beta_fast", "yarn_beta_slow", "hc_eps", "rms_eps")
EPSILONS = ("hc_eps", "rms_eps")


# Keys every writer adds and every reader checks (docs/gguf.md, "What each consumer requires").
GATING_KEY = f"{ARCH}.expert_gating_func"
SQRTSOFTPLUS = 4  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS (= gguf.ExpertGatingFuncType.SQRTSOFTPLUS)
ROPE_SCALING_KEY = f"{ARCH}.rope.scaling.type"
NEXTN_KEY = f"{ARCH}.nextn_predict_layers"


def key_of(fname: str) -> str:
    """The GGUF key of a config field, for messages."""
    return f"{ARCH}.{KEYS[fname][0]}"


class ConfigError(ValueError):
    """The GGUF metadata does not describe a model ds4ref can run."""


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


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
    version: str = ORIGINAL  # gguf.version: "original" or "0731" (what the file says of itself)
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

    def layer_kind(self, layer: int) -> LayerKind:
        return LayerKind(self.compress_ratios[layer])

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        return tuple(map(LayerKind, self.compress_ratios))

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.n_hash_layers

    def draft_layers(self, n: int, clamp: float | None = None) -> "DS4Config":
        """A draft module's blocks as a model of n layers of this model's sizes (gguf.mtp's MTP
        block, gguf.dspark's stages): sliding-window layers only (ratio 0), routed by learned
        scores (no hash layers), each with the SwiGLU clamp `clamp` (default this model's last
        layer's); versioned original, as the blocks carry no draft stages of their own."""
        clamp = self.swiglu_clamp[-1] if clamp is None else float(clamp)
        return dataclasses.replace(self, n_layer=n, compress_ratios=(0,) * n, swiglu_clamp=(clamp,) * n,
                                   n_hash_layers=0, version=ORIGINAL, extra={})

    # ---- checks --------------------------------------------------------
    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        self._check_bounds()
        need(len(self.compress_ratios) == self.n_layer,
             f"attention.compress_ratios has {len(self.compress_ratios)} entries for {self.n_layer} layers")
        need(len(self.swiglu_clamp) == self.n_layer,
             f"swiglu_clamp_exp has {len(self.swiglu_clamp)} entries for {self.n_layer} layers")
        for i, r in enumerate(self.compress_ratios):
            need(r in tuple(LayerKind), f"layer {i}: compress ratio {r} is not 0, 4 or 128")
        need(self.n_head_kv == 1, f"attention.head_count_kv must be 1 (one shared K=V head), got {self.n_head_kv}")
        need(self.value_dim == self.head_dim, "attention.value_length must equal key_length (K and V are one vector)")
        need(self.n_rot % 2 == 0 and 0 < self.n_rot <= self.head_dim,
             f"rope.dimension_count {self.n_rot} must be even and <= key_length {self.head_dim}")
        need(self.n_rot <= self.indexer_head_dim, "rope.dimension_count exceeds the indexer key_length")
        need(self.n_head % self.o_groups == 0,
             f"head_count {self.n_head} is not a multiple of output_group_count {self.o_groups}")
        need(1 <= self.n_expert_used <= self.n_expert, "expert_used_count must be in 1..expert_count")
        need(self.version in VERSIONS, f"version {self.version!r} is not one of {VERSIONS}")
        need(self.n_hash_layers <= self.n_layer,
             f"hash_layer_count {self.n_hash_layers} exceeds block_count {self.n_layer}")

    def _check_bounds(self) -> None:
        """Every size within INT_BOUNDS, every float finite and positive, before anything
        is derived from them; the message names the GGUF key."""
        for fname, (lo, hi) in INT_BOUNDS.items():
            v = getattr(self, fname)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise ConfigError(f"{key_of(fname)} is {v!r}; it must be an integer in {lo}..{hi}")
        for fname in POSITIVE_FLOATS:
            v = getattr(self, fname)
            hi = 1.0 if fname in EPSILONS else math.inf
            if not _is_real(v) or not 0.0 < v < hi:
                bound = "in (0, 1)" if fname in EPSILONS else "finite and > 0"
                raise ConfigError(f"{key_of(fname)} is {v!r}; it must be a number {bound}")
        for i, c in enumerate(self.swiglu_clamp):
            if not _is_real(c) or not 0.0 < c < math.inf:
                raise ConfigError(f"{key_of('swiglu_clamp')}[{i}] is {c!r}; it must be finite and > 0")
        for which, v in (("bos_token_id", self.bos_id), ("eos_token_id", self.eos_id)):
            if not 0 <= v < self.vocab_size:
                raise ConfigError(f"tokenizer.ggml.{which} is {v}; it must be a token id in "
                                  f"0..{self.vocab_size - 1} (vocab_size {self.vocab_size})")

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
        for fname, (suffix, required, _) in KEYS.items():
            key = f"{ARCH}.{suffix}"
            if key in meta:
                kw[fname] = meta[key]
            elif required:
                raise ConfigError(f"missing GGUF metadata key {key!r}")
        _check_routing_and_rope(meta)
        for g in ("expert_group_count", "expert_group_used_count"):
            if meta.get(f"{ARCH}.{g}", 0) not in (0, None):
                raise ConfigError(f"{ARCH}.{g} must be absent or 0 (no group-limited routing)")
        kw["bos_id"] = int(meta.get("tokenizer.ggml.bos_token_id", 0))
        kw["eos_id"] = int(meta.get("tokenizer.ggml.eos_token_id", 1))
        kw["name"] = str(meta.get("general.name", ARCH))
        kw["version"] = model_version(meta)
        ints = {f.name for f in dataclasses.fields(cls) if f.type in ("int", int)}
        for k in list(kw):
            if k in ints:
                kw[k] = int(kw[k])
        if "expert_weights_norm" in kw:
            kw["expert_weights_norm"] = bool(kw["expert_weights_norm"])
        return cls(**kw)

    def to_metadata(self) -> dict:
        """{GGUF key: python value}, the inverse of from_metadata (tokenizer keys excluded).

        Adds the two keys the math does not read but llama.cpp needs: the gating function
        (its loader refuses a file without it) and the rope scaling type (without it
        llama.cpp silently applies *linear* scaling with rope.scaling.factor). A 0731 model's
        compress_ratios carry its DSpark stages' zeros after the layers', as the checkpoint's
        and llama.cpp's files do (gguf.version).
        """
        meta = {"general.architecture": ARCH, "general.name": self.name}
        for fname, (suffix, _, _) in KEYS.items():
            v = getattr(self, fname)
            meta[f"{ARCH}.{suffix}"] = list(v) if isinstance(v, tuple) else v
        if self.version == V0731:
            meta[key_of("compress_ratios")] += [0] * DSPARK_STAGES
        meta[GATING_KEY] = SQRTSOFTPLUS
        meta[ROPE_SCALING_KEY] = "yarn"
        return meta


def _check_routing_and_rope(meta: dict) -> None:
    """Refuse what the math would silently get wrong: another router score function, or a
    rope scaling type other than YaRN (ds4ref always applies YaRN to compressed layers).
    Both keys are optional when reading (antirez's files carry neither)."""
    gating = meta.get(GATING_KEY, SQRTSOFTPLUS)
    if gating != SQRTSOFTPLUS:
        raise ConfigError(f"{GATING_KEY} is {gating!r}; DS4 routes with sqrtsoftplus ({SQRTSOFTPLUS}), "
                          f"the only expert scoring ds4ref implements")
    scaling = meta.get(ROPE_SCALING_KEY, "yarn")
    if scaling != "yarn":
        raise ConfigError(f"{ROPE_SCALING_KEY} is {scaling!r}; DS4's compressed layers use 'yarn', "
                          f"the only rope scaling ds4ref implements")
