"""`python -m ds4ref.diff` (docs/diff.md): the reference's tap changes no bit and records the
same intermediates from both drivers; a fault planted in one tensor of a copy of the tiny model
(written with gguf-py) is where the comparison of the faulted dump with the clean one says the
two first part; and llama.cpp (skipped without llama-cpp-python) runs the tiny model within the
known numerics differences of ds4ref op by op, and is caught at a fault planted in its file."""
from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4ref.diff.compare import compare, first_divergence, report
from ds4ref.diff.dumpfile import read_dump
from ds4ref.diff.names import dataflow
from ds4ref.diff.recorder import Recorder, dump_reference
from ds4ref.gguf.file import open_gguf
from ds4ref.gguf.tiny import default_model_path
from ds4ref.reference import tap
from ds4ref.reference.model import Model

TINY = default_model_path()
# 40 positions: ten ratio-4 windows, so the indexer picks (more than top_k = 8 rows) from position 35
TOKENS = [1] + np.random.default_rng(7).integers(10, 500, 39).tolist()

# tensor suffix -> (the op it first shows at, the layers where it does within TOKENS). The tiny
# model: layers 2 and 4 ratio 4 (compressor + indexer), 3 and 5 ratio 128 (no window completes in
# 40 positions, so only their per-token projections show), 0-2 hash-routed, 3-5 biased.
FAULTS = {
    "hc_attn_fn.weight": ("hc_attn_pre", range(6)),  # its first hc_mult rows: the pre weights
    "attn_norm.weight": ("attn_norm", range(6)),
    "attn_q_a.weight": ("qr", range(6)),
    "attn_kv.weight": ("kv", range(6)),
    "attn_compressor_kv.weight": ("attn_comp_kv", range(2, 6)),
    "attn_compressor_norm.weight": ("attn_comp_row", (2, 4)),
    "indexer_compressor_gate.weight": ("idx_comp_score", (2, 4)),
    "indexer_compressor_norm.weight": ("idx_comp_row", (2, 4)),
    "indexer.proj.weight": ("idx_weights", (2, 4)),
    "attn_output_b.weight": ("attn_out", range(6)),
    "ffn_norm.weight": ("ffn_norm", range(6)),
    "ffn_gate_inp.weight": ("router_logits", range(6)),
    "exp_probs_b.bias": ("router_scores", (3, 4, 5)),
    "ffn_down_exps.weight": ("expert_down", range(6)),
    "ffn_down_shexp.weight": ("ffn_shexp", range(6)),
}


def plant(src, dst, name: str, row: int, expert: int | None = None):
    """A copy of src with one row of `name` wrong, edited in place through gguf-py's reader: a
    float row negated and shifted, or a quantised row's first block scale negated."""
    shutil.copy(src, dst)
    t = next(t for t in gguf.GGUFReader(str(dst), "r+").tensors if t.name == name)
    data = t.data if expert is None else t.data[expert]
    row %= data.shape[0]
    if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        data[row] = -data[row] - data.dtype.type(0.5)
    else:  # a block: the f16 scale's two bytes first; its sign bit is the high byte's top bit
        data[row, 1] ^= 0x80
    return dst


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    d = tmp_path_factory.mktemp("clean")
    dump_reference(TINY, TOKENS, d)
    return read_dump(d)


# The fault hunts run official float64 (a third of float32's time here): the same code on the same
# machine gives the same bits, so everything before the fault must agree exactly all the same.
F64 = dict(numerics="official", dtype=np.float64)


@pytest.fixture(scope="module")
def clean64(tmp_path_factory):
    d = tmp_path_factory.mktemp("clean64")
    dump_reference(TINY, TOKENS, d, **F64)
    return read_dump(d)


def test_the_tap_changes_no_bit():
    """Logits with a recording running are the logits without one, bit for bit."""
    model = Model(open_gguf(TINY).weights(np.float32), "official")
    off = model.step_rows([model.new_state()] * len(TOKENS), TOKENS, np.arange(len(TOKENS)))
    rec = Recorder()
    with tap.recording(rec):
        on = model.step_rows([model.new_state()] * len(TOKENS), TOKENS, np.arange(len(TOKENS)))
    assert np.array_equal(off.view(np.uint32), on.view(np.uint32))
    assert len(rec.passes) == 1 and np.array_equal(rec.passes[0].tensors["output.logits"][0][0], on)
    assert not tap.on()


