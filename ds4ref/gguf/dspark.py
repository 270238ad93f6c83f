"""The DSpark draft module of DeepSeek-V4-Flash-0731: its config, its tensor names in the two
GGUF layouts that carry it, its weights, and llama.cpp's `dflash` file (docs/mtp.md, "DSpark").

DSpark is `n_stages` (3) V4 blocks of compress ratio 0 (sliding window only) stored under the
official checkpoint's `mtp.0` .. `mtp.2`; stage 0 also has `main_proj` / `main_norm` (the target's
hidden states in), the last stage `norm`, `hc_head_*`, the Markov head and the confidence head.
Inside ds4ref every tensor has antirez's name (his DSpark support file): `mtp.{s}.<GGUF layer
suffix>` for the blocks, and

    mtp.0.main_proj.weight                 (d, T*d)     T = len(target_layers)
    mtp.0.main_norm.weight                 (d,)
    mtp.{L}.norm.weight                    (d,)         L = n_stages - 1
    mtp.{L}.hc_head_{fn,base,scale}.weight (hc, hc*d) / (hc,) / (1,)
    mtp.{L}.markov_head.markov_w1.weight   (vocab, r)   an embedding table
    mtp.{L}.markov_head.markov_w2.weight   (vocab, r)   a projection r -> vocab
    mtp.{L}.confidence_head.proj.weight    (1, d + r)

The layouts a file may carry it in:

* llama.cpp's (`convert_hf_to_gguf.py --dspark --target-model-dir`, class DeepseekV4DSparkModel):
  `general.architecture = dflash`, the blocks as `blk.{s}.<suffix>`, main_proj / main_norm as
  `fc` / `enc.output_norm`, the last stage's norm and hc head at the root (`output_norm`,
  `output_hc_*`), `markov_w1`, `markov_w2`, `conf_proj`; keys `dflash.block_size`,
  `dflash.target_layers` (official ids + 1: llama.cpp taps a layer's input), and the noise token
  as `tokenizer.ggml.mask_token_id`; no embedding or output matrix (the target's are shared).
* antirez's (`deepseek4-quantize --dspark-support`): `general.architecture = deepseek4-dspark`,
  ds4ref's names, keys `dspark.block_size`, `dspark.markov_rank`, `dspark.noise_token_id`,
  `dspark.target_layer_ids` (official ids), `dspark.stage_count`, `dspark.n_layers`.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from .config import ARCH, DS4Config
from .file import MTPFile, write_tensor_file
from .mtp import _check_types, mtp_config
from .quant_codes import QUANT_TYPES
from .tensors import layer_tensor_shapes
from .weights import Weights, WeightsError

LLAMA_ARCH = "dflash"
ANTIREZ_ARCH = "deepseek4-dspark"
MASK_KEY = "tokenizer.ggml.mask_token_id"
# the extra tensors, by their suffix after `mtp.{s}.`: stage 0's, and the last stage's
FIRST = ("main_proj.weight", "main_norm.weight")
LAST = ("norm.weight", "hc_head_fn.weight", "hc_head_base.weight", "hc_head_scale.weight",
        "markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight")
# llama.cpp's names of the extra tensors (root names, no `blk.`)
LLAMA_EXTRA = {"main_proj.weight": "fc.weight", "main_norm.weight": "enc.output_norm.weight",
               "norm.weight": "output_norm.weight", "hc_head_fn.weight": "output_hc_fn.weight",
               "hc_head_base.weight": "output_hc_base.weight", "hc_head_scale.weight": "output_hc_scale.weight",
               "markov_head.markov_w1.weight": "markov_w1.weight", "markov_head.markov_w2.weight": "markov_w2.weight",
               "confidence_head.proj.weight": "conf_proj.weight"}


class DSparkError(WeightsError):
    """A DSpark file that is missing a tensor, is of another model, or is neither layout."""


@dataclass(frozen=True)
class DSparkConfig:
    """The draft's shape. `stages` is the blocks as a DS4Config of n_stages ratio-0 layers (the
    official DSparkAttention sets compress_ratio 0; layer ids >= n_layers: no hash routing)."""
    block_size: int           # tokens a draft block holds: the anchor and block_size - 1 noise tokens
    noise_token_id: int
    markov_rank: int
    target_layers: tuple[int, ...]  # the target's layers whose output streams it reads (official ids)
    stages: DS4Config

    @property
    def n_stages(self) -> int:
        return self.stages.n_layer


def stage_config(cfg: DS4Config, n_stages: int, clamp: float | None = None) -> DS4Config:
    """The stages as n_stages ratio-0 layers of the target's sizes, learned routing, the SwiGLU
    clamp of the MTP block (the global swiglu_limit)."""
    one = mtp_config(cfg, 0, clamp)
    return dataclasses.replace(one, n_layer=n_stages, compress_ratios=(0,) * n_stages,
                               swiglu_clamp=one.swiglu_clamp * n_stages)


def dspark_config(cfg: DS4Config, block_size: int, noise_token_id: int, markov_rank: int,
                  target_layers, n_stages: int, clamp: float | None = None, where: str = "DSpark") -> DSparkConfig:
    target_layers = tuple(int(t) for t in target_layers)
    checks = [
        (block_size >= 1, f"block size {block_size} must be >= 1"),
        (0 <= noise_token_id < cfg.vocab_size, f"noise token {noise_token_id} is not in the vocab 0..{cfg.vocab_size - 1}"),
        (markov_rank >= 1, f"Markov rank {markov_rank} must be >= 1"),
        (n_stages >= 1, f"{n_stages} stages"),
        (len(target_layers) >= 1 and all(0 <= t < cfg.n_layer for t in target_layers),
         f"target layers {list(target_layers)} are not layers of a {cfg.n_layer}-layer model"),
    ]
    for ok, msg in checks:
        if not ok:
            raise DSparkError(f"{where}: {msg}")
    return DSparkConfig(int(block_size), int(noise_token_id), int(markov_rank), target_layers,
                        stage_config(cfg, n_stages, clamp))


def dspark_tensor_shapes(dc: DSparkConfig) -> dict[str, tuple[int, ...]]:
    """ds4ref name -> NumPy shape of every DSpark tensor."""
    sc = dc.stages
    d, hc, r, last = sc.n_embd, sc.hc_mult, dc.markov_rank, dc.n_stages - 1
    out = {}
    for s in range(dc.n_stages):
        out.update({f"mtp.{s}.{k}": v for k, v in layer_tensor_shapes(sc, s).items()})
    out.update({"mtp.0.main_proj.weight": (d, len(dc.target_layers) * d), "mtp.0.main_norm.weight": (d,),
                f"mtp.{last}.norm.weight": (d,), f"mtp.{last}.hc_head_fn.weight": (hc, sc.hc_dim),
                f"mtp.{last}.hc_head_base.weight": (hc,), f"mtp.{last}.hc_head_scale.weight": (1,),
                f"mtp.{last}.markov_head.markov_w1.weight": (sc.vocab_size, r),
                f"mtp.{last}.markov_head.markov_w2.weight": (sc.vocab_size, r),
                f"mtp.{last}.confidence_head.proj.weight": (1, d + r)})
    return out


def llama_name(name: str) -> str:
    """llama.cpp's name of a ds4ref DSpark tensor."""
    _, stage, suffix = name.split(".", 2)
    return LLAMA_EXTRA.get(suffix) if suffix in LLAMA_EXTRA else f"blk.{stage}.{suffix}"


