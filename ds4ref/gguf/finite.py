"""The load-time check that a GGUF's weights are finite, kept cheap enough for Flash's ~80 GiB.

Dequantising every block to look for NaN or infinity would cost as much as the model's whole
first pass. What is checked instead decides finiteness without decoding:

* float tensors (F32, F16, BF16, F64): every value, by its exponent bits;
* block-quantised tensors: every block's float scale fields (the f16 `d`, and `dmin` or `m`
  where the type has one; MXFP4's E8M0 exponent, whose 0xFF is NaN in the OCP MX
  spec and an infinite scale in ggml's decoder). The other bytes of a block are integer codes
  and small integer sub-scales, and a finite f16 scale times them cannot overflow float32, so
  a block with finite scales decodes to finite values;
* integer tensors hold no floats. Block types outside BLOCK_SCALES (IQ1_M, whose scale is
  assembled from nibbles, and NVFP4) are not checked here; gguf-py decodes no other type,
  so ds4ref reads no other.

Scales sit at a fixed offset in every block, so each check reads a strided view of the mapped
file: the file is read once (page cache permitting), and nothing is decoded or copied whole.
Non-finite values that arise later, from finite weights (overflow), are the engine's to catch
at run time (scheduler.seq_engine, backend.StepResult.non_finite).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

# Bits that are all ones exactly for infinity and NaN, per stored float format.
_EXPONENT_BITS = {"f16": (np.dtype("<u2"), 0x7C00), "bf16": (np.dtype("<u2"), 0x7F80),
                  "f32": (np.dtype("<u4"), 0x7F800000), "f64": (np.dtype("<u8"), 0x7FF0000000000000)}
_FLOAT_TYPES = {QType.F16: "f16", QType.BF16: "bf16", QType.F32: "f32", QType.F64: "f64"}
E8M0_NAN = 0xFF

# GGML block type -> its float scale fields: (name, byte offset in the block, format), after
# gguf-py's block layouts (tests/test_gguf_finite.py checks each against gguf-py's decoder).
BLOCK_SCALES: dict[QType, tuple[tuple[str, int, str], ...]] = {
    QType.Q4_0: (("d", 0, "f16"),), QType.Q4_1: (("d", 0, "f16"), ("m", 2, "f16")),
    QType.Q5_0: (("d", 0, "f16"),), QType.Q5_1: (("d", 0, "f16"), ("m", 2, "f16")),
    QType.Q8_0: (("d", 0, "f16"),),
    QType.Q2_K: (("d", 80, "f16"), ("dmin", 82, "f16")), QType.Q3_K: (("d", 108, "f16"),),
    QType.Q4_K: (("d", 0, "f16"), ("dmin", 2, "f16")), QType.Q5_K: (("d", 0, "f16"), ("dmin", 2, "f16")),
    QType.Q6_K: (("d", 208, "f16"),),
    QType.IQ2_XXS: (("d", 0, "f16"),), QType.IQ2_XS: (("d", 0, "f16"),), QType.IQ2_S: (("d", 0, "f16"),),
    QType.IQ3_XXS: (("d", 0, "f16"),), QType.IQ3_S: (("d", 0, "f16"),), QType.IQ1_S: (("d", 0, "f16"),),
    QType.IQ4_NL: (("d", 0, "f16"),), QType.IQ4_XS: (("d", 0, "f16"),),
    QType.TQ1_0: (("d", 52, "f16"),), QType.TQ2_0: (("d", 64, "f16"),),
    QType.MXFP4: (("e", 0, "e8m0"),),
}

CHUNK = 1 << 22  # values or blocks looked at a time: bounds each thread's temporaries (~12 MiB)


def _first_bad(bits: np.ndarray, fmt: str) -> Optional[int]:
    """Flat index of the first non-finite entry of `bits` (a 1-D strided view), or None."""
    mask = 0xFF if fmt == "e8m0" else _EXPONENT_BITS[fmt][1]
    want = E8M0_NAN if fmt == "e8m0" else mask
    for start in range(0, bits.size, CHUNK):
        bad = np.flatnonzero((bits[start:start + CHUNK] & mask) == want)
        if bad.size:
            return start + int(bad[0])
    return None


def _value(bits, fmt: str) -> str:
    """The stored value a bad entry holds, as it reads: nan, inf or -inf."""
    if fmt == "e8m0":
        return "0xFF (NaN)"
    dtype = {"f16": np.float16, "f32": np.float32, "f64": np.float64}.get(fmt)
    if dtype is None:  # bf16: the upper half of a float32
        return repr(float((np.uint32(bits) << np.uint32(16)).view(np.float32)))
    return repr(float(np.asarray(bits).view(dtype)))


def _where(index: int, shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(i) for i in np.unravel_index(index, shape)) + "]"


def non_finite(qtype: QType, shape: tuple[int, ...], data: np.ndarray) -> Optional[str]:
    """Where a stored tensor (`data`: gguf.file's memory-mapped view, values for float types
    and bytes per row for block types) is not finite, in words, or None when the cheap check
    finds nothing (module docstring: what is looked at)."""
    if qtype in _FLOAT_TYPES:
        fmt = _FLOAT_TYPES[qtype]
        bits = np.ascontiguousarray(data).view(_EXPONENT_BITS[fmt][0]).reshape(-1)
        at = _first_bad(bits, fmt)
        return None if at is None else f"the value {_value(bits[at], fmt)} at {_where(at, shape)}"
    fields = BLOCK_SCALES.get(qtype)
    if fields is None:
        return None
    per_block, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = np.asarray(data).reshape(-1, block_bytes)
    for name, offset, fmt in fields:
        dtype = np.dtype("u1") if fmt == "e8m0" else _EXPONENT_BITS[fmt][0]
        # a strided view of one field of every block: no copy of the tensor
        field = np.ndarray((blocks.shape[0],), dtype, blocks, offset, (block_bytes,))
        at = _first_bad(field, fmt)
        if at is not None:
            row, block = divmod(at, shape[-1] // per_block)
            row_at = f"row {_where(row, shape[:-1])}, " if len(shape) > 1 else ""
            return f"a {qtype.name} block scale {name} = {_value(field[at], fmt)} ({row_at}block {block})"
    return None
