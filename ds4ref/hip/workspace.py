"""What HipBackend.configure allocates beside the weights, in bytes, from the config alone.

One sizing for both users: configure checks it against free device memory and allocates by it
(`workspace_sizes`), and the server's memory plan (paging/plan.py, `--dry-run`) adds it to the
weights and state (`with_pass_workspace`), so the plan and the start-up refusal agree. What grows
with the keys a row can see (block tables, RoPE rows, indexer scores, attention partials) is
sized by the context a lane can reach (device_state.lane_context: the server's max_context
within the pool and the model's context), and `check_pass_fits` refuses a pass past it. Pure
arithmetic: no device.
"""
from __future__ import annotations

import math
from dataclasses import replace

from ..backend import DECODE_LANES
from ..gguf.config import CSA
from ..gguf.tensors import is_int_tensor, tensor_shapes
from ..paging.layout import PageLayout
from ..paging.plan import MemoryPlan
from . import launch as K
from .device_state import LANE_FIELDS, DeviceState, lane_context, max_pages_per_slot
from .device_weights import is_vector


def _blocks(n: int, per: int) -> int:
    return max(1, -(-int(n) // per))


def max_keys(cfg, context: int) -> int:
    """The most keys one lane's attention can read in any layer at this context: the raw
    window plus the visible compressed rows (at most the top-k for ratio 4)."""
    context = min(context, cfg.context_length)
    most = cfg.sliding_window
    for r in cfg.compress_ratios:
        if r == CSA:
            most = max(most, cfg.sliding_window + min(cfg.indexer_top_k, context // 4))
        elif r:
            most = max(most, cfg.sliding_window + context // r + 1)
    return most


def score_capacity(cfg, maxp: int, page_tokens: int) -> int:
    """Indexer scores a lane can have: a slot's ratio-4 rows."""
    return maxp * (page_tokens // CSA) if CSA in cfg.compress_ratios else 1


def attention_slices(cfg, maxp: int, page_tokens: int) -> int:
    return _blocks(max_keys(cfg, maxp * page_tokens), K.AT3_SPLIT)


class WorkspaceError(ValueError):
    """A pass's rows would read more than the workspace was sized for (raised before any state
    changes, as the protocol's other checks)."""


def lane_needs(cfg, position: int) -> dict[str, int]:
    """What a lane at `position` reads from the sized buffers: RoPE rows (positions 0..position),
    indexer scores (its visible ratio-4 rows) and attention key slices (max_keys)."""
    n = position + 1
    return {"RoPE rows": n, "indexer scores": n // CSA if CSA in cfg.compress_ratios else 1,
            "attention slices": _blocks(max_keys(cfg, n), K.AT3_SPLIT)}


def check_pass_fits(cfg, last_position: int, holds: dict[str, int], context: int) -> None:
    """Refuse a pass whose furthest row needs more than `holds` (lane_needs' keys, as configured
    for lanes of `context` positions)."""
    for what, need in lane_needs(cfg, last_position).items():
        if need > holds[what]:
            raise WorkspaceError(f"a row at position {last_position} needs {need} {what}, but the workspace holds "
                                 f"{holds[what]} (configured for lanes of {context} positions: max_context)")


def matrix_shapes(cfg) -> list[tuple[int, int]]:
    """(rows, cols) of every weight a matvec reads: what DeviceWeights holds as matrices."""
    return [(math.prod(shape[:-1]), shape[-1]) for name, shape in tensor_shapes(cfg).items()
            if not (is_int_tensor(name) or is_vector(name, shape))]


def q8_width(cfg, quantised_products: bool) -> int:
    """Elements per lane of the widest input a quantised product takes (the routed experts' down
    input is a lane's kk rows); 0 without quantised products (plain numerics)."""
    if not quantised_products:
        return 0
    c = cfg
    return max(c.n_embd, c.q_lora_rank, c.n_head * c.head_dim, c.o_groups * c.o_lora_rank,
               c.expert_ff * max(c.n_expert_shared, 1), c.n_expert_used * c.expert_ff)


def shared_q8_inputs(cfg, quantised_products: bool) -> dict[str, int]:
    """Activations that several quantised products read, with their widths: each keeps its own
    int8 rows, written by the norm that makes it (ds4_rmsnorm_q8), so it is quantised once."""
    if not quantised_products:
        return {}
    return {"a": cfg.n_embd, "qr": cfg.q_lora_rank, "xn": cfg.n_embd}


def _q8_sizes(prefix: str, width: int) -> dict[str, int]:
    """int32/float32 elements per lane of launch.Q8Rows for rows `width` wide: int8 codes, f32 block
    scales, int16 half sums."""
    w = -(-width // 32) * 32
    return {f"{prefix}_codes": max(w // 4, 1), f"{prefix}_scales": max(w // 32, 1), f"{prefix}_sums": max(w // 32, 1)}


# Outputs of matrices that share their input and run as one launch (HipBackend._mv_joint): each
# pair is one allocation, the second name a view of its second half.
JOINT_OUTPUTS = (("ckv", "csc"), ("ikv", "isc"), ("sg", "su"))
JOINT_WEIGHTS = (("attn_compressor_kv.weight", "attn_compressor_gate.weight"),
                 ("indexer_compressor_kv.weight", "indexer_compressor_gate.weight"),
                 ("ffn_gate_shexp.weight", "ffn_up_shexp.weight"))


# What a layer's commit (HipBackend._commit: ring and compressor state) reads from the pass, in
# the order the round log lays them out (joint pairs first then second, adjacent). Buckets of
# up to ROUND_LANES lanes keep these in each layer's own part of the round log, so that a
# speculative round can be cut back to its accepted rows by committing again from the
# snapshot (HipBackend.restore_state) instead of running those rows again.
COMMIT_INPUTS = ("kv", "ckv", "csc", "ikv", "isc", "nprev_a_kv", "nprev_a_sc", "nprev_i_kv", "nprev_i_sc")
ROUND_LANES = 4 * DECODE_LANES  # 16 lanes of a decode row and 3 drafts


def round_log_lanes(max_pass_rows: int) -> int:
    return min(ROUND_LANES, max_pass_rows)


def workspace_sizes(cfg, max_pass_rows: int, maxp: int, page_tokens: int,
                    quantised_products: bool = False) -> dict[str, int]:
    """int32/float32 elements per lane of every workspace buffer of a max_pass_rows-lane pass at this
    page geometry (every bucket's program uses the first lanes of these buffers)."""
    c, L = cfg, max_pass_rows
    D, Di, hc, d = c.head_dim, c.indexer_head_dim, c.hc_mult, c.n_embd
    wmax = max(D, Di)
    cmax = max([8] + [r for r in c.compress_ratios if r])
    ffs = c.expert_ff * max(c.n_expert_shared, 1)
    kk = c.n_expert_used
    ncap4, at_nz = score_capacity(c, maxp, page_tokens), attention_slices(c, maxp, page_tokens)
    f32 = {
        "s0": hc * d, "s1": hc * d, "mix": c.hc_mix, "u": d, "post": hc, "comb": hc * hc,
        "a": d, "qa_raw": c.q_lora_rank, "qr": c.q_lora_rank, "q_raw": c.n_head * D, "q": c.n_head * D,
        "kv_raw": D, "kv": D,
        "ckv": 2 * D, "csc": 2 * D, "ikv": 2 * Di, "isc": 2 * Di,
        "cand_kv": cmax * wmax, "cand_sc": cmax * wmax, "pooled": wmax, "crow": wmax, "crow2": wmax,
        "nprev_a_kv": 4 * D, "nprev_a_sc": 4 * D, "nprev_i_kv": 4 * Di, "nprev_i_sc": 4 * Di,
        "qi": c.indexer_heads * Di, "qi_q": c.indexer_heads * Di,
        "wraw": c.indexer_heads, "scores": ncap4,
        "o": c.n_head * D, "z": c.o_groups * c.o_lora_rank, "y": d,
        "xn": d, "rlog": c.n_expert, "rw": kk, "eg": kk * c.expert_ff, "eu": kk * c.expert_ff,
        "eh": kk * c.expert_ff, "ed": kk * d, "sg": ffs, "su": ffs, "sh": ffs, "sd": d, "ym": d,
        "hmix": hc, "hx": d, "hn": d, "logits": c.vocab_size,
    }
    f32["hs"] = hc * d  # the emitting rows' streams, gathered for the head
    i32 = {"emit_pos": 1, "sel": c.indexer_top_k, "hid": kk, "ids": kk, "amax": 1,
           "elist": -(-K.expert_list_ints(c.n_expert, kk, L) // L),
           "etiles": -(-K.expert_tiles_ints(c.n_expert, kk, L) // L)}
    # v3: K-split scratch for few-row matrices, attention slice partials (m, den, acc)
    ksf = max([K.ksplit_floats(rows, cols, L) for rows, cols in matrix_shapes(c)] + [1])
    f32["ksplit"] = -(-ksf // L)
    f32["at_m"] = f32["at_den"] = c.n_head * at_nz
    f32["at_acc"] = c.n_head * at_nz * D
    # quantised activations (launch.Q8Rows): the scratch any product quantises into, and the rows of
    # the activations several products share
    f32.update(_q8_sizes("q8", q8_width(c, quantised_products)))
    for name, width in shared_q8_inputs(c, quantised_products).items():
        f32.update(_q8_sizes(f"{name}_q8", width))
    return {**f32, **i32}


def rope_positions(cfg, n_pages: int, page_tokens: int, max_context: int | None = None) -> int:
    """Rows of the RoPE tables: every position a slot can hold."""
    return lane_context(cfg, n_pages, page_tokens, max_context)


def device_bytes(cfg, n_slots: int, n_pages: int, page_tokens: int, max_pass_rows: int, compact: bool,
                 quantised_products: bool = False, max_context: int | None = None) -> dict[str, int]:
    """Bytes of everything configure allocates for lanes of up to max_context positions (None:
    the model's context), by part: "state" (pages, per-slot rings and compressor state, block
    tables: DeviceState.bytes_needed), "lanes" (the per-lane fields), "rope" (cos/sin of both
    RoPE kinds, f32), "workspace" (the max_pass_rows-lane pass) and "round_log" (COMMIT_INPUTS
    of every layer, for the buckets of up to ROUND_LANES lanes)."""
    maxp = max_pages_per_slot(n_pages, page_tokens, lane_context(cfg, n_pages, page_tokens, max_context))
    ratios = {r for r in cfg.compress_ratios if r}
    return {
        "state": DeviceState.bytes_needed(cfg, n_slots, n_pages, page_tokens, compact, max_context),
        "lanes": 4 * (len(LANE_FIELDS) + len(ratios)) * max_pass_rows,
        "rope": 2 * 2 * 4 * (cfg.n_rot // 2) * rope_positions(cfg, n_pages, page_tokens, max_context),
        "workspace": 4 * max_pass_rows * sum(workspace_sizes(cfg, max_pass_rows, maxp, page_tokens,
                                                        quantised_products).values()),
        "round_log": 4 * round_log_lanes(max_pass_rows) * cfg.n_layer * sum(
            workspace_sizes(cfg, max_pass_rows, maxp, page_tokens, quantised_products)[n] for n in COMMIT_INPUTS),
    }


def pass_workspace(config, lanes: int, n_pages: int, page_tokens: int, max_pass_rows: int, storage: str,
                   numerics: str, max_context: int | None = None) -> int:
    """What configure allocates beside the paged history and the per-slot state for lanes of up
    to max_context positions: block tables, lane fields, RoPE tables and the max_pass_rows-row
    pass's buffers (official numerics' products with quantised weights take int8 activations,
    whose scratch is part of the workspace)."""
    layout = PageLayout(config, page_tokens)
    allocated = sum(device_bytes(config, lanes, n_pages, page_tokens, max_pass_rows, storage == "compact",
                                 numerics == "official", max_context).values())
    return allocated - n_pages * layout.page_bytes(storage) - lanes * layout.slot_bytes(storage)


def with_pass_workspace(plan: MemoryPlan, max_pass_rows: int, numerics: str) -> MemoryPlan:
    """The server's memory plan with the hip backend's pass workspace counted, for lanes of the
    plan's context (what SeqEngine configures the backend with)."""
    return replace(plan, workspace=pass_workspace(plan.config, plan.lanes, plan.n_pages, plan.page_tokens,
                                                  max_pass_rows, plan.storage, numerics, plan.context),
                   workspace_rows=max_pass_rows)


def flash_table(lanes: int = 16, contexts=(1 << 16, 1 << 20), rows=(256, 1024, 2048, 4096)) -> str:
    """docs/paging.md's table: Flash's pass workspace (compact rows, official numerics) for `lanes`
    lanes of each context, a pool of lanes x context, sized by the pool's reach up to the model's
    context (no max_context) and by the lanes' context."""
    from ..gguf.tiny import flash_config
    cfg, gib = flash_config(), float(1 << 30)
    out = [f"| {lanes} lanes x context | sized by | " + " | ".join(f"{r:,} rows" for r in rows) + " |",
           "|---|---|" + "---|" * len(rows)]
    for ctx in contexts:
        n_pages = lanes * -(-ctx // 128)
        for label, limit in (("the pool (up to the model's context)", None), ("the lanes' context", ctx)):
            sizes = [pass_workspace(cfg, lanes, n_pages, 128, r, "compact", "official", limit) / gib for r in rows]
            out.append(f"| {ctx:,} ({n_pages:,} pages) | {label} | " + " | ".join(f"{s:.1f} GiB" for s in sizes) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    print(flash_table())
