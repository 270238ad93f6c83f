"""Bad GGUF files: each is refused at open with one line naming the file
and the key (or tensor), never a Python-internal error or a later crash."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGUFValueType as V

import ds4ref
from ds4ref.gguf.file import GGUFError, open_gguf
from ds4ref.gguf.tokenizer import tiny_tokenizer_meta
from test_gguf import CFG, plain_tensors, raw_gguf, typed_meta

P = "deepseek4."


def tokenizer_typed(vocab_size: int) -> dict:
    types = {"tokenizer.ggml.tokens": (V.ARRAY, V.STRING), "tokenizer.ggml.merges": (V.ARRAY, V.STRING),
             "tokenizer.ggml.token_type": (V.ARRAY, V.INT32)}
    out = {}
    for k, v in tiny_tokenizer_meta(vocab_size).items():
        vt, sub = types.get(k, (V.BOOL if isinstance(v, bool) else V.UINT32 if isinstance(v, int) else V.STRING,
                                None))
        out[k] = (v, vt, sub)
    return out


@pytest.fixture(scope="module")
def tensors():
    return plain_tensors(CFG)


@pytest.fixture(scope="module")
def base_meta():
    return {**typed_meta(CFG), **tokenizer_typed(CFG.vocab_size)}


def write_variant(path, base_meta, tensors, changes: dict):
    """The good file with some keys changed ((value, type, element type)) or removed (None)."""
    meta = dict(base_meta)
    for key, typed in changes.items():
        if typed is None:
            meta.pop(key, None)
        else:
            meta[key] = typed
    raw_gguf(path, meta, tensors)
    return path


def refused(path) -> str:
    with pytest.raises(GGUFError) as err:
        open_gguf(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: ") and "\n" not in msg, msg
    return msg


def test_the_base_file_opens(tmp_path, base_meta, tensors):
    f = open_gguf(write_variant(tmp_path / "good.gguf", base_meta, tensors, {}))
    assert f.config == CFG


# ---- 4. general.alignment --------------------------------------------------------------------------

@pytest.mark.parametrize("align", [0, 3, 48])
def test_alignment_must_be_a_power_of_two(tmp_path, base_meta, tensors, align):
    path = write_variant(tmp_path / "align.gguf", base_meta, tensors,
                         {"general.alignment": (align, V.UINT32, None)})
    assert f"general.alignment is {align}; it must be a power of two" in refused(path)


# ---- 5. tensor sizes that overflow int64 -------------------------------------------------------------

def _set_ne(path, name: str, ne: list[int]) -> None:
    reader = gguf.GGUFReader(str(path), "r+")  # the header mapped writable: patch one tensor's dims
    t = next(t for t in reader.tensors if t.name == name)
    t.field.parts[3][:] = ne
    reader.data.flush()


@pytest.mark.parametrize("ne", [[1 << 32, 1 << 32], [1 << 62, 3]])  # int64 products: 0 and negative
def test_tensor_dims_whose_product_overflows_are_truncation(tmp_path, base_meta, tensors, ne):
    path = write_variant(tmp_path / "dims.gguf", base_meta, tensors, {})
    _set_ne(path, "output.weight", ne)
    msg = refused(path)
    needed = re.search(r"file is truncated: tensor 'output.weight' needs bytes up to (\d+)", msg)
    assert needed and int(needed.group(1)) > 1 << 64, msg  # the exact size, not a wrapped one


# ---- 6, 7, 9. bad types and absurd values, each named ---------------------------------------------------

BAD = {
    # 6. absurd sizes
    "context_length 2^40": ({P + "context_length": (1 << 40, V.UINT64, None)},
                            "deepseek4.context_length is 1099511627776; it must be an integer in 2..16777216"),
    "sliding_window 2^40": ({P + "attention.sliding_window": (1 << 40, V.UINT64, None)},
                            "deepseek4.attention.sliding_window is 1099511627776; it must be an integer in 1..65536"),
    "block_count 0": ({P + "block_count": (0, V.UINT32, None)}, "deepseek4.block_count is 0"),
    # 7. mistyped metadata
    "block_count string": ({P + "block_count": ("six", V.STRING, None)},
                           "'deepseek4.block_count' is a string, expected u32 (any integer type)"),
    "compress_ratios scalar": ({P + "attention.compress_ratios": (4, V.INT32, None)},
                               "'deepseek4.attention.compress_ratios' is an int32, expected array of i32"),
    "swiglu_clamp_exp scalar": ({P + "swiglu_clamp_exp": (2.0, V.FLOAT32, None)},
                                "'deepseek4.swiglu_clamp_exp' is a float32, expected array of f32"),
    "rope.freq_base array": ({P + "rope.freq_base": ([1.0, 2.0], V.ARRAY, V.FLOAT32)},
                             "'deepseek4.rope.freq_base' is an array of float32, expected f32"),
    "tokens integer": ({"tokenizer.ggml.tokens": (5, V.UINT32, None)},
                       "'tokenizer.ggml.tokens' is a uint32, expected array of string"),
    "expert_weights_norm int": ({P + "expert_weights_norm": (1, V.UINT8, None)},
                                "'deepseek4.expert_weights_norm' is a uint8, expected bool"),
    "alignment string": ({"general.alignment": ("32", V.STRING, None)},
                         "'general.alignment' is a string, expected u32"),
    # 9. out-of-range special ids and absurd hyper-parameters
    "bos 99999": ({"tokenizer.ggml.bos_token_id": (99999, V.UINT32, None)},
                  "tokenizer.ggml.bos_token_id is 99999; it must be a token id in 0..511"),
    "eos 99999": ({"tokenizer.ggml.eos_token_id": (99999, V.UINT32, None)},
                  "tokenizer.ggml.eos_token_id is 99999; it must be a token id in 0..511"),
    "padding 512": ({"tokenizer.ggml.padding_token_id": (512, V.UINT32, None)},
                    "tokenizer.ggml.padding_token_id is 512; it must be a token id in 0..511"),
    "rms epsilon string": ({P + "attention.layer_norm_rms_epsilon": ("tiny", V.STRING, None)},
                           "'deepseek4.attention.layer_norm_rms_epsilon' is a string, expected f32"),
    "rms epsilon 0": ({P + "attention.layer_norm_rms_epsilon": (0.0, V.FLOAT32, None)},
                      "deepseek4.attention.layer_norm_rms_epsilon is 0.0; it must be a number in (0, 1)"),
    "rope base nan": ({P + "rope.freq_base": (float("nan"), V.FLOAT32, None)},
                      "deepseek4.rope.freq_base is nan; it must be a number finite and > 0"),
    "sinkhorn 2^40": ({P + "hyper_connection.sinkhorn_iterations": (1 << 40, V.UINT64, None)},
                      "deepseek4.hyper_connection.sinkhorn_iterations is 1099511627776; it must be an integer "
                      "in 1..1000"),
    "clamp negative": ({P + "swiglu_clamp_exp": ([2.0, -1.0, 2.0], V.ARRAY, V.FLOAT32)},
                       "deepseek4.swiglu_clamp_exp[1] is -1.0; it must be finite and > 0"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_metadata_is_refused_naming_the_key(tmp_path, base_meta, tensors, case):
    changes, needle = BAD[case]
    msg = refused(write_variant(tmp_path / "bad.gguf", base_meta, tensors, changes))
    assert needle in msg, msg


# ---- 8. a tokenizer that does not fit the model -------------------------------------------------------------

def test_too_few_tokens_for_the_vocabulary(tmp_path, base_meta, tensors):
    tokens = base_meta["tokenizer.ggml.tokens"][0][:412]
    path = write_variant(tmp_path / "short.gguf", base_meta, tensors, {
        "tokenizer.ggml.tokens": (tokens, V.ARRAY, V.STRING),
        "tokenizer.ggml.token_type": (base_meta["tokenizer.ggml.token_type"][0][:412], V.ARRAY, V.INT32)})
    assert "tokenizer.ggml.tokens has 412 entries but deepseek4.vocab_size is 512" in refused(path)


def test_token_types_must_match_the_tokens(tmp_path, base_meta, tensors):
    path = write_variant(tmp_path / "types.gguf", base_meta, tensors, {
        "tokenizer.ggml.token_type": (base_meta["tokenizer.ggml.token_type"][0][:-1], V.ARRAY, V.INT32)})
    assert "tokenizer.ggml.token_type has 511 entries for 512 tokens" in refused(path)


def test_a_file_without_tokenizer_still_loads(tmp_path, base_meta, tensors):
    no_tok = {k: None for k in base_meta if k.startswith("tokenizer.")}
    model = ds4ref.load(write_variant(tmp_path / "ids.gguf", base_meta, tensors, no_tok))
    assert model.config.vocab_size == 512


# ---- what `serve --model` shows ---------------------------------------------------------------------------------

def test_serve_names_file_and_key_and_exits_2(tmp_path, base_meta, tensors):
    path = write_variant(tmp_path / "ctx.gguf", base_meta, tensors,
                         {P + "context_length": (1 << 40, V.UINT64, None)})
    p = subprocess.run([sys.executable, "-m", "ds4ref.serve", "--model", str(path), "--port", "1"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        f"ds4ref.serve: error: {path}: deepseek4.context_length is 1099511627776; it must be an integer in "
        f"2..16777216"]


def test_more_than_four_dims_is_refused(tmp_path, base_meta, tensors):
    path = write_variant(tmp_path / "5d.gguf", base_meta, {**tensors, "extra.weight": np.zeros((1, 1, 1, 1, 2),
                                                                                              np.float32)}, {})
    assert "tensor 'extra.weight' has 5 dimensions; GGUF allows at most 4" in refused(path)


# ---- 6. the serve-time memory plan ------------------------------------------------------------------------------

def test_kv_state_larger_than_memory_is_refused_before_allocating(tmp_path, base_meta, tensors, monkeypatch):
    import ds4ref.serve as serve

    monkeypatch.setattr(serve, "host_memory_bytes", lambda: 256 << 20)
    path = write_variant(tmp_path / "window.gguf", base_meta, tensors,
                         {P + "attention.sliding_window": (1 << 16, V.UINT32, None)})  # in bounds, but 16 lanes
    with pytest.raises(MemoryError) as err:
        serve.build_state(str(path), max_concurrency=16)
    msg = str(err.value)
    assert "this machine has 256.0 MiB" in msg and "deepseek4.attention.sliding_window = 65536" in msg
    assert "deepseek4.context_length" in msg and "--max-context" in msg
    # one small lane fits (without the prefix cache, whose 8 snapshots of this 37 MiB lane state would not)
    serve.build_state(str(path), max_concurrency=1, max_context=64, prefix_cache=False).runner.stop()


def test_an_error_without_a_message_is_still_named(monkeypatch, capsys):
    import ds4ref.serve as serve
    from ds4ref.serve.__main__ import main

    def no_memory(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(serve, "build_state", no_memory)
    assert main([]) == 2
    assert capsys.readouterr().err == "ds4ref.serve: error: MemoryError\n"


# ---- the documented table is the checked one ------------------------------------------------------------------

def _doc_rows() -> dict[str, tuple[str, str]]:
    """{full key: (type, bounds)} from the two key tables of docs/gguf.md."""
    text = (Path(__file__).parents[1] / "docs" / "gguf.md").read_text(encoding="utf-8")
    rows = {}
    for section, prefix in (("### Metadata keys: GGUF type and bounds", P), ("### Tokenizer keys", "tokenizer.ggml.")):
        table = text.split(section, 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
        for line in table.splitlines():
            cells = [c.strip() for c in line.strip("|").split("|")]
            if not line.startswith("| `") or len(cells) < 3:
                continue
            for key in re.findall(r"`([^`]+)`", cells[0]):
                full = key if key.startswith(("general.", "ds4ref.", "tokenizer.")) else prefix + key
                rows[full] = (cells[1].replace("*", ""), cells[2])
    return rows


def _fmt(n: int) -> str:
    return f"2^{n.bit_length() - 1}" if n >= 1 << 17 and n & (n - 1) == 0 else str(n)


def test_docs_list_every_key_type_and_bound():
    from ds4ref.gguf.config import EPSILONS, INT_BOUNDS, POSITIVE_FLOATS, key_of
    from ds4ref.gguf.metadata import KEY_TYPES

    rows = _doc_rows()
    assert {k: t for k, (t, _) in rows.items() if k in KEY_TYPES} == KEY_TYPES
    assert set(KEY_TYPES) <= set(rows)
    for fname, (lo, hi) in INT_BOUNDS.items():
        assert f"{_fmt(lo)}..{_fmt(hi)}" in rows[key_of(fname)][1], fname
    for fname in POSITIVE_FLOATS:
        assert ("(0, 1)" if fname in EPSILONS else "> 0") in rows[key_of(fname)][1], fname
