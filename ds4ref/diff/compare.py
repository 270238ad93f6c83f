"""Two dumps, aligned by position, op by op in dataflow order: where the second leaves the first.

Errors are row-relative: |a - b| over the largest |a| of a's row (a row: one position's tensor),
so an element near zero in a large row does not dominate. Per op: the max and the median over
rows, and the first row (position), head and dim past the op's tolerance. The tolerance of an
op is the sum of the allowances of the numerics traits the two dumps differ in whose effect has
reached that op (TRAITS: each enters at one op and flows down the dataflow from there); two
dumps of one canonical arithmetic get none: they must agree bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .dumpfile import Dump
from .names import HEAD_OPS, LAYER_OPS, OP_OF, dataflow, split


@dataclass(frozen=True)
class Trait:
    entry: str       # the op where its effect first shows (of the first layer that has it)
    median: float    # allowance on the median row error at the entry op, and again each layer after it
    max: float       # allowance on the largest row error, likewise
    why: str


# A rounding's error is passed on and added to at every layer: an allowance grows by its own size
# each layer past the entry's (the head counts as one more layer). The sizes: the errors seen on
# the tiny model with the trait (docs/results/diff_llama_cpp.md), rounded up.
TRAITS: dict[str, Trait] = {
    "order": Trait("hc_attn_pre", 1e-5, 1e-4,
                   "float32 sums in another order, or float64 against float32: rounding of ~6e-8 a product"),
    "f16-act": Trait("hc_attn_pre", 2e-3, 1e-2,
                     "activations rounded to f16 before a product with an f16 weight (ggml's vec_dot_type "
                     "for F16; the hyper-connection mixes are the first): 2^-11 an element"),
    "q8-act": Trait("qr", 1.5e-2, 6e-2,
                    "activations rounded to int8 blocks of 32 before a product with a block-quantised weight "
                    "(ds4ref official float32: canon.quantize_q8; ggml: Q8_0 / Q8_1 / Q8_K): ~0.4% an element"),
    "fp8-kv": Trait("attn_o", 3e-2, 1e-1,
                    "KV rows' non-RoPE dims rounded to FP8 E4M3 (blocks of 64) before storage (attention rows "
                    "and compressed rows): 2^-4 an element"),
    "fp4-indexer": Trait("idx_score", 3e-1, 5e-1,
                         "indexer queries and keys Hadamard-rotated and rounded to FP4 E2M1 (blocks of 32)"),
    "f16-kv": Trait("attn_o", 2e-3, 1e-2, "KV rows stored as f16: 2^-11 an element"),
}
ARITHMETIC = ("canonical", "f64")  # the others (TRAITS) are roundings; no tag: float32 in an order of its own
RANKED_BY = {"router_ids": "router_scores", "idx_topk": "idx_score"}


def differences(a: Dump, b: Dump) -> list[str]:
    """The traits two dumps differ in. Two canonical dumps, or two of one engine with the same
    traits, differ in the roundings one has and the other lacks (one engine against itself must
    agree bit for bit: a run-to-run difference is a finding); otherwise they differ in 'order' and
    every rounding either has (two engines' int8 blocks need not round alike)."""
    ta, tb = set(a.numerics) - set(ARITHMETIC), set(b.numerics) - set(ARITHMETIC)
    if ("canonical" in a.numerics and "canonical" in b.numerics) or \
            (a.engine == b.engine and a.numerics == b.numerics):
        return sorted(ta ^ tb)
    return ["order"] + sorted(ta | tb)


@dataclass
class OpResult:
    name: str
    rows: int
    max: float = 0.0
    median: float = 0.0
    tol_max: float = 0.0
    tol_median: float = 0.0
    first: tuple | None = None        # (position, index within the row) of the first element past tol_max
    explained_by: list[str] = field(default_factory=list)
    flips: list[int] = field(default_factory=list)     # positions whose choice differs at a near tie
    skipped: int = 0                  # rows left out: they follow a flip upstream
    note: str = ""

    @property
    def diverges(self) -> bool:
        return self.max > self.tol_max or self.median > self.tol_median

    @property
    def status(self) -> str:
        if self.diverges:
            return "DIVERGES"
        if self.rows == 0:
            return "not compared"
        if self.max == 0:
            return "exact"
        if self.flips:
            return "near-tie flip: " + ", ".join(self.explained_by)
        return "within: " + ", ".join(self.explained_by)


def compare(a: Dump, b: Dump, n_layer: int | None = None) -> list[OpResult]:
    """Every name both dumps hold, in dataflow order."""
    if n_layer is None:
        n_layer = 1 + max((split(n)[0] for n in a.keys() | b.keys() if n.startswith("blk.")), default=-1)
    order = dataflow(n_layer)
    diffs = differences(a, b)
    entry = {t: _entry_index(TRAITS[t].entry, order, a, b) for t in diffs}
    results, flips = [], []  # (layer, dataflow index, position) of every near-tie flip so far
    for i, name in enumerate(order):
        if name not in a.tensors or name not in b.tensors:
            continue
        reached = [t for t in diffs if i >= entry[t]]
        grown = {t: 1 + _layer(name, n_layer) - _layer(order[entry[t]], n_layer) for t in reached}
        r = OpResult(name, 0, tol_max=sum(TRAITS[t].max * grown[t] for t in reached),
                     tol_median=sum(TRAITS[t].median * grown[t] for t in reached), explained_by=reached)
        _measure(r, a, b, name, flips, i, _layer(name, n_layer))
        results.append(r)
    return results


def _layer(name: str, n_layer: int) -> int:
    il = split(name)[0]
    return n_layer if il is None else il


def _entry_index(op: str, order: list[str], a: Dump, b: Dump) -> int:
    for i, name in enumerate(order):
        if split(name)[1] == op and name in a.tensors and name in b.tensors:
            return i
    return len(order)


def _aligned(a: Dump, b: Dump, name: str):
    ka, ra = a.tensors[name]
    kb, rb = b.tensors[name]
    keys, ia, ib = np.intersect1d(ka, kb, return_indices=True)
    return keys, ra[ia], rb[ib]


WINDOW = 128  # the longest compressor window: a compressed row keyed w pools positions w .. w + 127


def _after_flip(name: str, keys: np.ndarray, flips: list, layer: int) -> np.ndarray:
    """Rows downstream of a near-tie flip: in the flip's layer, its own position; in later layers
    every position from it on (they attend to what it wrote); a compressed row (keyed by its
    window's start) when its window may reach it."""
    reach = keys + (WINDOW - 1 if split(name)[1] in ("attn_comp_row", "idx_comp_row") else 0)
    out = np.zeros(len(keys), bool)
    for lf, _, p in flips:
        out |= (keys == p) if layer == lf else (reach >= p) if layer > lf else False
    return out


def _measure(r: OpResult, a: Dump, b: Dump, name: str, flips: list, index: int, layer: int) -> None:
    keys, ra, rb = _aligned(a, b, name)
    keep = ~_after_flip(name, keys, flips, layer)
    r.skipped = int((~keep).sum())
    keys, ra, rb = keys[keep], ra[keep], rb[keep]
    r.rows = len(keys)
    if r.rows == 0:
        return
    il, op = split(name)
    if OP_OF[op].kind == "ids":
        _measure_ids(r, a, b, name, keys, ra, rb, flips, index, layer)
        return
    ra, rb = ra.astype(np.float64), rb.astype(np.float64)
    if OP_OF[op].kind == "scores":  # rows grow with the position: compare the columns both have
        width = min(ra.shape[1], rb.shape[1])
        ra, rb = ra[:, :width], rb[:, :width]
    elif ra.shape != rb.shape:
        if ra[0].size != rb[0].size:
            raise ValueError(f"{name}: rows of {ra.shape[1:]} against {rb.shape[1:]}")
        rb = rb.reshape(ra.shape)  # an engine's own layout of the same row (ggml's flat heads)
    if OP_OF[op].kind == "scores":  # compare where a sees a row; a row b does not see is an error
        seen = np.isfinite(ra)
        rb = np.where(seen, rb, ra)
        ra = np.where(seen, ra, 0.0)
        rb = np.where(seen, rb, 0.0)
    flat_a, flat_b = ra.reshape(len(ra), -1), rb.reshape(len(rb), -1)
    scale = np.abs(flat_a).max(axis=1, keepdims=True)
    diff = np.abs(flat_a - flat_b)
    err = np.where(diff == 0, 0.0, diff / np.where(scale > 0, scale, np.inf))
    err = np.where(np.isnan(flat_b) | np.isinf(flat_b), np.inf, err)
    per_row = err.max(axis=1)
    r.max, r.median = float(per_row.max()), float(np.median(per_row))
    over = np.nonzero(per_row > r.tol_max)[0]
    if len(over):
        row = over[0]
        r.first = (int(keys[row]), np.unravel_index(int(np.argmax(err[row] > r.tol_max)), ra.shape[1:]))


def _measure_ids(r, a, b, name, keys, ra, rb, flips, index, layer) -> None:
    """Sets per row. A row whose sets differ is a near-tie flip when each side chose the best of
    its own ranking scores (router_scores, idx_score) and those scores agree within tolerance:
    the flip then follows from the numerics, and what it feeds is left out (_after_flip)."""
    differ = [i for i in range(len(keys)) if set(ra[i].tolist()) != set(rb[i].tolist())]
    r.max = len(differ) / len(keys) if differ else 0.0
    r.median = 0.0
    if not differ:
        return
    il, op = split(name)
    ranked = f"blk.{il}.{RANKED_BY[op]}"
    unexplained = []
    for i in differ:
        if r.explained_by and _follows_ranking(a, ranked, keys[i], ra[i]) and \
                _follows_ranking(b, ranked, keys[i], rb[i]):
            r.flips.append(int(keys[i]))
            flips.append((layer, index, int(keys[i])))
        else:
            unexplained.append(i)
    if unexplained:
        r.first = (int(keys[unexplained[0]]), ())
        r.tol_max = -1.0  # any unexplained flip diverges
    else:
        r.max = 0.0 if not r.flips else r.max
        r.tol_max = max(r.tol_max, r.max)
        r.note = f"{len(r.flips)} near-tie flip(s) at positions {r.flips[:8]}"


def _follows_ranking(d: Dump, ranked: str, key: int, chosen: np.ndarray) -> bool:
    if ranked not in d.tensors:
        return False
    keys, rows = d.tensors[ranked]
    hit = np.nonzero(keys == key)[0]
    if not len(hit):
        return False
    s = rows[hit[0]].astype(np.float64)
    s = s[np.isfinite(s)] if s.ndim == 1 else s
    mask = np.zeros(len(s), bool)
    mask[chosen[chosen < len(s)]] = True
    return not mask.all() and (mask.any() and s[mask].min() >= s[~mask].max())


def first_divergence(results: list[OpResult]) -> OpResult | None:
    return next((r for r in results if r.diverges), None)


def report(a_name: str, b_name: str, a: Dump, b: Dump, results: list[OpResult]) -> str:
    """Markdown: the verdict, then every op in dataflow order."""
    diffs = differences(a, b)
    lines = [f"A: {a_name} ({a.engine}; numerics: {', '.join(a.numerics) or 'f32'})",
             f"B: {b_name} ({b.engine}; numerics: {', '.join(b.numerics) or 'f32'})", ""]
    if diffs:
        lines.append("Known numerics differences (each allowed from the op where it enters):")
        lines += [f"- {t} (from {TRAITS[t].entry}; median {TRAITS[t].median:g}, max {TRAITS[t].max:g} a layer): "
                  f"{TRAITS[t].why}" for t in diffs]
    else:
        lines.append("Same canonical arithmetic on both sides: every op must agree bit for bit.")
    lines.append("")
    first = first_divergence(results)
    if first is None:
        lines.append("No divergence: every op is exact or within its known numerics differences.")
    else:
        where = f" at position {first.first[0]}, index {tuple(int(x) for x in first.first[1])}" if first.first else ""
        lines.append(f"FIRST DIVERGENCE: {first.name}{where}: max {first.max:.3g} > {first.tol_max:.3g} "
                     f"or median {first.median:.3g} > {first.tol_median:.3g}; not explained by "
                     f"{', '.join(first.explained_by) or 'any known numerics difference'}.")
    nonzero = next((r for r in results if r.max > 0), None)
    if nonzero is not None and nonzero is not first:
        lines.append(f"First difference: {nonzero.name} (max {nonzero.max:.3g}): {nonzero.status}.")
    lines += ["", "| op | rows | max rel | median rel | tolerance (max / median) | first past tolerance "
              "(position, index) | status |", "|---|---|---|---|---|---|---|"]
    for r in results:
        first_cell = f"{r.first[0]}, {tuple(int(x) for x in r.first[1])}" if r.first else ""
        extra = f" ({r.note})" if r.note else ""
        extra += f" ({r.skipped} rows after a flip left out)" if r.skipped else ""
        lines.append(f"| {r.name} | {r.rows} | {r.max:.3g} | {r.median:.3g} | {max(r.tol_max, 0):.3g} / "
                     f"{r.tol_median:.3g} | {first_cell} | {r.status}{extra} |")
    return "\n".join(lines)


__all__ = ["TRAITS", "compare", "differences", "first_divergence", "report", "LAYER_OPS", "HEAD_OPS"]
