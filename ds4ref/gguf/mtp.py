"""The MTP (multi-token prediction) block: its tensor names in the GGUF layouts that carry
it, its one-layer config, its weights, and llama.cpp's MTP file (docs/mtp.md).

Inside ds4ref every MTP tensor has antirez's name, `mtp.0.<suffix>`: the block's
tensors keep their layer suffixes (`mtp.0.attn_q_a.weight`, ...) and the MTP's own
are `mtp.0.{e_proj,h_proj,enorm,hnorm,norm,hc_head_fn,hc_head_base,hc_head_scale}.weight`.
The layouts a file may carry it in, each beside its model file (never inside it):

* llama.cpp's MTP file (its converter's `--mtp`; what ds4ref writes): block N = block_count - 1
  holds the block as `blk.N.<suffix>` and `blk.N.nextn.{eh_proj,enorm,hnorm,shared_head_norm}`,
  eh_proj being [e_proj | h_proj]; the MTP's own hc head sits at the root names
  (`output_hc_*`), beside copies of the main model's `token_embd`, `output_norm` and `output`;
* antirez's, a file of `mtp.0.*` tensors;
* and, read for compatibility only, ds4ref's files from before it wrote llama.cpp's MTP file:
  the block inside the model file as its last block, with `blk.N.nextn.<name>` for the MTP's
  own tensors (NEXTN), which llama.cpp refuses (its tensor count does not match).

The MTP runs as a one-layer model of its own (mtp_config): the official code builds
it as layer n_layers, whose compress ratio (the published array's last entry) is 0,
so it is a sliding-window layer on the main RoPE table, routed by learned scores.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np

from .config import ARCH, NEXTN_KEY, DS4Config
from .quant_codes import QUANT_TYPES
from .file import MTPFile, check_float_types, write_tensor_file
from .tensors import NEXTN_PROJ, layer_tensor_shapes, tensor_shapes
from .weights import RenamedWeights, WeightsError, check_shapes

PREFIX = "mtp.0."
OWN = ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight",
       "hc_head_fn.weight", "hc_head_base.weight", "hc_head_scale.weight")
E_PROJ, H_PROJ = PREFIX + "e_proj.weight", PREFIX + "h_proj.weight"
# The main model's tensors that llama.cpp's MTP file carries too: its MTP graph embeds and
# projects through the MTP model's own copies (src/models/deepseek4.cpp, graph_mtp)
SHARED = ("token_embd.weight", "output_norm.weight", "output.weight")
# llama.cpp's MTP file: the MTP's own tensors but e_proj / h_proj (fused into EH_PROJ), by the
# name after `blk.N.` or, for the hc head, at the root
LLAMA_OWN = {"enorm.weight": "nextn.enorm.weight", "hnorm.weight": "nextn.hnorm.weight",
             "norm.weight": "nextn.shared_head_norm.weight"}
LLAMA_ROOT = {"hc_head_fn.weight": "output_hc_fn.weight", "hc_head_base.weight": "output_hc_base.weight",
              "hc_head_scale.weight": "output_hc_scale.weight"}
EH_PROJ = NEXTN_PROJ[1]
# ds4ref's former in-file names of the MTP's own tensors, after `blk.N.` (read, never written)
NEXTN = {"e_proj.weight": "nextn.e_proj.weight", "h_proj.weight": "nextn.h_proj.weight",
         "enorm.weight": "nextn.enorm.weight", "hnorm.weight": "nextn.hnorm.weight",
         "norm.weight": "nextn.shared_head_norm.weight", "hc_head_fn.weight": "nextn.hc_head_fn.weight",
         "hc_head_base.weight": "nextn.hc_head_base.weight", "hc_head_scale.weight": "nextn.hc_head_scale.weight"}


class MTPError(WeightsError):
    """An MTP block that is missing, incomplete or does not fit the model (a ValueError)."""


def mtp_config(cfg: DS4Config, ratio: int = 0, clamp: float | None = None) -> DS4Config:
    """The MTP block as a one-layer config (DS4Config.draft_layers): the main config's sizes, the
    MTP layer's ratio and SwiGLU clamp, no hash routing (the official MTP layer id is n_layers >=
    n_hash_layers)."""
    if ratio != 0:
        raise MTPError(f"MTP layer compress ratio {ratio}: only 0 (sliding window, as the published "
                       f"compress_ratios' last entry says) is supported")
    return cfg.draft_layers(1, clamp)


def mtp_tensor_shapes(mcfg: DS4Config) -> dict[str, tuple[int, ...]]:
    """`mtp.0.*` name -> NumPy shape, for the one-layer MTP config."""
    d, hc = mcfg.n_embd, mcfg.hc_mult
    out = {PREFIX + s: shape for s, shape in layer_tensor_shapes(mcfg, 0).items()}
    out.update({E_PROJ: (d, d), H_PROJ: (d, d),
                PREFIX + "enorm.weight": (d,), PREFIX + "hnorm.weight": (d,), PREFIX + "norm.weight": (d,),
                PREFIX + "hc_head_fn.weight": (hc, mcfg.hc_dim), PREFIX + "hc_head_base.weight": (hc,),
                PREFIX + "hc_head_scale.weight": (1,)})
    return out


def mtp_file_name(name: str, block: int) -> str:
    """The name of an `mtp.0.*` tensor in llama.cpp's MTP file, the block being `block`
    (e_proj and h_proj: the fused eh_proj they are halves of)."""
    suffix = name[len(PREFIX):]
    if name in (E_PROJ, H_PROJ):
        return f"blk.{block}.{EH_PROJ}"
    if suffix in LLAMA_ROOT:
        return LLAMA_ROOT[suffix]
    return f"blk.{block}.{LLAMA_OWN.get(suffix, suffix)}"


def in_file_name(name: str, block: int) -> str:
    """ds4ref's former in-file name of an `mtp.0.*` tensor when the MTP is block `block`."""
    suffix = name[len(PREFIX):]
    return f"blk.{block}.{NEXTN.get(suffix, suffix)}"


