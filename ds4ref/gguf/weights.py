"""Weight access for the math: whole tensors and single routed experts.

The math asks for tensors by their GGUF name and gets NumPy arrays in the
shapes of ds4ref.gguf.tensors, already dequantised to one float dtype. Routed
expert tensors are large (25.8 GB per Flash layer in f32), so they are also
reachable one expert at a time; an implementation backed by a quantised file
dequantises only that expert's slice. A tensor stored in a GGUF block type
(quant_codes.QUANT_TYPES) is also reachable as its integer codes (quant_codes.QuantCodes),
which official float32 products take instead of the floats (docs/exactness.md).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Mapping

import numpy as np

from .config import DS4Config
from .quant_codes import QUANT_TYPES, QuantCodes, quant_codes
from .tensors import is_int_tensor, tensor_shapes

FLOAT_DTYPES = (np.float32, np.float64)


class WeightsError(ValueError):
    """A tensor is missing, has the wrong shape, or cannot be read."""


def check_float_dtype(dtype) -> type:
    dt = np.dtype(dtype).type
    if dt not in FLOAT_DTYPES:
        raise WeightsError(f"weights dtype must be float32 or float64, got {np.dtype(dtype).name}")
    return dt


def check_shapes(want: Mapping[str, tuple[int, ...]], found: Mapping[str, tuple[int, ...]], where: str,
                 error: type[ValueError] = WeightsError, noun: str = "tensor", whose: str | None = None) -> None:
    """Raise `error`, naming the tensor, when `found` (name -> NumPy shape) lacks a tensor of
    `want` or holds it in another shape; with `whose` ("the MTP block's"), also when `found`
    holds tensors beyond `want`."""
    for name, expected in want.items():
        if name not in found:
            raise error(f"{where}: missing {noun} {name!r} (expected NumPy shape {tuple(expected)})")
        shape = tuple(int(n) for n in found[name])
        if shape != tuple(expected):
            raise error(f"{where}: {noun} {name!r} has NumPy shape {shape}, expected {tuple(expected)}")
    extra = sorted(set(found) - set(want)) if whose is not None else []
    if extra:
        raise error(f"{where}: tensors that are not {whose}: {extra}")


def check_tensor_shapes(config: DS4Config, shapes: Mapping[str, tuple[int, ...]], where: str) -> None:
    """Raise unless every tensor the config needs is in `shapes` with its expected shape.

    Extra tensors are allowed: published files may carry more (e.g. MTP) than
    the main forward pass reads.
    """
    check_shapes(tensor_shapes(config), shapes, where)


def check_hash_routes(config: DS4Config, name: str, table: np.ndarray, where: str = "weights") -> None:
    """Refuse a hash-routing table (`blk.N.ffn_gate_tid2eid.weight`) that names an expert outside
    0..n_expert-1, or one expert twice for a token.

    Both backends read the table through Weights, so both refuse the same files at load: the
    GPU expert kernels list each chosen expert once per token (step_expert_list), so a repeat
    would drop a choice there while the reference would add it twice. Published tables hold
    distinct experts per token."""
    layer = name.split(".")[1] if name.startswith("blk.") else "?"
    ids = np.asarray(table)
    outside = (ids < 0) | (ids >= config.n_expert)
    if outside.any():
        tok, k = (int(i) for i in np.argwhere(outside)[0])
        raise WeightsError(f"{where}: layer {layer}'s hash routing table {name!r} sends token {tok} to expert "
                           f"{int(ids[tok, k])}, outside 0..{config.n_expert - 1}")
    ranked = np.sort(ids, axis=1)
    repeated = ranked[:, 1:] == ranked[:, :-1]
    tokens = np.flatnonzero(repeated.any(axis=1))
    if tokens.size:
        tok = int(tokens[0])
        expert = int(ranked[tok, 1:][repeated[tok]][0])
        raise WeightsError(f"{where}: layer {layer}'s hash routing table {name!r} sends token {tok} to expert "
                           f"{expert} twice; each token must name {ids.shape[1]} distinct experts")


class Weights(ABC):
    """Base class: caching and expert slicing on top of two loaders.

    Subclasses implement `_load(name)` (the whole tensor, any float or int
    dtype) and may override `_load_expert(name, e)` to avoid touching the
    other experts.
    """

    def __init__(self, config: DS4Config, dtype=np.float32, max_cached_experts: int | None = None):
        self.config = config
        self.dtype = check_float_dtype(dtype)
        self._shapes = tensor_shapes(config)
        self._cache: dict[str, np.ndarray] = {}
        self._codes: dict[str, QuantCodes | None] = {}
        # LRU (expert floats and codes), because all 256 experts of 43 Flash layers would not fit in memory.
        self._experts: OrderedDict[tuple, np.ndarray | QuantCodes] = OrderedDict()
        self.max_cached_experts = max_cached_experts

    # ---- what subclasses provide ----------------------------------------
    @abstractmethod
    def _load(self, name: str) -> np.ndarray:
        """The whole tensor as stored (any float or int dtype)."""

    def _load_expert(self, name: str, e: int) -> np.ndarray:
        return self._load(name)[e]

    @property
    def where(self) -> str:
        """What an error names as the weights' source."""
        return type(self).__name__

    def _stored_blocks(self, name: str) -> tuple[str, np.ndarray] | None:
        """(GGML type name, block bytes (*shape[:-1], bytes per row)) of a tensor stored in one
        of quant_codes.QUANT_TYPES; None for any other storage (floats in memory have no blocks)."""
        return None

    def names(self) -> list[str]:
        """Names of every tensor the model needs (all are present once constructed)."""
        return list(self._shapes)

    @abstractmethod
    def with_dtype(self, dtype) -> "Weights":
        """The same tensors read as another float dtype (shares the source, not the cache)."""

    # ---- the interface the math uses ------------------------------------
    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._shapes:
            raise WeightsError(f"unknown tensor {name!r} for this config")
        return self._shapes[name]

    def get(self, name: str) -> np.ndarray:
        """The whole tensor, `dtype` (int32 for tid2eid), NumPy shape from ds4ref.gguf.tensors.

        The returned array is read-only so that a caller cannot corrupt the cache.
        """
        arr = self._cache.get(name)
        if arr is None:
            shape = self.shape(name)  # unknown names fail here, before any loading
            arr = self._finish(name, self._load(name), shape)
            self._cache[name] = arr
        return arr

    def expert(self, name: str, e: int) -> np.ndarray:
        """Expert e's (out, in) matrix of a 3-D `*_exps.weight` tensor."""
        shape = self._expert_shape(name, e)
        if name in self._cache:  # the whole tensor is already resident: a view costs nothing
            return self._cache[name][e]
        return self._expert_cached((name, int(e)), lambda: self._finish(name, self._load_expert(name, e), shape[1:]))

    def codes(self, name: str) -> QuantCodes | None:
        """A 2-D tensor's QuantCodes when it is stored block-quantised (quant_codes.QUANT_TYPES), else None."""
        if name not in self._codes:
            shape = self.shape(name)
            stored = self._stored_blocks(name) if len(shape) == 2 else None
            self._codes[name] = None if stored is None else self._checked_codes(name, *stored, shape)
        return self._codes[name]

    def expert_codes(self, name: str, e: int) -> QuantCodes | None:
        """Expert e's QuantCodes of a 3-D `*_exps.weight` tensor stored block-quantised, else None."""
        shape = self._expert_shape(name, e)
        stored = self._stored_blocks(name)
        if stored is None:
            return None
        return self._expert_cached((name, int(e), "codes"),
                                   lambda: self._checked_codes(name, stored[0], stored[1][e], shape[1:]))

    def clear_cache(self) -> None:
        self._cache.clear()
        self._codes.clear()
        self._experts.clear()

    # ---- helpers -----------------------------------------------------------
    def _expert_shape(self, name: str, e: int) -> tuple[int, ...]:
        shape = self.shape(name)
        if len(shape) != 3:
            raise WeightsError(f"{name!r} is not a per-expert tensor (shape {shape})")
        if not 0 <= e < shape[0]:
            raise WeightsError(f"expert index {e} out of range 0..{shape[0] - 1} for {name!r}")
        return shape

    def _expert_cached(self, key: tuple, make):
        value = self._experts.get(key)
        if value is None:
            value = self._experts[key] = make()
            self._evict()
        else:
            self._experts.move_to_end(key)
        return value

    def check_hash_routes(self) -> None:
        """Read and check every hash-routing table (check_hash_routes): what the load calls,
        so a bad table is refused before serving, whichever backend runs it."""
        for name in self._shapes:
            if is_int_tensor(name):
                self.get(name)

    @staticmethod
    def _checked_codes(name: str, qtype_name: str, raw: np.ndarray, shape: tuple[int, ...]) -> QuantCodes:
        qc = quant_codes(qtype_name, raw)
        if qc.shape != tuple(shape):
            raise WeightsError(f"tensor {name!r}: {qtype_name} blocks decode to shape {qc.shape}, "
                               f"expected {tuple(shape)}")
        return qc

    def _evict(self) -> None:
        if self.max_cached_experts is None:
            return
        while len(self._experts) > self.max_cached_experts:
            self._experts.popitem(last=False)

    def _finish(self, name: str, arr: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        target = np.int32 if is_int_tensor(name) else self.dtype
        out = np.ascontiguousarray(arr, dtype=target)
        if out.shape != tuple(shape):
            raise WeightsError(f"tensor {name!r} loaded with shape {out.shape}, expected {tuple(shape)}")
        if is_int_tensor(name):
            check_hash_routes(self.config, name, out, self.where)
        if np.may_share_memory(out, arr):
            out = out.copy()  # never hand out a view of a caller's dict or of the memory map
        out.flags.writeable = False
        return out


class DictWeights(Weights):
    """In-memory weights, keyed by GGUF name (tests, converter, tiny model)."""

    def __init__(self, config: DS4Config, tensors: Mapping[str, np.ndarray], dtype=np.float32,
                 max_cached_experts: int | None = None):
        super().__init__(config, dtype, max_cached_experts)
        check_tensor_shapes(config, {k: np.shape(v) for k, v in tensors.items()}, "DictWeights")
        for name in self._shapes:
            if is_int_tensor(name) and not np.issubdtype(np.asarray(tensors[name]).dtype, np.integer):
                raise WeightsError(f"DictWeights: tensor {name!r} must hold integers, "
                                   f"got {np.asarray(tensors[name]).dtype}")
        self._tensors = dict(tensors)

    def _load(self, name: str) -> np.ndarray:
        return np.asarray(self._tensors[name])

    def _load_expert(self, name: str, e: int) -> np.ndarray:
        return np.asarray(self._tensors[name][e])

    def with_dtype(self, dtype) -> "DictWeights":
        return DictWeights(self.config, self._tensors, dtype, self.max_cached_experts)


class RenamedWeights(Weights):
    """A draft module's tensors under our names (`shapes`), read from a file that holds them
    under others (`names`: ours -> the file's): gguf.mtp's MTP block, gguf.dspark_file's draft."""

    def __init__(self, config: DS4Config, shapes: Mapping[str, tuple[int, ...]], source, names: Mapping[str, str],
                 dtype=np.float32, where: str = "draft") -> None:
        super().__init__(config, dtype)
        self._shapes = dict(shapes)
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
        """Bytes of the stored tensors it reads (a memory plan's share)."""
        return sum(self.source.tensor(n).n_bytes for n in set(self.names.values()))
