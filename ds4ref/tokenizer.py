"""DS4's byte-level BPE tokenizer, read from (and for the tiny model written to) GGUF.

The vocabulary and merges come from `tokenizer.ggml.*`; the HuggingFace
`tokenizers` library runs the BPE. Pre-tokenisation follows DS4C's reading of
the `joyai-llm` rules (spec §6.2) as one regex; docs/gguf.md lists where a
regex cannot follow the hand-written splitter exactly.

Special tokens are found by their strings, never by assumed ids (spec §6.1).
"""
from __future__ import annotations

import copy
import functools
import json
import importlib.resources
from typing import Iterable, Mapping, Sequence

from tokenizers import AddedToken, Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
END_THINK = "</think>"
DSML = "｜DSML｜"
PAD = "<｜▁pad▁｜>"

# The strings DS4C splits a rendered chat on; everything else goes through BPE.
SPLIT_SPECIALS = (BOS, EOS, USER, ASSISTANT, THINK, END_THINK, DSML)
# Order of the control tokens at the head of the tiny vocabulary (BOS=0, EOS=1).
TINY_SPECIALS = SPLIT_SPECIALS + (PAD,)

# llama.cpp token types
TYPE_NORMAL, TYPE_CONTROL = 1, 3


class TokenizerError(ValueError):
    """The GGUF tokenizer metadata is missing or inconsistent."""


# ---------------------------------------------------------------------------
# pre-tokeniser (spec §6.2): one alternative per rule, first match wins
# ---------------------------------------------------------------------------
_PUNCT = r"!-/:-@\[-`{-~"            # ASCII punctuation and symbols
_LETTER = r"A-Za-z\x{80}-\x{10FFFF}"  # ASCII letters and any non-ASCII code point
_WS = r"\t\n\x0B\f\r "                # ASCII whitespace only; other spaces count as letters
_CJK = r"\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}"

PRETOKENIZE_PATTERN = "|".join([
    r"[0-9]{1,3}",                                              # 1 up to three digits
    rf"[{_CJK}]+",                                              # 2 CJK / kana run
    rf"[{_PUNCT}][A-Za-z]+",                                    # 3 punct + ASCII letters
    rf"[{_LETTER}]+",                                           # 4 letter run
    rf"[^\r\n{_PUNCT}{_LETTER}][{_LETTER}]+",                   # 5 one other char + letters
    rf" [{_PUNCT}]+[\r\n]*",                                    # 6 space + punctuation
    rf"[{_PUNCT}]+[\r\n]*",                                     # 7 punctuation run
    rf"[{_WS}]*[\r\n]",                                         # 8a whitespace up to its last newline
    rf"[{_WS}]+(?=[{_WS}][{_LETTER}{_PUNCT}])",                 # 8b leave the last space to the word
    rf"[{_WS}]+",                                               # 8c the whole run
    r"[\s\S]",                                                  # 9 any one character
])


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def byte_symbols() -> list[str]:
    """The 256 GPT-2 byte symbols, in byte order."""
    table = _byte_to_symbol()
    return [table[b] for b in range(256)]


@functools.lru_cache(maxsize=1)
def _byte_to_symbol() -> dict[int, str]:
    # GPT-2's map: printable Latin-1 bytes stand for themselves, the others are
    # moved to U+0100.. so that every byte is one visible character.
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@functools.lru_cache(maxsize=1)
def _symbol_to_byte() -> dict[str, int]:
    return {s: b for b, s in _byte_to_symbol().items()}


