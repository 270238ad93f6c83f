"""Reading and writing deepseek4 GGUF files through the `gguf` package.

Reading memory-maps the file and parses only the header (with struct: see
_Header for why not gguf-py's GGUFReader), so a 150 GB model opens in
seconds; tensor bytes are touched when the math asks for a tensor, and
routed experts are dequantised one slice at a time. Dequantisation is
gguf-py's (gguf.quants), writing is gguf-py's GGUFWriter.

Writing follows the published convention of spec §2.1 for metadata types
(u32 counts, u64 context lengths, f32 scalars, bool, i32/f32 arrays) and
§2.2 for shapes: GGUF `ne` is the reverse of the NumPy shape.
"""
from __future__ import annotations

import math
import mmap
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import GGUFValueType as VType

from .config import ARCH, NEXTN_KEY, ConfigError, DS4Config
from .dspark import DFLASH_ARCH, LAYOUTS
from .finite import non_finite
from .metadata import MetadataError, check_tokenizer, check_types
from .tensors import has_in_file_mtp_block, is_int_tensor, tensor_shapes
from .quant_codes import QUANT_TYPES
from .weights import Weights, WeightsError, check_tensor_shapes


class GGUFError(WeightsError):
    """The file is not a deepseek4 GGUF that ds4ref can read (a ValueError)."""


GGML_MAX_DIMS = 4  # ggml tensors have at most four dimensions
_INT_TYPES = {QType.I8: np.int8, QType.I16: np.int16, QType.I32: np.int32, QType.I64: np.int64}

# Metadata keys whose GGUF type is not the default for their Python type (spec §2.1).
_KEY_TYPES: dict[str, tuple[VType, VType | None]] = {
    f"{ARCH}.context_length": (VType.UINT32, None),  # u32: llama.cpp refuses u64 here (config.KEYS)
    f"{ARCH}.rope.scaling.original_context_length": (VType.UINT32, None),
    f"{ARCH}.expert_gating_func": (VType.UINT32, None),
    f"{ARCH}.expert_weights_norm": (VType.BOOL, None),
    f"{ARCH}.attention.compress_ratios": (VType.ARRAY, VType.INT32),
    f"{ARCH}.swiglu_clamp_exp": (VType.ARRAY, VType.FLOAT32),
    "tokenizer.ggml.token_type": (VType.ARRAY, VType.INT32),
    f"{ARCH}.swiglu_clamp_shexp": (VType.ARRAY, VType.FLOAT32),
    f"{DFLASH_ARCH}.target_layers": (VType.ARRAY, VType.INT32),  # llama.cpp's converter writes i32
}


# ---------------------------------------------------------------------------
# quantisation helpers (shared by the writer, the tests and the converter)
# ---------------------------------------------------------------------------
def qtype_of(dtype: str | QType) -> QType:
    """'f32', 'f16', 'bf16', 'q8_0', ... -> GGMLQuantizationType."""
    if isinstance(dtype, QType):
        return dtype
    try:
        return QType[str(dtype).upper()]
    except KeyError:
        raise GGUFError(f"unknown tensor dtype {dtype!r} "
                        f"(use f32, f16, bf16, q8_0 or another GGML type name)") from None


@dataclass(frozen=True)
class StoredBlocks:
    """A tensor already in its stored form: GGML block bytes (rows of `data`) of type
    `qtype` for values of NumPy shape `shape`. write_gguf writes the bytes as they are:
    this is how types gguf-py cannot quantise to (Q2_K, Q4_K, IQ2_XXS) get into a file,
    and how FP4 checkpoints reach MXFP4 without a round trip through floats."""
    shape: tuple[int, ...]
    qtype: QType
    data: np.ndarray  # uint8, (*shape[:-1], bytes per row)

    def __post_init__(self):
        want = gguf.quants.quant_shape_to_byte_shape(self.shape, self.qtype)
        if tuple(self.data.shape) != tuple(want) or self.data.dtype != np.uint8:
            raise GGUFError(f"{self.qtype.name} blocks for shape {self.shape} must be uint8 {want}, "
                            f"got {self.data.dtype} {self.data.shape}")


