"""The FP8 E4M3FN and FP4 E2M1 grids of `official` numerics (spec §3.0): the value of every code
(the compact rows' and the FP8/FP4 checkpoints' decoding), and rounding to the grid (nearest, ties
to even, on the mantissa grid; exact in any float dtype: only power-of-two scaling)."""
from __future__ import annotations

import numpy as np


def _e4m3fn_table() -> np.ndarray:
    """Value of every E4M3FN code (bias 7, subnormals m * 2^-9, 0x7F and 0xFF NaN)."""
    code = np.arange(256)
    exp, mant = (code >> 3) & 0xF, code & 7
    mag = np.where(exp == 0, mant * 2.0 ** -9, (8 + mant) * 2.0 ** (exp - 10))
    val = np.where(code & 0x80, -mag, mag)
    val[[0x7F, 0xFF]] = np.nan
    return val.astype(np.float32)


E4M3FN = _e4m3fn_table()
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6] + [-0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)  # by code


def pow2_ceil_log2(y: np.ndarray) -> np.ndarray:
    """2**ceil(log2(y)) for y > 0, computed exactly from the binary exponent."""
    m, e = np.frexp(y)
    e = np.where(m == 0.5, e - 1, e)
    return np.ldexp(np.ones_like(y), e)


def _round_to_grid(x: np.ndarray, min_exp: int, mant_bits: int) -> np.ndarray:
    """Round to the nearest float with `mant_bits` mantissa bits and normal exponent
    >= min_exp (subnormals below), ties to even."""
    _, e = np.frexp(np.abs(x))  # |x| = m * 2**e, m in [0.5, 1)
    exp = np.maximum(e - 1, min_exp)
    q = exp - mant_bits
    return np.ldexp(np.rint(np.ldexp(x, -q)), q)


def e4m3_round(x: np.ndarray) -> np.ndarray:
    """Nearest E4M3FN value (max 448, subnormals m*2^-9), ties to even. |x| must be <= 448."""
    return _round_to_grid(x, -6, 3)


def e2m1_round(x: np.ndarray) -> np.ndarray:
    """Nearest FP4 E2M1 value in {0, .5, 1, 1.5, 2, 3, 4, 6} (signed), ties to even."""
    return _round_to_grid(x, 0, 1)
