"""The byte-level BPE tokenizer: specials, round trips, pre-tokenisation rules, BPE order."""
from __future__ import annotations

import functools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ds4ref.tokenizer import (BOS, DSML, EOS, SPLIT_SPECIALS, TINY_SPECIALS, Tokenizer, TokenizerError,
                              build_tiny_tokenizer, byte_symbols, default_corpus, tiny_tokenizer_meta)

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


@pytest.mark.parametrize("text, pieces", [
    ("12345", ["123", "45"]),                              # rule 1: up to three digits
    ("東京タワー", ["東京タワー"]),                           # rule 2: CJK and kana run
    ("x.append", ["x", ".append"]),                        # rule 3: punctuation + letters
    ("hello world", ["hello", " world"]),                  # rules 4, 5
    ("a ;b", ["a", " ;", "b"]),                            # rule 6: space + punctuation
    ("x>;\ny", ["x", ">;\n", "y"]),                        # rule 7 keeps the newline
    ("a \n\n  b", ["a", " \n\n", " ", " b"]),              # rule 8: cut after the last newline
    ("a   b", ["a", "  ", " b"]),                          # rule 8: last space joins the word
    ("a   ", ["a", "   "]),                                # rule 8: whole trailing run
    ("né", ["né"]),                                        # non-ASCII counts as a letter
])
def test_pre_tokenizer_rules(tiny_tokenizer, text, pieces):
    assert tiny_tokenizer.pre_tokenize(text) == pieces


def test_tiny_vocabulary_layout():
    meta = build_tiny_tokenizer(400, default_corpus())
    tokens = meta["tokenizer.ggml.tokens"]
    assert len(tokens) == 400 and len(set(tokens)) == 400
    assert tokens[:len(TINY_SPECIALS)] == list(TINY_SPECIALS)
    assert tokens[len(TINY_SPECIALS):len(TINY_SPECIALS) + 256] == byte_symbols()
    assert meta["tokenizer.ggml.token_type"][:len(TINY_SPECIALS)] == [3] * len(TINY_SPECIALS)
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
