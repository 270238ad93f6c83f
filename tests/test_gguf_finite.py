"""Weights that are not finite are refused at load, in one line naming the file and the tensor
(gguf/finite.py): every float tensor's values and every block's scales are looked at, and
the table of where each block type keeps its scales is checked against gguf-py's decoder."""
from __future__ import annotations

import shutil
import subprocess
import sys

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import ds4ref
from ds4ref.gguf.file import GGUFError, open_gguf
from ds4ref.gguf.finite import BLOCK_SCALES, non_finite
from ds4ref.gguf.tiny import default_model_path

NOT_FINITE = {"f16": [np.float16(np.nan).view(np.uint16), np.float16(-np.inf).view(np.uint16)],
              "e8m0": [np.uint8(0xFF)]}


def _blocks(qtype: Q, n: int, seed: int) -> np.ndarray:
    """n blocks of random codes whose scale fields hold 1.0 (a finite block)."""
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(seed).integers(0, 256, (n, size), dtype=np.uint8)
    for _, offset, fmt in BLOCK_SCALES[qtype]:
        one = {"f16": np.float16(1.0), "e8m0": np.uint8(127)}[fmt]
        raw[:, offset:offset + one.nbytes] = np.frombuffer(one.tobytes(), np.uint8)
    return raw


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:overflow:RuntimeWarning")
@pytest.mark.parametrize("qtype", sorted(BLOCK_SCALES, key=lambda q: q.name), ids=lambda q: q.name)
def test_each_scale_field_is_where_gguf_reads_a_scale(qtype):
    """Finite scales decode to finite values; each field made NaN or infinite makes gguf-py's
    decoding of that block non-finite, and the check names that field and block."""
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, row_blocks = 3, 2
    good = _blocks(qtype, rows * row_blocks, seed=int(qtype))
    if qtype == Q.MXFP4:  # the largest E2M1 code everywhere: a NaN exponent must show in every value
        good[:, 1:] = 0x77
    assert np.isfinite(gguf.quants.dequantize(good, qtype)).all()
    assert non_finite(qtype, (rows, row_blocks * per), good.reshape(rows, -1)) is None
    for name, offset, fmt in BLOCK_SCALES[qtype]:
        for bad in NOT_FINITE[fmt]:
            raw = good.copy()
            raw[4, offset:offset + bad.nbytes] = np.frombuffer(bad.tobytes(), np.uint8)  # row 2, block 0
            values = gguf.quants.dequantize(raw, qtype).reshape(rows * row_blocks, per)
            assert not np.isfinite(values[4]).all() and np.isfinite(np.delete(values, 4, axis=0)).all()
            found = non_finite(qtype, (rows, row_blocks * per), raw.reshape(rows, -1))
            assert found is not None and f"block scale {name} = " in found and found.endswith("(row [2], block 0)")


@pytest.mark.parametrize("qtype, dtype", [(Q.F32, np.float32), (Q.F16, np.float16), (Q.F64, np.float64)])
def test_float_tensors_are_checked_value_by_value(qtype, dtype):
    values = np.ones((4, 5), dtype)
    assert non_finite(qtype, values.shape, values) is None
    values[3, 1] = -np.inf
    assert non_finite(qtype, values.shape, values) == "the value -inf at [3, 1]"
    values[0, 4] = np.nan
    assert non_finite(qtype, values.shape, values) == "the value nan at [0, 4]"


def test_bf16_is_read_from_its_stored_bits():
    bits = (np.ones((2, 3), np.float32).view(np.uint32) >> 16).astype(np.uint16)
    assert non_finite(Q.BF16, bits.shape, bits.view(np.uint8).reshape(2, 6)) is None
    bits[1, 2] = np.uint16(np.float32(np.nan).view(np.uint32) >> 16)
    assert non_finite(Q.BF16, bits.shape, bits.view(np.uint8).reshape(2, 6)) == "the value nan at [1, 2]"


def damaged_copy(tmp_path, name: str, scale_value) -> str:
    """The embedded tiny model with every block scale of Q8_0 tensor `name` set to scale_value
    (all-NaN output.weight is the held-out bad file)."""
    src, dst = default_model_path(), tmp_path / f"bad-{name}.gguf"
    shutil.copy(src, dst)
    t = open_gguf(src).tensor(name)
    assert t.qtype == Q.Q8_0
    blocks = np.array(t.data).reshape(-1, 34)
    blocks[:, 0:2] = np.frombuffer(np.float16(scale_value).tobytes(), np.uint8)
    with open(dst, "r+b") as f:
        f.seek(t.offset)
        f.write(blocks.tobytes())
    return str(dst)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # gguf-py decoding inf * 0 codes
def test_an_infinite_block_scale_is_refused_at_load(tmp_path):
    path = damaged_copy(tmp_path, "blk.3.attn_kv.weight", np.inf)
    assert np.isinf(open_gguf(path).read("blk.3.attn_kv.weight")).any()  # the file opens: its header is sound
    with pytest.raises(GGUFError) as err:
        ds4ref.load(path)
    assert str(err.value) == (f"{path}: tensor 'blk.3.attn_kv.weight' holds a Q8_0 block scale d = inf (row [0], "
                              f"block 0): its weights are not finite (a damaged or badly converted file)")


@pytest.mark.parametrize("backend", ["numpy", "hip"])
def test_serve_refuses_an_all_nan_output_weight_in_one_line_before_any_backend(tmp_path, backend):
    """The held-out bad file. Both backends: the check runs before a backend is made, so
    `--backend hip` gets the same line with or without a GPU (without one it would otherwise
    say there is no GPU)."""
    path = damaged_copy(tmp_path, "output.weight", np.nan)
    assert np.isnan(open_gguf(path).read("output.weight")).all()
    p = subprocess.run([sys.executable, "-m", "ds4ref.serve", "--model", path, "--backend", backend, "--port", "0"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.splitlines() == [
        f"ds4ref.serve: error: {path}: tensor 'output.weight' holds a Q8_0 block scale d = nan (row [0], block 0): "
        f"its weights are not finite (a damaged or badly converted file)"]
