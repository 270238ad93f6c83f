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

import numpy as np

F32 = np.float32
KV_BLOCK, INDEX_BLOCK = 64, 32
KV_QMAX, INDEX_QMAX = F32(448.0), F32(6.0)
KV_FLOOR, INDEX_FLOOR = F32(1e-4), F32(7.052966104933725e-38)  # fp8sim's and qat's amax floors
EXP_BIAS = 127


def _e4m3fn_table() -> np.ndarray:
    """Value of every E4M3FN code (bias 7, subnormals m * 2^-9, 0x7F and 0xFF NaN)."""
    code = np.arange(256)
    exp, mant = (code >> 3) & 0xF, code & 7
    mag = np.where(exp == 0, mant * 2.0 ** -9, (8 + mant) * 2.0 ** (exp - 10))
    val = np.where(code & 0x80, -mag, mag)
    val[[0x7F, 0xFF]] = np.nan
    return val.astype(F32)


E4M3FN = _e4m3fn_table()
E4M3FN_FORMAT = (-6, 3, 448.0, 0x80)  # min normal exponent, mantissa bits, max, sign code
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6] + [-0.0, -0.5, -1, -1.5, -2, -3, -4, -6], F32)
E2M1_FORMAT = (0, 1, 6.0, 0x8)


def _pad4(n: int) -> int:
    return -(-n // 4) * 4


def kv_row_bytes(d: int, n_rot: int) -> int:
    nope = d - n_rot
    return _pad4(nope + nope // KV_BLOCK) + 4 * n_rot


def index_row_bytes(di: int) -> int:
    return _pad4(di // 2 + di // INDEX_BLOCK)


# ---- the shared pieces -----------------------------------------------------------


def block_exponents(blocks: np.ndarray, qmax: np.float32, floor: np.float32) -> np.ndarray:
    """e = ceil(log2(max(amax, floor) / qmax)) per block (last axis), exactly, as int32."""
    amax = np.maximum(np.max(np.abs(blocks), axis=-1), floor)
    f, k = np.frexp(amax / qmax)
    return np.where(f > 0.5, k, k - 1).astype(np.int32)


def _exponent_bytes(e: np.ndarray) -> np.ndarray:
    # Only a row that is refused below can have e outside 1 - 127 .. 255 - 127.
    return np.clip(e + EXP_BIAS, 0, 255).astype(np.uint8)


def _grid_codes(blocks: np.ndarray, e: np.ndarray, fmt: tuple[int, int, float, int]) -> np.ndarray:
    """Codes of blocks / 2^e rounded to the nearest value of the format (min normal
    exponent, mantissa bits, largest value, sign code), ties to even. A tie, like any value
    off the grid, only happens in a row that the encoder then refuses."""
    min_exp, mant, qmax, sign = fmt
    with np.errstate(over="ignore", invalid="ignore"):
        x = np.ldexp(blocks, -e[..., None])
        a = np.fmin(np.abs(x), qmax)  # fmin: NaN -> qmax, refused later
        exp = np.where(a < 2.0 ** min_exp, min_exp, np.frexp(a)[1] - 1)  # the binade (subnormals: the lowest)
        m = np.rint(np.ldexp(a, mant - exp))  # steps of 2^(exp - mant); 2^(mant+1) carries into the next binade
        code = (exp - min_exp) * (1 << mant) + m
    return (code.astype(np.int32) + np.where(np.signbit(x), sign, 0)).astype(np.uint8)


def _decode_blocks(codes: np.ndarray, exp_bytes: np.ndarray, table: np.ndarray) -> np.ndarray:
    e = exp_bytes.astype(np.int32) - EXP_BIAS
    with np.errstate(over="ignore"):
        return np.ldexp(table[codes], e[..., None]).astype(F32)


def _check_lossless(rows: np.ndarray, back: np.ndarray, what: str) -> None:
    bad = rows.view(np.uint32) != back.view(np.uint32)
    if bad.any():
        where = np.argwhere(bad)[0]
        row, dim = tuple(int(i) for i in where[:-1]), int(where[-1])
        row_name = row[0] if len(row) == 1 else row
        raise ValueError(f"{what} row {row_name} dim {dim}: {float(rows[(*row, dim)])!r} is not a value of the "
                         f"official-numerics grid (it would be stored as {float(back[(*row, dim)])!r}); compact "
                         f"storage holds only official float32 rows")


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
    blocks = rows[..., :nope].reshape(*lead, nb, KV_BLOCK)
    e = block_exponents(blocks, KV_QMAX, KV_FLOOR)
    out = np.zeros((*lead, kv_row_bytes(d, n_rot)), np.uint8)
    out[..., :nope] = _grid_codes(blocks, e, E4M3FN_FORMAT).reshape(*lead, nope)
    out[..., nope:nope + nb] = _exponent_bytes(e)
    out[..., out.shape[-1] - 4 * n_rot:] = rows[..., nope:].astype("<f4").view(np.uint8)
    _check_lossless(rows, decode_kv_rows(out, d, n_rot), "KV")
    return out


def decode_kv_rows(data: np.ndarray, d: int, n_rot: int) -> np.ndarray:
    """uint8 (..., kv_row_bytes(D, n_rot)) -> float32 (..., D), exactly the encoded rows."""
    nope, lead = d - n_rot, data.shape[:-1]
    nb = nope // KV_BLOCK
    out = np.empty((*lead, d), F32)
    codes = data[..., :nope].reshape(*lead, nb, KV_BLOCK)
    out[..., :nope] = _decode_blocks(codes, data[..., nope:nope + nb], E4M3FN).reshape(*lead, nope)
    out[..., nope:] = np.ascontiguousarray(data[..., data.shape[-1] - 4 * n_rot:]).view("<f4")
    return out


# ---- indexer rows -----------------------------------------------------------------------


def encode_index_rows(rows: np.ndarray) -> np.ndarray:
    """float32 (..., Di) qat rows -> uint8 (..., index_row_bytes(Di))."""
    di = np.shape(rows)[-1]
    rows = _as_rows(rows, di, "indexer")
    if di % INDEX_BLOCK:
        raise ValueError(f"indexer rows of {di} dims are not whole blocks of {INDEX_BLOCK}")
    lead, nb = rows.shape[:-1], di // INDEX_BLOCK
    blocks = rows.reshape(*lead, nb, INDEX_BLOCK)
    e = block_exponents(blocks, INDEX_QMAX, INDEX_FLOOR)
    nibbles = _grid_codes(blocks, e, E2M1_FORMAT).reshape(*lead, di)
    out = np.zeros((*lead, index_row_bytes(di)), np.uint8)
    out[..., :di // 2] = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    out[..., di // 2:di // 2 + nb] = _exponent_bytes(e)
    _check_lossless(rows, decode_index_rows(out, di), "indexer")
    return out


def decode_index_rows(data: np.ndarray, di: int) -> np.ndarray:
    """uint8 (..., index_row_bytes(Di)) -> float32 (..., Di), exactly the encoded rows."""
    lead, nb = data.shape[:-1], di // INDEX_BLOCK
    packed = data[..., :di // 2]
    nibbles = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*lead, nb, INDEX_BLOCK)
    return _decode_blocks(nibbles, data[..., di // 2:di // 2 + nb], E2M1).reshape(*lead, di)
