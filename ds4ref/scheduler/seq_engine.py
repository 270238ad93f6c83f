"""SeqEngine: the mechanism under the scheduler.

It owns the slots, their block tables (through a BlockManager) and their
samplers, and turns "slot s runs n rows" into one backend pass. It decides
nothing: which requests run and how many prompt rows each gets is the
Scheduler's business.

Per slot, a sequence walks through positions 0, 1, 2, ...: first the prompt
tokens, then each generated token is fed back at the next position. The row
that feeds the last prompt token, and every decode row, produces the next
token; earlier prompt rows only fill the KV state.

preempt(slot) gives a sequence's slot and pages back but keeps its sampler (the
tokens, random stream and constraint state so far); admitting it again with
`resume=` recomputes prompt + generated tokens as one longer prompt, which is
exact because a prefill row equals the decode row it replaces bitwise.

With the prefix cache (paging/prefix.py), every page a sequence fills is registered
under its tokens, and at chosen page boundaries the backend's state is snapshotted: the
boundary at or before its prompt's end, every `snapshot_every` pages of its prompt, and
every boundary it reaches while decoding. A newcomer (or a preempted sequence coming
back) whose tokens start with cached pages ending at a snapshot takes those pages and
that state, and feeds only the rest. Prompt chunks end at the snapshot boundaries
(rows_to_snapshot), which changes no bit: chunking never does. A sequence that ends mid-page
leaves its partial last page and its state there as a tail (a backend with copy_page): a
newcomer resuming from it copies that page into a page of its own.

Speculative decoding (speculative_tokens = k > 0; docs/scheduler.md): a decoding slot's
round feeds its known token at p and up to k drafts after it, every row emitting. The
sampler walks the rows in order exactly as plain decoding would, accepting while its choice
equals the next draft; the choices up to the first mismatch (or a stop) are the round's
tokens. A round that rejects a draft restores the state saved before the pass; the accepted
rows whose results are known are fed again (emit=False) at the head of the slot's next
round. `fed` is always the backend's position, whose state is exact, so the prefix cache
only ever sees accepted rows.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from ..console import plural
from ..backend import DECODE_LANES, PAGE_TOKENS, Backend, DraftRequest, Row, StepPlan, StepResult
from ..paging.blocks import BlockManager
from ..paging.pool import PagePool, pool_pages
from ..paging.prefix import CACHE_OWNER, SNAPSHOTS_PER_SLOT, Match, PrefixCache
from .request import NON_FINITE_VALUES, Request
from .sampling import Choice, SlotSampler
from .speculative import MIN_RATE, WINDOW, Acceptance, BackendDrafter, Drafter

# the fewest pages between a prompt's snapshots by default (a largest pass of more pages sets more):
# a prompt diverging in its middle resumes no further back than that from the divergence
SNAPSHOT_PAGES = 8

log = logging.getLogger(__name__)


class StepError(RuntimeError):
    """A backend pass broke the protocol (wrong number of rows, missing logits...)."""


@dataclass(frozen=True)
class Admission:
    status: str          # "admitted" | "busy" | "refused"
    slot: int = -1
    reason: str = ""


@dataclass(frozen=True)
class Work:
    """Run `rows` consecutive rows of slot `slot` in the next pass."""
    slot: int
    rows: int = 1


@dataclass(frozen=True)
class Outcome:
    slot: int
    rows: int
    choices: tuple[Choice, ...] = ()  # the tokens this pass produced, in order; none for a mid-prompt chunk
    failure: str = ""    # why this slot's request ends with an error now (its rows computed a NaN, ...)
    failure_code: str = ""  # the OpenAI error code the server answers it with


@dataclass
class Seq:
    request: Request
    slot: int
    order: int               # admission order: lower is older
    prompt: list[int]
    max_new: int             # output cap, already clamped to the context
    sampler: SlotSampler
    fed: int = 0             # positions already run through the backend
    prompt_len: int = -1     # the request's own prompt (self.prompt also holds recomputed tokens)
    cached_tokens: int = 0   # prompt tokens its first admission took from the prefix cache
    keys: list = field(default_factory=list)  # prefix-cache keys of its full pages, in order
    spec: Optional[Acceptance] = None  # speculating: its drafts' record (None: it never drafts)
    drafts: list = field(default_factory=list)  # drafts for its next round
    mtp_fed: int = 0         # positions fed to the MTP block (the backend's drafter)
    done: bool = False       # it produced a stop token or its last one, or failed
    failed: bool = False     # its last pass went wrong for it alone (Outcome.failure): it ends now

    def __post_init__(self) -> None:
        if self.prompt_len < 0:
            self.prompt_len = len(self.prompt)

    @property
    def generated(self) -> list[int]:
        return self.sampler.generated

    @property
    def prompting(self) -> bool:
        return self.fed < len(self.prompt)

    @property
    def prompt_left(self) -> int:
        return max(0, len(self.prompt) - self.fed)

    @property
    def lifetime(self) -> int:
        """Positions this sequence can ever feed (its last token is never fed back)."""
        return self.prompt_len + self.max_new - 1

    def history(self) -> list[int]:
        """Its tokens by position: the request's prompt, then everything generated."""
        return self.prompt[:self.prompt_len] + self.generated

    @property
    def pending(self) -> int:
        """Known tokens not yet fed: a prompt's rest, or a decoder's last token after any
        accepted rows a rejected round must feed again."""
        return len(self.prompt) - self.fed if self.prompting else self.prompt_len + len(self.generated) - self.fed

    def stops(self, token: int, eos_id: int) -> bool:
        return (token == eos_id and not self.request.ignore_eos) or token in self.request.stop_ids

    def tokens(self, rows: int) -> list[int]:
        if self.prompting:
            return self.prompt[self.fed:self.fed + rows]
        known = self.history()[self.fed:]
        return known + self.drafts[:rows - len(known)]