def encode_tensor(name: str, arr: np.ndarray, dtype: str | QType) -> tuple[np.ndarray, QType]:
    """The bytes to store for `arr` as `dtype`, and the GGML type they are in."""
    if isinstance(arr, StoredBlocks):
        return arr.data, arr.qtype
    if is_int_tensor(name):
        return np.ascontiguousarray(arr, dtype=np.int32), QType.I32
    qtype = qtype_of(dtype)
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if qtype == QType.F32:
        return arr, qtype
    if qtype == QType.F16:
        return arr.astype(np.float16), qtype
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if arr.shape[-1] % block:
        raise GGUFError(f"tensor {name!r}: row length {arr.shape[-1]} is not a multiple of the "
                        f"{qtype.name} block size {block}")
    try:
        return gguf.quants.quantize(arr, qtype), qtype
    except NotImplementedError:
        raise GGUFError(f"tensor {name!r}: the gguf package cannot quantise to {qtype.name}") from None


def decode_tensor(name: str, data: np.ndarray, qtype: QType) -> np.ndarray:
    """Stored bytes -> float32 values (int32 for integer tensors), NumPy shape."""
    if qtype in _INT_TYPES:
        return np.asarray(data).view(_INT_TYPES[qtype])
    if qtype == QType.F64:
        return np.asarray(data).view(np.float64)
    try:
        return gguf.quants.dequantize(data, qtype)
    except NotImplementedError:
        raise GGUFError(f"tensor {name!r}: GGML type {qtype.name} ({int(qtype)}) cannot be dequantised "
                        f"by the gguf package") from None


def stored_values(arr: np.ndarray, dtype: str | QType, name: str = "tensor") -> np.ndarray:
    """What a reader will see after storing `arr` as `dtype` (float32)."""
    payload, qtype = encode_tensor(name, arr, dtype)
    return decode_tensor(name, payload, qtype)


def _can_dequantise(qtype: QType) -> bool:
    if qtype in _INT_TYPES or qtype in (QType.F32, QType.F16, QType.F64):
        return True
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    try:  # gguf.quants has no "is supported" query: try one block of zeros
        gguf.quants.dequantize(np.zeros((1, size), np.uint8), qtype)
        return True
    except NotImplementedError:
        return False


# ---------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------
class _Header:
    """A sequential reader of the GGUF header over a read-only mmap.

    gguf-py's GGUFReader builds a NumPy view per string, which for DS4's
    129280 tokens and 127741 merges takes over ten seconds and ~400 MB;
    plain struct reads of the same bytes take a fraction of a second. The
    layout follows the GGUF spec (little-endian, versions 2 and 3); the
    value and tensor type ids are gguf-py's enums.
    """

    _SCALARS = {VType.UINT8: "<B", VType.INT8: "<b", VType.UINT16: "<H", VType.INT16: "<h",
                VType.UINT32: "<I", VType.INT32: "<i", VType.FLOAT32: "<f", VType.BOOL: "<?",
                VType.UINT64: "<Q", VType.INT64: "<q", VType.FLOAT64: "<d"}
    _ARRAYS = {VType.UINT8: "<u1", VType.INT8: "<i1", VType.UINT16: "<u2", VType.INT16: "<i2",
               VType.UINT32: "<u4", VType.INT32: "<i4", VType.FLOAT32: "<f4", VType.BOOL: "?",
               VType.UINT64: "<u8", VType.INT64: "<i8", VType.FLOAT64: "<f8"}

    def __init__(self, buf: mmap.mmap):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str):
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise struct.error("string runs past the end of the file")
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        return raw.decode("utf-8")

    def value(self, vtype: int) -> tuple[Any, int, int | None]:
        """(python value, value type id, array element type id or None)."""
        vtype = VType(vtype)
        if vtype == VType.STRING:
            return self.string(), vtype, None
        if vtype in self._SCALARS:
            return self.unpack(self._SCALARS[vtype]), vtype, None
        if vtype != VType.ARRAY:
            raise ValueError(f"unknown metadata value type {int(vtype)}")
        sub, count = VType(self.unpack("<I")), self.unpack("<Q")
        if sub == VType.STRING:
            return [self.string() for _ in range(count)], vtype, sub
        if sub not in self._ARRAYS:
            raise ValueError(f"unsupported array element type {sub.name}")
        dt = np.dtype(self._ARRAYS[sub])
        if self.pos + count * dt.itemsize > len(self.buf):
            raise struct.error("array runs past the end of the file")
        arr = np.frombuffer(self.buf, dt, count, self.pos)
        self.pos += count * dt.itemsize
        return arr.tolist(), vtype, sub


