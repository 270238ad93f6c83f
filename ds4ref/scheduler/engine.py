"""Engine: the synchronous front door. Requests in, token ids out.

    eng = Engine(ds4ref.load(), max_concurrency=8)
    outs = eng.run([Request([0, 5, 9], max_new_tokens=20), ...])

run() drives the Scheduler pass by pass until every request has finished. By
default a pass holds as many rows as the backend takes and a lone prompt may
fill it (chunked prefill); `prompt_quantum=1` is upstream's one-token-a-pass
schedule, `max_batched_rows` bounds the pass. Tokens are the same either way.
For tests it can also replay a timeline: `arrivals={i: pass}` submits
request i just before that pass (default 0), `cancel_at={i: pass}` cancels it
just before that pass.
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

from .request import Event, FinishEvent, Request, TokenEvent
from .scheduler import Scheduler
from .seq_engine import SeqEngine


class Engine:
    def __init__(self, model, max_concurrency: int = 16, kv_pool_tokens: Optional[int] = None,
                 prompt_quantum: Optional[int] = None, backend=None, *, max_context: Optional[int] = None,
                 max_queue: Optional[int] = None, page_order_seed: Optional[int] = None,
                 max_batched_rows: Optional[int] = None, prefix_cache: bool = True, speculative_tokens: int = 0,
                 drafter=None, spec_min_rate: Optional[float] = None, max_itl_ms: Optional[float] = None,
                 pass_cost=None):
        """model: what ds4ref.load() returns (.config, .make_backend(name)).
        backend: None for the model's own backend (numpy unless loaded for hip), a name
        for model.make_backend, or a Backend instance. prompt_quantum, max_batched_rows:
        the Scheduler's (None: the backend's whole pass); max_itl_ms, pass_cost: the Scheduler's
        inter-token budget and pass cost model (None: no budget). speculative_tokens, drafter,
        spec_min_rate: speculative decoding's (SeqEngine; 0 drafts: off)."""
        if backend is None or isinstance(backend, str):
            backend = model.make_backend(backend)
        self.model = model
        self.seq_engine = SeqEngine(backend, model.config, max_concurrency, kv_pool_tokens,
                                    max_context=max_context, page_order_seed=page_order_seed,
                                    prefix_cache=prefix_cache, speculative_tokens=speculative_tokens,
                                    drafter=drafter,
                                    **({} if spec_min_rate is None else {"spec_min_rate": spec_min_rate}))
        self.scheduler = Scheduler(self.seq_engine, max_queue=max_queue, prompt_quantum=prompt_quantum,
                                   max_batched_rows=max_batched_rows, max_itl_ms=max_itl_ms, pass_cost=pass_cost)
        self.events: list[Event] = []                 # everything the last run() saw
        self.finishes: list[Optional[FinishEvent]] = []  # per request of the last run()

    def run(self, requests: Sequence[Request], arrivals: Optional[Mapping[int, int]] = None,
            cancel_at: Optional[Mapping[int, int]] = None) -> list[list[int]]:
        """New token ids per request, in request order."""
        arrivals, cancel_at = dict(arrivals or {}), dict(cancel_at or {})
        index = {r.req_id: i for i, r in enumerate(requests)}
        if len(index) != len(requests):
            raise ValueError("two requests share a req_id")
        tokens: list[list[int]] = [[] for _ in requests]
        self.events, self.finishes = [], [None] * len(requests)
        unsent = sorted(range(len(requests)), key=lambda i: (arrivals.get(i, 0), i))
        step = 0
        while unsent or self.scheduler.has_work():
            while unsent and arrivals.get(unsent[0], 0) <= step:
                self.scheduler.submit(requests[unsent.pop(0)])
            for i, at in cancel_at.items():
                if at == step:
                    self.scheduler.cancel(requests[i].req_id)
            for ev in self.scheduler.step():
                self._record(ev, index, tokens)
            step += 1
        return tokens

    def _record(self, ev: Event, index: dict[int, int], tokens: list[list[int]]) -> None:
        self.events.append(ev)
        i = index[ev.req_id]
        if isinstance(ev, TokenEvent):
            tokens[i].append(ev.token)
        else:
            self.finishes[i] = ev

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, **kw) -> list[int]:
        """One request, alone (kw are Request fields: sampling, stop_ids, ignore_eos)."""
        return self.run([Request(list(prompt_ids), max_new_tokens, **kw)])[0]