class DSparkWeights(Weights):
    """The DSpark tensors under ds4ref's names, read from a source that holds them under other
    names (`names`: ours -> the source's)."""

    def __init__(self, dc: DSparkConfig, source, names: Mapping[str, str], dtype=np.float32,
                 where: str = "DSpark") -> None:
        super().__init__(dc.stages, dtype)
        self.dspark = dc
        self._shapes = dspark_tensor_shapes(dc)
        self.source, self.names, self._where = source, dict(names), where

    @property
    def where(self) -> str:
        return self._where

    def _load(self, name: str) -> np.ndarray:
        return self.source.read(self.names[name])

    def _load_expert(self, name: str, e: int) -> np.ndarray:
        return self.source.read_expert(self.names[name], e)

    def _stored_blocks(self, name: str):
        t = self.source.tensor(self.names[name])
        return (t.qtype.name, t.data) if t.qtype.name in QUANT_TYPES else None

    def stored_bytes(self) -> int:
        """Bytes of the stored tensors (a memory plan's share)."""
        return sum(self.source.tensor(n).n_bytes for n in self.names.values())

    def with_dtype(self, dtype) -> "DSparkWeights":
        return DSparkWeights(self.dspark, self.source, self.names, dtype, self._where)


def _check_shapes(dc: DSparkConfig, found: Mapping[str, tuple], names: Mapping[str, str], where: str) -> None:
    for ours, shape in dspark_tensor_shapes(dc).items():
        theirs = names[ours]
        if theirs not in found:
            raise DSparkError(f"{where}: the DSpark module has no tensor {theirs!r} (expected NumPy shape {shape})")
        if tuple(found[theirs]) != tuple(shape):
            raise DSparkError(f"{where}: DSpark tensor {theirs!r} has NumPy shape {tuple(found[theirs])}, "
                              f"expected {tuple(shape)} for this model")


def _check_sizes(meta: Mapping[str, Any], arch: str, cfg: DS4Config, where: str) -> None:
    for key in ("embedding_length", "attention.head_count", "attention.key_length", "expert_count"):
        mine = cfg.to_metadata().get(f"{ARCH}.{key}")
        theirs = meta.get(f"{arch}.{key}")
        if theirs is not None and mine is not None and theirs != mine:
            raise DSparkError(f"{where}: {arch}.{key} is {theirs} but the model's is {mine}: "
                              f"this DSpark file belongs to another model")