@dataclass(frozen=True)
class _RawTensor:
    name: str
    type_id: int
    shape: tuple[int, ...]  # NumPy order
    rel_offset: int


def _parse(buf: mmap.mmap) -> tuple[dict[str, Any], dict[str, tuple[int, int | None]], list[_RawTensor], int]:
    """metadata, {key: (type, element type)}, tensor infos, end of the header."""
    h = _Header(buf)
    if buf[:4] != b"GGUF":
        raise GGUFError("not a GGUF file (bad magic)")
    h.pos = 4
    version = h.unpack("<I")
    if version not in (2, 3):
        raise GGUFError(f"GGUF version {version} is not supported (only 2 and 3, little-endian)")
    n_tensors, n_kv = h.unpack("<Q"), h.unpack("<Q")
    meta, types = {}, {}
    for _ in range(n_kv):
        key = h.string()
        value, vtype, sub = h.value(h.unpack("<I"))
        meta[key], types[key] = value, (vtype, sub)
    infos = []
    for _ in range(n_tensors):
        name = h.string()
        n_dims = h.unpack("<I")
        if n_dims > GGML_MAX_DIMS:
            raise GGUFError(f"tensor {name!r} has {n_dims} dimensions; GGUF allows at most {GGML_MAX_DIMS}")
        ne = [h.unpack("<Q") for _ in range(n_dims)]
        infos.append(_RawTensor(name, h.unpack("<I"), tuple(reversed(ne)), h.unpack("<Q")))
    return meta, types, infos, h.pos


