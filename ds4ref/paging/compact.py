"""Compact lossless storage of official-numerics KV and indexer rows (docs/paging.md).

In `official` numerics every stored KV row is an fp8sim output: each 64-dim block of
its non-RoPE dims is an E4M3FN value times a power of two. Every indexer row is a qat
output: each 32-dim block is an E2M1 value times a power of two. Storing the codes and
one exponent byte per block is therefore lossless; the RoPE tail stays float32.

The byte format is shared with the GPU side, so it is fixed:

  KV row      E4M3FN codes of dims 0..nope-1 | nope/64 exponent bytes | zero pad to 4 |
              n_rot RoPE dims, little-endian float32
  indexer row E2M1 codes, two per byte, low nibble = even index | Di/32 exponent bytes |
              zero pad to 4

An exponent byte is e + 127, the block's scale being 2^e, derived from the stored values
(not from fp8sim's own scale): amax = max(max|v|, floor), e = ceil(log2(amax / qmax)),
the division in float32, the ceil exact. The encoder decodes what it wrote and refuses,
naming the row and dim, any row that does not come back bit for bit.
"""
from __future__ import annotations

import math

import numba
import numpy as np

from ..numerics.grids import E2M1, E4M3FN

F32 = np.float32
KV_BLOCK, INDEX_BLOCK = 64, 32
KV_QMAX, INDEX_QMAX = F32(448.0), F32(6.0)
KV_FLOOR, INDEX_FLOOR = F32(1e-4), F32(7.052966104933725e-38)  # fp8sim's and qat's amax floors
EXP_BIAS = 127
E4M3FN_FORMAT = (-6, 3, 448.0, 0x80)  # smallest normal exponent, mantissa bits, max, sign code
E2M1_FORMAT = (0, 1, 6.0, 0x8)


