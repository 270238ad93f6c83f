"""Device weight layouts, on the host: the weight types the kernels read (WTYPES, the GGUF
BLOCK_QUANTS dequantised in registers), bf16 and Q8_0 encodings, DeviceWeight (a matrix on the
device and its type) and pack_qrows, the row layout the quantised products read
(device_weights.py uploads in it)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .buffers import DeviceBuffer
from .runtime import Runtime

F32 = np.float32
WTYPES = ("f32", "f16", "bf16", "q8_0", "q2_k", "q4_k", "iq2_xxs", "mxfp4")
# GGUF block quants the kernels dequantise in registers: (bytes, weights) per block
BLOCK_QUANTS = {"q8_0": (34, 32), "q2_k": (84, 256), "q4_k": (144, 256), "iq2_xxs": (66, 256), "mxfp4": (17, 32)}
K_QUANTS = ("q2_k", "q4_k", "iq2_xxs", "mxfp4")  # rows per warp 1 or 2


class UnsupportedShapeError(ValueError):
    """A kernel's shape limit was exceeded; the message names the limit."""


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise UnsupportedShapeError(msg)


# ---------------------------------------------------------------------------
# 16-bit and Q8_0 weight encodings (host side, for tests and the benchmark)
# ---------------------------------------------------------------------------


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round f32 to bf16 (nearest, ties to even) as raw uint16."""
    u = np.ascontiguousarray(x, dtype=F32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(F32)


def quantize_q8_0(w: np.ndarray) -> np.ndarray:
    """(N, K) f32 -> (N, K/32*34) uint8 Q8_0 rows: f16 scale amax/127, then 32 int8."""
    n, k = w.shape
    if k % 32:
        raise UnsupportedShapeError(f"Q8_0 needs K % 32 == 0, got K={k}")
    blk = w.reshape(n, k // 32, 32).astype(F32)
    d = (np.max(np.abs(blk), axis=-1) / 127.0).astype(np.float16)
    dinv = np.where(d == 0, 0.0, 1.0 / np.where(d == 0, 1, d.astype(F32)))
    q = np.clip(np.rint(blk * dinv[..., None]), -127, 127).astype(np.int8)
    out = np.empty((n, k // 32, 34), dtype=np.uint8)
    out[..., :2] = d.view(np.uint8).reshape(n, k // 32, 2)
    out[..., 2:] = q.view(np.uint8)
    return out.reshape(n, k // 32 * 34)


def dequantize_q8_0(raw: np.ndarray) -> np.ndarray:
    n = raw.shape[0]
    blk = raw.reshape(n, -1, 34)
    d = blk[..., :2].copy().view(np.float16).astype(F32)  # (n, nb, 1)
    q = blk[..., 2:].view(np.int8).astype(F32)
    return (d * q).reshape(n, -1)


def dequantize(w: np.ndarray, wtype: str) -> np.ndarray:
    """Host f32 copy of a weight in any supported encoding (the reference's W)."""
    if wtype == "f32":
        return np.asarray(w, F32)
    if wtype == "f16":
        return np.asarray(w, np.float16).astype(F32)
    if wtype == "bf16":
        return bf16_bits_to_f32(w)
    if wtype == "q8_0":
        return dequantize_q8_0(w)
    if wtype in BLOCK_QUANTS:  # gguf-py's dequantisation is the reference's
        from gguf import GGMLQuantizationType, quants
        return quants.dequantize(np.ascontiguousarray(w, np.uint8), GGMLQuantizationType[wtype.upper()])
    raise UnsupportedShapeError(f"weight type {wtype!r} is not one of {WTYPES}")


def _wtype_of(w: np.ndarray, wtype: str | None) -> str:
    if wtype is not None:
        if wtype not in WTYPES:
            raise UnsupportedShapeError(f"weight type {wtype!r} is not one of {WTYPES}")
        return wtype
    if w.dtype == F32:
        return "f32"
    if w.dtype == np.float16:
        return "f16"
    raise UnsupportedShapeError(f"weight dtype {w.dtype} needs an explicit wtype ('bf16' for uint16 bits, "
                                f"'q8_0' for uint8 blocks)")


def weight_cols(w: np.ndarray, wtype: str) -> int:
    if wtype in BLOCK_QUANTS:
        nbytes, per = BLOCK_QUANTS[wtype]
        return w.shape[-1] // nbytes * per
    return w.shape[-1]


# ---------------------------------------------------------------------------
# Batched matvec and the grouped output projection
# ---------------------------------------------------------------------------


@dataclass
class DeviceWeight:
    buf: DeviceBuffer
    wtype: str
    rows: int
    cols: int
    packed: bool = False  # rows in pack_qrows' layout (the quantised products' kernels read only those)

    @classmethod
    def upload(cls, rt: Runtime, w: np.ndarray, wtype: str | None = None) -> "DeviceWeight":
        wt = _wtype_of(w, wtype)
        k = weight_cols(w, wt)
        block = BLOCK_QUANTS.get(wt, (0, 8))[1]
        _need(k % block == 0, f"matvec: K={k} must be a multiple of {block} for {wt}")
        return cls(rt.upload(np.ascontiguousarray(w)), wt, int(np.prod(w.shape[:-1])), k)


# ---------------------------------------------------------------------------
# Quantised products (qdot.hip): official numerics' products with block-quantised weights,
# int8 activations and exact integer block dots (canon.quantize_q8, canon.qlinear)
# ---------------------------------------------------------------------------
QUANT_WTYPES = tuple(BLOCK_QUANTS)


def packed_row_bytes(wtype: str, K: int) -> int:
    """Bytes per row of K weights in pack_qrows' layout (a multiple of 16 for the repacked types)."""
    nbytes, per = BLOCK_QUANTS[wtype]
    if wtype == "q4_k":
        return K // per * nbytes
    body = {"q8_0": K + K // 16, "iq2_xxs": K // 4 + K // 128, "mxfp4": K // 2 + K // 32,
            "q2_k": K // 4 + K // 16 + K // 64}[wtype]
    return -(-body // 16) * 16


def pack_qrows(wtype: str, raw: np.ndarray) -> np.ndarray:
    """GGUF rows (rows, row bytes) uint8 -> the layout qdot.hip reads, where a lane's 32-column
    block is one aligned load: Q8_0 [K int8 codes in runs of 32 blocks, each run's first 16 codes
    of every block, then their last 16 (q8_run_halves)][K/32 f16 d], IQ2_XXS [K/32 x 8-byte
    sub-blocks][K/256 f16 d], MXFP4 [K/32 x 16 code bytes][K/32 E8M0 bytes], Q2_K
    [K/32 x 8 code bytes (q2k_block_codes)][K/16 scale bytes][K/256 x f16 d, f16 dmin], each row
    padded to 16 bytes. Q4_K keeps the file's super-blocks (16-byte aligned already). Every
    byte of the file is kept (unpack_q2k_rows inverts the Q2_K layout)."""
    raw = np.ascontiguousarray(raw, np.uint8)
    rows = raw.shape[0]
    K = weight_cols(raw, wtype)
    if wtype == "q4_k":
        return raw
    nbytes, per = BLOCK_QUANTS[wtype]
    blk = raw.reshape(rows, K // per, nbytes)
    if wtype == "q2_k":
        parts = [q2k_block_codes(blk[..., 16:80]).reshape(rows, -1), blk[..., :16].reshape(rows, -1),
                 blk[..., 80:84].reshape(rows, -1)]
    else:
        head = {"q8_0": 2, "iq2_xxs": 2, "mxfp4": 1}[wtype]  # the block's scale bytes come first
        codes = q8_run_halves(blk[..., head:]) if wtype == "q8_0" else blk[..., head:]
        parts = [codes.reshape(rows, -1), blk[..., :head].reshape(rows, -1)]
    body = np.concatenate(parts, axis=1)
    out = np.zeros((rows, packed_row_bytes(wtype, K)), np.uint8)
    out[:, :body.shape[1]] = body
    return out


def q8_run_halves(codes: np.ndarray, inverse: bool = False) -> np.ndarray:
    """Q8_0 codes (rows, blocks, 32) -> (rows, blocks * 32) in runs of 32 blocks (the last run
    shorter), each run's first halves (16 codes a block) before its second halves: the order
    ds4_qblock.h's q8_half reads. inverse: the same run order back to (rows, blocks, 32)."""
    codes = np.asarray(codes, np.uint8)
    rows = codes.shape[0]
    nb = codes.size // (rows * 32)
    flat = codes.reshape(rows, nb * 32)
    out = np.empty_like(flat)
    for b0 in range(0, nb, 32):
        m = min(32, nb - b0)
        run = flat[:, b0 * 32:(b0 + m) * 32]
        out[:, b0 * 32:(b0 + m) * 32] = (run.reshape(rows, 2, m, 16) if inverse else
                                         run.reshape(rows, m, 2, 16)).swapaxes(1, 2).reshape(rows, -1)
    return out.reshape(rows, nb, 32) if inverse else out


def q2k_block_codes(qs: np.ndarray) -> np.ndarray:
    """Q2_K's qs bytes (..., 64) of each super-block -> (..., 8 blocks, 8 bytes): block j's 32
    2-bit codes on their own, so a lane reads 8 bytes instead of the 32 its block shares with
    three others. Byte 4w + e of a block holds the codes of its columns 16w + 4s + e at bits
    2s (s < 4): the block's code word k (columns 4k .. 4k + 3, one per byte, as dp4a takes them)
    is (word k/4 >> 2(k%4)) & 0x03030303. In the file, column l of block j = 4u + s is bits 2s of
    qs[32u + l]."""
    qs = np.asarray(qs, np.uint8)
    lead = qs.shape[:-1]
    # codes[..., j, l]: block j = 4u + s, column l
    codes = (qs.reshape(*lead, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)) & 3
    codes = codes.reshape(*lead, 8, 2, 4, 4)  # (block, w, s, e): column 16w + 4s + e
    out = np.zeros((*lead, 8, 2, 4), np.uint8)  # (block, w, e)
    for s in range(4):
        out |= codes[..., :, :, s, :] << (2 * s)
    return out.reshape(*lead, 8, 8)


def unpack_q2k_rows(packed: np.ndarray, K: int) -> np.ndarray:
    """pack_qrows' Q2_K rows (rows, packed_row_bytes) -> the file's rows (rows, K/256 * 84)."""
    packed = np.ascontiguousarray(packed, np.uint8)
    rows, nsb = packed.shape[0], K // 256
    cb = packed[:, :K // 4].reshape(rows, nsb, 8, 2, 4)  # (super-block, block, w, e)
    codes = (cb[..., None, :] >> (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)) & 3  # (.., w, s, e)
    codes = codes.reshape(rows, nsb, 2, 4, 32)  # (u, s, l): block 4u + s, column l
    qs = np.zeros((rows, nsb, 2, 32), np.uint8)
    for s in range(4):
        qs |= codes[:, :, :, s, :] << (2 * s)
    scales = packed[:, K // 4:K // 4 + K // 16].reshape(rows, nsb, 16)
    dd = packed[:, K // 4 + K // 16:K // 4 + K // 16 + K // 64].reshape(rows, nsb, 4)
    return np.concatenate([scales, qs.reshape(rows, nsb, 64), dd], axis=2).reshape(rows, -1)