# ---------------------------------------------------------------------------
# the tokenizer
# ---------------------------------------------------------------------------
class Tokenizer:
    """Encode/decode with a GGUF `gpt2`-model vocabulary."""

    def __init__(self, tokens: Sequence[str], merges: Sequence[str], bos_id: int, eos_id: int,
                 token_types: Sequence[int] | None = None):
        self.tokens = list(tokens)
        self._ids = {t: i for i, t in enumerate(self.tokens)}
        if len(self._ids) != len(self.tokens):
            raise TokenizerError("tokenizer.ggml.tokens contains duplicate strings")
        self.token_types = list(token_types) if token_types is not None else [TYPE_NORMAL] * len(self.tokens)
        self.bos_id, self.eos_id = int(bos_id), int(eos_id)
        self.special_tokens = {s: self._ids[s] for s in SPLIT_SPECIALS if s in self._ids}
        self._merges = _parse_merges(merges)
        self._hf = _build_hf(self._ids, self._merges, self.special_tokens)
        self._hf_plain: HFTokenizer | None = None  # built on first special=False call

    @classmethod
    def from_gguf(cls, metadata: Mapping) -> "Tokenizer":
        """Rebuild from the `tokenizer.ggml.*` keys of a GGUF metadata dict."""
        model = metadata.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise TokenizerError(f"tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2') is supported")
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            if key not in metadata:
                raise TokenizerError(f"missing GGUF metadata key {key!r}")
        tokens = metadata["tokenizer.ggml.tokens"]
        bos = _special_id(metadata, tokens, "tokenizer.ggml.bos_token_id", BOS)
        eos = _special_id(metadata, tokens, "tokenizer.ggml.eos_token_id", EOS)
        return cls(tokens, metadata["tokenizer.ggml.merges"], bos, eos, metadata.get("tokenizer.ggml.token_type"))

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids of `text`, no BOS added. With special=True the DS4 special strings
        in the text become their single ids; with special=False they are plain text."""
        if special or not self.special_tokens:
            return self._hf.encode(text, add_special_tokens=False).ids
        if self._hf_plain is None:
            self._hf_plain = _build_hf(self._ids, self._merges, {})
        return self._hf_plain.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the ids; specials are spelled out, incomplete UTF-8 becomes U+FFFD."""
        ids = [int(i) for i in ids]
        for i in ids:
            if not 0 <= i < len(self.tokens):
                raise TokenizerError(f"token id {i} out of range 0..{len(self.tokens) - 1}")
        return self._hf.decode(ids, skip_special_tokens=False)

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Raw bytes of the ids (for streaming: a character may span tokens)."""
        sym = _symbol_to_byte()
        out = bytearray()
        for i in ids:
            tok = self.id_to_token(int(i))
            if self.token_types[int(i)] == TYPE_CONTROL or tok in self.special_tokens:
                out += tok.encode("utf-8")
            else:
                out += bytes(sym[c] for c in tok)
        return bytes(out)

    def token_to_id(self, token: str) -> int | None:
        return self._ids.get(token)

    def id_to_token(self, i: int) -> str:
        if not 0 <= i < len(self.tokens):
            raise TokenizerError(f"token id {i} out of range 0..{len(self.tokens) - 1}")
        return self.tokens[i]

    def pre_tokenize(self, text: str) -> list[str]:
        """The pieces BPE sees (before byte mapping), for tests and docs."""
        split = pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated", invert=False)
        return [p for p, _ in split.pre_tokenize_str(text)]


def _special_id(metadata: Mapping, tokens: Sequence[str], key: str, text: str) -> int:
    if key in metadata:
        return int(metadata[key])
    try:
        return list(tokens).index(text)
    except ValueError:
        raise TokenizerError(f"missing {key!r} and no {text!r} token in the vocabulary") from None


def _parse_merges(merges: Sequence[str]) -> list[tuple[str, str]]:
    out = []
    for rank, m in enumerate(merges):
        a, sep, b = m.partition(" ")
        if not sep or not a or not b:
            raise TokenizerError(f"merge #{rank} {m!r} is not of the form 'A B'")
        out.append((a, b))
    return out


def _build_hf(vocab: dict[str, int], merges: list[tuple[str, str]], specials: dict[str, int]) -> HFTokenizer:
    for a, b in merges:
        if a not in vocab or b not in vocab or a + b not in vocab:
            raise TokenizerError(f"merge {a!r} + {b!r} refers to a token missing from the vocabulary")
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False, single_word=False,
                                       lstrip=False, rstrip=False) for s in specials])
    return tok


# ---------------------------------------------------------------------------
# building a tiny vocabulary
# ---------------------------------------------------------------------------
def default_corpus() -> str:
    return importlib.resources.files("ds4ref").joinpath("data", "corpus.txt").read_text(encoding="utf-8")


def build_tiny_tokenizer(vocab_size: int, corpus_text: str) -> dict:
    """tokenizer.ggml.* keys of a BPE trained on `corpus_text`, exactly `vocab_size` tokens:
    the control tokens (BOS=0, EOS=1, ...), the 256 byte symbols in byte order, then
    one token per merge in merge-rank order."""
    head = list(TINY_SPECIALS) + byte_symbols()
    n_merges = vocab_size - len(head)
    if n_merges < 0:
        raise TokenizerError(f"vocab_size {vocab_size} is smaller than the {len(head)} special and byte tokens")
    tokens, merges = list(head), []
    known = set(tokens)
    for a, b in _train_merges(corpus_text, vocab_size + 64):
        if len(tokens) == vocab_size:
            break
        merges.append(f"{a} {b}")
        if a + b not in known:  # two merges can spell the same token; keep one entry
            tokens.append(a + b)
            known.add(a + b)
    if len(tokens) < vocab_size:
        raise TokenizerError(f"the corpus yields only {len(tokens)} tokens, fewer than vocab_size {vocab_size}")
    types = [TYPE_CONTROL] * len(TINY_SPECIALS) + [TYPE_NORMAL] * (vocab_size - len(TINY_SPECIALS))
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "joyai-llm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": tokens.index(BOS),
        "tokenizer.ggml.eos_token_id": tokens.index(EOS),
        "tokenizer.ggml.padding_token_id": tokens.index(PAD),
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.ggml.add_eos_token": False,
    }


def _train_merges(corpus_text: str, target: int) -> list[tuple[str, str]]:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = _pre_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=target, min_frequency=2, show_progress=False,
                                  initial_alphabet=byte_symbols(), special_tokens=[])
    tok.train_from_iterator(corpus_text.splitlines(keepends=True), trainer=trainer)
    merges = json.loads(tok.to_str())["model"]["merges"]
    return [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in merges]


def tiny_tokenizer_meta(vocab_size: int = 512) -> dict:
    """The tiny model's tokenizer keys, trained on the packaged corpus (a fresh copy)."""
    return copy.deepcopy(_tiny_meta_cached(vocab_size))


@functools.lru_cache(maxsize=8)
def _tiny_meta_cached(vocab_size: int) -> dict:
    return build_tiny_tokenizer(vocab_size, default_corpus())
