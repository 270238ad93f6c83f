"""The memory plan of a server start, computed before anything is allocated.

From the config, the weights' stored bytes (the GGUF header gives them) and the serving
flags: the weights, the paged KV history (pool pages x bytes per page), the per-slot
fixed state (raw rings + compressor state), the hip backend's pass workspace (what
HipBackend.configure allocates beside the state: hip/workspace.with_pass_workspace adds it,
from the sizing configure itself uses) and their total; and, to compare the two
storage forms, bytes per token of context and per slot as float32 and as compact rows.
Sizes come from PageLayout, the pool size from pool_pages (what SeqEngine allocates).

    python -m ds4ref.paging.plan --flash     # the table of docs/paging.md
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

from ..backend import PAGE_TOKENS
from ..gguf.config import DS4Config
from ..gguf.tiny import flash_config
from .layout import PageLayout
from .pool import pool_pages
from .prefix import SNAPSHOTS_PER_SLOT


class PlanError(MemoryError):
    """The plan does not fit the memory available."""


@dataclass(frozen=True)
class MemoryPlan:
    config: DS4Config
    weights: int        # stored tensor bytes the forward pass reads
    lanes: int
    context: int        # per-request context limit
    n_pages: int
    storage: str        # how the backend holds KV rows (layout.kv_storage)
    page_tokens: int = PAGE_TOKENS
    workspace: int = 0  # the backend's allocations beside weights and state (hip: pass_workspace)
    workspace_rows: int = 0  # the largest pass the workspace serves
    snapshots: int = 0  # prefix-cache snapshots held at most (0: no cache); its pages are the pool's
    mtp_slot: int = 0   # one lane's MTP window ring (0: no MTP block); a snapshot carries one too
    draft: int = 0      # the MTP block's per-lane window rings (and on hip its pass buffers)
    round_snapshots: int = 0  # speculation's: one a lane, taken before each round with drafts
    drafter: str = "MTP block"  # what holds the draft rings: the MTP block, or the DSpark draft

    @property
    def layout(self) -> PageLayout:
        return PageLayout(self.config, self.page_tokens)

    @property
    def paged(self) -> int:
        return self.n_pages * self.layout.page_bytes(self.storage)

    @property
    def per_slot(self) -> int:
        return self.layout.slot_bytes(self.storage)

    @property
    def slots(self) -> int:
        return self.lanes * self.per_slot

    @property
    def snapshot_bytes(self) -> int:
        """The prefix cache's share beside the pool: each snapshot is one slot's fixed state
        (and its MTP window ring)."""
        return self.snapshots * (self.per_slot + self.mtp_slot)

    @property
    def round_bytes(self) -> int:
        """Speculation's share: a lane's round snapshot is its fixed state and MTP window ring
        (the backend keeps dropped ones for the next round)."""
        return self.round_snapshots * (self.per_slot + self.mtp_slot)

    @property
    def total(self) -> int:
        return (self.weights + self.paged + self.slots + self.workspace + self.snapshot_bytes + self.draft
                + self.round_bytes)

    def bytes_per_token(self, storage: str) -> float:
        """Paged history per token of context (the raw ring is per slot, not per token)."""
        return self.layout.page_bytes(storage) / self.page_tokens


def make_plan(config: DS4Config, weights: int, lanes: int, context: int, kv_pool_tokens: Optional[int],
              storage: str, page_tokens: int = PAGE_TOKENS, prefix_cache: bool = True,
              mtp_storage: Optional[str] = None, draft_config: Optional[DS4Config] = None) -> MemoryPlan:
    """mtp_storage: how the backend holds the draft module's window rows (None: no draft module);
    draft_config: DSpark's stages (gguf.dspark, a window ring a stage), else the MTP block's one layer
    (gguf.mtp). A lane's draft state is that config's fixed slot state."""
    mtp_slot = 0
    if mtp_storage:
        from ..gguf.mtp import mtp_config
        layers = draft_config if draft_config is not None else mtp_config(config)
        mtp_slot = PageLayout(layers, page_tokens).slot_bytes(mtp_storage)
    return MemoryPlan(config, weights, lanes, context,
                      pool_pages(lanes, context, kv_pool_tokens, page_tokens), storage, page_tokens,
                      snapshots=SNAPSHOTS_PER_SLOT * lanes if prefix_cache else 0,
                      mtp_slot=mtp_slot, draft=lanes * mtp_slot, round_snapshots=lanes if mtp_storage else 0,
                      drafter="DSpark draft" if draft_config is not None else "MTP block")


def weight_bytes(model_file) -> int:
    """Stored bytes of the tensors the forward pass reads, from the GGUF directory (no data read),
    with the MTP block's when the file carries one (ds4ref's former in-file layout, gguf.mtp)."""
    from ..gguf.tensors import tensor_shapes
    names = set(tensor_shapes(model_file.config))
    block = getattr(model_file, "mtp_block", None)
    if block is not None:
        names |= {n for n in model_file.tensors if n.startswith(f"blk.{block}.")}
    return sum(model_file.tensors[name].n_bytes for name in names)


# ---- checking and printing ------------------------------------------------------------


def size(n: float) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n:g} B"


def check_fits(plan: MemoryPlan, available: int, where: str) -> None:
    """Raise PlanError (one line, naming the parts and the flags that size them) unless
    the plan's total fits `available` bytes; `where` says what those bytes are."""
    if plan.total <= available:
        return
    c = plan.config
    if plan.weights > available:
        raise PlanError(f"the weights alone need {size(plan.weights)} but {where} {size(available)}")
    work = f" and {size(plan.workspace)} of pass workspace" if plan.workspace else ""
    work += (f", {size(plan.snapshot_bytes)} of prefix-cache snapshots (--no-prefix-cache drops them)"
             if plan.snapshots else "")
    work += f", {size(plan.draft)} of {plan.drafter} state" if plan.draft else ""
    work += f", {size(plan.round_bytes)} of speculation's round snapshots" if plan.round_snapshots else ""
    raise PlanError(
        f"the memory plan needs {size(plan.total)} but {where} {size(available)}: weights "
        f"{size(plan.weights)}, {size(plan.paged)} of paged history ({plan.n_pages} pages) for "
        f"{plan.lanes} lanes x {plan.context} tokens (deepseek4.context_length, or --max-context / "
        f"--kv-pool-tokens), {size(plan.slots)} of per-lane state (deepseek4.attention.sliding_window = "
        f"{c.sliding_window}){work}; lower --max-context, --kv-pool-tokens or --max-concurrency")


