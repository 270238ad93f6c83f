"""The MTP (multi-token prediction) block: its tensor names in both published GGUF
layouts, its one-layer config, and its weights (docs/mtp.md).

Inside ds4ref every MTP tensor has antirez's name, `mtp.0.<suffix>`: the block's
tensors keep their layer suffixes (`mtp.0.attn_q_a.weight`, ...) and the MTP's own
are `mtp.0.{e_proj,h_proj,enorm,hnorm,norm,hc_head_fn,hc_head_base,hc_head_scale}.weight`.
The two layouts a file may carry:

* llama.cpp's, in the model file: block N = block_count - nextn_predict_layers holds
  the block's tensors as `blk.N.<suffix>` and the MTP's own as `blk.N.nextn.<name>`
  (`norm` is `nextn.shared_head_norm`; a fused `nextn.eh_proj` = [e_proj | h_proj]
  is accepted too);
* antirez's, a separate file of `mtp.0.*` tensors, given next to the model.

The MTP runs as a one-layer model of its own (mtp_config): the official code builds
it as layer n_layers, whose compress ratio (the published array's last entry) is 0,
so it is a sliding-window layer on the main RoPE table, routed by learned scores.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping

import numpy as np

from .config import ARCH, NEXTN_KEY, DS4Config
from .quant_codes import QUANT_TYPES
from .file import _INT_TYPES, MTPFile, _can_dequantise
from .tensors import NEXTN_PROJ, layer_tensor_shapes
from .weights import Weights, WeightsError

PREFIX = "mtp.0."
OWN = ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight",
       "hc_head_fn.weight", "hc_head_base.weight", "hc_head_scale.weight")
# llama.cpp's in-file names of the MTP's own tensors, after `blk.N.` (docs/mtp.md)
NEXTN = {"e_proj.weight": "nextn.e_proj.weight", "h_proj.weight": "nextn.h_proj.weight",
         "enorm.weight": "nextn.enorm.weight", "hnorm.weight": "nextn.hnorm.weight",
         "norm.weight": "nextn.shared_head_norm.weight", "hc_head_fn.weight": "nextn.hc_head_fn.weight",
         "hc_head_base.weight": "nextn.hc_head_base.weight", "hc_head_scale.weight": "nextn.hc_head_scale.weight"}
FUSED = NEXTN_PROJ[1]


class MTPError(WeightsError):
    """An MTP block that is missing, incomplete or does not fit the model (a ValueError)."""


def mtp_config(cfg: DS4Config, ratio: int = 0, clamp: float | None = None) -> DS4Config:
    """The MTP block as a one-layer config: the main config's sizes, the MTP layer's ratio
    and SwiGLU clamp, no hash routing (the official MTP layer id is n_layers >= n_hash_layers)."""
    if ratio != 0:
        raise MTPError(f"MTP layer compress ratio {ratio}: only 0 (sliding window, as the published "
                       f"compress_ratios' last entry says) is supported")
    clamp = cfg.swiglu_clamp[-1] if clamp is None else float(clamp)
    return dataclasses.replace(cfg, n_layer=1, compress_ratios=(0,), swiglu_clamp=(clamp,), n_hash_layers=0,
                               extra={})


def mtp_tensor_shapes(mcfg: DS4Config) -> dict[str, tuple[int, ...]]:
    """`mtp.0.*` name -> NumPy shape, for the one-layer MTP config."""
    d, hc = mcfg.n_embd, mcfg.hc_mult
    out = {PREFIX + s: shape for s, shape in layer_tensor_shapes(mcfg, 0).items()}
    out.update({PREFIX + "e_proj.weight": (d, d), PREFIX + "h_proj.weight": (d, d),
                PREFIX + "enorm.weight": (d,), PREFIX + "hnorm.weight": (d,), PREFIX + "norm.weight": (d,),
                PREFIX + "hc_head_fn.weight": (hc, mcfg.hc_dim), PREFIX + "hc_head_base.weight": (hc,),
                PREFIX + "hc_head_scale.weight": (1,)})
    return out


def in_file_name(name: str, block: int) -> str:
    """llama.cpp's in-file name of an `mtp.0.*` tensor when the MTP is block `block`."""
    suffix = name[len(PREFIX):]
    return f"blk.{block}.{NEXTN.get(suffix, suffix)}"


