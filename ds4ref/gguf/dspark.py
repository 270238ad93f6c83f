"""DeepSeek-V4-Flash-0731's DSpark draft as files describe it: its settings (DSparkConfig, read
from config.json or from any of the GGUF layouts that carry it), the stages as a config, and its
tensors' names in the three layouts (one table) with their NumPy shapes. The table and the
layouts: docs/mtp.md "Files and names".

Names inside ds4ref are antirez/ds4's: a stage's block tensors are `mtp.S.<layer suffix>` (the
suffixes of gguf.tensors: `mtp.1.attn_q_a.weight`, `mtp.2.exp_probs_b.bias`, ...), the draft's own
are `mtp.0.main_proj.weight`, `mtp.0.main_norm.weight` and, on the last stage L,
`mtp.L.{norm,hc_head_fn,hc_head_base,hc_head_scale}.weight`,
`mtp.L.markov_head.markov_w{1,2}.weight`, `mtp.L.confidence_head.proj.weight`. The official
checkpoint's differ only in the block's (convert.hf.LAYER_NAMES) and the hc head's (no
`.weight`); llama.cpp's dflash file names the stages `blk.S.` and the own tensors apart (OWN).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .config import ARCH, DS4Config
from .tensors import layer_tensor_shapes
from .version import DSPARK_STAGES
from .weights import WeightsError

PREFIX = "mtp."
# general.architecture of llama.cpp's dflash file and of antirez/ds4's DSpark support file
DFLASH_ARCH, SUPPORT_ARCH = "dflash", "deepseek4-dspark"
LAYOUTS = {DFLASH_ARCH: "llama.cpp's dflash file", SUPPORT_ARCH: "antirez/ds4's DSpark support file"}
DSPARK_ARCHS = tuple(LAYOUTS)
# the DSpark keys of a checkpoint's config.json (0731's: 5, 128799, 256, [40, 41, 42])
HF_KEYS = ("dspark_block_size", "dspark_noise_token_id", "dspark_markov_rank", "dspark_target_layer_ids")
# llama.cpp's dflash keys; target_layers holds official id + 1 (its converter adds one)
DFLASH_BLOCK_SIZE, DFLASH_TARGET_LAYERS = f"{DFLASH_ARCH}.block_size", f"{DFLASH_ARCH}.target_layers"
MASK_TOKEN_KEY = "tokenizer.ggml.mask_token_id"
# antirez/ds4's support file (deepseek4-quantize --dspark-support): official ids, a u32 array
SUPPORT_KEYS = {"block_size": "dspark.block_size", "noise_token_id": "dspark.noise_token_id",
                "markov_rank": "dspark.markov_rank", "target_layers": "dspark.target_layer_ids",
                "n_stages": "dspark.stage_count"}
SUPPORT_LAYERS = "dspark.n_layers"  # written beside stage_count, the same number
# its earlier --dspark-only file: the main model's deepseek4.* keys and these, one u32 key per
# target layer (`.0`, `.1`, ...)
INLINE = f"{ARCH}.dspark."
INLINE_KEYS = {"block_size": INLINE + "block_size", "noise_token_id": INLINE + "noise_token_id",
               "markov_rank": INLINE + "markov_rank", "n_stages": INLINE + "n_mtp_layers"}
INLINE_TARGET_LAYER = INLINE + "target_layer_ids"

# the draft's own tensors: (ours after `mtp.S.`, stage: 0 = first, -1 = last, llama.cpp's dflash name)
OWN = (("main_proj.weight", 0, "fc.weight"),
       ("main_norm.weight", 0, "enc.output_norm.weight"),
       ("norm.weight", -1, "output_norm.weight"),
       ("hc_head_fn.weight", -1, "output_hc_fn.weight"),
       ("hc_head_base.weight", -1, "output_hc_base.weight"),
       ("hc_head_scale.weight", -1, "output_hc_scale.weight"),
       ("markov_head.markov_w1.weight", -1, "markov_w1.weight"),
       ("markov_head.markov_w2.weight", -1, "markov_w2.weight"),
       ("confidence_head.proj.weight", -1, "conf_proj.weight"))
HC_HEAD = ("hc_head_fn.weight", "hc_head_base.weight", "hc_head_scale.weight")


class DSparkError(WeightsError):
    """A DSpark config or file that is incomplete or does not describe a draft ds4ref reads."""


@dataclass(frozen=True)
class DSparkConfig:
    """The draft's own settings (the checkpoint's dspark_* keys). target_layers are the official
    ids: stage 0 reads the target's hidden state after each of these (0-based) layers."""
    block_size: int       # tokens a draft block holds: the anchor and block_size - 1 noise tokens
    noise_token_id: int
    markov_rank: int
    target_layers: tuple[int, ...]
    n_stages: int = DSPARK_STAGES

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layers", tuple(int(i) for i in self.target_layers))
        for name in ("block_size", "markov_rank", "n_stages"):
            if int(getattr(self, name)) < 1:
                raise DSparkError(f"DSpark {name} is {getattr(self, name)}; it must be >= 1")
        if not self.target_layers or min(self.target_layers) < 0:
            raise DSparkError(f"DSpark target layers {list(self.target_layers)} must be one or more layer ids >= 0")

    @property
    def last(self) -> int:
        return self.n_stages - 1

    @classmethod
    def from_hf(cls, d: Mapping[str, Any], n_stages: int = DSPARK_STAGES) -> "DSparkConfig":
        missing = [k for k in HF_KEYS if k not in d]
        if missing:
            raise DSparkError(f"config.json lacks the DSpark keys {missing}")
        return cls(int(d["dspark_block_size"]), int(d["dspark_noise_token_id"]), int(d["dspark_markov_rank"]),
                   tuple(d["dspark_target_layer_ids"]), n_stages)

    def to_hf(self) -> dict:
        return {"dspark_block_size": self.block_size, "dspark_noise_token_id": self.noise_token_id,
                "dspark_markov_rank": self.markov_rank, "dspark_target_layer_ids": list(self.target_layers)}

    def dflash_metadata(self) -> dict:
        """The keys llama.cpp's converter adds for the draft (beside the model's sizes)."""
        return {DFLASH_BLOCK_SIZE: self.block_size, DFLASH_TARGET_LAYERS: [i + 1 for i in self.target_layers],
                MASK_TOKEN_KEY: self.noise_token_id}

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], shapes: Mapping[str, tuple] | None = None) -> "DSparkConfig":
        """From a draft file's metadata: llama.cpp's dflash file (its Markov rank from `shapes`,
        by the dflash names), antirez/ds4's support file, or its earlier in-model keys."""
        arch = meta.get("general.architecture")
        try:
            if arch == DFLASH_ARCH:
                w1 = (shapes or {}).get("markov_w1.weight")
                if w1 is None:
                    raise DSparkError("a dflash file without markov_w1.weight is a DFlash draft, not DSpark")
                return cls(int(meta[DFLASH_BLOCK_SIZE]), int(meta[MASK_TOKEN_KEY]), int(w1[-1]),
                           tuple(int(i) - 1 for i in meta[DFLASH_TARGET_LAYERS]),
                           int(meta[f"{DFLASH_ARCH}.block_count"]))
            if arch == SUPPORT_ARCH:
                k = SUPPORT_KEYS
                if int(meta.get(SUPPORT_LAYERS, meta[k["n_stages"]])) != int(meta[k["n_stages"]]):
                    raise DSparkError(f"{SUPPORT_LAYERS} = {meta[SUPPORT_LAYERS]} and {k['n_stages']} = "
                                      f"{meta[k['n_stages']]} disagree")
                return cls(int(meta[k["block_size"]]), int(meta[k["noise_token_id"]]), int(meta[k["markov_rank"]]),
                           tuple(meta[k["target_layers"]]), int(meta[k["n_stages"]]))
            k = INLINE_KEYS
            targets = sorted((int(key.rsplit(".", 1)[1]), int(v)) for key, v in meta.items()
                             if key.startswith(INLINE_TARGET_LAYER + "."))
            return cls(int(meta[k["block_size"]]), int(meta[k["noise_token_id"]]), int(meta[k["markov_rank"]]),
                       tuple(v for _, v in targets), int(meta[k["n_stages"]]))
        except KeyError as exc:
            raise DSparkError(f"DSpark metadata key {exc.args[0]!r} is missing") from None


