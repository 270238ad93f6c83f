"""The official DeepSeek V4 checkpoint's quantised weights, decoded without torch.

* FP8 dense weights: F8_E4M3 (E4M3FN) values `[out, in]` with one scale per 128x128 block,
  `X.scale` `[ceil(out/128), ceil(in/128)]` as E8M0 (official) or `X.weight_scale_inv` as
  float (transformers' FP8 layout); value = e4m3 * scale (the scale is a multiplier despite
  the name `scale_inv`, as in DeepSeek's `weight_dequant`).
* FP4 routed experts: int8 `[out, in/2]`, two E2M1 codes a byte, low nibble = even input
  index, and `X.scale` E8M0 `[out, in/32]`; value = e2m1[code] * 2^(e-127).

NumPy has no 8- or 4-bit float types, so the three decoders are 256/16-entry tables built
here from the format definitions (hand-written; torch's float8 types are the test oracle).

FP4 -> MXFP4 is lossless: ggml's MXFP4 block is one E8M0 byte then 16 bytes with element j
in the low and j+16 in the high nibble, its codes index the same E2M1 order (ggml stores the
doubled values 0,1,2,3,4,6,8,12 and halves the scale), so only the nibbles move
(`fp4_to_mxfp4`; llama.cpp's converter does the same). An E8M0 byte 255 (NaN) has no MXFP4
equivalent and is refused.
"""
from __future__ import annotations

import numpy as np

from ..numerics.grids import E2M1, E4M3FN as E4M3

FP8_BLOCK = 128   # rows and columns per FP8 scale
FP4_GROUP = 32    # values per FP4 scale (one MXFP4 block)
E8M0 = np.where(np.arange(256) == 255, np.nan, 2.0 ** (np.arange(256) - 127.0)).astype(np.float32)


class QuantError(ValueError):
    """Scales or codes that do not describe finite values."""


def block_scales(scale: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """One scale per 128x128 block expanded to `shape` (edge blocks may be partial)."""
    rows, cols = shape
    return np.repeat(np.repeat(scale, FP8_BLOCK, 0)[:rows], FP8_BLOCK, 1)[:, :cols]


def decode_scales(raw: np.ndarray, dtype: str) -> np.ndarray:
    """E8M0 bytes -> float32 powers of two; float scales as they are (float32)."""
    return E8M0[raw] if dtype == "F8_E8M0" else raw.astype(np.float32)


def dequantise_fp8(codes: np.ndarray, scale: np.ndarray, name: str) -> np.ndarray:
    """float32 values of an E4M3 `[out, in]` weight and its float block scales."""
    rows, cols = codes.shape
    want = (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
    if scale.shape != want:
        raise QuantError(f"tensor {name!r}: FP8 scales have shape {scale.shape}, expected {want} (128x128 blocks)")
    values = E4M3[codes] * block_scales(scale, codes.shape)  # exact: a power-of-two or f32 multiply per value
    if not np.isfinite(values).all():
        raise QuantError(f"tensor {name!r}: FP8 codes or scales are NaN/inf")
    return values


def fp4_values(packed: np.ndarray, scale_bytes: np.ndarray) -> np.ndarray:
    """float64 values of FP4 `[out, in/2]` codes with E8M0 `[out, in/32]` scales (the oracle of the repack)."""
    lo, hi = packed & 0xF, packed >> 4
    codes = np.stack([lo, hi], -1).reshape(packed.shape[0], -1)
    return E2M1[codes].astype(np.float64) * np.repeat(2.0 ** (scale_bytes.astype(np.float64) - 127), FP4_GROUP, 1)


def fp4_to_mxfp4(packed: np.ndarray, scale_bytes: np.ndarray, name: str) -> np.ndarray:
    """ggml MXFP4 block bytes `[out, in/32*17]` holding exactly the FP4 weight's values."""
    packed, scale_bytes = packed.view(np.uint8), scale_bytes.view(np.uint8)
    rows, half = packed.shape
    groups = half * 2 // FP4_GROUP
    if half * 2 % FP4_GROUP or scale_bytes.shape != (rows, groups):
        raise QuantError(f"tensor {name!r}: FP4 codes {packed.shape} and scales {scale_bytes.shape} do not "
                         f"describe groups of {FP4_GROUP}")
    if (scale_bytes == 255).any():
        raise QuantError(f"tensor {name!r}: an E8M0 scale is 255 (NaN), which MXFP4 cannot hold")
    src = packed.reshape(rows, groups, FP4_GROUP // 2)
    codes = np.stack([src & 0xF, src >> 4], -1).reshape(rows, groups, FP4_GROUP)  # element order
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return np.concatenate([scale_bytes[..., None], qs], -1).reshape(rows, groups * 17).astype(np.uint8)
