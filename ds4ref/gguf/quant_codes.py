"""Block-quantised weights as integer codes: the one form every GGUF block type takes for the
exact integer products of official numerics (docs/exactness.md, section 2a). Weight [o, i] is
s1[o, b] * mul[o, h] * codes[o, i] - s2[o, b] * mn[o, h], b = i // 32 its block, h = i // 16
its 16-column half. A model-file concern (the weights layer builds these from a tensor's
bytes); the arithmetic over them is numerics/canon.py's and the kernels'.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

F32 = np.float32
QBLOCK, QHALF = 32, 16


@dataclass(frozen=True, eq=False)
class QuantCodes:
    """A block-quantised weight (N, K) in the one form every GGUF block type takes: weight
    [o, i] is s1[o, b] * mul[o, h] * codes[o, i] - s2[o, b] * mn[o, h], with b = i // 32 its
    block and h = i // 16 its 16-column half. Built by `quant_codes`."""
    codes: np.ndarray  # int8 (N, K)
    mul: np.ndarray    # int8 (N, K // 16)
    mn: np.ndarray     # int8 (N, K // 16)
    s1: np.ndarray     # float32 (N, K // 32)
    s2: np.ndarray     # float32 (N, K // 32)
    _views: dict = field(default_factory=dict, repr=False)  # rows(a, b) and the blocked layout, made once

    def __post_init__(self):
        n, k = self.codes.shape
        want = {"codes": (np.int8, (n, k)), "mul": (np.int8, (n, k // QHALF)), "mn": (np.int8, (n, k // QHALF)),
                "s1": (np.float32, (n, k // QBLOCK)), "s2": (np.float32, (n, k // QBLOCK))}
        for name, (dtype, shape) in want.items():
            a = getattr(self, name)
            if a.dtype != dtype or a.shape != shape or k % QBLOCK:
                raise ValueError(f"QuantCodes.{name} must be {np.dtype(dtype).name} {shape} "
                                 f"(K a multiple of {QBLOCK}), got {a.dtype} {a.shape}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    def rows(self, start: int, stop: int) -> "QuantCodes":
        """Weight rows start .. stop - 1 (the output projection's groups), kept with its layout."""
        key = (start, stop)
        if key not in self._views:
            self._views[key] = QuantCodes(*(a[start:stop] for a in (self.codes, self.mul, self.mn, self.s1, self.s2)))
        return self._views[key]


# ggml's tables: MXFP4's doubled E2M1 values (code 8 is +0), IQ2_XXS's sign patterns and grid
_MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


def _iq2xxs_tables() -> tuple[np.ndarray, np.ndarray]:
    """(grid int8 (256, 8): magnitudes 8, 25, 43; sign bits uint8 (128, 8): 1 = negative),
    from gguf-py's copy of ggml's iq2xxs_grid and ksigns_iq2xs."""
    from gguf.quants import IQ2_XXS
    IQ2_XXS.init_grid()
    grid = IQ2_XXS.grid.reshape(256, 8).astype(np.int8)
    ksigns = np.frombuffer(IQ2_XXS.ksigns, np.uint8)
    return grid, ((ksigns[:, None] >> np.arange(8, dtype=np.uint8)) & 1).astype(np.uint8)


def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian f16 from its 2 bytes (last axis), widened exactly to float32."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(F32)


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's get_scale_min_k4 for j = 0..7 over the 12 packed bytes (last axis): 6-bit
    scales and mins."""
    lo, hi, mix = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & 63, (mix & 15) | ((lo >> 6) << 4)], axis=-1)
    m = np.concatenate([hi & 63, (mix >> 4) | ((hi >> 6) << 4)], axis=-1)
    return sc, m


def _codes_q8_0(blk):
    return blk[..., 2:].view(np.int8), None, None, _f16(blk[..., 0:2]), None


def _codes_mxfp4(blk):
    e = blk[..., 0].astype(np.uint32)
    s1 = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23)).astype(np.uint32).view(F32)
    qs = blk[..., 1:]
    return _MXFP4_VALUES[np.concatenate([qs & 15, qs >> 4], axis=-1)], None, None, s1, None


def _codes_iq2_xxs(blk):
    grid, sign_bits = _iq2xxs_tables()
    n, nsb = blk.shape[:2]
    aux = np.ascontiguousarray(blk[..., 2:]).view(np.uint32).reshape(n, nsb, 8, 2)
    idx = np.ascontiguousarray(aux[..., 0]).view(np.uint8).reshape(n, nsb, 8, 4)
    sidx = (aux[..., 1, None] >> np.array([0, 7, 14, 21], np.uint32)) & 127
    neg = sign_bits[sidx]                                      # (n, nsb, 8, 4, 8)
    codes = np.where(neg == 1, -grid[idx], grid[idx])           # (n, nsb, 8 sub-blocks, 4 groups, 8)
    ls = (aux[..., 1] >> 28).astype(F32)
    s1 = (_f16(blk[..., 0:2])[..., None] * (F32(0.5) + ls)) * F32(0.25)  # gguf-py's db, same operations
    return codes.reshape(n, -1), None, None, s1.reshape(n, -1), None


def _codes_q2_k(blk):
    n, nsb = blk.shape[:2]
    scales, qs = blk[..., 0:16], blk[..., 16:80]
    q = (qs.reshape(n, nsb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)) & 3
    per_block = np.ones((1, 1, 8), F32)
    return (q.reshape(n, -1).astype(np.int8), scales & 15, scales >> 4,
            _f16(blk[..., 80:82])[..., None] * per_block, _f16(blk[..., 82:84])[..., None] * per_block)


def _codes_q4_k(blk):
    n, nsb = blk.shape[:2]
    sc, m = _scale_min_k4(blk[..., 4:16])
    qs = blk[..., 16:144]
    q = (qs.reshape(n, nsb, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & 15
    per_block = np.ones((1, 1, 8), F32)
    return (q.reshape(n, -1).astype(np.int8), np.repeat(sc, 2, axis=-1), np.repeat(m, 2, axis=-1),
            _f16(blk[..., 0:2])[..., None] * per_block, _f16(blk[..., 2:4])[..., None] * per_block)


# type -> (weights per block, bytes per block, decoder of (N, blocks, bytes) -> codes, mul, mn,
# s1, s2 per block (None: mul = 1, mn = 0, s2 = 0))
QUANT_TYPES = {"Q8_0": (32, 34, _codes_q8_0), "MXFP4": (32, 17, _codes_mxfp4),
               "IQ2_XXS": (256, 66, _codes_iq2_xxs), "Q2_K": (256, 84, _codes_q2_k),
               "Q4_K": (256, 144, _codes_q4_k)}


def quant_codes(qtype_name: str, raw: np.ndarray) -> QuantCodes:
    """The QuantCodes of a weight stored as GGUF blocks of `qtype_name` (one of QUANT_TYPES):
    raw uint8 (N, bytes per row), gguf-py's block layouts (docs/exactness.md)."""
    if qtype_name not in QUANT_TYPES:
        raise ValueError(f"quant_codes: {qtype_name} is not one of {sorted(QUANT_TYPES)}")
    per, size, decode = QUANT_TYPES[qtype_name]
    raw = np.asarray(raw)
    if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] % size:
        raise ValueError(f"quant_codes: {qtype_name} rows must be uint8 (N, a multiple of {size} bytes), "
                         f"got {raw.dtype} {raw.shape}")
    n, k = raw.shape[0], raw.shape[1] // size * per
    codes, mul, mn, s1, s2 = decode(raw.reshape(n, -1, size))
    ones, zeros = np.ones((n, k // QHALF), np.int8), np.zeros((n, k // QHALF), np.int8)

    def arr(a, default, dtype, cols):
        a = default if a is None else a
        return np.ascontiguousarray(np.asarray(a).reshape(n, cols), dtype)
    return QuantCodes(arr(codes, None, np.int8, k), arr(mul, ones, np.int8, k // QHALF),
                      arr(mn, zeros, np.int8, k // QHALF), arr(s1, None, F32, k // QBLOCK),
                      arr(s2, np.zeros((n, k // QBLOCK), F32), F32, k // QBLOCK))