def _pad4(n: int) -> int:
    return -(-n // 4) * 4


def kv_row_bytes(d: int, n_rot: int) -> int:
    nope = d - n_rot
    return _pad4(nope + nope // KV_BLOCK) + 4 * n_rot


def index_row_bytes(di: int) -> int:
    return _pad4(di // 2 + di // INDEX_BLOCK)


# ---- the per-value loops ---------------------------------------------------------------
# Numba, because every token writes one ring row per layer and reads the window back: as
# a dozen NumPy calls per row, compact storage cost 15% of the tiny model's decode step;
# with these loops the difference is within the noise (<1%).


@numba.njit(cache=True)
def _block_exponents(blocks, qmax, floor, e):
    """e = ceil(log2(max(amax, floor) / qmax)) per block (row of `blocks`), exactly:
    amax / qmax = f * 2^k with f in [0.5, 1), e = k if f > 0.5 else k - 1."""
    for i in range(blocks.shape[0]):
        amax = floor
        for j in range(blocks.shape[1]):
            amax = max(amax, abs(blocks[i, j]))
        f, k = math.frexp(np.float32(amax / qmax))  # the quotient rounded to float32
        e[i] = k if f > 0.5 else k - 1


@numba.njit(cache=True)
def _grid_codes(blocks, e, min_exp, mant, vmax, sign, codes):
    """Code of blocks[i] / 2^e[i] rounded to the nearest value of the format (smallest
    normal exponent, mantissa bits, largest value, sign code), ties to even. A tie, like
    any value off the grid, only happens in a row that the encoder then refuses."""
    for i in range(blocks.shape[0]):
        for j in range(blocks.shape[1]):
            x = math.ldexp(np.float64(blocks[i, j]), -e[i])
            a = min(abs(x), vmax) if x == x else vmax  # NaN, refused later
            binade = min_exp if a < 2.0 ** min_exp else math.frexp(a)[1] - 1  # subnormals: the lowest
            m = np.rint(math.ldexp(a, mant - binade))  # 2^(mant+1) steps carry into the next binade
            codes[i, j] = (binade - min_exp) * (1 << mant) + int(m) + (sign if math.copysign(1.0, x) < 0 else 0)


@numba.njit(cache=True)
def _grid_values(codes, exp_bytes, table, out):
    """table[code] * 2^e in float32 (exact: every stored value is a float32, subnormal or not)."""
    for i in range(codes.shape[0]):
        e = np.int32(exp_bytes[i]) - EXP_BIAS
        for j in range(codes.shape[1]):
            out[i, j] = np.float32(math.ldexp(np.float64(table[codes[i, j]]), e))


def _encode_blocks(blocks: np.ndarray, qmax, floor, fmt) -> tuple[np.ndarray, np.ndarray]:
    """float32 (n, block) -> codes uint8 (n, block), exponent bytes uint8 (n,)."""
    e = np.empty(blocks.shape[0], np.int32)
    _block_exponents(blocks, qmax, floor, e)
    codes = np.empty(blocks.shape, np.uint8)
    _grid_codes(blocks, e, *fmt, codes)
    # e + 127 is in 1..253 for every float32 block, finite or not (the floors bound it
    # below, the float32 maximum above), so the cast never wraps.
    return codes, (e + EXP_BIAS).astype(np.uint8)


def _decode_blocks(codes: np.ndarray, exp_bytes: np.ndarray, table: np.ndarray) -> np.ndarray:
    out = np.empty(codes.shape, F32)
    _grid_values(codes, exp_bytes.reshape(-1), table, out)
    return out


def _check_lossless(rows: np.ndarray, back: np.ndarray, what: str) -> None:
    bad = rows.view(np.uint32) != back.view(np.uint32)
    if bad.any():
        where = np.argwhere(bad)[0]
        row, dim = tuple(int(i) for i in where[:-1]), int(where[-1])
        name = f"{what} row" + ("" if not row else f" {row[0]}" if len(row) == 1 else f" {row}")
        raise ValueError(f"{name} dim {dim}: {float(rows[(*row, dim)])!r} is not a value of the "
                         f"official-numerics grid (it would be stored as {float(back[(*row, dim)])!r}); compact "
                         f"storage holds only official float32 rows")


def _blocks(a: np.ndarray, block: int) -> np.ndarray:
    """All blocks of `a`'s trailing dims as one contiguous (n, block) array (the loops' input)."""
    return np.ascontiguousarray(a).reshape(-1, block)


def _as_rows(rows: np.ndarray, width: int, what: str) -> np.ndarray:
    rows = np.asarray(rows)
    if rows.dtype != F32 or rows.ndim < 1 or rows.shape[-1] != width:
        raise ValueError(f"{what} rows must be float32 (..., {width}), got {rows.dtype} {rows.shape}")
    return np.ascontiguousarray(rows)


# ---- KV rows ------------------------------------------------------------------------


def encode_kv_rows(rows: np.ndarray, n_rot: int) -> np.ndarray:
    """float32 (..., D) fp8sim rows -> uint8 (..., kv_row_bytes(D, n_rot))."""
    d = np.shape(rows)[-1]
    rows = _as_rows(rows, d, "KV")
    nope = d - n_rot
    if nope % KV_BLOCK or n_rot < 0:
        raise ValueError(f"KV rows of {d} dims with {n_rot} RoPE dims: {nope} non-RoPE dims are not "
                         f"whole blocks of {KV_BLOCK}")
    lead, nb = rows.shape[:-1], nope // KV_BLOCK
    codes, exps = _encode_blocks(_blocks(rows[..., :nope], KV_BLOCK), KV_QMAX, KV_FLOOR, E4M3FN_FORMAT)
    out = np.zeros((*lead, kv_row_bytes(d, n_rot)), np.uint8)
    out[..., :nope] = codes.reshape(*lead, nope)
    out[..., nope:nope + nb] = exps.reshape(*lead, nb)
    out[..., out.shape[-1] - 4 * n_rot:] = rows[..., nope:].astype("<f4").view(np.uint8)
    _check_lossless(rows, decode_kv_rows(out, d, n_rot), "KV")
    return out


@numba.njit(cache=True)
def _kv_values(rows, nope, table, out):
    """out[i, :nope] = the E4M3FN codes of rows[i] times 2^(exponent byte - 127) per block
    (_grid_values over a row's own layout, one call for every row: rows are decoded every
    pass, so the per-call cost counts)."""
    for i in range(rows.shape[0]):
        for j in range(nope):
            e = np.int32(rows[i, nope + j // KV_BLOCK]) - EXP_BIAS
            out[i, j] = np.float32(math.ldexp(np.float64(table[rows[i, j]]), e))


def decode_kv_rows(data: np.ndarray, d: int, n_rot: int) -> np.ndarray:
    """uint8 (..., kv_row_bytes(D, n_rot)) -> float32 (..., D), exactly the encoded rows."""
    nope, lead = d - n_rot, data.shape[:-1]
    rows = np.ascontiguousarray(data).reshape(-1, data.shape[-1])
    out = np.empty((rows.shape[0], d), F32)
    _kv_values(rows, nope, E4M3FN, out)
    out[:, nope:] = rows[:, rows.shape[1] - 4 * n_rot:].copy().view("<f4")
    return out.reshape(*lead, d)


# ---- indexer rows -----------------------------------------------------------------------


def encode_index_rows(rows: np.ndarray) -> np.ndarray:
    """float32 (..., Di) qat rows -> uint8 (..., index_row_bytes(Di))."""
    di = np.shape(rows)[-1]
    rows = _as_rows(rows, di, "indexer")
    if di % INDEX_BLOCK:
        raise ValueError(f"indexer rows of {di} dims are not whole blocks of {INDEX_BLOCK}")
    lead, nb = rows.shape[:-1], di // INDEX_BLOCK
    codes, exps = _encode_blocks(_blocks(rows, INDEX_BLOCK), INDEX_QMAX, INDEX_FLOOR, E2M1_FORMAT)
    nibbles = codes.reshape(*lead, di)
    out = np.zeros((*lead, index_row_bytes(di)), np.uint8)
    out[..., :di // 2] = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    out[..., di // 2:di // 2 + nb] = exps.reshape(*lead, nb)
    _check_lossless(rows, decode_index_rows(out, di), "indexer")
    return out


def decode_index_rows(data: np.ndarray, di: int) -> np.ndarray:
    """uint8 (..., index_row_bytes(Di)) -> float32 (..., Di), exactly the encoded rows."""
    lead, nb = data.shape[:-1], di // INDEX_BLOCK
    packed = data[..., :di // 2]
    nibbles = np.stack([packed & 0xF, packed >> 4], axis=-1)  # low nibble first: the even dim
    values = _decode_blocks(_blocks(nibbles, INDEX_BLOCK), _blocks(data[..., di // 2:di // 2 + nb], 1), E2M1)
    return values.reshape(*lead, di)
