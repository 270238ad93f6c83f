"""llama.cpp's side: the intermediates of llama.cpp's deepseek4 graph (src/models/deepseek4.cpp),
taken through its graph eval callback (llama_context_params.cb_eval) with llama-cpp-python, one
token a decode call and one dump file a token, under this dump's names (docs/diff.md has the
table). Needs llama-cpp-python (0.3.36 is the version read); the CPU build, whose tensors live
in host memory.

llama.cpp names a tensor `{name}-{il}` (`{name}` for the head's); a name given to several
tensors of one graph is taken in evaluation order and the mapping says which (`last`).
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..gguf.file import open_gguf
from .dumpfile import write_step

_F32, _I32 = 0, 26  # ggml_type codes
_NP = {_F32: np.float32, _I32: np.int32}


class _Tensor(ctypes.Structure):
    """struct ggml_tensor of ggml.h (GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS 64, GGML_MAX_SRC 10,
    GGML_MAX_NAME 64): the fields read here are type, ne, nb, data and name."""
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64),
                ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]


def _strided(raw: np.ndarray, dtype: np.dtype, shape, strides) -> np.ndarray:
    base = np.ndarray(shape=tuple(shape), dtype=dtype, buffer=raw, strides=tuple(strides))
    return np.array(base, copy=True)


@dataclass(frozen=True)
class Twin:
    """How one dump name is read from llama.cpp: which tensor, which of its namesakes, and the
    step's row from it (or None: no row at this position)."""
    names: tuple[str, ...]         # candidates, first present wins; "{il}" is the layer
    pick: int = 0                  # which namesake, in evaluation order (-1: the last)
    row: Callable | None = None    # (array, ctx) -> row or None; default: reshape to the dump's row


# Fills for the twins whose row needs the step's context: pos, cfg, il.
def _window_row(ratio_of):
    def row(a, c):
        ratio = ratio_of(c)
        return (a.reshape(-1), c["pos"] + 1 - ratio) if (c["pos"] + 1) % ratio == 0 else None
    return row


def _picking(fn):
    """Rows of the indexer's queries: only where it picks, (pos + 1) // 4 > top_k, like ds4ref."""
    def row(a, c):
        return fn(a, c) if (c["pos"] + 1) // 4 > c["cfg"].indexer_top_k else None
    return row


def _scores(a, c):
    n = (c["pos"] + 1) // 4
    return a.reshape(-1)[:n]


MAPPING: dict[str, Twin] = {
    "hc_attn_in": Twin(("l_last-{prev}", "hc_init")),
    "hc_attn_pre": Twin(("hc_attn_pre-{il}",)),
    "attn_norm": Twin(("attn_norm-{il}",)),
    "qr": Twin(("qr_norm-{il}",)),
    "q": Twin(("q-{il}",)),
    "kv": Twin(("kv-{il}",)),
    "attn_comp_kv": Twin(("csa_state_kv-{il}", "hca_state_kv-{il}")),
    "attn_comp_score": Twin(("csa_state_score_ape-{il}", "hca_state_score_ape-{il}")),
    "attn_comp_row": Twin(("csa_state_compress-{il}", "hca_state_compress-{il}"), -1,
                          _window_row(lambda c: c["cfg"].ratio(c["il"]))),
    "idx_comp_kv": Twin(("lid_state_kv-{il}",)),
    "idx_comp_score": Twin(("lid_state_score_ape-{il}",)),
    "idx_comp_row": Twin(("lid_state_compress-{il}",), -1, _window_row(lambda c: 4)),
    "idx_q": Twin(("lid_q_rope-{il}",), 0, _picking(lambda a, c: a)),
    "idx_weights": Twin(("lid_weights-{il}",), 0, _picking(lambda a, c: a)),
    "idx_score": Twin(("lid_score_masked-{il}",), 0, _picking(_scores)),
    "idx_topk": Twin(("lid_top_k-{il}",), 0, _picking(lambda a, c: np.sort(a.reshape(-1)))),
    "attn_o": Twin(("attn_raw-{il}", "attn_csa_lid-{il}", "attn_hca-{il}")),
    "attn_out": Twin(("attn_out-{il}",)),
    "hc_attn_out": Twin(("hc_attn_post-{il}",)),
    "hc_ffn_pre": Twin(("hc_ffn_pre-{il}",)),
    "ffn_norm": Twin(("ffn_norm-{il}",)),
    "router_logits": Twin(("ffn_moe_logits-{il}",)),
    "router_scores": Twin(("ffn_moe_probs_biased-{il}", "ffn_moe_probs-{il}")),
    "router_ids": Twin(("ffn_moe_topk-{il}",), 0, lambda a, c: np.sort(a.reshape(-1))),
    # llama.cpp keeps its experts in the order it chose them: ds4ref's is ascending id
    "router_weights": Twin(("ffn_moe_weights_scaled-{il}", "ffn_moe_weights_norm-{il}", "ffn_moe_weights-{il}"),
                           0, lambda a, c: a.reshape(-1)[c["order"]]),
    "expert_down": Twin(("ffn_moe_down-{il}",), 0, lambda a, c: a.reshape(len(c["order"]), -1)[c["order"]]),
    "ffn_moe": Twin(("ffn_moe_out-{il}",)),
    "ffn_shexp": Twin(("ffn_shexp-{il}",)),
    "ffn_out": Twin(("ffn_out-{il}",)),
    "hc_ffn_out": Twin(("l_last-{il}",)),
}
HEAD_MAPPING: dict[str, Twin] = {
    "hc_head": Twin(("hc_head",)),
    "norm": Twin(("result_norm",)),
    "logits": Twin(("result_output",)),
}