class MTPWeights(RenamedWeights):
    """The MTP block's tensors under their `mtp.0.*` names, read from a source that holds
    them under other names (`names`: ours -> the source's). `fused`: the source's name of a
    [e_proj | h_proj] matrix, split here by columns."""

    def __init__(self, mcfg: DS4Config, source, names: Mapping[str, str], fused: str | None = None,
                 dtype=np.float32, where: str = "MTP") -> None:
        names = {ours: theirs for ours, theirs in names.items() if fused is None or ours not in (E_PROJ, H_PROJ)}
        super().__init__(mcfg, mtp_tensor_shapes(mcfg), source, names, dtype, where)
        self.fused = fused

    def _split(self, name: str) -> int | None:
        """0 / 1 for e_proj / h_proj read from the fused matrix, else None."""
        if self.fused is None:
            return None
        return {E_PROJ: 0, H_PROJ: 1}.get(name)

    def _load(self, name: str) -> np.ndarray:
        half = self._split(name)
        if half is None:
            return super()._load(name)
        d = self.config.n_embd
        return self.source.read(self.fused)[:, half * d:(half + 1) * d]

    def _stored_blocks(self, name: str):
        half = self._split(name)
        if half is None:
            return super()._stored_blocks(name)
        t = self.source.tensor(self.fused)
        if t.qtype.name not in QUANT_TYPES:
            return None
        nb = t.data.shape[-1] // 2  # whole blocks per half: the reader checked d is a block multiple
        return t.qtype.name, t.data[..., half * nb:(half + 1) * nb]

    def stored_bytes(self) -> int:
        """Bytes of the stored tensors this block reads (a memory plan's share)."""
        return super().stored_bytes() + (self.source.tensor(self.fused).n_bytes if self.fused is not None else 0)

    def with_dtype(self, dtype) -> "MTPWeights":
        return MTPWeights(self.config, self.source, self.names, self.fused, dtype, self.where)


def _check_shapes(mcfg: DS4Config, found: Mapping[str, tuple], names: Mapping[str, str], where: str,
                  fused: str | None) -> None:
    want = {names[ours]: shape for ours, shape in mtp_tensor_shapes(mcfg).items()
            if fused is None or ours not in (E_PROJ, H_PROJ)}
    if fused is not None:
        want[fused] = (mcfg.n_embd, 2 * mcfg.n_embd)  # [e_proj | h_proj]
    check_shapes(want, found, where, MTPError, "MTP tensor")


def _layer_config(cfg: DS4Config, meta: Mapping[str, Any], block: int, where: str) -> DS4Config:
    """mtp_config with the ratio and clamp a file's per-block arrays give block `block`."""
    ratios = meta.get(f"{ARCH}.attention.compress_ratios", [])
    clamps = meta.get(f"{ARCH}.swiglu_clamp_exp", [])
    try:
        return mtp_config(cfg, int(ratios[block]) if len(ratios) > block else 0,
                          clamps[block] if len(clamps) > block else None)
    except MTPError as exc:
        raise MTPError(f"{where}: {exc}") from None