def _need(meta: Mapping[str, Any], key: str, where: str):
    if key not in meta:
        raise DSparkError(f"{where}: missing metadata key {key!r}")
    return meta[key]


def load_dspark(path: str | os.PathLike, cfg: DS4Config, dtype=np.float32) -> DSparkWeights:
    """The DSpark module of a separate GGUF for a target model of config `cfg`: llama.cpp's
    `dflash` file or antirez's `deepseek4-dspark` file."""
    f = MTPFile(path)
    meta, where = f.metadata, f.path
    shapes = {n: t.shape for n, t in f.tensors.items()}
    arch = meta.get("general.architecture")
    if arch == LLAMA_ARCH:
        n_stages = int(_need(meta, f"{LLAMA_ARCH}.block_count", where))
        w1 = shapes.get("markov_w1.weight")
        if w1 is None:
            raise DSparkError(f"{where}: a dflash file without markov_w1.weight is DFlash, not DSpark")
        ratios = meta.get(f"{LLAMA_ARCH}.attention.compress_ratios", [0] * n_stages)
        if any(int(r) != 0 for r in ratios):
            raise DSparkError(f"{where}: DSpark stages have compress ratio 0, the file says {list(ratios)}")
        clamps = meta.get(f"{LLAMA_ARCH}.swiglu_clamp_exp", [])
        dc = dspark_config(cfg, int(_need(meta, f"{LLAMA_ARCH}.block_size", where)),
                           int(_need(meta, MASK_KEY, where)), int(w1[1]),
                           [int(t) - 1 for t in _need(meta, f"{LLAMA_ARCH}.target_layers", where)], n_stages,
                           clamps[0] if len(clamps) else None, where)
        names = {ours: llama_name(ours) for ours in dspark_tensor_shapes(dc)}
    elif arch == ANTIREZ_ARCH:
        dc = dspark_config(cfg, int(_need(meta, "dspark.block_size", where)),
                           int(_need(meta, "dspark.noise_token_id", where)),
                           int(_need(meta, "dspark.markov_rank", where)),
                           _need(meta, "dspark.target_layer_ids", where),
                           int(_need(meta, "dspark.stage_count", where)), None, where)
        names = {ours: ours for ours in dspark_tensor_shapes(dc)}
    else:
        raise DSparkError(f"{where}: not a DSpark GGUF: general.architecture is {arch!r}, expected "
                          f"{LLAMA_ARCH!r} (llama.cpp's) or {ANTIREZ_ARCH!r} (antirez's)")
    _check_sizes(meta, arch, cfg, where)
    _check_shapes(dc, shapes, names, where)
    _check_types(f, names, where)
    return DSparkWeights(dc, f, names, dtype, where)


# ---------------------------------------------------------------------------
# writing llama.cpp's dflash file
# ---------------------------------------------------------------------------
def dflash_metadata(cfg: DS4Config, dc: DSparkConfig) -> dict:
    """llama.cpp's keys for the draft: the target's sizes under `dflash.`, the stages as its
    blocks (all ratio 0, no hash layers), the block size, the taps (official ids + 1) and the
    noise token as the mask token."""
    meta = {k.replace(f"{ARCH}.", f"{LLAMA_ARCH}.", 1): v for k, v in dc.stages.to_metadata().items()}
    meta["general.architecture"] = LLAMA_ARCH
    meta.update({f"{LLAMA_ARCH}.block_size": dc.block_size,
                 f"{LLAMA_ARCH}.target_layers": [t + 1 for t in dc.target_layers],
                 MASK_KEY: dc.noise_token_id})
    return meta


def write_dflash_gguf(path: str | os.PathLike, cfg: DS4Config, dc: DSparkConfig, tensors: Mapping[str, Any],
                      tokenizer_meta: Mapping[str, Any] | None = None, dtypes: Mapping[str, str] | None = None,
                      default_dtype: str = "f32") -> None:
    """Write the DSpark module as llama.cpp's dflash file: `tensors` by ds4ref's names in NumPy
    shape (dspark_tensor_shapes), `dtypes` by the same names."""
    want = dspark_tensor_shapes(dc)
    for name, shape in want.items():
        if name not in tensors:
            raise DSparkError(f"write_dflash_gguf: missing tensor {name!r} (expected NumPy shape {shape})")
        if tuple(tensors[name].shape) != tuple(shape):
            raise DSparkError(f"write_dflash_gguf: tensor {name!r} has NumPy shape {tuple(tensors[name].shape)}, "
                              f"expected {tuple(shape)}")
    extra = sorted(set(tensors) - set(want))
    if extra:
        raise DSparkError(f"write_dflash_gguf: tensors that are not the DSpark module's: {extra}")
    meta = dict(tokenizer_meta or {})
    meta.update(dflash_metadata(cfg, dc))
    out = {llama_name(n): tensors[n] for n in want}
    stored = {llama_name(n): t for n, t in (dtypes or {}).items()}
    write_tensor_file(path, meta, out, stored, default_dtype, arch=LLAMA_ARCH)
