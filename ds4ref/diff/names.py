"""The dump's names, in the model's dataflow order (docs/diff.md has the table).

A layer's intermediates are `blk.{il}.{op}`, the head's `output.{op}`. Every tensor's first axis
is its rows: one row a position, unless the file carries `{name}.pos` (then row r is keyed by
pos[r]: the query position for the indexer's rows, the window's first position for a compressed
row). Float tensors are f32 or f64; ids are i32.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    name: str
    shape: str   # per row, in NumPy order (GGUF's ne is its reverse)
    kind: str    # "float", "ids" (a row's chosen ids, compared as a set) or "scores"
    what: str


LAYER_OPS: tuple[Op, ...] = (
    Op("hc_attn_in", "(hc, d)", "float", "the hyper-connection streams into the layer"),
    Op("hc_attn_pre", "(d,)", "float", "mHC pre mix of the streams: the attention block's input"),
    Op("attn_norm", "(d,)", "float", "attention input norm"),
    Op("qr", "(q_lora,)", "float", "the query's low-rank residual after its norm"),
    Op("q", "(H, D)", "float", "query heads after the head norm and RoPE"),
    Op("kv", "(D,)", "float", "the KV row after its norm and RoPE, before any storage rounding (FP8)"),
    Op("attn_comp_kv", "(c*D,)", "float", "the attention compressor's kv projection of the token"),
    Op("attn_comp_score", "(c*D,)", "float", "its score projection plus the position bias (ape)"),
    Op("attn_comp_row", "(D,)", "float", "a committed compressed row (pooled, normed, roped at the window's "
                                          "first position, before FP8); keyed by window start"),
    Op("idx_comp_kv", "(2*Di,)", "float", "the indexer compressor's kv projection"),
    Op("idx_comp_score", "(2*Di,)", "float", "its score projection plus ape"),
    Op("idx_comp_row", "(Di,)", "float", "a committed indexer key row (before Hadamard and FP4); keyed by "
                                         "window start"),
    Op("idx_q", "(Hi, Di)", "float", "indexer query heads after RoPE (before Hadamard and FP4); rows that "
                                     "pick"),
    Op("idx_weights", "(Hi,)", "float", "indexer head weights, scaled by 1/sqrt(Hi*Di)"),
    Op("idx_score", "(n,)", "scores", "indexer score of each visible compressed row; -inf past the visible "
                                      "ones"),
    Op("idx_topk", "(top_k,)", "ids", "the compressed rows the indexer keeps (a set)"),
    Op("attn_o", "(H, D)", "float", "attention output heads (with sinks), before the inverse RoPE"),
    Op("attn_out", "(d,)", "float", "after the grouped output projection"),
    Op("hc_attn_out", "(hc, d)", "float", "the streams after the attention block's mHC post"),
    Op("hc_ffn_pre", "(d,)", "float", "mHC pre mix: the FFN block's input"),
    Op("ffn_norm", "(d,)", "float", "FFN input norm"),
    Op("router_logits", "(E,)", "float", "router logits (before sqrt-softplus)"),
    Op("router_scores", "(E,)", "float", "sqrt(softplus(logits)), plus the bias on biased layers: what the "
                                         "choice ranks"),
    Op("router_ids", "(k,)", "ids", "the chosen experts (a set; hash layers: the token's)"),
    Op("router_weights", "(k,)", "float", "the chosen experts' weights, ascending expert id"),
    Op("expert_down", "(k, d)", "float", "each chosen expert's output, unweighted, ascending expert id"),
    Op("ffn_moe", "(d,)", "float", "the routed experts' weighted sum"),
    Op("ffn_shexp", "(d,)", "float", "the shared expert's output"),
    Op("ffn_out", "(d,)", "float", "routed + shared"),
    Op("hc_ffn_out", "(hc, d)", "float", "the streams out of the layer"),
)
HEAD_OPS: tuple[Op, ...] = (
    Op("hc_head", "(d,)", "float", "mHC head mix of the final streams"),
    Op("norm", "(d,)", "float", "output norm"),
    Op("logits", "(vocab,)", "float", "the final logits"),
)
OP_OF = {op.name: op for op in LAYER_OPS + HEAD_OPS}


def layer_name(il: int, op: str) -> str:
    return f"blk.{il}.{op}"


def dataflow(n_layer: int) -> list[str]:
    """Every name a dump may hold, in the order the model computes them."""
    return [layer_name(il, op.name) for il in range(n_layer) for op in LAYER_OPS] + \
        [f"output.{op.name}" for op in HEAD_OPS]


def split(name: str) -> tuple[int | None, str]:
    """'blk.3.kv' -> (3, 'kv'); 'output.logits' -> (None, 'logits')."""
    parts = name.split(".")
    return (int(parts[1]), parts[2]) if parts[0] == "blk" else (None, parts[1])