# ---------------------------------------------------------------------------
# the block inside a model file: ds4ref's files from before llama.cpp's MTP file
# ---------------------------------------------------------------------------
def in_file_mtp(model_file, dtype=np.float32, notes: list | None = None) -> MTPWeights | None:
    """The MTP block a model file carries in ds4ref's former in-file layout, or None when it has
    none. A block that does not fit is not an error here (the main model runs without it):
    `notes` gets why; in_file_mtp_strict raises instead."""
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
    where = f"{model_file.path} (MTP block {block})"
    mcfg = _layer_config(model_file.config, model_file.metadata, block, where)
    names = {ours: in_file_name(ours, block) for ours in mtp_tensor_shapes(mcfg)}
    shapes = {n: t.shape for n, t in model_file.tensors.items()}
    fused = f"blk.{block}.{EH_PROJ}" if names[E_PROJ] not in shapes else None
    _check_shapes(mcfg, shapes, names, where, fused)
    check_float_types(model_file, names, where, "MTP", MTPError)
    return MTPWeights(mcfg, model_file, names, fused, dtype, where)


# ---------------------------------------------------------------------------
# an MTP file beside the model: llama.cpp's or antirez's
# ---------------------------------------------------------------------------
def mtp_file_block(meta: Mapping[str, Any], shapes) -> int | None:
    """The MTP block of llama.cpp's MTP file, else None: its loader's probe, the nextn
    projection of block block_count - nextn_predict_layers."""
    nextn, blocks = meta.get(NEXTN_KEY, 0), meta.get(f"{ARCH}.block_count")
    if not nextn or not isinstance(blocks, int):
        return None
    block = blocks - nextn
    return block if f"blk.{block}.{EH_PROJ}" in shapes else None


def separate_mtp(path: str | os.PathLike, cfg: DS4Config, dtype=np.float32, model_file=None) -> MTPWeights:
    """The MTP block of a separate MTP GGUF for a model of config `cfg`: llama.cpp's MTP file
    (its converter's `--mtp`, and ds4ref's) or antirez's (`mtp.0.*` tensors). With the model's
    file, the MTP file must belong to it (gguf.draft_target: sizes, version, the model's
    output_norm where the MTP file carries a copy)."""
    from .draft_target import DSPARK, DraftTargetError, check_draft_target, draft_kind, size_difference
    mf = MTPFile(path)
    if draft_kind(mf.metadata, mf.tensors) == DSPARK:
        raise MTPError(f"{mf.path}: this is a DSpark draft (DeepSeek-V4-Flash-0731's), not an MTP file")
    if model_file is not None:
        try:
            check_draft_target(mf.metadata, mf.path, model_file, mf)
        except DraftTargetError as exc:
            raise MTPError(str(exc)) from None
    elif (other := size_difference(mf.metadata, cfg)) is not None:  # without the model's file: its config's
        raise MTPError(f"{mf.path}: {other}: this MTP file belongs to another model")
    shapes = {n: t.shape for n, t in mf.tensors.items()}
    block = mtp_file_block(mf.metadata, shapes)
    if block is not None:
        return _llama_mtp(mf, cfg, block, shapes, dtype)
    if any(n.startswith(PREFIX) for n in mf.tensors):
        return _antirez_mtp(mf, cfg, shapes, dtype)
    raise MTPError(f"{mf.path}: not an MTP GGUF: neither llama.cpp's layout (nextn_predict_layers and "
                   f"blk.N.{EH_PROJ}, N = block_count - nextn_predict_layers) nor antirez's (mtp.0.* tensors)")


def _llama_mtp(mf, cfg: DS4Config, block: int, shapes, dtype) -> MTPWeights:
    where = f"{mf.path} (MTP block {block})"
    nextn = mf.metadata[NEXTN_KEY]
    if nextn != 1:
        raise MTPError(f"{where}: {NEXTN_KEY} is {nextn}; DS4 has one MTP block, ds4ref runs one")
    if block != cfg.n_layer:
        raise MTPError(f"{where}: the MTP block follows {block} layers, the model has {cfg.n_layer}: "
                       f"this MTP file belongs to another model")
    mcfg = _layer_config(cfg, mf.metadata, block, where)
    names = {ours: mtp_file_name(ours, block) for ours in mtp_tensor_shapes(mcfg)}
    fused = f"blk.{block}.{EH_PROJ}"
    _check_shapes(mcfg, shapes, names, where, fused)
    # ds4ref embeds and projects through the model's own token_embd / output (the official MTP
    # shares them); llama.cpp through this file's copies, which must therefore be of its shapes
    for name in SHARED:
        want = tensor_shapes(cfg)[name]
        if name in shapes and tuple(shapes[name]) != want:
            raise MTPError(f"{where}: {name!r} has NumPy shape {tuple(shapes[name])}, the model's is {want}: "
                           f"this MTP file belongs to another model")
    check_float_types(mf, names, where, "MTP", MTPError)
    return MTPWeights(mcfg, mf, names, fused, dtype, where)


