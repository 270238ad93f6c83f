"""The weight layout the quantised products read (layouts.pack_qrows), checked on the host.

The kernels (qdot.hip) read the repacked rows instead of the file's blocks, so the repack
must keep every byte, and what a kernel reads from it must be the codes, multipliers, mins
and scales docs/exactness.md gives for the file's bytes (quant_codes). The Q2_K reader is
emulated here with the kernel's own word operations.
"""
from __future__ import annotations

import numpy as np
import pytest

from ds4ref.gguf.quant_codes import quant_codes
from ds4ref.gguf.tiny import random_blocks
from ds4ref.hip import layouts as g

WIDTHS = (256, 512, 768, 2048, 4096)


def q2k_rows(seed: int, rows: int, K: int, valid: bool) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if valid:
        return np.ascontiguousarray(random_blocks(rng, "Q2_K", (rows, K), 0.02).data).view(np.uint8)
    return rng.integers(0, 256, (rows, K // 256 * 84), dtype=np.uint8)  # any f16, NaN and inf included


def kernel_q2k_read(packed: np.ndarray, K: int):
    """qdot.hip's qb_load<WT_Q2_K> over every block b of every row: the 8 code bytes at 8b as
    two little-endian words, code word k = (word k/4 >> 2(k%4)) & 0x03030303; the scale pair
    at K/4 + 2b; (d, dmin) as one word at K/4 + K/16 + 4(b/8)."""
    rows, nb = packed.shape[0], K // 32
    words = packed[:, :K // 4].copy().view("<u4").reshape(rows, nb, 2).astype(np.uint32)
    cw = np.stack([(words[:, :, k // 4] >> np.uint32(2 * (k % 4))) & np.uint32(0x03030303) for k in range(8)], -1)
    codes = cw.astype("<u4").view(np.uint8).reshape(rows, K).astype(np.int8)  # byte e of word k: column 4k + e
    sc = packed[:, K // 4:K // 4 + K // 16].copy().view("<u2").astype(np.uint32)  # (rows, nb)
    mul = np.stack([sc & 15, (sc >> 8) & 15], -1).reshape(rows, K // 16).astype(np.int8)
    mn = np.stack([(sc >> 4) & 15, (sc >> 12) & 15], -1).reshape(rows, K // 16).astype(np.int8)
    dd = packed[:, K // 4 + K // 16:K // 4 + K // 16 + K // 64].copy().view("<u4").astype(np.uint32)
    d = (dd & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float32)
    dmin = (dd >> 16).astype(np.uint16).view(np.float16).astype(np.float32)
    return codes, mul, mn, np.repeat(d, 8, axis=1), np.repeat(dmin, 8, axis=1)


@pytest.mark.parametrize("K", WIDTHS)
@pytest.mark.parametrize("valid", [True, False])
def test_q2k_repack_is_lossless(K, valid):
    raw = q2k_rows(K + valid, 5, K, valid)
    packed = g.pack_qrows("q2_k", raw)
    assert packed.shape == (5, g.packed_row_bytes("q2_k", K)) and packed.shape[1] % 16 == 0
    assert np.array_equal(g.unpack_q2k_rows(packed, K), raw)
    assert not packed[:, K // 4 + K // 16 + K // 64:].any()  # the row's padding is zero


@pytest.mark.parametrize("K", WIDTHS)
@pytest.mark.parametrize("valid", [True, False])
def test_q2k_kernel_reads_the_quant_codes(K, valid):
    """What the kernel decodes from the repacked bytes is quant_codes of the file's bytes (the
    scales compared as bits; random bytes hold NaN f16, where only NaN-ness is compared)."""
    raw = q2k_rows(7 * K + valid, 4, K, valid)
    qc = quant_codes("Q2_K", raw)
    codes, mul, mn, s1, s2 = kernel_q2k_read(g.pack_qrows("q2_k", raw), K)
    assert np.array_equal(codes, qc.codes)
    assert np.array_equal(mul, qc.mul) and np.array_equal(mn, qc.mn)
    for got, want in ((s1, qc.s1), (s2, qc.s2)):
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan)
        assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_q2k_regions_are_aligned():
    """The kernel's loads: 8-byte code pairs, 2-byte scale pairs, 4-byte (d, dmin) words, each
    region starting on 16 bytes so a row stride that is a multiple of 16 keeps them aligned."""
    for K in WIDTHS:
        assert (K // 4) % 16 == 0 and (K // 4 + K // 16) % 16 == 0
        assert g.packed_row_bytes("q2_k", K) >= K // 4 + K // 16 + K // 64


@pytest.mark.parametrize("wtype", ["q8_0", "iq2_xxs", "mxfp4"])
def test_other_repacks_keep_every_byte(wtype):
    """[codes][scales] per row: the file's blocks come back by moving the scale bytes in front."""
    nbytes, per = g.BLOCK_QUANTS[wtype]
    head = {"q8_0": 2, "iq2_xxs": 2, "mxfp4": 1}[wtype]
    K = 1280  # 40 blocks of 32 columns: a full run and a short one
    raw = np.random.default_rng(3).integers(0, 256, (3, K // per * nbytes), dtype=np.uint8)
    packed = g.pack_qrows(wtype, raw)
    nblk = K // per
    body = packed[:, :nblk * (nbytes - head)].reshape(3, nblk, nbytes - head)
    if wtype == "q8_0":  # runs of 32 blocks, halves apart
        body = g.q8_run_halves(body.reshape(3, -1), inverse=True)
    scales = packed[:, nblk * (nbytes - head):nblk * nbytes].reshape(3, nblk, head)
    assert np.array_equal(np.concatenate([scales, body], axis=2).reshape(3, -1), raw)
