"""The GGUF metadata ds4ref reads: each key's type, and the tokenizer's fit to the model.

GGUF stores a type with every value, so a file can hold a count as a string or a
per-layer array as a scalar. Such a file is refused here, naming the key and the
type it should have, before anything is built from it (otherwise it fails later
inside Python: int("six"), len(4)). The bounds of the config sizes are checked by
DS4Config.validate. docs/gguf.md lists both.
"""
from __future__ import annotations

from typing import Any, Mapping

from gguf import GGUFValueType as VType

from .config import KEYS, ARCH


class MetadataError(ValueError):
    """A metadata key has the wrong type, or the tokenizer does not fit the model."""


_INTS = frozenset({VType.UINT8, VType.INT8, VType.UINT16, VType.INT16, VType.UINT32, VType.INT32,
                   VType.UINT64, VType.INT64})
_NUMBERS = _INTS | {VType.FLOAT32, VType.FLOAT64}

# The published type (what the writer uses) -> the GGUF types the reader accepts for it:
# converters differ in integer width and float precision, never in kind.
ACCEPTED: dict[str, frozenset] = {
    "u32": _INTS, "u64": _INTS, "f32": _NUMBERS, "bool": frozenset({VType.BOOL}),
    "string": frozenset({VType.STRING}),
}
ACCEPTED_ELEMENTS: dict[str, frozenset] = {
    "array of i32": _INTS, "array of f32": _NUMBERS, "array of string": frozenset({VType.STRING}),
}

TOKENIZER_KEY_TYPES: dict[str, str] = {
    "tokenizer.ggml.model": "string",
    "tokenizer.ggml.pre": "string",
    "tokenizer.ggml.tokens": "array of string",
    "tokenizer.ggml.token_type": "array of i32",
    "tokenizer.ggml.merges": "array of string",
    "tokenizer.ggml.bos_token_id": "u32",
    "tokenizer.ggml.eos_token_id": "u32",
    "tokenizer.ggml.padding_token_id": "u32",
    "tokenizer.ggml.add_bos_token": "bool",
    "tokenizer.ggml.add_eos_token": "bool",
    "tokenizer.chat_template": "string",
}

KEY_TYPES: dict[str, str] = {
    "general.architecture": "string",
    "general.name": "string",
    "general.alignment": "u32",
    **{f"{ARCH}.{suffix}": gguf_type for suffix, _, gguf_type in KEYS.values()},
    f"{ARCH}.expert_group_count": "u32",
    f"{ARCH}.expert_group_used_count": "u32",
    f"{ARCH}.rope.scaling.type": "string",
    f"{ARCH}.expert_gating_func": "u32",
    f"{ARCH}.nextn_predict_layers": "u32",
    **TOKENIZER_KEY_TYPES,
}


def expected_type(key: str) -> str | None:
    """The type a key must have; None for keys ds4ref does not read."""
    if key in KEY_TYPES:
        return KEY_TYPES[key]
    if key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):  # eot, unknown, ...
        return "u32"
    return None


def _accepts(expected: str, vtype: int, sub: int | None) -> bool:
    if expected in ACCEPTED_ELEMENTS:
        return vtype == VType.ARRAY and sub in ACCEPTED_ELEMENTS[expected]
    return vtype in ACCEPTED[expected]


def _describe(vtype: int, sub: int | None) -> str:
    if vtype == VType.ARRAY:
        return f"an array of {VType(sub).name.lower()}"
    name = VType(vtype).name.lower()
    return f"{'an' if name.startswith('int') else 'a'} {name}"


def check_types(value_types: Mapping[str, tuple[int, int | None]]) -> None:
    """Raise MetadataError naming the first key whose GGUF type is not what ds4ref reads."""
    for key, (vtype, sub) in value_types.items():
        expected = expected_type(key)
        if expected is not None and not _accepts(expected, vtype, sub):
            kind = "any integer type" if expected in ("u32", "u64") else None
            note = f" ({kind})" if kind else ""
            raise MetadataError(f"metadata key {key!r} is {_describe(vtype, sub)}, expected {expected}{note}")


def check_tokenizer(meta: Mapping[str, Any], vocab_size: int) -> None:
    """The tokenizer keys must describe one token per embedding row, and every special
    id must name one of them. A file without tokenizer keys is allowed (ids only)."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens) != vocab_size:
        raise MetadataError(
            f"tokenizer.ggml.tokens has {len(tokens)} entries but {ARCH}.vocab_size is {vocab_size}; "
            f"a file lists one token per embedding row (ids a tokenizer leaves undefined are "
            f"[PAD<id>] tokens of type UNUSED, as ds4ref.convert writes them)")
    types = meta.get("tokenizer.ggml.token_type")
    if types is not None and tokens is not None and len(types) != len(tokens):
        raise MetadataError(f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    for key, value in meta.items():
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id") and not 0 <= value < vocab_size:
            raise MetadataError(f"{key} is {value}; it must be a token id in 0..{vocab_size - 1}")