def summary(plan: MemoryPlan) -> str:
    """The banner's line."""
    work = f" + pass workspace {size(plan.workspace)}" if plan.workspace else ""
    cache = (f" + prefix-cache snapshots {plan.snapshots} x {size(plan.per_slot + plan.mtp_slot)} "
             f"(cached pages share the pool)"
             if plan.snapshots else "")
    cache += f" + {plan.drafter} state {size(plan.draft)}" if plan.draft else ""
    cache += (f" + speculation's round snapshots {plan.round_snapshots} x {size(plan.per_slot + plan.mtp_slot)}"
              if plan.round_snapshots else "")
    return (f"memory plan: {size(plan.total)} = weights {size(plan.weights)} + paged history "
            f"{size(plan.paged)} ({plan.storage} KV rows, {plan.bytes_per_token(plan.storage):,.2f} B/token) + "
            f"per-slot state {plan.lanes} x {size(plan.per_slot)}{work}{cache}")


def table(plan: MemoryPlan, available: str) -> str:
    """The dry run's table."""
    lay = plan.layout
    rows = [("weights", plan.weights, "stored tensor bytes"),
            ("paged history", plan.paged,
             f"{plan.n_pages} pages x {lay.page_bytes(plan.storage):,} B ({plan.storage} KV rows)"),
            ("per-slot state", plan.slots, f"{plan.lanes} lanes x {plan.per_slot:,} B"),
            *([("pass workspace", plan.workspace,
                f"the {plan.workspace_rows}-row pass's buffers, the round log, RoPE tables, block tables, "
                f"lane fields")] if plan.workspace else []),
            *([("prefix cache", plan.snapshot_bytes, f"at most {plan.snapshots} snapshots x "
                                                     f"{plan.per_slot + plan.mtp_slot:,} B; "
                                                     f"cached pages are the pool's own")] if plan.snapshots else []),
            *([(plan.drafter, plan.draft, f"its window rings for {plan.lanes} lanes (and the hip backend's "
                                         f"draft pass buffers); its weights are in 'weights'")] if plan.draft else []),
            *([("speculation", plan.round_bytes, f"a round snapshot a lane, {plan.round_snapshots} x "
                                                 f"{plan.per_slot + plan.mtp_slot:,} B")] if plan.round_snapshots else []),
            ("total", plan.total, "")]
    out = [f"{name:<16}{n:>14,}  {size(n):>10}  {note}".rstrip() for name, n, note in rows]
    return "\n".join([*out, f"{'available':<16}{available}", "", *storage_lines(plan)])


def storage_lines(plan: MemoryPlan) -> list[str]:
    """bytes/token and bytes/slot, f32 vs compact rows."""
    lay = plan.layout
    f32, compact = plan.bytes_per_token("f32"), plan.bytes_per_token("compact")
    return [f"{'KV rows as':<16}{'f32':>14}  {'compact':>10}",
            f"{'bytes/token':<16}{f32:>14,.2f}  {compact:>10,.2f}  paged history per token of context "
            f"({f32 / compact:.2f}x less)",
            f"{'bytes/slot':<16}{lay.slot_bytes('f32'):>14,}  {lay.slot_bytes('compact'):>10,}  "
            f"raw rings + compressor state (the latter f32 in both)"]


# ---- python -m ds4ref.paging.plan --flash ---------------------------------------------


def flash_report(contexts=(4096, 32768, 131072, 1 << 20)) -> str:
    plan = make_plan(flash_config(), 0, 1, 1 << 20, None, "compact")
    lay = plan.layout
    lines = [f"DeepSeek V4 Flash: {lay.page_rows()[0]} KV + {lay.page_rows()[1]} indexer rows per page of "
             f"{plan.page_tokens} tokens",
             *storage_lines(plan),
             f"{'bytes/page':<16}{lay.page_bytes('f32'):>14,}  {lay.page_bytes('compact'):>10,}",
             "paged history of one sequence by context (f32 / compact):"]
    for n in contexts:
        pages = -(-n // plan.page_tokens)
        lines.append(f"  {n:>8} tokens  {size(pages * lay.page_bytes('f32')):>10} / "
                     f"{size(pages * lay.page_bytes('compact'))}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ds4ref.paging.plan",
                                description="KV memory per token and per slot, float32 vs compact rows.")
    p.add_argument("--flash", action="store_true", help="DeepSeek V4 Flash's dimensions (the only choice now)")
    p.parse_args(argv)
    print(flash_report())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