def wanted_names(n_layer: int) -> set[str]:
    out = {n for t in HEAD_MAPPING.values() for n in t.names}
    for il in range(n_layer):
        for t in MAPPING.values():
            out |= {n.format(il=il, prev=il - 1) for n in t.names}
    out.add("ffn_moe_topk-{il}")
    return out


def _rows(captured: dict[str, list[np.ndarray]], cfg, pos: int) -> dict[str, tuple[np.ndarray, np.ndarray | None]]:
    out = {}
    for il in range(cfg.n_layer):
        ids = captured.get(f"ffn_moe_topk-{il}")
        ctx = {"pos": pos, "cfg": cfg, "il": il,
               "order": np.argsort(ids[0].reshape(-1), kind="stable") if ids else None}
        for op, twin in MAPPING.items():
            _take(out, f"blk.{il}.{op}", twin, captured, ctx, il)
    for op, twin in HEAD_MAPPING.items():
        _take(out, f"output.{op}", twin, captured, {"pos": pos, "cfg": cfg, "il": None}, None)
    return out


def _take(out, name, twin, captured, ctx, il):
    found = None
    for n in twin.names:
        n = n.format(il=il, prev=(il or 0) - 1)
        if n in captured:
            found = captured[n][twin.pick]
            break
    if found is None:
        return
    if twin.row is None:
        out[name] = (found.reshape(1, *_row_shape(found)), None)
        return
    row = twin.row(found, ctx)
    if row is None:
        return
    if isinstance(row, tuple):
        out[name] = (row[0][None], np.array([row[1]]))
    else:
        out[name] = (np.asarray(row)[None], np.array([ctx["pos"]]))


def _row_shape(a: np.ndarray) -> tuple[int, ...]:
    """One token's tensor without ggml's unit axes (the token axis included)."""
    shape = tuple(n for n in a.shape if n != 1)
    return shape or (1,)


def traits(model_path) -> list[str]:
    """llama.cpp's arithmetic in compare.TRAITS' terms: float32 in orders of its own, KV rows in
    f32 (the context asks for it), activations rounded to the weights' dot-product type (ggml's
    vec_dot_type): int8 blocks for block-quantised matrices, f16 for f16 / bf16 ones."""
    import gguf
    Q = gguf.GGMLQuantizationType
    stored = {t.tensor_type for t in gguf.GGUFReader(str(model_path)).tensors
              if t.name.endswith(".weight") and len(t.shape) > 1 and "tid2eid" not in t.name}
    out = ["f16-act"] if stored & {Q.F16, Q.BF16} else []
    return out + (["q8-act"] if stored - {Q.F32, Q.F16, Q.BF16} else [])


def dump_llama_cpp(model_path: str | os.PathLike, tokens, out: str | os.PathLike, threads: int = 2) -> list[Path]:
    """Feed tokens one decode call each through llama.cpp and write one dump file a token."""
    import llama_cpp as L
    cfg = open_gguf(model_path).config
    wanted = wanted_names(cfg.n_layer)
    captured: dict[str, list[np.ndarray]] = {}

    def on_eval(t, ask, user):
        tensor = ctypes.cast(t, ctypes.POINTER(_Tensor)).contents
        name = tensor.name.decode("utf-8", "replace")
        if name not in wanted or tensor.type not in _NP:
            return False if ask else True
        if not ask:
            captured.setdefault(name, []).append(_strided_copy(tensor))
        return True

    L.llama_backend_init()
    log = []
    keep_log = L.llama_log_callback(lambda level, text, user: log.append(text))
    L.llama_log_set(keep_log, ctypes.c_void_p())
    model = L.llama_model_load_from_file(str(model_path).encode(), L.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp refuses {model_path}: " + b"".join(log[-5:]).decode("utf-8", "replace"))
    cp = L.llama_context_default_params()
    cp.type_k = cp.type_v = L.GGML_TYPE_F32
    cp.n_ctx = cp.n_batch = cp.n_ubatch = max(256, 1 << (len(tokens) - 1).bit_length())
    cp.n_threads = cp.n_threads_batch = threads
    keep_cb = L.ggml_backend_sched_eval_callback(on_eval)
    cp.cb_eval = keep_cb
    ctx = L.llama_init_from_model(model, cp)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("step-*.gguf"):
        old.unlink()
    files, names = [], traits(model_path)
    try:
        for pos, tok in enumerate(tokens):
            captured.clear()
            token = (L.llama_token * 1)(int(tok))
            if L.llama_decode(ctx, L.llama_batch_get_one(token, 1)) != 0:
                raise RuntimeError(f"llama_decode failed at position {pos}")
            files.append(out / f"step-{pos:05d}.gguf")
            write_step(files[-1], "llama.cpp (llama-cpp-python " + L.__version__ + ")", names,
                       Path(model_path).name, [pos], [tok], _rows(captured, cfg, pos))
    finally:
        L.llama_free(ctx)
        L.llama_model_free(model)
    del keep_cb, keep_log
    return files


def _strided_copy(t: _Tensor) -> np.ndarray:
    dtype = np.dtype(_NP[t.type])
    ne, nb = list(t.ne)[::-1], list(t.nb)[::-1]
    span = sum((n - 1) * b for n, b in zip(ne, nb)) + dtype.itemsize
    raw = np.frombuffer((ctypes.c_char * span).from_address(t.data), np.uint8)
    return _strided(raw, dtype, ne, nb)
