"""What each deepseek4 GGUF consumer requires of the metadata: ds4ref, llama.cpp, ds4.c.

A hand-written table, because neither llama.cpp nor ds4.c can be run in CI. It was read
from their loaders (llama.cpp as vendored by the PyPI sdist llama-cpp-python 0.3.36:
src/llama-model.cpp `load_hparams`, src/models/deepseek4.cpp `load_arch_hparams`,
src/llama-model-loader.cpp `get_key`/`get_arr`, src/llama-vocab.cpp; antirez/ds4 ds4.c
`config_validate_model`, `required_u32/u64/f32/bool`, the tokenizer loader). The strictness
differs: llama.cpp's `get_key` takes exactly the C type's GGUF type (a uint32_t field
refuses u64), ds4.c's `required_u32` takes only u32, `required_u64` u32 or u64,
`required_f32` f32, f64, u32 or i32. docs/gguf.md prints this table; a test checks that
the files ds4ref writes satisfy every column.

ds4.c also asserts Flash's values (43 layers, 4096 wide, ...): only a full-size file
can load there; the tiny files satisfy its key and type rules only.
"""
from __future__ import annotations

from typing import Any, Mapping

from gguf import GGUFValueType as VType

from ds4ref.gguf.config import ARCH, KEYS
from ds4ref.gguf.metadata import ACCEPTED, ACCEPTED_ELEMENTS, KEY_TYPES

CONSUMERS = ("ds4ref", "llama.cpp", "ds4.c")
P = f"{ARCH}."

# (requirement, accepted types). "req" = the loader fails without it, "opt" = read if
# present, "info" = read for display only (another type is ignored), "" = not read. Types: u32 u64 i32 f32 f64 bool string, array[...] of those.
_U32, _U32_64, _F32 = ("u32",), ("u32", "u64"), ("f32",)
_F_DS4C = ("f32", "f64", "u32", "i32")

# llama.cpp, deepseek4 (key suffix -> (requirement, types))
_LLAMA = {
    "context_length": ("req", _U32), "embedding_length": ("req", _U32), "block_count": ("req", _U32),
    "nextn_predict_layers": ("opt", _U32), "expert_count": ("opt", _U32),
    "expert_used_count": ("opt", _U32 + ("array[u32]",)), "expert_group_count": ("opt", _U32),
    "expert_group_used_count": ("opt", _U32), "attention.head_count": ("opt", _U32 + ("array[u32]",)),
    "attention.head_count_kv": ("opt", _U32 + ("array[u32]",)),
    "rope.scaling.original_context_length": ("opt", _U32), "rope.freq_base": ("opt", _F32),
    "rope.scaling.type": ("opt", ("string",)), "rope.scaling.factor": ("opt", _F32),
    "attention.key_length": ("opt", _U32), "attention.value_length": ("opt", _U32),
    "rope.dimension_count": ("opt", _U32), "attention.layer_norm_rms_epsilon": ("req", _F32),
    "attention.q_lora_rank": ("req", _U32), "attention.sliding_window": ("req", _U32),
    "expert_feed_forward_length": ("req", _U32 + ("array[u32]",)), "expert_shared_count": ("req", _U32),
    "expert_weights_scale": ("req", _F32), "expert_weights_norm": ("req", ("bool",)),
    "swiglu_clamp_exp": ("req", _F32 + ("array[f32]",)), "swiglu_clamp_shexp": ("opt", _F32 + ("array[f32]",)),
    "attention.indexer.head_count": ("req", _U32), "attention.indexer.key_length": ("req", _U32),
    "attention.indexer.top_k": ("req", _U32), "attention.output_group_count": ("req", _U32),
    "attention.output_lora_rank": ("req", _U32), "attention.compress_rope_freq_base": ("req", _F32),
    "hyper_connection.count": ("req", _U32), "hyper_connection.sinkhorn_iterations": ("req", _U32),
    "hyper_connection.epsilon": ("req", _F32), "hash_layer_count": ("req", _U32),
    "attention.compress_ratios": ("req", ("array[u32]", "array[i32]")),
    "expert_gating_func": ("req", _U32),
}
# ds4.c (antirez/ds4)
_DS4C = {
    "block_count": ("req", _U32), "embedding_length": ("req", _U32), "vocab_size": ("req", _U32),
    "attention.head_count": ("req", _U32), "attention.head_count_kv": ("req", _U32),
    "attention.key_length": ("req", _U32), "attention.value_length": ("req", _U32),
    "rope.dimension_count": ("req", _U32), "attention.q_lora_rank": ("req", _U32),
    "attention.output_lora_rank": ("req", _U32), "attention.output_group_count": ("req", _U32),
    "expert_count": ("req", _U32), "expert_used_count": ("req", _U32),
    "expert_feed_forward_length": ("req", _U32), "expert_shared_count": ("req", _U32),
    "hash_layer_count": ("req", _U32), "expert_group_count": ("opt", _U32),
    "expert_group_used_count": ("opt", _U32), "attention.sliding_window": ("req", _U32),
    "attention.indexer.head_count": ("req", _U32), "attention.indexer.key_length": ("req", _U32),
    "attention.indexer.top_k": ("req", _U32), "hyper_connection.count": ("req", _U32),
    "hyper_connection.sinkhorn_iterations": ("req", _U32),
    "attention.compress_ratios": ("req", ("array[u32]", "array[i32]")),
    "swiglu_clamp_exp": ("req", ("array[f32]", "array[f64]")),
    "rope.scaling.original_context_length": ("req", _U32_64), "rope.freq_base": ("req", _F_DS4C),
    "rope.scaling.factor": ("req", _F_DS4C), "rope.scaling.yarn_beta_fast": ("req", _F_DS4C),
    "rope.scaling.yarn_beta_slow": ("req", _F_DS4C), "attention.compress_rope_freq_base": ("req", _F_DS4C),
    "expert_weights_scale": ("req", _F_DS4C), "attention.layer_norm_rms_epsilon": ("req", _F_DS4C),
    "hyper_connection.epsilon": ("req", _F_DS4C), "expert_weights_norm": ("req", ("bool",)),
    "context_length": ("info", ("u64",)),  # banner only: another type is not refused, just not printed
}
_GLOBAL = {  # keys without the arch prefix: (ds4ref, llama.cpp, ds4.c)
    "general.architecture": (("req", ("string",)),) * 3,
    "tokenizer.ggml.model": (("opt", ("string",)), ("req", ("string",)), ("", ())),
    "tokenizer.ggml.tokens": (("opt", ("array[string]",)), ("req", ("array[string]",)),
                              ("req", ("array[string]",))),
    "tokenizer.ggml.merges": (("opt", ("array[string]",)), ("req", ("array[string]",)),
                              ("req", ("array[string]",))),
    "tokenizer.ggml.token_type": (("opt", ("array[i32]",)), ("opt", ("array[i32]",)), ("", ())),
}