class MTPWeights(Weights):
    """The MTP block's tensors under their `mtp.0.*` names, read from a source that holds
    them under other names (`names`: ours -> the source's). `fused`: the source's name of a
    [e_proj | h_proj] matrix, split here by columns."""

    def __init__(self, mcfg: DS4Config, source, names: Mapping[str, str], fused: str | None = None,
                 dtype=np.float32, where: str = "MTP") -> None:
        super().__init__(mcfg, dtype)
        self._shapes = mtp_tensor_shapes(mcfg)
        self.source, self.names, self.fused, self._where = source, dict(names), fused, where

    @property
    def where(self) -> str:
        return self._where

    def _split(self, name: str) -> int | None:
        """0 / 1 for e_proj / h_proj read from the fused matrix, else None."""
        if self.fused is None:
            return None
        return {PREFIX + "e_proj.weight": 0, PREFIX + "h_proj.weight": 1}.get(name)

    def _load(self, name: str) -> np.ndarray:
        half = self._split(name)
        if half is not None:
            d = self.config.n_embd
            return self.source.read(self.fused)[:, half * d:(half + 1) * d]
        return self.source.read(self.names[name])

    def _load_expert(self, name: str, e: int) -> np.ndarray:
        return self.source.read_expert(self.names[name], e)

    def _stored_blocks(self, name: str):
        half = self._split(name)
        t = self.source.tensor(self.fused if half is not None else self.names[name])
        if t.qtype.name not in QUANT_TYPES:
            return None
        if half is None:
            return t.qtype.name, t.data
        nb = t.data.shape[-1] // 2  # whole blocks per half: the reader checked d is a block multiple
        return t.qtype.name, t.data[..., half * nb:(half + 1) * nb]

    def with_dtype(self, dtype) -> "MTPWeights":
        return MTPWeights(self.config, self.source, self.names, self.fused, dtype, self._where)


def _check_shapes(mcfg: DS4Config, found: Mapping[str, tuple], names: Mapping[str, str], where: str,
                  fused: str | None) -> None:
    for ours, shape in mtp_tensor_shapes(mcfg).items():
        if fused is not None and ours in (PREFIX + "e_proj.weight", PREFIX + "h_proj.weight"):
            continue
        theirs = names[ours]
        if theirs not in found:
            raise MTPError(f"{where}: the MTP block has no tensor {theirs!r} (expected NumPy shape {shape})")
        if tuple(found[theirs]) != tuple(shape):
            raise MTPError(f"{where}: MTP tensor {theirs!r} has NumPy shape {tuple(found[theirs])}, "
                           f"expected {tuple(shape)} for this model")
    if fused is not None:
        d = mcfg.n_embd
        if tuple(found[fused]) != (d, 2 * d):
            raise MTPError(f"{where}: MTP tensor {fused!r} has NumPy shape {tuple(found[fused])}, "
                           f"expected {(d, 2 * d)} ([e_proj | h_proj])")


def _check_types(model_file, names: Mapping[str, str], where: str) -> None:
    for theirs in names.values():
        t = model_file.tensors.get(theirs)
        if t is None:
            continue
        if t.qtype in _INT_TYPES or not _can_dequantise(t.qtype):
            raise MTPError(f"{where}: MTP tensor {theirs!r} is stored as {t.qtype.name}, which is not a "
                           f"float type ds4ref can dequantise")


