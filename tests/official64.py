"""Pieces of the official inference code's formulas in float64, written out for the tests that
check a draft module (MTP, DSpark) against them: RMSNorm, interleaved RoPE and the hc head
(DeepSeek-V4-Flash inference/model.py: RMSNorm, apply_rotary_emb, Transformer.hc_head)."""
from __future__ import annotations

import numpy as np


def rms(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def rope(v, pos, omega, inverse=False):
    """Interleaved pairs of the last 2 * len(omega) dims rotated by pos * omega."""
    th = np.asarray(pos, np.float64)[:, None] * omega[None, :]
    th = th[:, None, :] if v.ndim == 3 else th
    c, s = np.cos(th), (-1 if inverse else 1) * np.sin(th)
    out, n = v.copy(), 2 * len(omega)
    a, b = v[..., -n::2], v[..., -n + 1::2]
    out[..., -n::2], out[..., -n + 1::2] = a * c - b * s, a * s + b * c
    return out


def hc_head(x, fn, scale, base, eps, hc_eps):
    """(N, hc, d) streams -> (N, d): the sigmoid mix of the streams, its logits fn applied to the
    flattened streams over their RMS."""
    f = x.reshape(len(x), -1)
    m = (f @ fn.T) / np.sqrt(np.mean(f * f, axis=-1, keepdims=True) + eps)
    pre = 1 / (1 + np.exp(-(m * scale[0] + base))) + hc_eps
    return np.einsum("nk,nkd->nd", pre, x)