_INT_NAMES = {VType.UINT8: "u8", VType.INT8: "i8", VType.UINT16: "u16", VType.INT16: "i16",
              VType.UINT32: "u32", VType.INT32: "i32", VType.UINT64: "u64", VType.INT64: "i64",
              VType.FLOAT32: "f32", VType.FLOAT64: "f64", VType.BOOL: "bool", VType.STRING: "string"}


def type_name(vtype: int, sub: int | None) -> str:
    """'u32', 'array[i32]', ... for a GGUF (type, element type) pair."""
    if vtype == VType.ARRAY:
        return f"array[{_INT_NAMES[VType(sub)]}]"
    return _INT_NAMES[VType(vtype)]


def _ds4ref_accepts(expected: str) -> tuple[str, ...]:
    if expected in ACCEPTED_ELEMENTS:
        return tuple(f"array[{_INT_NAMES[t]}]" for t in sorted(ACCEPTED_ELEMENTS[expected]))
    return tuple(_INT_NAMES[t] for t in sorted(ACCEPTED[expected]))


def _ds4ref_requirement(key: str) -> str:
    suffix = key.removeprefix(P)
    required = {P + s for s, req, _ in KEYS.values() if req} - {P + "vocab_size"}  # vocab_size is derived
    return "req" if key in required or key == "general.architecture" else "opt"


def requirements() -> dict[str, dict[str, tuple[str, tuple[str, ...]]]]:
    """{key: {consumer: (requirement, accepted type names)}} over every key any consumer reads."""
    keys = [k for k in KEY_TYPES if k.startswith(P)] + list(_GLOBAL)
    keys += [P + s for s in (*_LLAMA, *_DS4C) if P + s not in keys]
    out = {}
    for key in keys:
        if key in _GLOBAL:
            out[key] = dict(zip(CONSUMERS, _GLOBAL[key]))
            continue
        suffix = key.removeprefix(P)
        ours = ((_ds4ref_requirement(key), _ds4ref_accepts(KEY_TYPES[key])) if key in KEY_TYPES else ("", ()))
        out[key] = {"ds4ref": ours, "llama.cpp": _LLAMA.get(suffix, ("", ())), "ds4.c": _DS4C.get(suffix, ("", ()))}
    return out


def problems(consumer: str, value_types: Mapping[str, tuple[int, int | None]]) -> list[str]:
    """Why `consumer` would refuse a file with these key types ([] = it accepts them)."""
    out = []
    for key, per in requirements().items():
        need, types = per[consumer]
        if key not in value_types:
            if need == "req":
                out.append(f"{consumer}: missing {key}")
        elif need in ("req", "opt") and type_name(*value_types[key]) not in types:
            out.append(f"{consumer}: {key} is {type_name(*value_types[key])}, needs one of {', '.join(types)}")
    return out


_ALL_INTS = {"u8", "i8", "u16", "i16", "u32", "i32", "u64", "i64"}


def _summary(types: tuple[str, ...]) -> str:
    """ds4ref's own column lists every integer width: say it in words."""
    scalars = {t for t in types if not t.startswith("array[")}
    elems = {t[6:-1] for t in types if t.startswith("array[")}
    for group, words in ((scalars, ""), (elems, "array of ")):
        if group >= _ALL_INTS:
            rest = sorted(group - _ALL_INTS)
            name = f"{words}any integer" + (" or float" if rest else "")
            return name
    return " / ".join(types)


def markdown_table() -> str:
    """The table docs/gguf.md carries (regenerate with `python -m tests.consumers`)."""
    rows = ["| key | " + " | ".join(CONSUMERS) + " |", "|---" * (len(CONSUMERS) + 1) + "|"]
    for key, per in requirements().items():
        cells = []
        for c in CONSUMERS:
            need, types = per[c]
            label = {"req": "**required**", "opt": "optional", "info": "banner only"}.get(need)
            cells.append(f"{label}: {_summary(types)}" if label else "–")
        rows.append(f"| `{key.removeprefix(P) if key.startswith(P) else key}` | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def metadata_types(meta: Mapping[str, Any]) -> dict[str, tuple[int, int | None]]:
    """The GGUF types ds4ref's writer gives these values (for checking before writing)."""
    from ds4ref.gguf.file import _value_type
    return {k: _value_type(k, v) for k, v in meta.items()}


if __name__ == "__main__":
    print(markdown_table())