def in_file_mtp(model_file, dtype=np.float32, notes: list | None = None) -> MTPWeights | None:
    """The MTP block of a model file in llama.cpp's layout, or None when it has none. A block
    that does not fit is not an error here (the main model runs without it, as llama.cpp loads
    such files): `notes` gets why; in_file_mtp_strict raises instead."""
    try:
        return in_file_mtp_strict(model_file, dtype)
    except MTPError as exc:
        if notes is not None:
            notes.append(f"MTP block not usable: {exc}")
        return None


def in_file_mtp_strict(model_file, dtype=np.float32) -> MTPWeights | None:
    """The in-file MTP block, raising MTPError (naming the tensor) for one that does not fit."""
    block = getattr(model_file, "mtp_block", None)
    if block is None:
        return None
    cfg, meta = model_file.config, model_file.metadata
    ratios = meta.get(f"{ARCH}.attention.compress_ratios", [])
    clamps = meta.get(f"{ARCH}.swiglu_clamp_exp", [])
    where = f"{model_file.path} (MTP block {block})"
    try:
        mcfg = mtp_config(cfg, int(ratios[block]) if len(ratios) > block else 0,
                          clamps[block] if len(clamps) > block else None)
    except MTPError as exc:
        raise MTPError(f"{where}: {exc}") from None
    names = {ours: in_file_name(ours, block) for ours in mtp_tensor_shapes(mcfg)}
    shapes = {n: t.shape for n, t in model_file.tensors.items()}
    fused = f"blk.{block}.{FUSED}" if names[PREFIX + "e_proj.weight"] not in shapes else None
    _check_shapes(mcfg, shapes, names, where, fused)
    _check_types(model_file, names, where)
    return MTPWeights(mcfg, model_file, names, fused, dtype, where)


def separate_mtp(path: str | os.PathLike, cfg: DS4Config, dtype=np.float32) -> MTPWeights:
    """antirez's separate MTP GGUF (`mtp.0.*` tensors) for a model of config `cfg`."""
    mf = MTPFile(path)
    where = mf.path
    meta = mf.metadata
    for key in ("embedding_length", "attention.head_count", "attention.key_length", "expert_count"):
        full = f"{ARCH}.{key}"
        mine = cfg.to_metadata().get(full)
        if full in meta and mine is not None and meta[full] != mine:
            raise MTPError(f"{where}: {full} is {meta[full]} but the model's is {mine}: "
                           f"this MTP file belongs to another model")
    clamps = meta.get(f"{ARCH}.swiglu_clamp_exp", [])
    mcfg = mtp_config(cfg, 0, clamps[cfg.n_layer] if len(clamps) > cfg.n_layer else None)
    names = {ours: ours for ours in mtp_tensor_shapes(mcfg)}
    if not any(n.startswith(PREFIX) for n in mf.tensors):
        raise MTPError(f"{where}: no mtp.0.* tensors: not an MTP GGUF (antirez's layout)")
    _check_shapes(mcfg, {n: t.shape for n, t in mf.tensors.items()}, names, where, None)
    _check_types(mf, names, where)
    return MTPWeights(mcfg, mf, names, None, dtype, where)


def nextn_metadata(cfg: DS4Config, mcfg: DS4Config) -> dict:
    """The metadata of a model file that carries the MTP as its last block (llama.cpp's layout):
    block_count and the per-layer arrays count it, nextn_predict_layers says it is one."""
    return {f"{ARCH}.block_count": cfg.n_layer + 1, NEXTN_KEY: 1,
            f"{ARCH}.attention.compress_ratios": list(cfg.compress_ratios) + list(mcfg.compress_ratios),
            f"{ARCH}.swiglu_clamp_exp": list(cfg.swiglu_clamp) + list(mcfg.swiglu_clamp)}


def to_in_file(tensors: Mapping[str, np.ndarray], block: int) -> dict:
    """`mtp.0.*` tensors renamed to llama.cpp's in-file layout for block `block`."""
    return {in_file_name(n, block): v for n, v in tensors.items()}