def test_a_dump_holds_every_name_in_dataflow_order(clean):
    """Everything the names table lists for the tiny model is recorded (the ratio-128 layers'
    compressed rows aside: no window of 128 completes in 40 positions)."""
    missing = {n for n in dataflow(6) if n not in clean.tensors}
    indexer = ("idx_comp_kv", "idx_comp_score", "idx_comp_row", "idx_q", "idx_weights", "idx_score", "idx_topk")
    assert missing == {f"blk.{il}.{op}" for il in (0, 1, 3, 5) for op in indexer + ("attn_comp_row",)} | \
        {f"blk.{il}.{op}" for il in (0, 1) for op in ("attn_comp_kv", "attn_comp_score")}
    keys, rows = clean.tensors["blk.2.idx_topk"]
    assert keys.tolist() == list(range(35, 40)) and rows.shape == (5, 8)
    keys, _ = clean.tensors["blk.2.attn_comp_row"]
    assert keys.tolist() == list(range(0, 40, 4))  # a compressed row is keyed by its window's start


def test_prefill_and_decode_record_the_same_intermediates(tmp_path):
    """The two drivers, written independently, agree op by op to 1e-9 in float64 (tolerance: one
    side's BLAS sums a pass of rows, the other one row at a time)."""
    dump_reference(TINY, TOKENS, tmp_path / "decode", "plain", np.float64)
    dump_reference(TINY, TOKENS, tmp_path / "prefill", "plain", np.float64, driver="prefill")
    a, b = read_dump(tmp_path / "decode"), read_dump(tmp_path / "prefill")
    assert a.keys() == b.keys()
    results = compare(a, b)
    assert first_divergence(results) is None
    assert max(r.max for r in results) < 1e-9


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_planted_fault_is_the_first_divergence(clean64, tmp_path_factory, data):
    suffix = data.draw(st.sampled_from(sorted(FAULTS)), "tensor")
    op, layers = FAULTS[suffix]
    il = data.draw(st.sampled_from(list(layers)), "layer")
    row = data.draw(st.integers(0, 3 if suffix == "hc_attn_fn.weight" else 1000), "row")
    expert = None
    if suffix == "ffn_down_exps.weight":  # an expert some position chose
        expert = int(np.bincount(clean64.tensors[f"blk.{il}.router_ids"][1].ravel()).argmax())
    d = tmp_path_factory.mktemp("fault")
    plant(TINY, d / "faulted.gguf", f"blk.{il}.{suffix}", row, expert)
    dump_reference(d / "faulted.gguf", TOKENS, d / "dump", **F64)
    faulted = read_dump(d / "dump")
    results = compare(clean64, faulted)
    first = first_divergence(results)
    assert first is not None and first.name == f"blk.{il}.{op}", report("clean", "faulted", clean64, faulted, results)
    assert all(r.max == 0 for r in results[:results.index(first)])


def test_a_fault_in_the_head_is_found_there(clean64, tmp_path):
    plant(TINY, tmp_path / "faulted.gguf", "output_norm.weight", 3)
    dump_reference(tmp_path / "faulted.gguf", TOKENS, tmp_path / "dump", **F64)
    assert first_divergence(compare(clean64, read_dump(tmp_path / "dump"))).name == "output.norm"


try:
    import llama_cpp
except ImportError:
    llama_cpp = None
needs_llama = pytest.mark.skipif(llama_cpp is None, reason="llama-cpp-python is not installed (pip install "
                                 "llama-cpp-python==0.3.36; it builds llama.cpp from source)")


@needs_llama
def test_llama_cpp_stays_within_the_known_numerics_differences(tmp_path):
    """The tiny model in llama.cpp against ds4ref's plain float64: every op within the
    allowances of llama.cpp's f16 / int8 activation rounding (a foreign engine: tolerances)."""
    from ds4ref.diff.llama_cpp import dump_llama_cpp
    dump_reference(TINY, TOKENS, tmp_path / "ours", "plain", np.float64)
    dump_llama_cpp(TINY, TOKENS, tmp_path / "llama")
    a, b = read_dump(tmp_path / "ours"), read_dump(tmp_path / "llama")
    assert a.keys() - b.keys() == set()
    results = compare(a, b)
    assert first_divergence(results) is None, report("ds4ref", "llama.cpp", a, b, results)


@needs_llama
@pytest.mark.parametrize("tensor, op", [("blk.2.attn_kv.weight", "blk.2.kv"),
                                        ("blk.4.ffn_down_shexp.weight", "blk.4.ffn_shexp")])
def test_llama_cpp_is_caught_at_a_planted_fault(tmp_path, tensor, op):
    from ds4ref.diff.llama_cpp import dump_llama_cpp
    plant(TINY, tmp_path / "faulted.gguf", tensor, 5)
    dump_reference(TINY, TOKENS, tmp_path / "ours", "plain", np.float64)
    dump_llama_cpp(tmp_path / "faulted.gguf", TOKENS, tmp_path / "llama")
    a, b = read_dump(tmp_path / "ours"), read_dump(tmp_path / "llama")
    results = compare(a, b)
    assert first_divergence(results).name == op, report("ds4ref", "llama.cpp", a, b, results)