class SeqEngine:
    def __init__(self, backend: Backend, config, max_concurrency: int = 16,
                 kv_pool_tokens: Optional[int] = None, page_tokens: int = PAGE_TOKENS,
                 max_context: Optional[int] = None, page_order_seed: Optional[int] = None,
                 prefix_cache: bool = True, snapshot_every: Optional[int] = None, max_snapshots: Optional[int] = None,
                 speculative_tokens: int = 0, drafter: Optional[Drafter] = None, spec_min_rate: float = MIN_RATE,
                 spec_window: int = WINDOW):
        """config needs .eos_id, .vocab_size, .context_length (a DS4Config has them).
        max_concurrency: live sequences, at most the decode lanes (DECODE_LANES, or the backend's
        max_pass_rows if smaller), since every one of them may be decoding in the same pass.
        prefix_cache: reuse cached pages and state (a backend without save_state/load_state/
        drop_state runs without); snapshot_every: pages between a prompt's snapshots (default
        SNAPSHOT_PAGES, or a largest pass's pages where that is more, so that a lone prompt's
        passes are whole);
        max_snapshots: snapshots held at once (default SNAPSHOTS_PER_SLOT per slot).
        speculative_tokens: drafts per round (0: off); drafter: where drafts come from (default
        the backend's MTP block); spec_min_rate, spec_window: the auto-off rule (speculative.py)."""
        lanes = min(DECODE_LANES, backend.max_pass_rows)
        if not 1 <= max_concurrency <= lanes:
            raise ValueError(f"max_concurrency must be in 1..{lanes} (decode lanes), got {max_concurrency}")
        self.backend = backend
        self.config = config
        self.max_pass_rows = backend.max_pass_rows  # the most rows of one pass
        self.max_concurrency = max_concurrency
        self.max_context = int(max_context or config.context_length)
        if not 1 < self.max_context <= config.context_length:
            raise ValueError(f"max_context must be in 2..{config.context_length} (the model's context), "
                             f"got {self.max_context}")
        self.kv_pool_tokens = kv_pool_tokens
        n_pages = pool_pages(max_concurrency, self.max_context, kv_pool_tokens, page_tokens)
        self.pool = PagePool(n_pages, page_tokens, order_seed=page_order_seed)
        if snapshot_every is None:
            snapshot_every = max(SNAPSHOT_PAGES, self.max_pass_rows // page_tokens)
        if snapshot_every < 1:
            raise ValueError(f"snapshot_every must be >= 1 page, got {snapshot_every}")
        self.snapshot_every = snapshot_every
        snapshots = all(hasattr(backend, m) for m in ("save_state", "load_state", "drop_state"))
        self.cache = (PrefixCache(self.pool, backend.drop_state, max_snapshots or SNAPSHOTS_PER_SLOT * max_concurrency)
                      if prefix_cache and snapshots else None)
        self.blocks = BlockManager(self.pool, max_concurrency, self.cache)
        self.tails = self.cache is not None and hasattr(backend, "copy_page")
        self.seqs: dict[int, Seq] = {}
        self._admitted = 0
        if speculative_tokens < 0:
            raise ValueError(f"speculative_tokens must be >= 0, got {speculative_tokens}")
        self.speculative_tokens = speculative_tokens
        self.spec_min_rate, self.spec_window = spec_min_rate, spec_window
        if speculative_tokens:
            missing = [m for m in ("save_state", "restore_state", "drop_state") if not hasattr(backend, m)]
            if drafter is None and not hasattr(backend, "draft"):
                missing.append("draft")
            if missing:
                raise ValueError(f"speculative decoding needs the {backend.name} backend's {', '.join(missing)}")
            most = getattr(backend, "max_draft_tokens", None)  # DSpark: one block a round
            if drafter is None and most is not None and speculative_tokens > most:
                raise ValueError(f"speculative_tokens {speculative_tokens}: the backend's DSpark module "
                                 f"proposes at most {most} tokens a round (its block size)")
        self.drafter = drafter if drafter is not None else BackendDrafter(backend) if speculative_tokens else None
        self.spec_totals = {"spec_proposed": 0, "spec_accepted": 0, "spec_rounds": 0, "spec_off": 0}
        backend.configure(max_concurrency, n_pages, page_tokens, max_context=self.max_context)

    # ---- admission -------------------------------------------------------------
    def refusal(self, request: Request) -> Optional[str]:
        """Why this request can never run here, or None. Depends only on fixed sizes."""
        n = len(request.prompt_ids)
        if n == 0:
            return "the prompt is empty (it needs at least one token, e.g. BOS)"
        if request.max_new_tokens < 1:
            return f"max_new_tokens must be >= 1, got {request.max_new_tokens}"
        bad = [t for t in request.prompt_ids if not 0 <= int(t) < self.config.vocab_size]
        if bad:
            return f"prompt token {bad[0]} is outside the vocabulary of {self.config.vocab_size}"
        if n >= self.max_context:
            return (f"the prompt has {plural(n, 'token')}; the context limit is {self.max_context}, "
                    f"which leaves no room for output")
        cap = self.output_cap(request)
        need = self.blocks.pages_for(n + cap - 1)
        if need > self.pool.n_pages:
            # Alone it would have the whole pool; still too small, so it could only be cut short.
            return (f"the prompt ({plural(n, 'token')}) plus max_tokens ({cap}) needs {need} KV pages of "
                    f"{self.pool.page_tokens} tokens but the whole pool (kv_pool_tokens) holds "
                    f"{self.pool.n_pages}; lower max_tokens, shorten the prompt or raise --kv-pool-tokens")
        return None

    def output_cap(self, request: Request) -> int:
        return max(0, min(request.max_new_tokens, self.max_context - len(request.prompt_ids)))

    def admit(self, request: Request, resume: Optional[Seq] = None) -> Admission:
        """Give request a slot, or (resume=) give a preempted sequence one back."""
        reason = self.refusal(request)
        if reason:
            return Admission("refused", reason=reason)
        if len(self.seqs) >= self.max_concurrency:
            return Admission("busy", reason="every slot is live")
        if resume is None:
            prompt = [int(t) for t in request.prompt_ids]
            seq = Seq(request, -1, self._admitted, prompt, self.output_cap(request),
                      SlotSampler(request.sampling, prompt, request.constraint))
        else:  # recompute everything it had: its prompt and the tokens it generated
            seq = Seq(request, -1, resume.order, resume.history(), resume.max_new, resume.sampler,
                      prompt_len=resume.prompt_len, cached_tokens=resume.cached_tokens)
        match = self.cache.match(seq.prompt, self.tails) if self.cache is not None else Match([], None)
        if self.cache is not None:
            self.cache.acquire(match.held)  # mapped (or copied) from now on: not the pool's to reclaim
        if not self.blocks.can_admit(len(seq.prompt), seq.lifetime, len(match.pages)):
            for p in match.held:
                self.cache.unref(p.handle)
            return Admission("busy", reason="not enough free pages")
        if resume is None:
            self._admitted += 1
            seq.cached_tokens = match.tokens
        seq.slot = min(set(range(self.max_concurrency)) - set(self.seqs))
        self.backend.reset_slot(seq.slot)
        self.blocks.admit(seq.slot, len(seq.prompt), seq.lifetime, [p.handle for p in match.pages])
        if match.tail is not None:  # its own page, from its reservation, starts as the tail's copy
            self.blocks.map(seq.slot, match.tokens)
            self.backend.copy_page(match.tail.handle.page, self.blocks.table(seq.slot)[-1])
            self.cache.unref(match.tail.handle)
        if match.snapshot is not None:
            self.backend.load_state(seq.slot, match.snapshot, self.blocks.table(seq.slot))
            seq.fed, seq.keys = match.tokens, [p.key for p in match.pages]
        if self.cache is not None:
            self.cache.record(match)
        if self.speculative_tokens:  # a preempted sequence keeps its record (and its auto-off)
            seq.spec = resume.spec if resume is not None and resume.spec is not None else \
                Acceptance(self.spec_min_rate, self.spec_window)
        seq.mtp_fed = seq.fed
        self.seqs[seq.slot] = seq
        return Admission("admitted", slot=seq.slot)

    def preempt(self, slot: int) -> Seq:
        """Free slot and its pages; the returned Seq can be admitted again with resume=."""
        seq = self.seqs[slot]
        self.retire(slot)  # no tail: the sequence it makes room for takes its pages, deepest first
        return seq

    def retire(self, slot: int, cache_tail: bool = False) -> None:
        """Free slot and its pages; cache_tail: it ended with its state sound (not preempted, not
        after a failed pass), so its partial last page may stay cached as a tail."""
        if slot not in self.seqs:
            raise KeyError(f"slot {slot} is not live")
        seq = self.seqs.pop(slot)
        if cache_tail and self.tails:
            self._cache_tail(seq)
        self.blocks.release(slot)
        self.backend.reset_slot(slot)

    def _cache_tail(self, s: Seq, copy: bool = False) -> None:
        """Hand the cache s's partial last page and its state after its last fed position: s's
        own page when s ends; a copy when s has just fed its prompt (on a free page no live
        sequence is owed), so that a next turn whose rendering of s's reply differs from the
        tokens s generates still resumes at the prompt's end."""
        T = self.pool.page_tokens
        j, n = divmod(s.fed, T)
        if not n:  # at a boundary the page snapshots cover it
            return
        parent, tokens = s.keys[j - 1] if j else b"", s.history()[j * T:s.fed]
        if self.cache.has_tail(parent, tokens) or (copy and self.pool.free_pages <= self.blocks.total_debt()):
            return
        handle = self.pool.allocate(CACHE_OWNER) if copy else self.blocks.handles(s.slot)[j]
        try:
            if copy:
                self.backend.copy_page(self.blocks.table(s.slot)[j], handle.page)
            snapshot = self.backend.save_state(s.slot)
        except MemoryError as exc:
            if copy:
                self.pool.free(handle)
            log.warning("prefix cache: no tail at position %d of slot %d: %s", s.fed, s.slot, exc)
            return
        if not self.cache.register_tail(CACHE_OWNER if copy else s.slot, handle, parent, j, tokens, snapshot,
                                        mapped=not copy):
            self.backend.drop_state(snapshot)
            if copy:
                self.pool.free(handle)

    # ---- planning helpers ----------------------------------------------------------
    def live(self) -> list[Seq]:
        """Live sequences, oldest first."""
        return sorted(self.seqs.values(), key=lambda s: s.order)

    @property
    def free_pages(self) -> int:
        return self.pool.free_pages

    def rows_to_snapshot(self, slot: int) -> int:
        """Prompt rows slot may run before the next page boundary that wants a snapshot (all
        that are left without the cache): a prompt chunk ends there, so the state there is seen."""
        s = self.seqs[slot]
        if self.cache is None:
            return s.prompt_left
        T = self.pool.page_tokens
        for b in range(s.fed // T + 1, len(s.prompt) // T + 1):
            if self._prompt_snapshots_at(s, b):
                return b * T - s.fed
        return s.prompt_left

    def _prompt_snapshots_at(self, s: Seq, boundary: int) -> bool:
        """Whether s's prompt wants a snapshot after `boundary` pages: every snapshot_every
        pages, and at the last boundary at or before the prompt's end."""
        return boundary % self.snapshot_every == 0 or boundary == len(s.prompt) // self.pool.page_tokens

    def decode_rows(self, slot: int) -> int:
        """Rows a decoding slot must run in its next round: its known tokens not yet fed."""
        return self.seqs[slot].pending

    def draft_rows(self, slot: int) -> int:
        """Drafts a decoding slot may add to its next round: those it holds, no more than its
        output has room for, none past the page its next token sits on (so a round takes no
        page beyond what one plain row takes, and a page boundary is reached exactly, with the
        state exact for the prefix cache), and none while it has k rows to feed again (a run of
        rejected rounds then ends with a plain one)."""
        s = self.seqs[slot]
        if s.prompting or s.spec is None or not s.spec.on or s.pending > self.speculative_tokens:
            return 0
        p, T = len(s.history()) - 1, self.pool.page_tokens
        return max(0, min(len(s.drafts), s.max_new - len(s.generated) - 1, T - 1 - p % T))

    def free_page_cost(self, slot: int, rows: int) -> int:
        """Free (unreserved) pages that running `rows` more rows of slot would take."""
        s = self.seqs[slot]
        missing = self.blocks.missing_pages(slot, s.fed + rows)
        return max(0, missing - self.pool.reservation(slot))

    # ---- one pass -----------------------------------------------------------------
    def step(self, work: Sequence[Work]) -> list[Outcome]:
        rows = self._rows(work)
        self._map_pages(work)
        # a round with drafts may be rolled back to here (restore_state)
        snaps = {w.slot: self.backend.save_state(w.slot) for w in work if w.rows > self.seqs[w.slot].pending}
        try:
            result = self.backend.step(StepPlan.from_rows(rows, self.max_pass_rows))
            self._check(rows, result)
            outcomes = self._advance(work, result, snaps)
        finally:
            for snap in snaps.values():
                self.backend.drop_state(snap)
        if self.drafter is not None:
            self._draft(work)
        if self.cache is not None:
            for w in work:
                if not self.seqs[w.slot].failed:  # a failed pass's rows are never offered for reuse
                    self._cache_progress(self.seqs[w.slot])
        self.blocks.top_up([s.slot for s in self.live()])
        return outcomes

    def _cache_progress(self, s: Seq) -> None:
        """Register the pages s has filled, and snapshot its state at a boundary that wants one."""
        T = self.pool.page_tokens
        if len(s.keys) < s.fed // T:
            history, handles = s.history(), self.blocks.handles(s.slot)
            while len(s.keys) < s.fed // T:
                j = len(s.keys)
                s.keys.append(self.cache.register(s.slot, handles[j], s.keys[-1] if s.keys else b"", j,
                                                  history[j * T:(j + 1) * T]))
        if s.fed == len(s.prompt) and self.tails:
            self._cache_tail(s, copy=True)
        b = s.fed // T
        if s.fed % T or not b or self.cache.has_snapshot(s.keys[-1]):
            return
        if not s.prompting or self._prompt_snapshots_at(s, b):
            try:
                snapshot = self.backend.save_state(s.slot)
            except MemoryError as exc:  # a cache without this snapshot still serves every request
                log.warning("prefix cache: no snapshot at position %d of slot %d: %s", s.fed, s.slot, exc)
                return
            if not self.cache.attach_snapshot(s.keys[-1], snapshot):
                self.backend.drop_state(snapshot)

    def _rows(self, work: Sequence[Work]) -> list[Row]:
        """Validate the plan and lay out its rows; changes nothing."""
        if len({w.slot for w in work}) != len(work):
            raise ValueError("a slot appears twice in one pass")
        if sum(w.rows for w in work) > self.max_pass_rows:
            raise ValueError(f"a pass holds at most {self.max_pass_rows} rows, plan has {sum(w.rows for w in work)}")
        rows: list[Row] = []
        for w in work:
            s = self.seqs.get(w.slot)
            if s is None:
                raise ValueError(f"slot {w.slot} is not live")
            least = 1 if s.prompting else s.pending
            most = s.prompt_left if s.prompting else s.pending + self.draft_rows(w.slot)
            if not least <= w.rows <= most:
                raise ValueError(f"slot {w.slot} may run {least}..{most} rows now, plan asks {w.rows}")
            # Only a sequence's newest known row and its drafts yield tokens; earlier rows fill state.
            first_emit = w.rows - 1 if s.prompting else s.pending - 1
            for i, tok in enumerate(s.tokens(w.rows)):
                emit = i >= first_emit and s.fed + w.rows >= len(s.prompt)
                rows.append(Row(w.slot, s.fed + i, tok, want_logits=emit and s.sampler.needs_logits, emit=emit))
        if sum(self.free_page_cost(w.slot, w.rows) for w in work) > self.pool.free_pages:
            raise ValueError("the plan needs more free pages than the pool has")
        return rows

    def _map_pages(self, work: Sequence[Work]) -> None:
        # The page holding position p (p // page_tokens) must be in the backend's
        # table before the row at p runs.
        for w in work:
            if self.blocks.map(w.slot, self.seqs[w.slot].fed + w.rows):
                self.backend.set_block_table(w.slot, self.blocks.table(w.slot))

    def _check(self, rows: list[Row], result: StepResult) -> None:
        n = len(rows)
        if len(result.logits) != n or len(np.asarray(result.argmax).reshape(-1)) != n:
            raise StepError(f"backend returned {len(result.logits)} logits and "
                            f"{np.asarray(result.argmax).size} argmax for {n} rows")
        unknown = set(result.non_finite) - {r.slot for r in rows}
        if unknown:
            raise StepError(f"backend reports slots {sorted(unknown)} non-finite, which ran no row of this pass")
        for i, r in enumerate(rows):
            if r.slot in result.non_finite:
                continue  # its results mean nothing: the slot's request fails (_advance)
            lg = result.logits[i]
            if r.emit and not 0 <= int(result.argmax[i]) < self.config.vocab_size:
                raise StepError(f"row {i} (slot {r.slot}, position {r.position}) emits but its argmax "
                                f"is {int(result.argmax[i])}")
            if not r.want_logits:
                continue
            if lg is None or np.shape(lg) != (self.config.vocab_size,):
                raise StepError(f"row {i} (slot {r.slot}, position {r.position}) wanted logits of "
                                f"shape ({self.config.vocab_size},), got {None if lg is None else np.shape(lg)}")
            if int(np.argmax(lg)) != int(result.argmax[i]):
                raise StepError(f"row {i} (slot {r.slot}): argmax {int(result.argmax[i])} disagrees "
                                f"with its logits ({int(np.argmax(lg))})")

    def _advance(self, work: Sequence[Work], result: StepResult, snaps: dict[int, int]) -> list[Outcome]:
        outcomes, i = [], 0
        for w in work:
            s = self.seqs[w.slot]
            if w.slot in result.non_finite:
                outcomes.append(self._fail(s, w, f"the model computed a NaN or an infinity for this request "
                                                 f"(positions {s.fed}..{s.fed + w.rows - 1}): its values "
                                                 f"overflowed float32, so it cannot go on", NON_FINITE_VALUES))
            elif s.prompting:
                s.fed += w.rows
                choices = [] if s.prompting else [self._choose(s, result, i + w.rows - 1)]
                outcomes.append(Outcome(w.slot, w.rows, tuple(choices)))
            else:
                outcomes.append(Outcome(w.slot, w.rows, tuple(self._round(s, w, result, i, snaps.get(w.slot)))))
            i += w.rows
        return outcomes

    @staticmethod
    def _fail(s: Seq, w: Work, why: str, code: str) -> Outcome:
        """The outcome of a slot whose pass went wrong for it alone: no token, and its request
        ends (Scheduler._apply retires it; nothing of this pass is cached or drafted from)."""
        s.done = s.failed = True
        return Outcome(w.slot, w.rows, (), why, code)

    def _choose(self, s: Seq, result: StepResult, row: int) -> Choice:
        c = s.sampler.choose(result.logits[row], int(result.argmax[row]))
        s.done = s.stops(c.token, self.config.eos_id) or len(s.generated) >= s.max_new
        return c

    def _round(self, s: Seq, w: Work, result: StepResult, first: int, snap: Optional[int]) -> list[Choice]:
        """Choose along the round's emitting rows as plain decoding would, one row at a time,
        while each choice confirms the next draft; restore the state if a draft was refused."""
        known, k = s.pending, w.rows - s.pending
        drafts, choices = s.drafts[:k], []
        for d in range(k + 1):
            choices.append(self._choose(s, result, first + known - 1 + d))
            if s.done or d == k or choices[-1].token != drafts[d]:
                break
        accepted = next((j for j, (c, t) in enumerate(zip(choices, drafts)) if c.token != t), min(len(choices), k))
        if k:
            s.spec.record(k, accepted)
            self.spec_totals["spec_rounds"] += 1
            self.spec_totals["spec_proposed"] += k
            self.spec_totals["spec_accepted"] += accepted
            if not s.spec.on:
                self.spec_totals["spec_off"] += 1
        if accepted == k:
            s.fed += w.rows
        else:  # rows past the last accepted one hold a refused draft's state; a finished sequence
            # is put back too, as its tail (prefix cache) is cached at `fed`
            s.fed += self.backend.restore_state(s.slot, snap, known + accepted)
        s.drafts = []
        return choices

    def _draft(self, work: Sequence[Work]) -> None:
        """Feed each speculating slot's accepted rows of this pass to the drafter, and take
        the drafts of its next round."""
        requests = []
        for w in work:
            s = self.seqs[w.slot]
            if s.spec is None or not s.spec.on or s.done:
                continue
            # the last row run with its true token: it chose (or its prompt gives) the next one
            known = s.fed - 1 if s.prompting else len(s.history()) - 2
            k = 0 if s.prompting else min(self.speculative_tokens, s.max_new - len(s.generated) - 1)
            positions = tuple(range(s.mtp_fed, known + 1))
            history = s.history() if not s.prompting else s.prompt
            requests.append(DraftRequest(s.slot, positions, tuple(history[p + 1] for p in positions), k))
            s.mtp_fed = known + 1
        for r, d in zip(requests, self.drafter.draft(requests, self.seqs)):
            d = np.asarray(d).reshape(-1)
            if d.size != r.k or (d.size and not (0 <= d.min() and d.max() < self.config.vocab_size)):
                raise StepError(f"slot {r.slot}: drafter returned {d.tolist()} for {r.k} drafts")
            self.seqs[r.slot].drafts = [int(t) for t in d]

    def stats(self) -> dict:
        cache = self.cache.stats() if self.cache is not None else dict.fromkeys(PrefixCache.STATS, 0)
        return {"live": len(self.seqs), **self.spec_totals, "pages_total": self.pool.n_pages,
                "pages_used": self.pool.used_pages, "pages_reserved": self.pool.reserved_pages,
                "pages_free": self.pool.free_pages, **cache}