def stage_config(cfg: DS4Config, dcfg: DSparkConfig, clamp: float | None = None) -> DS4Config:
    """The draft's stages as a config of n_stages layers (DS4Config.draft_layers): the target's
    sizes, the 128-token sliding window only (ratio 0: the official DSparkAttention), routed by
    learned scores (no hash layers), the SwiGLU clamp `clamp` (default the target's last layer's,
    swiglu_limit)."""
    return cfg.draft_layers(dcfg.n_stages, clamp)


def own_name(suffix: str, stage: int, dcfg: DSparkConfig) -> str:
    return f"{PREFIX}{stage % dcfg.n_stages}.{suffix}"


def dspark_tensor_shapes(cfg: DS4Config, dcfg: DSparkConfig) -> dict[str, tuple[int, ...]]:
    """Our name -> NumPy shape of every draft tensor, stages in order, then the draft's own."""
    scfg, d = stage_config(cfg, dcfg), cfg.n_embd
    out = {f"{PREFIX}{s}.{suffix}": shape for s in range(dcfg.n_stages)
           for suffix, shape in layer_tensor_shapes(scfg, s).items()}
    own = {"main_proj.weight": (d, len(dcfg.target_layers) * d), "main_norm.weight": (d,), "norm.weight": (d,),
           "hc_head_fn.weight": (cfg.hc_mult, cfg.hc_dim), "hc_head_base.weight": (cfg.hc_mult,),
           "hc_head_scale.weight": (1,),
           "markov_head.markov_w1.weight": (cfg.vocab_size, dcfg.markov_rank),
           "markov_head.markov_w2.weight": (cfg.vocab_size, dcfg.markov_rank),
           "confidence_head.proj.weight": (1, d + dcfg.markov_rank)}
    out.update({own_name(suffix, stage, dcfg): own[suffix] for suffix, stage, _ in OWN})
    return out


