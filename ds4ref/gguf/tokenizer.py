"""DS4's byte-level BPE tokenizer, read from (and for the tiny model written to) GGUF.

The vocabulary and merges come from `tokenizer.ggml.*`; the HuggingFace
`tokenizers` library runs the BPE and the pre-tokeniser. `tokenizer.ggml.pre`
names the pre-tokeniser: `joyai-llm` is the name llama.cpp's converter writes
for DeepSeek-V4 (its tokenizer hashes to that entry), and it stands for the
official Sequence of three splits that DeepSeek's tokenizer.json declares.

Added tokens are those of GGUF type CONTROL (HF `special: true`) or
USER_DEFINED (HF `special: false`, e.g. `<think>`, `<｜tool▁calls▁begin｜>`):
both are matched in the text by their strings, as HF does, never by assumed ids
(spec §6.1). docs/gguf.md says where DS4C's hand-written splitter differs.
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

# The chat-structure strings; in the published vocabulary they are USER_DEFINED tokens.
SPLIT_SPECIALS = (BOS, EOS, USER, ASSISTANT, THINK, END_THINK, DSML)
# Order of the added tokens at the head of the tiny vocabulary (BOS=0, EOS=1).
TINY_SPECIALS = SPLIT_SPECIALS + (PAD,)
# Which of them the published tokenizer.json marks `special: true` (GGUF CONTROL).
CONTROL_SPECIALS = (BOS, EOS, PAD)

# llama.cpp token types
TYPE_NORMAL, TYPE_CONTROL, TYPE_USER_DEFINED, TYPE_UNUSED = 1, 3, 4, 5
ADDED_TYPES = (TYPE_CONTROL, TYPE_USER_DEFINED)


class TokenizerError(ValueError):
    """The GGUF tokenizer metadata is missing or inconsistent."""


# ---------------------------------------------------------------------------
# pre-tokeniser: DeepSeek-V4's tokenizer.json, as llama.cpp's `joyai-llm` entry
# lists the same three expressions. Applied in order; each split isolates its
# matches and hands the pieces between them to the next split.
# ---------------------------------------------------------------------------
OFFICIAL_PRE = "joyai-llm"
DIGITS = r"\p{N}{1,3}"
CJK = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
MAIN = "|".join([
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+",  # ASCII punctuation + ASCII letters
    "[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+",          # one optional lead-in + a letter run
    " ?[\\p{P}\\p{S}]+[\r\n]*",                              # punctuation/symbol run, newlines kept
    "\\s*[\r\n]+",                                            # whitespace up to the last newline
    "\\s+(?!\\S)",                                             # leave the last space to the word
    "\\s+",
])
PRE_SPLITS = (DIGITS, CJK, MAIN)


def _splits() -> list:
    return [pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False) for p in PRE_SPLITS]


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(_splits() + [pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                          use_regex=False)])


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
                 token_types: Sequence[int] | None = None, pre: str = OFFICIAL_PRE):
        if pre != OFFICIAL_PRE:
            raise TokenizerError(f"tokenizer.ggml.pre is {pre!r}; ds4ref knows only {OFFICIAL_PRE!r} "
                                 f"(DeepSeek-V4's pre-tokeniser)")
        self.tokens = list(tokens)
        self._ids = {t: i for i, t in enumerate(self.tokens)}
        if len(self._ids) != len(self.tokens):
            raise TokenizerError("tokenizer.ggml.tokens contains duplicate strings")
        self.token_types = list(token_types) if token_types is not None else [TYPE_NORMAL] * len(self.tokens)
        if len(self.token_types) != len(self.tokens):
            raise TokenizerError(f"tokenizer.ggml.token_type has {len(self.token_types)} entries for "
                                 f"{len(self.tokens)} tokens")
        self.bos_id, self.eos_id = int(bos_id), int(eos_id)
        # string -> id of every added token, and whether HF calls it special (CONTROL)
        self.added = {t: i for i, t in enumerate(self.tokens) if self.token_types[i] in ADDED_TYPES}
        self.special_tokens = self.added  # kept name: the strings encode() turns into single ids
        self._merges = _parse_merges(merges)
        self._hf = _build_hf(self._ids, self._merges, self._added_tokens())
        # the same BPE without added tokens, for text whose added-token strings stay text
        self._hf_plain = _build_hf(self._ids, self._merges, [])

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
        return cls(tokens, metadata["tokenizer.ggml.merges"], bos, eos, metadata.get("tokenizer.ggml.token_type"),
                   metadata.get("tokenizer.ggml.pre", OFFICIAL_PRE))

    def _added_tokens(self) -> list[AddedToken]:
        return [AddedToken(t, special=self.token_types[i] == TYPE_CONTROL, normalized=False,
                           single_word=False, lstrip=False, rstrip=False) for t, i in self.added.items()]

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids of `text`, no BOS added. With special=True every added token's
        string in the text becomes its single id (as HF does); with special=False
        they are plain text."""
        if not isinstance(text, str):
            raise TokenizerError(f"can only encode text, got {type(text).__name__}")
        _check_encodable(text)
        return (self._hf if special else self._hf_plain).encode(text, add_special_tokens=False).ids

    def encode_parts(self, parts: Iterable[tuple[str, bool]]) -> list[int]:
        """Token ids of the parts' concatenation, BOS not added. In a part marked special
        (the template's own text) added-token strings become their ids; in the others (text
        from a request) they are plain text. The text between two added tokens is one piece
        whichever parts it spans, as it would be in one string: HF splits a text at its
        added tokens and pre-tokenises what lies between, so without added-token strings in
        the unspecial parts the ids are exactly `encode` of the concatenation."""
        ids: list[int] = []
        run: list[str] = []  # text since the last added token
        for text, special in parts:
            if not isinstance(text, str):
                raise TokenizerError(f"can only encode text, got {type(text).__name__}")
            _check_encodable(text)
            at = 0
            for tid, (start, end) in self._added_spans(text) if special else ():
                run.append(text[at:start])
                ids += self._plain_ids("".join(run))
                ids.append(tid)
                run, at = [], end
            run.append(text[at:])
        return ids + self._plain_ids("".join(run))

    def _added_spans(self, text: str) -> list[tuple[int, tuple[int, int]]]:
        # HF's own added-token matching; offsets are in characters of `text`
        enc = self._hf.encode(text, add_special_tokens=False)
        return [(i, off) for i, off in zip(enc.ids, enc.offsets) if self.token_types[i] in ADDED_TYPES]

    def _plain_ids(self, text: str) -> list[int]:
        return self._hf_plain.encode(text, add_special_tokens=False).ids if text else []

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of the ids; added tokens are spelled out (CONTROL ones dropped with
        skip_special), incomplete UTF-8 becomes U+FFFD."""
        ids = [int(i) for i in ids]
        for i in ids:
            self.id_to_token(i)  # range check with our own message
        return self._hf.decode(ids, skip_special_tokens=skip_special)

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Raw bytes of the ids (for streaming: a character may span tokens).
        An added token is its own UTF-8 text; any other token maps its symbols
        back to bytes (a token with a symbol outside the byte map is taken as
        UTF-8 text, as HF's ByteLevel decoder does)."""
        return b"".join(self._token_bytes(int(i)) for i in ids)

    def _token_bytes(self, i: int) -> bytes:
        tok = self.id_to_token(i)
        sym = _symbol_to_byte()
        if self.token_types[i] in ADDED_TYPES or any(c not in sym for c in tok):
            return tok.encode("utf-8")
        return bytes(sym[c] for c in tok)

    def is_added(self, i: int) -> bool:
        """True for CONTROL and USER_DEFINED tokens (BOS, `<think>`, `｜DSML｜`, ...)."""
        return self.token_types[int(i)] in ADDED_TYPES

    def token_to_id(self, token: str) -> int | None:
        return self._ids.get(token)

    def id_to_token(self, i: int) -> str:
        if not 0 <= i < len(self.tokens):
            raise TokenizerError(f"token id {i} out of range 0..{len(self.tokens) - 1}")
        return self.tokens[i]

    def pre_tokenize(self, text: str) -> list[str]:
        """The pieces BPE sees (before byte mapping), for tests and docs."""
        return [p for p, _ in pre_tokenizers.Sequence(_splits()).pre_tokenize_str(text)]


def _check_encodable(text: str) -> None:
    # The Rust side rejects lone surrogates with a message about its own types.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise TokenizerError(f"the text has a character UTF-8 cannot hold ({text[e.start]!r} at "
                             f"position {e.start}: a lone surrogate)") from None


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


def _build_hf(vocab: dict[str, int], merges: list[tuple[str, str]], added: list[AddedToken]) -> HFTokenizer:
    for a, b in merges:
        if a not in vocab or b not in vocab or a + b not in vocab:
            raise TokenizerError(f"merge {a!r} + {b!r} refers to a token missing from the vocabulary")
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens(added)
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
    types = ([TYPE_CONTROL if t in CONTROL_SPECIALS else TYPE_USER_DEFINED for t in TINY_SPECIALS]
             + [TYPE_NORMAL] * (vocab_size - len(TINY_SPECIALS)))
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": OFFICIAL_PRE,
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
