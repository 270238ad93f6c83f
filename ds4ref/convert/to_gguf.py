"""Convert a DeepSeek-V4 safetensors checkpoint directory to a deepseek4 GGUF.

    python -m ds4ref.convert --hf DIR --out FILE.gguf [--dtype f32|f16|bf16|q8_0] [--mtp-out MTP.gguf]

DIR holds config.json (transformers' modern keys or the legacy ones, see
ds4ref.convert.hf.config_from_hf) and one or more *.safetensors files with official
DeepSeek names, transformers' names (with or without the leading `model.`), or
the hybrid that transformers' save_pretrained writes. Tensors are read lazily,
one at a time, while the GGUF is written.

Unquantised checkpoints (F32/F16/BF16/F64, integer tid2eid) and the official FP8/FP4
release (ds4ref.convert.fp8): FP8 weights are dequantised exactly and stored as --dtype; FP4
routed experts are repacked to MXFP4 losslessly. docs/convert.md has the details.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable
from ..console import HelpFormatter

import numpy as np

from ..gguf.config import ConfigError, DS4Config
from ..gguf.mtp import OWN as MTP_OWN, PREFIX as MTP_PREFIX, mtp_config, mtp_tensor_shapes
from .fp8 import QuantError, decode_scales, dequantise_fp8, fp4_to_mxfp4, fp4_values
from .hf import (EXPERT_OFFICIAL, EXPERT_TENSORS, GLOBAL_ALIASES, GLOBAL_NAMES, HF_DOWN, HF_GATE_UP,
                 LAYER_ALIASES, LAYER_NAMES, HFError, config_from_hf, strip_model_prefix)
from ..gguf.tensors import is_int_tensor, layer_tensor_shapes, tensor_shapes
from ..gguf.version import ORIGINAL


class ConvertError(ValueError):
    """The checkpoint cannot be converted; the message names the tensor or key."""


# safetensors dtype strings
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
INT_DTYPES = {"I64", "I32", "I16", "U32"}
# The official release's quantised weights (ds4ref.convert.fp8): FP8 E4M3 values, int8-packed FP4, and
# their scales (E8M0, or float). Other quantised formats are refused naming the tensor.
QUANT_DTYPES = {"F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F4", "F6_E2M3", "F6_E3M2"}
FP8_DTYPE, FP4_DTYPES = "F8_E4M3", {"I8", "U8"}
SCALE_DTYPES = {"F8_E8M0", "F32", "BF16", "F16"}
# Companion names of block-quantised weights: official `X.scale`, transformers' FP8 `X.weight_scale_inv`.
_SCALE_NAME = re.compile(r"^(?P<base>.+?)(\.scale|\.weight_scale_inv)$")
_QUANT_NAME = re.compile(r"(\.scale|\.scale_inv|_scale_inv|\.weight_scale|\.input_scale)$")

# GGUF --dtype choices -> stored type of >= 2-D float tensors. 1-D tensors (norms, HC
# biases/scales, sinks, router bias) stay F32 as in the published files.
DTYPES = ("f32", "f16", "bf16", "q8_0")
_FILE_TYPE = {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7}  # llama.cpp's general.file_type codes


# --------------------------------------------------------------------------------------------
# safetensors directory reading
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SourceTensor:
    file: Path
    name: str      # name as stored
    dtype: str     # safetensors dtype string
    shape: tuple[int, ...]
    offset: int = 0   # byte offset of the data in the file
    nbytes: int = 0
    scale: "SourceTensor | None" = None  # the block scales of an FP8 / FP4 weight

    @property
    def is_fp4(self) -> bool:
        return self.scale is not None and self.dtype in FP4_DTYPES

    @property
    def value_shape(self) -> tuple[int, ...]:
        """The shape of the values: FP4 packs two a byte along the last axis."""
        return (*self.shape[:-1], 2 * self.shape[-1]) if self.is_fp4 else self.shape


def read_header(path: Path) -> dict[str, SourceTensor]:
    """The tensor directory of one safetensors file, without loading any data."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ConvertError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as exc:
            raise ConvertError(f"{path}: unreadable safetensors header ({exc})") from None
    start = 8 + n
    return {name: SourceTensor(path, name, info["dtype"], tuple(int(s) for s in info["shape"]),
                               start + int(info["data_offsets"][0]),
                               int(info["data_offsets"][1]) - int(info["data_offsets"][0]))
            for name, info in header.items() if name != "__metadata__"}


