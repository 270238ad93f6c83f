"""Tables derived from the model's config, shared by both backends: RoPE frequencies (plain and
YaRN, spec §4) per layer kind and the indexer's Hadamard matrix."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..gguf.config import DS4Config
from . import canon


def rope_omega(n_rot: int, base: float, yarn: tuple[float, int, float, float] | None = None) -> np.ndarray:
    """Angular frequencies omega_j, j < n_rot/2, in float64.

    yarn = (factor, original_context, beta_fast, beta_slow); the magnitude
    factor is 1.0 (DS4 forces attention_factor = 1; the default 1.2773 is wrong).
    """
    j = np.arange(n_rot // 2, dtype=np.float64)
    omega = canon.correctly_rounded_pow(base, -2.0 * j / n_rot)  # not libm's pow: same bits everywhere
    if yarn is None:
        return omega
    factor, orig_ctx, beta_fast, beta_slow = yarn

    def corr(n_rotations: float) -> float:
        return n_rot * math.log(orig_ctx / (2 * math.pi * n_rotations)) / (2 * math.log(base))

    low = max(0, math.floor(corr(beta_fast)))
    high = min(n_rot - 1, math.ceil(corr(beta_slow)))
    span = (high - low) if high != low else 0.001
    ramp = np.clip((j - low) / span, 0.0, 1.0)
    return omega * (1.0 - ramp) + (omega / factor) * ramp


def hadamard(n: int, dtype=np.float64) -> np.ndarray:
    """Orthonormal Sylvester Hadamard matrix H[i, j] = (-1)^popcount(i & j) / sqrt(n)."""
    i = np.arange(n)
    bits = np.bitwise_and(i[:, None], i[None, :])
    parity = np.zeros_like(bits)
    while bits.any():
        parity ^= bits & 1
        bits >>= 1
    return ((1 - 2 * parity) / math.sqrt(n)).astype(dtype)



@dataclass
class Tables:
    """Precomputed constants: RoPE frequencies per layer kind and the indexer Hadamard."""
    omega_main: np.ndarray
    omega_compress: np.ndarray
    hadamard: np.ndarray

    @classmethod
    def build(cls, cfg: DS4Config, dtype) -> "Tables":
        yarn = (cfg.yarn_factor, cfg.yarn_orig_ctx, cfg.yarn_beta_fast, cfg.yarn_beta_slow)
        return cls(rope_omega(cfg.n_rot, cfg.rope_freq_base),
                   rope_omega(cfg.n_rot, cfg.compress_rope_freq_base, yarn),
                   hadamard(cfg.indexer_head_dim, dtype))

    def omega(self, ratio: int) -> np.ndarray:
        """Sliding-only layers use the main table; compressed layers and their compressors
        and indexer use the YaRN-scaled compress table."""
        return self.omega_compress if ratio else self.omega_main