def dflash_name(name: str, dcfg: DSparkConfig) -> str:
    """llama.cpp's dflash name of our tensor `name`."""
    stage, suffix = _split(name)
    for own, at, theirs in OWN:
        if suffix == own and stage == at % dcfg.n_stages:
            return theirs
    return f"blk.{stage}.{suffix}"


def official_suffix(suffix: str) -> str | None:
    """The official checkpoint's name (after `mtp.S.`) of a draft-own tensor, else None (a block
    tensor: the official per-layer name, convert.hf.LAYER_NAMES)."""
    if suffix in HC_HEAD:
        return suffix.removesuffix(".weight")
    return suffix if any(suffix == own for own, _, _ in OWN) else None


def name_table(cfg: DS4Config, dcfg: DSparkConfig) -> list[tuple[str, str, tuple[int, ...]]]:
    """(ours = antirez/ds4's, llama.cpp's dflash name, NumPy shape) of every draft tensor."""
    return [(n, dflash_name(n, dcfg), shape) for n, shape in dspark_tensor_shapes(cfg, dcfg).items()]


def _split(name: str) -> tuple[int, str]:
    if not name.startswith(PREFIX):
        raise DSparkError(f"{name!r} is not a DSpark tensor name (mtp.S.*)")
    stage, _, suffix = name[len(PREFIX):].partition(".")
    return int(stage), suffix