def scan_dir(hf_dir: Path) -> dict[str, SourceTensor]:
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ConvertError(f"{hf_dir}: no *.safetensors files")
    out: dict[str, SourceTensor] = {}
    for path in files:
        for name, t in read_header(path).items():
            if name in out:
                raise ConvertError(f"tensor {name!r} appears in both {out[name].file.name} and {path.name}")
            out[name] = t
    return out


class _Opener:
    """Reads a checkpoint's tensors through memory maps; integer tensors through safe_open."""

    def __init__(self) -> None:
        self._handles: dict[Path, object] = {}

    def raw(self, t: SourceTensor, dtype) -> np.ndarray:
        """The stored bytes as `dtype`, memory-mapped (read when touched)."""
        return np.memmap(t.file, dtype=dtype, mode="r", offset=t.offset, shape=t.shape)

    def _scales(self, t: SourceTensor) -> np.ndarray:
        s = t.scale
        if s.dtype == "F8_E8M0":
            return self.raw(s, np.uint8)
        return self.load(s)

    def mxfp4(self, t: SourceTensor) -> np.ndarray:
        """An FP4 weight's MXFP4 block bytes (lossless, fp8.fp4_to_mxfp4)."""
        if t.scale.dtype != "F8_E8M0":
            raise ConvertError(f"tensor {t.scale.name!r}: FP4 scales must be F8_E8M0, found {t.scale.dtype}")
        try:
            return fp4_to_mxfp4(self.raw(t, np.uint8), self.raw(t.scale, np.uint8), t.name)
        except QuantError as exc:
            raise ConvertError(str(exc)) from None

    def load_rows(self, t: SourceTensor, r0: int, r1: int) -> np.ndarray:
        """float32 rows r0..r1 of a 2-D float or FP8 weight (r0 a multiple of 128), read through
        a memory map made for this call, so neither the values nor the file's pages outlive it."""
        if t.dtype == FP8_DTYPE:
            scale = decode_scales(self._scales(t)[r0 // 128: -(-r1 // 128)], t.scale.dtype)
            try:
                return dequantise_fp8(np.asarray(self.raw(t, np.uint8)[r0:r1]), scale, t.name)
            except QuantError as exc:
                raise ConvertError(str(exc)) from None
        return _widen(np.asarray(self.raw(t, _ROW_DTYPES[t.dtype])[r0:r1]), t.dtype)

    def load(self, t: SourceTensor) -> np.ndarray:
        from safetensors import safe_open

        try:
            if t.dtype == FP8_DTYPE:
                return dequantise_fp8(self.raw(t, np.uint8), decode_scales(self._scales(t), t.scale.dtype), t.name)
            if t.is_fp4:
                return fp4_values(self.raw(t, np.uint8), self._scales(t)).astype(np.float32)
        except QuantError as exc:
            raise ConvertError(str(exc)) from None

        if t.dtype in _ROW_DTYPES:
            return _widen(np.asarray(self.raw(t, _ROW_DTYPES[t.dtype])), t.dtype)
        h = self._handles.get(t.file)
        if h is None:
            h = self._handles[t.file] = safe_open(str(t.file), framework="numpy")
        return np.asarray(h.get_tensor(t.name))


_ROW_DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F64": "<f8"}


def _widen(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Stored float values as float32 (float64 stays float64); every widening here is exact."""
    if dtype == "BF16":  # the top half of a float32
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw if dtype == "F64" else raw.astype(np.float32)


class Lazy:
    """A tensor write_gguf can take: `.shape` now, values via np.asarray when written. With
    `load_rows(r0, r1)`, write_gguf converts a large 2-D tensor a block of rows at a time
    (`row_chunks`), so the embedding and the output head (129280 rows) never sit in memory
    whole: memory stays bounded whatever the checkpoint's size."""

    def __init__(self, shape: tuple[int, ...], load: Callable[[], np.ndarray],
                 load_rows: Callable[[int, int], np.ndarray] | None = None):
        self.shape = tuple(shape)
        self._load = load
        self._load_rows = load_rows

    def row_chunks(self, rows: int):
        """None, or a generator of float32 row blocks covering the tensor in order."""
        if self._load_rows is None or len(self.shape) != 2:
            return None
        return (self._load_rows(r0, min(r0 + rows, self.shape[0])) for r0 in range(0, self.shape[0], rows))

    def __array__(self, dtype=None, copy=None):
        arr = self._load()
        if arr.shape != self.shape:
            raise ConvertError(f"loaded shape {arr.shape}, expected {self.shape}")
        return arr if dtype is None else arr.astype(dtype)


class LazyBlocks:
    """Routed experts that are stored as MXFP4 whatever --dtype says (FP4 -> MXFP4 is lossless,
    anything else would round or inflate them): write_gguf calls stored_blocks() when writing."""

    def __init__(self, shape: tuple[int, ...], load: Callable[[], np.ndarray],
                 parts: Callable[[], Iterable[np.ndarray]] | None = None):
        from gguf import GGMLQuantizationType
        self.shape, self.qtype, self._load, self._parts = tuple(shape), GGMLQuantizationType.MXFP4, load, parts

    def block_parts(self):
        """None, or the stored bytes expert by expert (write_gguf writes them in turn: the
        stack of 256 experts is never built)."""
        return None if self._parts is None else self._parts()

    def stored_blocks(self):
        from ..gguf.file import StoredBlocks
        return StoredBlocks(self.shape, self.qtype, self._load())


# --------------------------------------------------------------------------------------------
# name mapping
# --------------------------------------------------------------------------------------------

@dataclass
class _Plan:
    """Where each GGUF tensor comes from."""
    single: dict[str, SourceTensor] = field(default_factory=dict)           # gguf -> source
    experts: dict[str, dict[int, SourceTensor]] = field(default_factory=dict)  # gguf -> e -> source
    fused_gate_up: dict[int, SourceTensor] = field(default_factory=dict)    # layer -> source
    fused_down: dict[int, SourceTensor] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)


def _lookup_tables() -> tuple[dict[str, str], dict[str, str]]:
    """(global name -> GGUF name, layer suffix -> GGUF suffix), all spellings, `model.` stripped."""
    glob = dict(GLOBAL_ALIASES)
    for g, (off, hfn) in GLOBAL_NAMES.items():
        glob[off] = g
        glob[strip_model_prefix(hfn)] = g
    layer = dict(LAYER_ALIASES)
    for s, (off, hfn) in LAYER_NAMES.items():
        layer[off] = s
        layer[hfn] = s
    return glob, layer


_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.weight$")
_OFFICIAL_TO_GGUF_EXPERT = {v: k for k, v in EXPERT_OFFICIAL.items()}


def pair_scales(sources: dict[str, SourceTensor]) -> dict[str, SourceTensor]:
    """The sources with each `X.scale` / `X.weight_scale_inv` attached to its weight `X.weight`
    (and removed); FP8/FP4 weights without one, or scales without a quantised weight, raise."""
    out = dict(sources)
    for name, t in sources.items():
        m = _SCALE_NAME.match(name)
        weight = out.get(f"{m.group('base')}.weight") if m else None
        if m is None or weight is None or weight.dtype not in {FP8_DTYPE, *FP4_DTYPES}:
            continue
        if t.dtype not in SCALE_DTYPES:
            raise ConvertError(f"tensor {name!r}: scales stored as {t.dtype}, expected one of {sorted(SCALE_DTYPES)}")
        out[weight.name] = dataclasses.replace(weight, scale=t)
        del out[name]
    for name, t in out.items():
        if t.dtype == FP8_DTYPE and t.scale is None:
            raise ConvertError(f"tensor {name!r} is F8_E4M3 without its block scales ({name.removesuffix('.weight')}"
                               f".scale or {name}_scale_inv)")
    return out


def plan_tensors(cfg: DS4Config, sources: dict[str, SourceTensor], mtp_own: dict[str, str] | None = None,
                 draft_layers: dict[str, int] | None = None) -> _Plan:
    """Assign every source tensor to its GGUF tensor; raise on quantised/unexpected/missing.
    mtp_own: the draft's own tensors (source key -> our name) when cfg counts the draft's blocks
    as its last layers (with_mtp, with_dspark); draft_layers: the source prefix of each such
    block -> its layer (default: the MTP block, `mtp.0.`, as the last layer). Without mtp_own,
    `mtp.*` tensors are ignored."""
    sources = pair_scales(sources)
    _refuse_quantised(sources)
    glob, layer = _lookup_tables()
    glob.update(mtp_own or {})
    if draft_layers is None:
        draft_layers = {MTP_SRC: cfg.n_layer - 1}
    plan = _Plan()
    unexpected: list[str] = []

    def assign(gguf_name: str, t: SourceTensor) -> None:
        if gguf_name in plan.single:
            raise ConvertError(f"tensors {plan.single[gguf_name].name!r} and {t.name!r} both map to {gguf_name!r}")
        plan.single[gguf_name] = t

    for name, t in sources.items():
        key = strip_model_prefix(name)
        if key.startswith("mtp.") and mtp_own is None:
            plan.ignored.append(name)
            continue
        prefix = next((p for p in draft_layers if key.startswith(p)), None)
        if prefix is not None and key not in glob:  # a draft block's layer tensors: its layer after the model's
            key = f"layers.{draft_layers[prefix]}.{key[len(prefix):]}"
        if key in glob:
            assign(glob[key], t)
            continue
        m = _LAYER_RE.match(key)
        if m is None or int(m.group(1)) >= cfg.n_layer:
            unexpected.append(name)
            continue
        il, rest = int(m.group(1)), m.group(2)
        if rest in layer:
            suffix = layer[rest]
            if suffix not in layer_tensor_shapes(cfg, il):  # e.g. a compressor on a ratio-0 layer
                unexpected.append(name)
            else:
                assign(f"blk.{il}.{suffix}", t)
        elif rest == HF_GATE_UP:
            plan.fused_gate_up[il] = t
        elif rest == HF_DOWN:
            plan.fused_down[il] = t
        elif (me := _EXPERT_RE.match(rest)) is not None:
            gname = f"blk.{il}.{_OFFICIAL_TO_GGUF_EXPERT[me.group(2)]}"
            plan.experts.setdefault(gname, {})[int(me.group(1))] = t
        else:
            unexpected.append(name)
    if unexpected:
        quant = [n for n in unexpected if _QUANT_NAME.search(n)]
        if quant:
            raise ConvertError(f"tensor {quant[0]!r} is a quantisation scale without an FP8/FP4 weight to go with")
        raise ConvertError(f"unexpected tensors for this config: {_show(unexpected)}")
    _check_complete(cfg, plan, {g: None for g in (mtp_own or {}).values()})
    return plan


def _refuse_quantised(sources: dict[str, SourceTensor]) -> None:
    for name, t in sorted(sources.items()):
        if t.dtype in QUANT_DTYPES or (t.dtype in FP4_DTYPES and t.scale is None) or t.dtype == "F8_E8M0":
            raise ConvertError(f"tensor {name!r} is stored as {t.dtype}: ds4ref converts F32/F16/BF16 and the "
                               f"official FP8 (F8_E4M3 + E8M0 128x128 scales) and FP4 (int8 + E8M0 per 32) weights")
        if t.dtype not in FLOAT_DTYPES | INT_DTYPES | {FP8_DTYPE} and not t.is_fp4:
            raise ConvertError(f"tensor {name!r} has unsupported safetensors dtype {t.dtype}")


def _show(names: list[str], n: int = 8) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(repr(x) for x in names[:n]) + more


def _check_complete(cfg: DS4Config, plan: _Plan, extra: dict | None = None) -> None:
    missing = [n for n in (extra or {}) if n not in plan.single]
    for name in tensor_shapes(cfg):
        il = int(name.split(".")[1]) if name.startswith("blk.") else -1
        suffix = name.split(".", 2)[-1]
        if suffix in EXPERT_TENSORS:
            fused = plan.fused_down if suffix == "ffn_down_exps.weight" else plan.fused_gate_up
            have = plan.experts.get(name, {})
            if il in fused and have:
                raise ConvertError(f"layer {il}: both fused and per-expert tensors for {suffix}")
            if il not in fused:
                missing += [f"{name}[expert {e}]" for e in range(cfg.n_expert) if e not in have]
                extra = sorted(e for e in have if not 0 <= e < cfg.n_expert)
                if extra:
                    raise ConvertError(f"unexpected tensors for this config: {have[extra[0]].name!r} "
                                       f"(expert {extra[0]} of {cfg.n_expert})")
        elif name not in plan.single:
            missing.append(name)
    if missing:
        raise ConvertError(f"missing tensors (GGUF names): {_show(missing)}")


# --------------------------------------------------------------------------------------------
# building the GGUF tensor dict
# --------------------------------------------------------------------------------------------

def _expect(t: SourceTensor, shape: tuple[int, ...], what: str) -> None:
    if tuple(t.value_shape) != tuple(shape):
        raise ConvertError(f"tensor {t.name!r} has shape {t.value_shape}, expected {tuple(shape)} for {what}")


def gguf_tensors(cfg: DS4Config, plan: _Plan, opener: _Opener, extra_shapes: dict | None = None) -> dict[str, Lazy]:
    """GGUF name -> Lazy tensor in ds4ref.gguf.tensors' NumPy shape (checked against the headers now)."""
    shapes = {**tensor_shapes(cfg), **(extra_shapes or {})}
    out: dict[str, Lazy] = {}
    for name, t in plan.single.items():
        _expect(t, shapes[name], name)
        if is_int_tensor(name):
            if t.dtype not in INT_DTYPES:
                raise ConvertError(f"tensor {t.name!r} must hold integer expert ids, found {t.dtype}")
            out[name] = Lazy(shapes[name], lambda t=t: _expert_ids(opener.load(t), t.name, cfg.n_expert))
        else:
            if t.dtype not in FLOAT_DTYPES | {FP8_DTYPE} and not t.is_fp4:
                raise ConvertError(f"tensor {t.name!r} must hold floats, found {t.dtype}")
            rows = ((lambda r0, r1, t=t: opener.load_rows(t, r0, r1))
                    if len(t.shape) == 2 and (t.dtype in _ROW_DTYPES or t.dtype == FP8_DTYPE) else None)
            out[name] = Lazy(shapes[name], lambda t=t: opener.load(t), rows)
    ff, d = cfg.expert_ff, cfg.n_embd
    for il, t in plan.fused_gate_up.items():
        _expect(t, (cfg.n_expert, 2 * ff, d), f"layer {il} gate_up_proj")
        # transformers concatenates along dim 1: gate rows first, then up rows.
        out[f"blk.{il}.ffn_gate_exps.weight"] = Lazy((cfg.n_expert, ff, d), lambda t=t: opener.load(t)[:, :ff])
        out[f"blk.{il}.ffn_up_exps.weight"] = Lazy((cfg.n_expert, ff, d), lambda t=t: opener.load(t)[:, ff:])
    for il, t in plan.fused_down.items():
        _expect(t, (cfg.n_expert, d, ff), f"layer {il} down_proj")
        out[f"blk.{il}.ffn_down_exps.weight"] = Lazy((cfg.n_expert, d, ff), lambda t=t: opener.load(t))
    for name, per in plan.experts.items():
        shape = shapes[name]
        for e, t in per.items():
            _expect(t, shape[1:], f"{name} expert {e}")
        srcs = [per[e] for e in range(cfg.n_expert)]
        if all(t.is_fp4 for t in srcs):  # official FP4 experts: MXFP4, bit for bit
            out[name] = LazyBlocks(shape, lambda srcs=srcs: np.stack([opener.mxfp4(t) for t in srcs]),
                                   lambda srcs=srcs: (opener.mxfp4(t) for t in srcs))
        else:
            out[name] = Lazy(shape, lambda srcs=srcs: np.stack([opener.load(t) for t in srcs]))
    return out


def _expert_ids(arr: np.ndarray, name: str, n_expert: int) -> np.ndarray:
    if arr.size and (arr.min() < 0 or arr.max() >= n_expert):
        raise ConvertError(f"tensor {name!r} holds expert ids outside 0..{n_expert - 1}")
    return arr.astype(np.int32)


# --------------------------------------------------------------------------------------------
# entry points
# --------------------------------------------------------------------------------------------

def load_config(hf_dir: Path) -> DS4Config:
    path = hf_dir / "config.json"
    if not path.is_file():
        raise ConvertError(f"{hf_dir}: no config.json")
    try:
        return config_from_hf(json.loads(path.read_text()), name=hf_dir.resolve().name)
    except KeyError as exc:
        raise ConvertError(f"{path}: missing key {exc.args[0]!r}") from None
    except (HFError, ConfigError) as exc:
        raise ConvertError(f"{path}: {exc}") from None


# llama.cpp token types
_TOK_NORMAL, _TOK_CONTROL, _TOK_USER, _TOK_UNUSED = 1, 3, 4, 5


def _looks_special(token: str) -> bool:
    """llama.cpp's converter types added `<｜…｜>` / `<|…|>` tokens CONTROL even when the
    tokenizer does not mark them special (`does_token_look_special`); so does ds4ref."""
    return (token.startswith("<｜") and token.endswith("｜>")) or (token.startswith("<|") and token.endswith("|>"))


def tokenizer_meta(hf_dir: Path, cfg: DS4Config) -> dict | None:
    """`tokenizer.ggml.*` keys from tokenizer.json (+ tokenizer_config.json), or None if absent.

    Byte-level BPE as published (`gpt2` model, `joyai-llm` pre-tokeniser). Ids the
    tokenizer does not define (the embedding is padded to vocab_size) become
    `[PAD{id}]` tokens of type UNUSED, as llama.cpp's converter writes them.
    """
    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        return None
    tj = json.loads(path.read_text(encoding="utf-8"))
    model = tj.get("model") or {}
    if model.get("type") != "BPE":
        raise ConvertError(f"{path}: tokenizer model {model.get('type')!r} is not BPE")
    by_id: dict[int, tuple[str, int]] = {int(i): (t, _TOK_NORMAL) for t, i in model["vocab"].items()}
    for a in tj.get("added_tokens", []):
        by_id[int(a["id"])] = (a["content"], _TOK_CONTROL if a.get("special") or _looks_special(a["content"])
                               else _TOK_USER)
    if by_id and max(by_id) >= cfg.vocab_size:
        raise ConvertError(f"{path}: token id {max(by_id)} does not fit vocab_size {cfg.vocab_size}")
    tokens = [by_id.get(i, (f"[PAD{i}]", _TOK_UNUSED)) for i in range(cfg.vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "joyai-llm",
        "tokenizer.ggml.tokens": [t for t, _ in tokens],
        "tokenizer.ggml.token_type": [k for _, k in tokens],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": cfg.bos_id,
        "tokenizer.ggml.eos_token_id": cfg.eos_id,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.ggml.add_eos_token": False,
    }
    tc = hf_dir / "tokenizer_config.json"
    if tc.is_file():
        template = json.loads(tc.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(template, str):
            meta["tokenizer.chat_template"] = template
    return meta


def stored_dtypes(cfg: DS4Config, dtype: str) -> dict[str, str]:
    if dtype not in DTYPES:
        raise ConvertError(f"--dtype must be one of {DTYPES}, got {dtype!r}")
    return {name: (dtype if len(shape) >= 2 else "f32") for name, shape in tensor_shapes(cfg).items()
            if not is_int_tensor(name)}


def convert(hf_dir, out, dtype: str = "f32", mtp_out=None, dspark_out=None) -> DS4Config:
    """Convert checkpoint directory `hf_dir` to GGUF file `out`; returns the config. `mtp_out`:
    where to write the checkpoint's MTP block (`mtp.0.*`) as llama.cpp's MTP file; `dspark_out`:
    where to write a 0731 checkpoint's DSpark draft (`mtp.0..2`) as llama.cpp's dflash file.
    Without them the draft is left out, as llama.cpp's converter leaves it out without --mtp
    or --dspark; the model file is the same bytes either way."""
    from ..gguf.file import write_gguf
    from ..gguf.mtp import SHARED, write_mtp_gguf

    hf_dir = Path(hf_dir)
    cfg = load_config(hf_dir)
    sources = scan_dir(hf_dir)
    extra = {"general.file_type": _FILE_TYPE[dtype], "deepseek4.rope.scaling.type": "yarn"}
    dtypes = stored_dtypes(cfg, dtype)
    tokenizer = tokenizer_meta(hf_dir, cfg)
    if has_dspark(sources) and mtp_out is not None:
        raise ConvertError(f"{hf_dir}: its mtp.* tensors are a DSpark draft (DeepSeek-V4-Flash-0731), not an MTP "
                           f"block: --dspark-out FILE writes it")
    if dspark_out is not None:
        if not has_dspark(sources):
            raise ConvertError(f"{hf_dir}: no DSpark draft ({DSPARK_MARK}): --dspark-out needs a 0731 checkpoint")
        return _convert_dspark(hf_dir, cfg, sources, out, dspark_out, dtype, dtypes, tokenizer, extra)
    if mtp_out is None:
        tensors = gguf_tensors(cfg, plan_tensors(cfg, sources), _Opener())
        write_gguf(out, cfg, _with_progress(tensors), tokenizer_meta=tokenizer, dtypes=dtypes, extra_meta=extra)
        return cfg
    if not has_mtp(sources):
        raise ConvertError(f"{hf_dir}: no {MTP_SRC}* tensors: the checkpoint has no MTP block to write to {mtp_out}")
    main, block = _with_mtp_block(cfg, sources)
    shared = {n: copy.copy(main[n]) for n in SHARED}  # read again for the MTP file, with a bar of its own
    write_gguf(out, cfg, _with_progress(main), tokenizer_meta=tokenizer, dtypes=dtypes, extra_meta=extra)
    mtp = _with_progress({**block, **shared})
    mtp_dtypes = {n: (dtype if len(t.shape) >= 2 else "f32") for n, t in mtp.items()}
    write_mtp_gguf(mtp_out, cfg, {n: mtp[n] for n in block}, {n: mtp[n] for n in shared}, tokenizer, mtp_dtypes,
                   extra_meta=extra)
    return cfg


MTP_SRC = "mtp.0."  # the official checkpoint's MTP block (num_nextn_predict_layers = 1)
DSPARK_MARK = "mtp.0.main_proj.weight"  # what 0731's DSpark draft has and an MTP block has not


def has_mtp(sources: dict[str, SourceTensor]) -> bool:
    return any(strip_model_prefix(n).startswith(MTP_SRC) for n in sources) and not has_dspark(sources)


def has_dspark(sources: dict[str, SourceTensor]) -> bool:
    return any(strip_model_prefix(n) == DSPARK_MARK for n in sources)


def _convert_dspark(hf_dir: Path, cfg: DS4Config, sources, out, dspark_out, dtype: str, dtypes, tokenizer,
                    extra) -> DS4Config:
    """The model file and the DSpark draft's dflash file, the draft planned as three more
    layers after the model's (so each stage is checked like a layer)."""
    from ..gguf.dspark import DSparkConfig, DSparkError, dspark_tensor_shapes
    from ..gguf.dspark_file import write_dflash_gguf
    from ..gguf.draft_target import fingerprint
    from ..gguf.file import write_gguf
    try:
        dcfg = DSparkConfig.from_hf(json.loads((hf_dir / "config.json").read_text()))
    except DSparkError as exc:
        raise ConvertError(f"{hf_dir / 'config.json'}: {exc}") from None
    ext, own, layers = with_dspark(cfg, dcfg)
    shapes = dspark_tensor_shapes(cfg, dcfg)
    try:
        tensors = gguf_tensors(ext, plan_tensors(ext, sources, own, layers), _Opener(),
                               {n: shapes[n] for n in own.values()})
    except ConvertError as exc:
        raise ConvertError(f"the checkpoint's DSpark draft (mtp.0..{dcfg.last}, planned as blocks {cfg.n_layer}.."
                           f"{cfg.n_layer + dcfg.last}): {exc}") from None
    main, draft = _split_draft(cfg, tensors)
    target = fingerprint(np.asarray(copy.copy(main["output_norm.weight"]), np.float32))
    write_gguf(out, cfg, _with_progress(main), tokenizer_meta=tokenizer, dtypes=dtypes, extra_meta=extra)
    draft = _with_progress(draft)
    write_dflash_gguf(dspark_out, cfg, dcfg, draft, tokenizer,
                      {n: (dtype if len(t.shape) >= 2 else "f32") for n, t in draft.items()},
                      extra_meta={"general.file_type": _FILE_TYPE[dtype], "general.name": cfg.name},
                      target_fingerprint=target)
    return cfg


def with_dspark(cfg: DS4Config, dcfg) -> tuple[DS4Config, dict[str, str], dict[str, int]]:
    """(cfg with the draft's stages as more layers, source key -> our name of the draft's own
    tensors, source prefix of each stage -> its layer), for planning the draft (gguf.dspark)."""
    from ..gguf.dspark import OWN, own_name, stage_config
    from .hf import official_dspark_names
    official = official_dspark_names(cfg, dcfg)
    own = {official[own_name(suffix, stage, dcfg)]: own_name(suffix, stage, dcfg) for suffix, stage, _ in OWN}
    return _after_layers(cfg, stage_config(cfg, dcfg)), own, {f"mtp.{s}.": cfg.n_layer + s for s in range(dcfg.n_stages)}


def _with_mtp_block(cfg: DS4Config, sources: dict[str, SourceTensor]) -> tuple[dict, dict]:
    """(the model's tensors, the MTP block's by their `mtp.0.*` names): the block planned as
    one more layer after the model's, so it is checked like any layer."""
    ext, own = with_mtp(cfg)
    try:
        tensors = gguf_tensors(ext, plan_tensors(ext, sources, own), _Opener(), own_shapes(cfg))
    except ConvertError as exc:
        raise ConvertError(f"the checkpoint has {MTP_SRC}* tensors (the MTP block, planned as block "
                           f"{cfg.n_layer}): {exc}") from None
    return _split_draft(cfg, tensors)


def with_mtp(cfg: DS4Config) -> tuple[DS4Config, dict[str, str]]:
    """(cfg with the MTP block as one more layer, source key -> `mtp.0.*` name of the MTP's own
    tensors), for planning the block beside the model's layers (docs/mtp.md)."""
    ext = _after_layers(cfg, mtp_config(cfg))
    own = {}
    for suffix in MTP_OWN:
        src = MTP_SRC + (suffix if suffix.endswith("proj.weight") or suffix.endswith("norm.weight")
                         else suffix.removesuffix(".weight"))
        own[src] = MTP_PREFIX + suffix
    return ext, own


def _after_layers(cfg: DS4Config, draft: DS4Config) -> DS4Config:
    """cfg with a draft module's blocks (draft: DS4Config.draft_layers) as more layers after its own."""
    return dataclasses.replace(cfg, n_layer=cfg.n_layer + draft.n_layer,
                               compress_ratios=cfg.compress_ratios + draft.compress_ratios,
                               swiglu_clamp=cfg.swiglu_clamp + draft.swiglu_clamp, version=ORIGINAL)


def _split_draft(cfg: DS4Config, tensors: dict) -> tuple[dict, dict]:
    """(the model's tensors, the draft's by our `mtp.S.*` names) of tensors planned by
    _after_layers: block n_layer + S is the draft's block S; its own tensors have our names."""
    model, main, draft = tensor_shapes(cfg), {}, {}
    for n, t in tensors.items():
        if n in model:
            main[n] = t
        elif n.startswith("blk."):
            _, layer, suffix = n.split(".", 2)
            draft[f"mtp.{int(layer) - cfg.n_layer}.{suffix}"] = t
        elif n.startswith("mtp."):
            draft[n] = t
    return main, draft


def own_shapes(cfg: DS4Config) -> dict[str, tuple[int, ...]]:
    """`mtp.0.*` name -> NumPy shape of the MTP's own tensors."""
    return {n: s for n, s in mtp_tensor_shapes(mtp_config(cfg)).items() if n[len(MTP_PREFIX):] in MTP_OWN}


def _with_progress(tensors: dict) -> dict:
    """The same tensors (Lazy or LazyBlocks), with one tick of a progress bar as each is read."""
    from ..console import progress

    bar = progress(desc="converting", total=len(tensors), unit="tensor")

    def ticking(lazy):
        inner, inner_rows = lazy._load, getattr(lazy, "_load_rows", None)

        def load():
            arr = inner()
            bar.update(1)
            return arr

        def load_rows(r0, r1):
            arr = inner_rows(r0, r1)
            if r1 == lazy.shape[0]:
                bar.update(1)
            return arr
        def parts():
            yield from inner_parts()
            bar.update(1)
        lazy._load = load
        if inner_rows is not None:
            lazy._load_rows = load_rows
        inner_parts = getattr(lazy, "_parts", None)
        if inner_parts is not None:
            lazy._parts = parts
        return lazy
    return {name: ticking(t) for name, t in tensors.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m ds4ref.convert",
                                 description="Convert a DeepSeek-V4 safetensors checkpoint to a deepseek4 GGUF.",
                                 formatter_class=HelpFormatter)
    ap.add_argument("--hf", required=True, help="directory with config.json and *.safetensors")
    ap.add_argument("--out", required=True, help="output .gguf path")
    ap.add_argument("--dtype", default="f32", choices=DTYPES,
                    help="stored type of matrices (1-D tensors stay f32; tid2eid is i32)")
    ap.add_argument("--mtp-out", default=None, metavar="FILE",
                    help="also write the checkpoint's MTP block (mtp.0.*) to FILE, as llama.cpp's MTP file "
                         "(its converter's --mtp); without it the block is left out")
    ap.add_argument("--dspark-out", default=None, metavar="FILE",
                    help="also write a DeepSeek-V4-Flash-0731 checkpoint's DSpark draft (mtp.0..2) to FILE, as "
                         "llama.cpp's dflash file (its converter's --dspark); without it the draft is left out")
    args = ap.parse_args(argv)
    try:
        cfg = convert(args.hf, args.out, args.dtype, args.mtp_out, args.dspark_out)
    except ConvertError as exc:
        raise SystemExit(f"convert: {exc}") from None
    print(f"wrote {args.out}: {cfg.n_layer} layers, {len(tensor_shapes(cfg))} tensors, dtype {args.dtype}, "
          f"DeepSeek-V4-Flash {cfg.version}")
    sources = scan_dir(Path(args.hf))
    if args.mtp_out:
        print(f"wrote {args.mtp_out}: its MTP block, as llama.cpp's MTP file")
    elif args.dspark_out:
        print(f"wrote {args.dspark_out}: its DSpark draft, as llama.cpp's dflash file")
    elif has_dspark(sources):
        print("left out the checkpoint's DSpark draft (mtp.0..2): --dspark-out FILE writes it")
    elif has_mtp(sources):
        print(f"left out the checkpoint's MTP block ({MTP_SRC}*): --mtp-out FILE writes it")