def _data_start(meta: dict, header_end: int) -> int:
    """Where tensor data begins: the header's end rounded up to general.alignment."""
    align = meta.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
    if not 1 <= align <= 1 << 30 or align & (align - 1):  # its integer type is checked already
        raise GGUFError(f"general.alignment is {align}; it must be a power of two up to 2^30 "
                        f"(as llama.cpp requires; the default is {gguf.GGUF_DEFAULT_ALIGNMENT})")
    return -(-header_end // align) * align


def _plain_f32(v: float) -> float:
    # The shortest decimal that rounds to the stored f32 (1e-06, not 9.99999997e-07), so
    # a config written from Python floats reads back equal and matches config.json values.
    return float(str(np.float32(v)))


def _python_value(value: Any, vtype: int, sub: int | None) -> Any:
    if vtype == VType.FLOAT32:
        return _plain_f32(value)
    if vtype == VType.ARRAY and sub == VType.FLOAT32:
        return [_plain_f32(v) for v in value]
    return value


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the file's directory."""
    name: str
    qtype: QType
    shape: tuple[int, ...]   # NumPy shape of the values (reverse of GGUF ne)
    data: np.ndarray         # memory-mapped stored bytes/values, not yet dequantised
    offset: int
    n_bytes: int


class GGUFTensorFile:
    """An opened GGUF: metadata and the tensor directory, no model config (MTPFile)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._buf = _map(self.path)
        try:
            meta, self.value_types, infos, header_end = _parse(self._buf)
        except GGUFError as exc:
            raise GGUFError(f"{self.path}: {exc}") from None
        except (struct.error, UnicodeDecodeError, ValueError) as exc:
            raise GGUFError(f"{self.path}: cannot parse the GGUF header, the file is truncated or corrupt "
                            f"({type(exc).__name__}: {exc})") from None
        try:
            check_types(self.value_types)  # before any value is used
            data_start = _data_start(meta, header_end)
        except (MetadataError, GGUFError) as exc:
            raise GGUFError(f"{self.path}: {exc}") from None
        self.metadata: dict[str, Any] = {k: _python_value(v, *self.value_types[k]) for k, v in meta.items()}
        self._infos, self._data_start = infos, data_start
        self.tensors: dict[str, TensorEntry] = {}
        self._setup()
        for info in infos:
            if info.name in self.tensors:
                raise GGUFError(f"{self.path}: tensor {info.name!r} appears twice")
            self.tensors[info.name] = self._entry(info, data_start)
        self._check_tensors()

    def _setup(self) -> None:
        """What a subclass derives from the metadata before the tensors are listed."""

    def _check_tensors(self) -> None:
        """A subclass's checks of the tensor directory."""

    def tensor(self, name: str) -> TensorEntry:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: no tensor named {name!r}") from None

    def check_finite(self) -> None:
        """Refuse, naming the tensor, a file whose weights hold a NaN or an infinity, by the
        cheap check of gguf.finite (float tensors' values, block types' scales): a model
        that computes with them answers NaN, or dies mid-pass."""
        tensors = list(self.tensors.values())
        # NumPy releases the GIL in these scans, and one thread reads memory far slower than the
        # machine can: Flash's 80 GiB take seconds this way. The first bad tensor in file order is named.
        with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
            for t, where in zip(tensors, pool.map(lambda t: non_finite(t.qtype, t.shape, t.data), tensors)):
                if where is not None:
                    pool.shutdown(cancel_futures=True)
                    raise GGUFError(f"{self.path}: tensor {t.name!r} holds {where}: its weights are not finite "
                                    f"(a damaged or badly converted file)")

    def read(self, name: str) -> np.ndarray:
        """The whole tensor dequantised to float32 (int32 for integer tensors)."""
        t = self.tensor(name)
        return decode_tensor(name, t.data, t.qtype)

    def read_expert(self, name: str, e: int) -> np.ndarray:
        """One expert slice of a 3-D tensor, dequantising only that slice."""
        t = self.tensor(name)
        return decode_tensor(name, t.data[e], t.qtype)

    def _entry(self, info: _RawTensor, data_start: int) -> TensorEntry:
        known = {int(t) for t in QType}
        if info.type_id not in known:
            raise GGUFError(f"{self.path}: tensor {info.name!r} has GGML type id {info.type_id}, which the "
                            f"gguf package does not know; ds4ref cannot read it")
        qtype = QType(info.type_id)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        if info.shape and info.shape[-1] % block:
            raise GGUFError(f"{self.path}: tensor {info.name!r}: row length {info.shape[-1]} is not a multiple "
                            f"of the {qtype.name} block size {block}")
        n = math.prod(info.shape)  # Python ints: NumPy's int64 product wraps ([2^32, 2^32] -> 0)
        offset, n_bytes = data_start + info.rel_offset, n // block * size
        if offset + n_bytes > len(self._buf):
            raise GGUFError(f"{self.path}: file is truncated: tensor {info.name!r} needs bytes up to "
                            f"{offset + n_bytes}, the file has {len(self._buf)}")
        data = _view(self._buf, qtype, info.shape, offset, n)
        return TensorEntry(info.name, qtype, info.shape, data, offset, n_bytes)


class MTPFile(GGUFTensorFile):
    """A draft module's own GGUF: an MTP file (llama.cpp's or antirez's, read by gguf.mtp) or a
    DSpark draft (gguf.dspark_file), checked against its model by gguf.draft_target."""

    def __repr__(self) -> str:
        return f"MTPFile({self.path!r}, {len(self.tensors)} tensors)"


def check_float_types(model_file, names: Mapping[str, str], where: str, what: str,
                      error: type[ValueError]) -> None:
    """Raise `error` for a `what` draft tensor (`names`: ours -> the file's) stored as a type that
    is not a float type ds4ref dequantises."""
    for theirs in names.values():
        t = model_file.tensors.get(theirs)
        if t is None:
            continue
        if t.qtype in _INT_TYPES or not _can_dequantise(t.qtype):
            raise error(f"{where}: {what} tensor {theirs!r} is stored as {t.qtype.name}, which is not a "
                        f"float type ds4ref can dequantise")


class GGUFModelFile(GGUFTensorFile):
    """An opened deepseek4 GGUF: metadata, config and the tensor directory. `mtp_block`: the
    index of the MTP block it carries as its last block (ds4ref's former layout, gguf.mtp), else None."""

    def _setup(self) -> None:
        shapes = {t.name: t.shape for t in self._infos}
        try:
            effective, self.notes = effective_metadata(self.metadata, shapes)
        except GGUFError as exc:
            raise GGUFError(f"{self.path}: {exc}") from None
        self.config = _config_from(effective, self.path)
        nextn = self.metadata.get(NEXTN_KEY, 0)
        self.mtp_block = self.config.n_layer if nextn and has_in_file_mtp_block(shapes, self.config.n_layer) else None

    def __repr__(self) -> str:
        return f"GGUFModelFile({self.path!r}, {len(self.tensors)} tensors, {self.config.n_layer} layers)"

    def weights(self, dtype=np.float32, max_cached_experts: int | None = None) -> "GGUFWeights":
        return GGUFWeights(self, dtype, max_cached_experts)

    # ---- checks --------------------------------------------------------
    def _check_tensors(self) -> None:
        try:
            check_tensor_shapes(self.config, {n: t.shape for n, t in self.tensors.items()}, self.path)
        except WeightsError as exc:
            raise GGUFError(str(exc)) from None
        checked: dict[QType, bool] = {}
        for name in tensor_shapes(self.config):
            qtype = self.tensors[name].qtype
            if is_int_tensor(name) != (qtype in _INT_TYPES):
                kind = "integer" if is_int_tensor(name) else "float"
                raise GGUFError(f"{self.path}: tensor {name!r} holds {kind} values but is stored as {qtype.name}")
            if qtype not in checked:
                checked[qtype] = _can_dequantise(qtype)
            if not checked[qtype]:
                raise GGUFError(f"{self.path}: tensor {name!r} has GGML type {qtype.name} (id {int(qtype)}), "
                                f"which the gguf package cannot dequantise")


def _map(path: str) -> mmap.mmap:
    if not os.path.isfile(path):
        raise GGUFError(f"{path}: no such file")
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise GGUFError(f"{path}: empty file, not a GGUF file")
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


_VIEW_DTYPES = {QType.F32: np.float32, QType.F16: np.float16, QType.F64: np.float64, **_INT_TYPES}


def _view(buf: mmap.mmap, qtype: QType, shape: tuple[int, ...], offset: int, n: int) -> np.ndarray:
    """The stored data as a read-only array: values for plain types, bytes per row for quantised ones."""
    if qtype in _VIEW_DTYPES:
        return np.frombuffer(buf, _VIEW_DTYPES[qtype], n, offset).reshape(shape)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    byte_shape = (*shape[:-1], shape[-1] // block * size) if shape else (size,)
    return np.frombuffer(buf, np.uint8, n // block * size, offset).reshape(byte_shape)


def effective_metadata(meta: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> tuple[dict, list[str]]:
    """The metadata the config is built from, and one note per thing derived.

    llama.cpp's converter leaves two facts implicit that ds4ref's config names:
    * `vocab_size`: the length of `tokenizer.ggml.tokens` (llama.cpp's n_vocab), else
      the rows of `token_embd.weight`;
    * MTP blocks counted in `block_count`: with `nextn_predict_layers` = k, the last k
      blocks are MTP, but only when block `block_count-k` has its nextn projection
      (`nextn.e_proj`, or a fused `nextn.eh_proj`)
      (llama.cpp's loader rule: antirez's files say k = 1 and ship the MTP block in a
      separate file, so all their blocks are layers). MTP blocks are never run as layers
      (gguf.mtp reads them). A file of the MTP block alone (llama.cpp's MTP file: no
      `blk.0.attn_norm.weight`, its loader's test) is refused: it goes beside a model.
    """
    out, notes = dict(meta), []
    vkey = f"{ARCH}.vocab_size"
    if vkey not in out:
        tokens, emb = out.get("tokenizer.ggml.tokens"), shapes.get("token_embd.weight")
        if tokens is not None:
            out[vkey], source = len(tokens), "the length of tokenizer.ggml.tokens"
        elif emb:
            out[vkey], source = int(emb[0]), "the rows of token_embd.weight"
        else:
            raise GGUFError(f"missing GGUF metadata key {vkey!r}, and neither tokenizer.ggml.tokens nor "
                            f"token_embd.weight gives it")
        notes.append(f"vocab_size {out[vkey]} derived from {source} ({vkey} absent)")
    _skip_mtp_blocks(out, shapes, notes)
    return out, notes


def _skip_mtp_blocks(meta: dict, shapes: Mapping[str, tuple[int, ...]], notes: list[str]) -> None:
    nextn, bkey = meta.get(NEXTN_KEY, 0), f"{ARCH}.block_count"
    blocks = meta.get(bkey)
    if not nextn or not isinstance(blocks, int):
        return
    if nextn >= blocks:
        raise GGUFError(f"{NEXTN_KEY} is {nextn} with {bkey} {blocks}: no main layers would remain "
                        f"(an MTP-only file is not a model ds4ref can run)")
    main = blocks - nextn
    probe = f"blk.{main}.nextn.e_proj.weight (or nextn.eh_proj)"
    if has_in_file_mtp_block(shapes, main) and "blk.0.attn_norm.weight" not in shapes:
        raise GGUFError("this is an MTP file (llama.cpp's layout: the MTP block without the model's "
                        "layers), not a model: give it beside its model, ds4ref.load(MODEL, mtp=FILE) or "
                        "python -m ds4ref.serve --model MODEL --mtp FILE")
    if has_in_file_mtp_block(shapes, main):
        meta[bkey] = main
        which = f"block {main}" if nextn == 1 else f"blocks {main}..{blocks - 1}"
        notes.append(f"MTP {which} skipped ({NEXTN_KEY}={nextn}, {bkey}={blocks}): {main} layers run")
    else:
        notes.append(f"{NEXTN_KEY}={nextn} but no {probe}: the MTP block is not in this file, "
                     f"all {blocks} blocks are layers (llama.cpp's rule)")


def _config_from(meta: dict, path: str) -> DS4Config:
    layout = LAYOUTS.get(meta.get("general.architecture"))
    if layout is not None:
        raise GGUFError(f"{path}: this is a DSpark draft (DeepSeek-V4-Flash-0731's, {layout}), not a model: "
                        f"it drafts beside its model file")
    try:
        config = DS4Config.from_metadata(meta)
        check_tokenizer(meta, config.vocab_size)
    except (ConfigError, MetadataError, TypeError, ValueError) as exc:  # a check's own bug still names the file
        raise GGUFError(f"{path}: {exc}") from None
    return config


def open_gguf(path: str | os.PathLike) -> GGUFModelFile:
    """Open and check a deepseek4 GGUF file (header only; tensors stay on disk)."""
    return GGUFModelFile(path)


class GGUFWeights(Weights):
    """Weights read lazily from an opened GGUF file."""

    def __init__(self, model_file: GGUFModelFile, dtype=np.float32, max_cached_experts: int | None = None):
        super().__init__(model_file.config, dtype, max_cached_experts)
        self.file = model_file

    def _load(self, name: str) -> np.ndarray:
        return self.file.read(name)

    def _load_expert(self, name: str, e: int) -> np.ndarray:
        return self.file.read_expert(name, e)

    @property
    def where(self) -> str:
        return self.file.path

    def _stored_blocks(self, name: str) -> tuple[str, np.ndarray] | None:
        t = self.file.tensor(name)
        return (t.qtype.name, t.data) if t.qtype.name in QUANT_TYPES else None

    def qtype(self, name: str) -> QType:
        return self.file.tensor(name).qtype

    def with_dtype(self, dtype) -> "GGUFWeights":
        return GGUFWeights(self.file, dtype, self.max_cached_experts)


# ---------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------
def _value_type(key: str, value: Any) -> tuple[VType, VType | None]:
    if key in _KEY_TYPES:
        return _KEY_TYPES[key]
    arch, _, suffix = key.partition(".")
    if arch == DFLASH_ARCH and f"{ARCH}.{suffix}" in _KEY_TYPES:  # a DSpark draft: deepseek4's sizes as dflash.*
        return _KEY_TYPES[f"{ARCH}.{suffix}"]
    if isinstance(value, (list, tuple)):
        if not value:
            raise GGUFError(f"metadata key {key!r}: cannot write an empty array (its element type is unknown)")
        return VType.ARRAY, _value_type(key + "[]", value[0])[0]
    if isinstance(value, (bool, np.bool_)):
        return VType.BOOL, None
    if isinstance(value, (int, np.integer)):
        if 0 <= value < 1 << 32:
            return VType.UINT32, None
        return (VType.UINT64 if value >= 0 else VType.INT64), None
    if isinstance(value, (float, np.floating)):
        return VType.FLOAT32, None
    if isinstance(value, str):
        return VType.STRING, None
    raise GGUFError(f"metadata key {key!r}: cannot write a value of type {type(value).__name__}")


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def _add_metadata(writer: gguf.GGUFWriter, meta: Mapping[str, Any]) -> None:
    for key, value in meta.items():
        if key == "general.architecture":
            continue  # GGUFWriter writes it from its `arch` argument
        vtype, sub = _value_type(key, value)
        writer.add_key_value(key, _plain(value), vtype, sub)


def _tensor_order(config: DS4Config, names: Iterable[str]) -> list[str]:
    known = list(tensor_shapes(config))
    extra = sorted(set(names) - set(known))
    return known + extra


def write_gguf(path: str | os.PathLike, config: DS4Config, tensors: Mapping[str, Any],
               tokenizer_meta: Mapping[str, Any] | None = None,
               dtypes: Mapping[str, str] | None = None, default_dtype: str = "f32",
               extra_meta: Mapping[str, Any] | None = None) -> None:
    """Write a deepseek4 GGUF.

    `tensors` maps GGUF names to arrays in NumPy shape (anything with `.shape`
    that np.asarray accepts, so a caller may produce huge tensors one at a
    time). `dtypes` picks the stored type per tensor ("f32", "f16", "bf16",
    "q8_0", ...); integer tensors are always I32.
    """
    check_tensor_shapes(config, {k: tuple(v.shape) for k, v in tensors.items()}, "write_gguf")
    meta = dict(config.to_metadata())
    meta.update(tokenizer_meta or {})
    meta.update(extra_meta or {})
    ordered = {name: tensors[name] for name in _tensor_order(config, tensors)}
    write_tensor_file(path, meta, ordered, dtypes, default_dtype)


def write_tensor_file(path: str | os.PathLike, meta: Mapping[str, Any], tensors: Mapping[str, Any],
                      dtypes: Mapping[str, str] | None = None, default_dtype: str = "f32", arch: str = ARCH) -> None:
    """Write a GGUF of `meta` and `tensors` (a deepseek4 one unless `arch` says otherwise), in
    their order, checking neither against a config (write_gguf does for a model file, gguf.mtp
    for an MTP file, gguf.dspark_file for a DSpark draft)."""
    dtypes = dict(dtypes or {})
    writer = gguf.GGUFWriter(os.fspath(path), arch)
    try:
        _add_metadata(writer, meta)
        for name, value in tensors.items():  # tensor infos first: the header precedes all data
            qtype = _stored_qtype(name, value, dtypes.get(name, default_dtype))
            shape = tuple(value.shape)
            writer.add_tensor_info(name, shape, np.dtype(np.float32), _stored_nbytes(name, shape, qtype),
                                   raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, value in tensors.items():
            dtype = dtypes.get(name, default_dtype)
            parts = _stored_parts(name, value, dtype)
            if parts is not None:  # a part at a time: quant blocks never span rows or experts
                _write_rows(writer, parts)
                continue
            array = _materialise(value)
            payload, _ = encode_tensor(name, array, dtype)
            writer.write_tensor_data(payload)
            del payload, array  # one tensor in memory at a time
    finally:
        writer.close()


ROW_CHUNK = 4096  # rows converted at a time for large lazy tensors (a multiple of FP8's 128)
ROW_CHUNK_MIN_BYTES = 256 << 20


def _stored_parts(name: str, value: Any, dtype: str):
    """The stored bytes of a lazy tensor too big to convert whole, in order, else None:
    stored blocks expert by expert (`block_parts` of the converter's LazyBlocks), or float32
    row blocks (`row_chunks` of its Lazy) encoded one at a time."""
    if hasattr(value, "block_parts"):
        return value.block_parts()
    if not hasattr(value, "row_chunks") or 4 * math.prod(value.shape) < ROW_CHUNK_MIN_BYTES:
        return None
    rows = value.row_chunks(ROW_CHUNK)
    return None if rows is None else (encode_tensor(name, block, dtype)[0] for block in rows)


def _write_rows(writer, payloads) -> None:
    """writer.write_tensor_data for one tensor given as consecutive byte blocks. gguf's writer
    takes one array per tensor; this is its body with the array written in parts, back to
    back (the alignment padding goes before the first part and after the last, as for one)."""
    file_id = next(i for i, infos in enumerate(writer.tensors) if infos)
    fout = writer.fout[file_id]
    info = writer.tensors[file_id].pop(next(iter(writer.tensors[file_id])))
    writer.write_padding(fout, fout.tell())
    written = 0
    for part in payloads:
        np.ascontiguousarray(part).tofile(fout)
        written += part.nbytes
    if written != info.nbytes:
        raise GGUFError(f"tensor data of {written} bytes written in parts, its header says {info.nbytes}")
    writer.write_padding(fout, written)
    writer.state = gguf.gguf_writer.WriterState.WEIGHTS


def _materialise(value: Any) -> "StoredBlocks | np.ndarray":
    """A tensor's values now: StoredBlocks as they are, a lazy source of blocks (anything with
    `stored_blocks()` and `qtype`, as the converter's FP4 experts) loaded, else np.asarray."""
    if isinstance(value, StoredBlocks):
        return value
    if hasattr(value, "stored_blocks"):
        return value.stored_blocks()
    return np.asarray(value)


def _stored_qtype(name: str, value: Any, dtype: str) -> QType:
    if isinstance(value, StoredBlocks) or hasattr(value, "stored_blocks"):
        return value.qtype
    return QType.I32 if is_int_tensor(name) else qtype_of(dtype)


def _stored_nbytes(name: str, shape: tuple[int, ...], qtype: QType) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = math.prod(int(d) for d in shape)
    if shape and shape[-1] % block:
        raise GGUFError(f"tensor {name!r}: row length {shape[-1]} is not a multiple of the "
                        f"{qtype.name} block size {block}")
    return n // block * size