def _antirez_mtp(mf, cfg: DS4Config, shapes, dtype) -> MTPWeights:
    clamps = mf.metadata.get(f"{ARCH}.swiglu_clamp_exp", [])
    mcfg = mtp_config(cfg, 0, clamps[cfg.n_layer] if len(clamps) > cfg.n_layer else None)
    names = {ours: ours for ours in mtp_tensor_shapes(mcfg)}
    _check_shapes(mcfg, shapes, names, mf.path, None)
    check_float_types(mf, names, mf.path, "MTP", MTPError)
    return MTPWeights(mcfg, mf, names, None, dtype, mf.path)


# ---------------------------------------------------------------------------
# writing llama.cpp's MTP file
# ---------------------------------------------------------------------------
def nextn_metadata(cfg: DS4Config, mcfg: DS4Config) -> dict:
    """The metadata that counts the MTP as the block after the model's layers (llama.cpp's MTP
    file): block_count and the per-layer arrays count it, nextn_predict_layers says it is one."""
    return {f"{ARCH}.block_count": cfg.n_layer + 1, NEXTN_KEY: 1,
            f"{ARCH}.attention.compress_ratios": list(cfg.compress_ratios) + list(mcfg.compress_ratios),
            f"{ARCH}.swiglu_clamp_exp": list(cfg.swiglu_clamp) + list(mcfg.swiglu_clamp)}


class _Columns:
    """[a | b] joined along the input dimension when the writer asks for its values, so a
    converter's lazy tensors stay lazy until then."""

    def __init__(self, a, b):
        self.a, self.b = a, b
        self.shape = (a.shape[0], a.shape[1] + b.shape[1])

    def __array__(self, dtype=None, copy=None):
        out = np.concatenate([np.asarray(self.a, np.float32), np.asarray(self.b, np.float32)], axis=1)
        return out if dtype is None else out.astype(dtype)


def write_mtp_gguf(path: str | os.PathLike, cfg: DS4Config, tensors: Mapping[str, Any], shared: Mapping[str, Any],
                   tokenizer_meta: Mapping[str, Any] | None = None, dtypes: Mapping[str, str] | None = None,
                   default_dtype: str = "f32", extra_meta: Mapping[str, Any] | None = None) -> None:
    """Write the MTP block of a model of config `cfg` as llama.cpp's MTP file.

    `tensors`: every `mtp.0.*` tensor (mtp_tensor_shapes) in NumPy shape; `shared`: the model's
    SHARED tensors; `dtypes` by the same names. e_proj and h_proj are stored as one
    eh_proj = [e_proj | h_proj] (e first, along the input dimension), so they take one type."""
    mcfg = mtp_config(cfg)
    want = {**mtp_tensor_shapes(mcfg), **{n: tensor_shapes(cfg)[n] for n in SHARED}}
    given = {**tensors, **shared}
    check_shapes(want, {n: t.shape for n, t in given.items()}, "write_mtp_gguf", MTPError, whose="the MTP block's")
    dtypes = dict(dtypes or {})
    e_type, h_type = (dtypes.get(n, default_dtype) for n in (E_PROJ, H_PROJ))
    if e_type != h_type:
        raise MTPError(f"write_mtp_gguf: e_proj ({e_type}) and h_proj ({h_type}) are stored as one eh_proj "
                       f"and must have one type")
    block = cfg.n_layer
    out = {name: shared[name] for name in SHARED}
    out.update({mtp_file_name(n, block): given[n] for n in mtp_tensor_shapes(mcfg) if n not in (E_PROJ, H_PROJ)})
    out[f"blk.{block}.{EH_PROJ}"] = _Columns(given[E_PROJ], given[H_PROJ])
    stored = {mtp_file_name(n, block) if n.startswith(PREFIX) else n: t for n, t in dtypes.items()}
    meta = dict(cfg.to_metadata())
    meta.update(tokenizer_meta or {})
    meta.update(extra_meta or {})
    meta.update(nextn_metadata(cfg, mcfg))
    write_tensor_file(path, meta, out, stored, default_dtype)
