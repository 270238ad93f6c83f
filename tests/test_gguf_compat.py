"""GGUF both ways: files in llama.cpp's and antirez's conventions load, and the
files ds4ref writes satisfy every consumer's key and type rules (tests/consumers.py)."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

import ds4ref
import consumers
from ds4ref.gguf.file import GGUFError, MTPFile, open_gguf, write_gguf
from ds4ref.gguf.tensors import is_int_tensor
from ds4ref.gguf.tiny import random_tensors, tiny_config, write_tiny
from ds4ref.gguf.tokenizer import tiny_tokenizer_meta
from test_gguf import typed_meta

P = "deepseek4."
CFG = tiny_config()
EXPERTS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
PROMPT = [0, 5, 17, 300, 2, 2, 511, 64, 128, 9, 33, 1]
CONTROL, USER_DEFINED = int(gguf.TokenType.CONTROL), int(gguf.TokenType.USER_DEFINED)


@pytest.fixture(scope="module")
def tensors():
    return {n: a.astype(np.int32) if is_int_tensor(n) else a for n, a in random_tensors(CFG, 3).items()}


def _is_expert(name: str) -> bool:
    return name.endswith(EXPERTS)


@pytest.fixture(scope="module")
def own_file(tmp_path_factory, tensors):
    """ds4ref's own file of these weights: routed experts MXFP4 (as llama.cpp's converter stores them)."""
    path = tmp_path_factory.mktemp("own") / "own.gguf"
    dtypes = {n: "mxfp4" for n in tensors if _is_expert(n)}
    write_gguf(path, CFG, tensors, tokenizer_meta=tiny_tokenizer_meta(CFG.vocab_size), dtypes=dtypes)
    return path


def _tokenizer_typed(token_type: int) -> dict:
    """The tiny tokenizer with its `<｜…｜>` specials typed `token_type`."""
    meta = tiny_tokenizer_meta(CFG.vocab_size)
    types = [token_type if t.startswith("<｜") and t.endswith("｜>") else k
             for t, k in zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"])]
    out = {"tokenizer.ggml.tokens": (meta["tokenizer.ggml.tokens"], V.ARRAY, V.STRING),
           "tokenizer.ggml.merges": (meta["tokenizer.ggml.merges"], V.ARRAY, V.STRING),
           "tokenizer.ggml.token_type": (types, V.ARRAY, V.INT32)}
    for k, v in meta.items():
        if k not in out:
            out[k] = (v, V.BOOL if isinstance(v, bool) else V.UINT32 if isinstance(v, int) else V.STRING, None)
    return out


def llama_cpp_style(path: Path, tensors: dict, mtp: bool = True, nextn: int = 1,
                    token_type: int = CONTROL, meta_changes: dict | None = None, tokenizer: bool = True) -> Path:
    """A file as llama.cpp's converter writes one: u32 keys, no vocab_size, gating func 4,
    rope.scaling.type yarn, CONTROL `<｜…｜>` tokens, MXFP4 experts (gguf-py's quantiser);
    mtp=True adds an MTP block counted in block_count with its nextn.* tensors, a main file
    llama.cpp's loader also takes (its converter writes the block to a file of its own)."""
    n_all = CFG.n_layer + (1 if mtp else 0)
    meta = typed_meta(CFG)
    del meta[P + "vocab_size"]
    meta.update({P + "block_count": (n_all, V.UINT32, None), P + "nextn_predict_layers": (nextn, V.UINT32, None),
                 P + "expert_gating_func": (4, V.UINT32, None),
                 P + "attention.compress_ratios": ([*CFG.compress_ratios, 0][:n_all], V.ARRAY, V.INT32),
                 P + "swiglu_clamp_exp": ([*CFG.swiglu_clamp, 1.0][:n_all], V.ARRAY, V.FLOAT32),
                 **(_tokenizer_typed(token_type) if tokenizer else {}), **(meta_changes or {})})
    w = gguf.GGUFWriter(str(path), "deepseek4")
    for k, (v, vt, sub) in meta.items():
        if k != "general.architecture":
            w.add_key_value(k, v, vt, sub)
    layer = {n: a for n, a in tensors.items() if n.startswith(f"blk.{CFG.n_layer - 1}.")}
    extra = {}
    if mtp:  # a full block (a copy of the last layer's tensors) plus the nextn head
        m, d = CFG.n_layer, CFG.n_embd
        extra = {n.replace(f"blk.{m - 1}.", f"blk.{m}.", 1): a for n, a in layer.items()}
        rng = np.random.default_rng(9)
        extra.update({f"blk.{m}.nextn.eh_proj.weight": rng.standard_normal((d, 2 * d)).astype(np.float32),
                      f"blk.{m}.nextn.enorm.weight": np.ones(d, np.float32),
                      f"blk.{m}.nextn.hnorm.weight": np.ones(d, np.float32)})
    for name, arr in {**tensors, **extra}.items():
        if _is_expert(name):
            w.add_tensor(name, gguf.quants.quantize(arr, Q.MXFP4), raw_dtype=Q.MXFP4)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _logits(path) -> np.ndarray:
    return ds4ref.load(path, numerics="official", dtype=np.float32).score(PROMPT)


def test_llama_cpp_file_gives_the_same_logits_bitwise(tmp_path, tensors, own_file):
    path = llama_cpp_style(tmp_path / "llama.gguf", tensors)
    model = ds4ref.load(path)
    assert model.config.n_layer == CFG.n_layer and model.config.vocab_size == CFG.vocab_size
    assert open_gguf(path).tensor("blk.0.ffn_up_exps.weight").qtype == Q.MXFP4
    assert _logits(path).tobytes() == _logits(own_file).tobytes()


def test_the_mtp_block_is_named_and_not_run(tmp_path, tensors):
    model = ds4ref.load(llama_cpp_style(tmp_path / "llama.gguf", tensors))
    assert model.config.n_layer == CFG.n_layer
    description = model.describe()
    assert f"MTP block {CFG.n_layer} skipped" in description, description
    assert "vocab_size 512 derived from the length of tokenizer.ggml.tokens" in description


def test_nextn_without_the_mtp_tensors_runs_every_block(tmp_path, tensors, own_file):
    """antirez's files: nextn_predict_layers = 1, MTP block in a separate file (llama.cpp's probe rule)."""
    path = llama_cpp_style(tmp_path / "antirez.gguf", tensors, mtp=False)
    model = ds4ref.load(path)
    assert model.config.n_layer == CFG.n_layer
    assert "all 6 blocks are layers" in model.describe()
    assert _logits(path).tobytes() == _logits(own_file).tobytes()


def test_vocab_size_from_the_embedding_without_a_tokenizer(tmp_path, tensors):
    path = llama_cpp_style(tmp_path / "ids.gguf", tensors, mtp=False, tokenizer=False)
    model = ds4ref.load(path)
    assert model.config.vocab_size == CFG.vocab_size
    assert "vocab_size 512 derived from the rows of token_embd.weight" in model.describe()


@pytest.mark.parametrize("token_type", [CONTROL, USER_DEFINED])
def test_specials_typed_control_or_user_defined_encode_alike(tmp_path, tensors, token_type):
    path = llama_cpp_style(tmp_path / "tok.gguf", tensors, mtp=False, token_type=token_type)
    own = ds4ref.load().tokenizer
    text = "<｜begin▁of▁sentence｜><｜User｜>hello<｜Assistant｜>"
    assert ds4ref.load(path).tokenizer.encode(text) == own.encode(text)


@pytest.mark.parametrize("changes, names", [
    ({P + "expert_gating_func": (1, V.UINT32, None)}, "deepseek4.expert_gating_func is 1"),
    ({P + "expert_gating_func": (2, V.UINT32, None)}, "deepseek4.expert_gating_func is 2"),
    ({P + "rope.scaling.type": ("linear", V.STRING, None)}, "deepseek4.rope.scaling.type is 'linear'"),
    ({P + "nextn_predict_layers": (7, V.UINT32, None)}, "deepseek4.nextn_predict_layers is 7"),
    ({P + "expert_gating_func": ("sqrtsoftplus", V.STRING, None)}, "'deepseek4.expert_gating_func' is a string"),
])
def test_refusals_name_the_key(tmp_path, tensors, changes, names):
    path = llama_cpp_style(tmp_path / "bad.gguf", tensors, meta_changes=changes)
    with pytest.raises(GGUFError) as err:
        open_gguf(path)
    assert str(err.value).startswith(f"{path}: ") and names in str(err.value), str(err.value)


# ---- what ds4ref writes, checked against each consumer ---------------------------------------------------------

def test_written_files_satisfy_every_consumer(tmp_path, own_file):
    tiny = tmp_path / "tiny.gguf"
    write_tiny(tiny, mtp=tmp_path / "mtp-tiny.gguf")
    packaged = (ds4ref.gguf.tiny.default_model_path(), ds4ref.gguf.tiny.default_mtp_path())
    for path in (tiny, tmp_path / "mtp-tiny.gguf", own_file, *packaged):
        types = MTPFile(path).value_types
        for consumer in consumers.CONSUMERS:
            assert consumers.problems(consumer, types) == [], (path, consumer)


def test_consumer_model_refuses_what_llama_cpp_refuses():
    """The table is not vacuous: u64 context lengths and a missing gating key are refused."""
    types = {k: (V.UINT32, None) for k in consumers.requirements()}
    types[P + "context_length"] = (V.UINT64, None)
    del types[P + "expert_gating_func"]
    got = consumers.problems("llama.cpp", types)
    assert any("context_length is u64" in p for p in got) and any("missing deepseek4.expert_gating_func" in p
                                                                   for p in got)


def test_docs_carry_the_consumer_table():
    text = (Path(__file__).parents[1] / "docs" / "gguf.md").read_text(encoding="utf-8")
    assert consumers.markdown_table() in text, "regenerate with python -m tests.consumers"
