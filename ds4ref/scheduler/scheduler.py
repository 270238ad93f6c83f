"""Scheduler: the policy over a SeqEngine.

One call to step() is one gathered pass:

  1. apply cancellations (free the slot and its pages, report "cancelled");
  2. admit waiting requests strictly FIFO until the first that does not fit
     (preempted sequences wait at the head, oldest first);
  2b. make room: while the oldest decoder that cannot get its next page has a
     younger live sequence, preempt the youngest (free its slot and pages and
     requeue it; on readmission it recomputes prompt + generated tokens, which
     is exact because prefill equals decode bitwise). A request therefore ends
     only at max_tokens, a stop, EOS or the context limit, never because the
     pool ran dry; one that could not fit even alone is refused at submit;
  3. plan rows (chunked prefill): one row for every decoding slot that can get
     its next page, oldest first, then the prompts' share of the pass dealt to
     prompts, the one that has waited longest for rows first (since its last
     chunk, or its admission), at most `prompt_quantum` rows each. The share
     is the rest of `max_batched_rows` when no decoder runs in the pass; beside
     decoders, with `max_itl_ms`, the most rows whose pass the cost model
     (pass_cost.py) predicts within that inter-token budget, and never fewer
     than `min_prompt_rows`;
  4. run the pass, check every planned slot got exactly one outcome;
  5. turn tokens into events and finish sequences on EOS / stop ids / length,
     and with an error those whose rows computed a NaN or an infinity (the
     backend says which slots; the others' results stand, bit for bit).

Decode rows go first and max_batched_rows >= max_concurrency, so a prompt never
takes a decoder's row: a long prompt only bounds how long a pass takes, which
max_itl_ms bounds while decoders wait for their next token and max_batched_rows
(vLLM's max_num_batched_tokens) caps. prompt_quantum defaults
to the pass size, so a lone prompt takes every row its pass has left;
prompt_quantum=1 is upstream's exact mode (one prompt token per prompt per
pass). All give the same tokens: the backend makes several rows of one slot in
one pass exactly equal to one row per pass.

submit() and cancel() may be called from another thread at any time; they
only touch the waiting queue and the cancel set, under a lock, and step()
picks their effect up at its next pass.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Optional

from ..console import plural
from .pass_cost import MIN_PROMPT_ROWS, MeasuredPassCost, PassCost
from .request import Event, FinishEvent, Refused, Request, TokenEvent
from .seq_engine import Outcome, Seq, SeqEngine, StepError, Work

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """The waiting queue is at max_queue; try again later (HTTP 503/429)."""


class CohortFailed(RuntimeError):
    """A pass failed. Its requests were finished with reason "error"; `events`
    holds every event of the failed step (those FinishEvents included) so the
    caller can still deliver them."""

    def __init__(self, message: str, events: list[Event]):
        super().__init__(message)
        self.events = events


class Scheduler:
    def __init__(self, engine: SeqEngine, max_queue: Optional[int] = None, prompt_quantum: Optional[int] = None,
                 max_batched_rows: Optional[int] = None, max_itl_ms: Optional[float] = None,
                 pass_cost: Optional[PassCost | MeasuredPassCost] = None, min_prompt_rows: int = MIN_PROMPT_ROWS,
                 clock: Callable[[], float] = time.perf_counter):
        """max_queue: requests that may wait beyond those the free slots will take at the
        next pass (None = unbounded). max_batched_rows: most rows of one pass, decode rows
        included (None = the backend's max_pass_rows): a lone prompt's pass. prompt_quantum:
        most prompt rows one sequence gets per pass (None = max_batched_rows; 1 = upstream's
        exact mode). max_itl_ms: the inter-token budget of a pass that carries decode rows
        (None = none: prompts take every row the decoders leave); pass_cost: the model that
        predicts a pass's time (None = MeasuredPassCost(), learning from the passes timed by
        `clock`, in seconds); min_prompt_rows: prompt rows such a pass holds even when its
        decode rows alone exceed the budget."""
        self.max_batched_rows = batched_rows(engine, max_batched_rows)
        if prompt_quantum is None:
            prompt_quantum = self.max_batched_rows
        if prompt_quantum < 1:
            raise ValueError(f"prompt_quantum must be >= 1, got {prompt_quantum}")
        if max_queue is not None and max_queue < 0:
            raise ValueError(f"max_queue must be >= 0 or None, got {max_queue}")
        if max_itl_ms is not None and not max_itl_ms > 0:
            raise ValueError(f"max_itl_ms must be > 0 or None, got {max_itl_ms}")
        if min_prompt_rows < 1:
            raise ValueError(f"min_prompt_rows must be >= 1, got {min_prompt_rows}")
        self.engine = engine
        self.max_queue = max_queue
        self.prompt_quantum = prompt_quantum
        self.max_itl_ms = max_itl_ms
        self.pass_cost = pass_cost if pass_cost is not None or max_itl_ms is None else MeasuredPassCost()
        self.min_prompt_rows = min_prompt_rows
        self.clock = clock
        # the rows the backend runs for a pass of n rows (HipBackend pads to a capacity bucket)
        self.lanes: Callable[[int], int] = getattr(engine.backend, "bucket", None) or (lambda n: n)
        self._lock = threading.Lock()       # guards _waiting, _cancel, _running
        self._step_lock = threading.Lock()  # one pass at a time
        self._waiting: deque[Request] = deque()
        self._cancel: set[int] = set()
        self._running: dict[int, int] = {}  # req_id -> slot
        self._resume: dict[int, Seq] = {}   # req_id -> preempted sequence waiting to come back
        self._preemptions = 0
        self._served: dict[int, int] = {}  # prompting req_id -> the last pass it got rows (or before it came)
        self._tokens_generated = 0
        self._steps = 0

    # ---- client side (any thread) ---------------------------------------------------
    def submit(self, request: Request) -> int:
        reason = self.engine.refusal(request)
        if reason:
            raise Refused(f"request {request.req_id} refused: {reason}")
        with self._lock:
            if request.req_id in self._running or any(r.req_id == request.req_id for r in self._waiting):
                raise ValueError(f"request id {request.req_id} is already submitted")
            # Free slots will take the head of the queue at the next pass, so they
            # do not count against max_queue.
            free_slots = self.engine.max_concurrency - len(self._running)
            if self.max_queue is not None and len(self._waiting) >= self.max_queue + free_slots:
                raise QueueFull(f"{plural(len(self._waiting), 'request')} already waiting "
                                f"(max_queue={self.max_queue}, {free_slots} free slots)")
            self._waiting.append(request)
        return request.req_id

    def cancel(self, req_id: int) -> bool:
        """Ask for req_id to stop; False if it is not waiting or running."""
        with self._lock:
            known = req_id in self._running or any(r.req_id == req_id for r in self._waiting)
            if known:
                self._cancel.add(req_id)
            return known

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._waiting or self._running or self._cancel)

    def stats(self) -> dict:
        with self._lock:
            s = {"running": len(self._running), "waiting": len(self._waiting),
                 "tokens_generated": self._tokens_generated, "steps": self._steps,
                 "preemptions": self._preemptions}
        s.update(self.engine.stats())
        return s

    # ---- one pass -----------------------------------------------------------------
    def step(self) -> list[Event]:
        with self._step_lock:
            with self._lock:
                events = self._apply_cancels() + self._admit()
                self._make_room()
            work = self._plan()
            if not work:
                return events + self._break_stall()
            try:
                t0 = self.clock()
                outcomes = self.engine.step(work)
                if self.pass_cost is not None:
                    self.pass_cost.observe(self.lanes(sum(w.rows for w in work)), 1e3 * (self.clock() - t0))
                self._check(work, outcomes)
            except Exception as e:
                events += self._fail(work, e)
                raise CohortFailed(f"pass {self._steps} failed: {type(e).__name__}: {e}", events) from e
            self._steps += 1
            with self._lock:
                return events + self._apply(outcomes)

    def _apply_cancels(self) -> list[Event]:
        events: list[Event] = []
        for r in [r for r in self._waiting if r.req_id in self._cancel]:
            self._waiting.remove(r)
            parked = self._resume.pop(r.req_id, None)
            events.append(FinishEvent(r.req_id, "cancelled", len(r.prompt_ids),
                                      0 if parked is None else len(parked.generated)))
        for req_id in [i for i in self._running if i in self._cancel]:
            events.append(self._finish(self.engine.seqs[self._running[req_id]], "cancelled"))
        self._cancel.clear()
        return events

    def _admit(self) -> list[Event]:
        events: list[Event] = []
        while self._waiting:
            r = self._waiting[0]
            a = self.engine.admit(r, resume=self._resume.get(r.req_id))
            if a.status == "busy":
                break  # strict FIFO: nobody overtakes the head of the queue
            self._waiting.popleft()
            self._resume.pop(r.req_id, None)
            if a.status == "admitted":
                self._running[r.req_id] = a.slot
                self._served[r.req_id] = self._steps - 1  # waiting since before this pass
            else:  # fixed sizes checked at submit, so only a changed engine gets here
                events.append(FinishEvent(r.req_id, "error", len(r.prompt_ids), 0, a.reason))
        return events

    def _make_room(self) -> None:
        """Preempt the youngest sequences while an older decoder cannot get its next page."""
        while True:
            live = self.engine.live()
            budget, starved = self.engine.free_pages, None
            for s in live:
                if s.prompting:
                    continue
                cost = self.engine.free_page_cost(s.slot, self.engine.decode_rows(s.slot))
                if cost > budget:
                    starved = s
                    break
                budget -= cost
            if starved is None or live[-1] is starved:
                return
            self._preempt(live[-1])

    def _preempt(self, s: Seq) -> None:
        seq = self.engine.preempt(s.slot)
        self._running.pop(s.request.req_id, None)
        self._served.pop(s.request.req_id, None)
        self._resume[s.request.req_id] = seq
        self._waiting.appendleft(s.request)  # later preemptions are older: they end up first
        self._preemptions += 1
        log.info("request %d preempted after %d tokens (KV pool of %d pages is full); it will be recomputed",
                 s.request.req_id, len(seq.generated), self.engine.pool.n_pages)

    def _plan(self) -> list[Work]:
        live = self.engine.live()
        work, budget = self._plan_decoders(live)
        rows_left = self.max_batched_rows - sum(w.rows for w in work)
        work, budget, rows_left = self._plan_drafts(live, work, budget, rows_left)
        return work + self._plan_prompts(live, budget, self.prompt_share(sum(w.rows for w in work), rows_left))

    def prompt_share(self, decode_rows: int, rows_left: int) -> int:
        """Prompt rows a pass may hold beside decode_rows decode rows, of the rows_left it has:
        all of them when no decoder waits on the pass (a lone prompt's large pass); beside
        decoders with a budget, the most whose pass the cost model predicts within max_itl_ms,
        but at least min_prompt_rows, so prompts advance whatever the decoders cost."""
        if self.max_itl_ms is None or not decode_rows:
            return rows_left

        def fits(n: int) -> bool:  # monotone in n: the cost grows with the lanes, the lanes with n
            return self.pass_cost.ms(self.lanes(decode_rows + n)) <= self.max_itl_ms

        if fits(rows_left):
            return rows_left
        lo, hi = 0, rows_left  # fits(hi) is false; the answer is lo once hi = lo + 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return min(rows_left, max(lo, self.min_prompt_rows))

    def _plan_decoders(self, live: list[Seq]) -> tuple[list[Work], int]:
        """Each decoder that can get its next page runs its known rows (one, or more after a
        refused draft), and the free pages left."""
        budget, work = self.engine.free_pages, []
        for s in live:
            if not s.prompting:
                rows = self.engine.decode_rows(s.slot)
                cost = self.engine.free_page_cost(s.slot, rows)
                if cost <= budget:  # otherwise it stalls until a page frees up
                    work.append(Work(s.slot, rows))
                    budget -= cost
        return work, budget

    def _plan_drafts(self, live: list[Seq], work: list[Work], budget: int, rows_left: int):
        """Drafts go to decoders oldest first, from the rows left after one row for every
        prompt. Were every draft refused, each decoder's next round must feed again at most
        the rows it runs now, so the next pass's required rows fit as these did."""
        spare = rows_left - sum(1 for s in live if s.prompting)
        out = []
        for w in work:
            n = min(self.engine.draft_rows(w.slot), max(0, spare))
            while n and self.engine.free_page_cost(w.slot, w.rows + n) - self.engine.free_page_cost(w.slot, w.rows) > budget:
                n -= 1  # drafts stay on the page of the round's first token, so this only guards
            budget -= self.engine.free_page_cost(w.slot, w.rows + n) - self.engine.free_page_cost(w.slot, w.rows)
            spare, rows_left = spare - n, rows_left - n
            out.append(Work(w.slot, w.rows + n))
        return out, budget, rows_left

    def _plan_prompts(self, live: list[Seq], budget: int, rows_left: int) -> list[Work]:
        """The prompts' share of the pass (rows_left) dealt to prompts as chunks, least recently
        served first: the first always gets rows and goes to the back, and nobody overtakes a prompt
        that waits, so none waits more passes than there are prompts ahead of it."""
        prompts = sorted((s for s in live if s.prompting), key=lambda s: (self._served[s.request.req_id], s.order))
        work = []
        for s in prompts:
            n = min(self.prompt_quantum, s.prompt_left, rows_left, self.engine.rows_to_snapshot(s.slot))
            while n and self.engine.free_page_cost(s.slot, n) > budget:
                n -= 1  # prompts hold reservations, so this only guards the invariant
            if n:
                work.append(Work(s.slot, n))
                self._served[s.request.req_id] = self._steps
                budget, rows_left = budget - self.engine.free_page_cost(s.slot, n), rows_left - n
        return work

    def _check(self, work: list[Work], outcomes: list[Outcome]) -> None:
        got = [(o.slot, o.rows) for o in outcomes]
        if got != [(w.slot, w.rows) for w in work]:
            raise StepError(f"planned (slot, rows) {[(w.slot, w.rows) for w in work]}, outcomes {got}")
        for o in outcomes:
            if o.failure:
                if o.choices:
                    raise StepError(f"slot {o.slot} failed ({o.failure}) yet chose tokens")
            elif (not o.choices) != self.engine.seqs[o.slot].prompting:
                raise StepError(f"slot {o.slot}: tokens are expected exactly when its prompt is done")

    def _apply(self, outcomes: list[Outcome]) -> list[Event]:
        events: list[Event] = []
        for o in outcomes:
            s = self.engine.seqs[o.slot]
            if o.failure:  # its lane and pages are freed now; the other slots' outcomes stand
                log.error("request %d: %s", s.request.req_id, o.failure)
                events.append(self._finish(s, "error", o.failure, o.failure_code))
                continue
            r, before = s.request, len(s.generated) - len(o.choices)
            for n, c in enumerate(o.choices, before + 1):
                self._tokens_generated += 1
                if s.stops(c.token, self.engine.config.eos_id):
                    events.append(self._finish(s, "stop"))  # the stop token itself is not reported
                    break
                events.append(TokenEvent(r.req_id, c.token, c.logprob, c.top_logprobs))
                if n >= s.max_new:
                    events.append(self._finish(s, "length"))
                    break
        return events

    def _finish(self, s: Seq, reason: str, message: str = "", error_code: str = "") -> FinishEvent:
        self.engine.retire(s.slot, cache_tail=reason != "error")
        self._running.pop(s.request.req_id, None)
        self._served.pop(s.request.req_id, None)
        spec = s.spec
        return FinishEvent(s.request.req_id, reason, s.prompt_len, len(s.generated), message, s.cached_tokens,
                           spec.proposed if spec else 0, spec.accepted if spec else 0, error_code)

    def _break_stall(self) -> list[Event]:
        """Nothing could run although _make_room had its turn: a bookkeeping bug, never
        an undersized pool (refusal and preemption cover that). Fail loudly, not silently."""
        live = self.engine.live()
        if not live:
            return []
        with self._lock:
            msg = f"internal error: no sequence can run ({self.engine.stats()})"
            log.error("request %d: %s", live[-1].request.req_id, msg)
            return [self._finish(live[-1], "error", msg)]

    def _fail(self, work: list[Work], err: Exception) -> list[Event]:
        log.error("pass failed, finishing its %d requests: %s", len(work), err)
        msg = f"{type(err).__name__}: {err}"
        events: list[Event] = []
        with self._lock:
            for w in work:
                s = self.engine.seqs.get(w.slot)
                if s is None:
                    continue
                try:
                    self.engine.retire(s.slot)  # drops the bookkeeping before touching the backend
                except Exception:
                    log.exception("slot %d: reset after a failed pass also failed", s.slot)
                self._running.pop(s.request.req_id, None)
                self._served.pop(s.request.req_id, None)
                events.append(FinishEvent(s.request.req_id, "error", s.prompt_len, len(s.generated), msg,
                                          s.cached_tokens))
        return events


def batched_rows(engine: SeqEngine, max_batched_rows: Optional[int]) -> int:
    """The pass size: the backend's max_pass_rows by default; never below max_concurrency, so
    every decoder gets its row in every pass (vLLM likewise wants max_num_batched_tokens >=
    max_num_seqs)."""
    n = engine.max_pass_rows if max_batched_rows is None else max_batched_rows
    if not 1 <= n <= engine.max_pass_rows:
        raise ValueError(f"max_batched_rows must be in 1..{engine.max_pass_rows} (the most rows one pass "
                         f"of the {engine.backend.name} backend holds), got {n}")
    if n < engine.max_concurrency:
        raise ValueError(f"max_batched_rows ({n}) must be at least max_concurrency ({engine.max_concurrency}): "
                         f"every decoding sequence needs its row in every pass")
    return n
