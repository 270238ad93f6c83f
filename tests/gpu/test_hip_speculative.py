"""Speculative decoding on the device (marker gpu): the HIP backend drafting with the embedded
tiny model's MTP block (random: nearly every round refuses a draft and rolls back through
restore_state) and with an oracle (mostly right: long accepted runs), against plain decoding
on the NumPy reference, in both numerics: the same tokens, logprobs (bit for bit) and finish
reasons. Prompts reach the ratio-128 window and the indexer's top-k, decoding crosses page and
compression boundaries, three requests share the passes (one sampled with penalties), and the
prefix cache is on or off. Skipped with the reason when no GPU runtime opens."""
from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ds4ref
from ds4ref.reference.numpy_backend import NumpyBackend
from ds4ref.scheduler.engine import Engine
from ds4ref.scheduler.request import FinishEvent, Request, Sampling, TokenEvent
from ds4ref.scheduler.speculative import OracleDrafter

pytestmark = pytest.mark.gpu
EXAMPLES = int(os.environ.get("DS4REF_GPU_EXAMPLES", "8"))


@pytest.fixture(scope="module", params=["official", "plain"])
def model(request):
    return ds4ref.load(numerics=request.param)


def trace(eng: Engine, ids):
    ev = {i: [] for i in ids}
    for e in eng.events:
        if isinstance(e, TokenEvent):
            ev[e.req_id].append((e.token, None if e.logprob is None else np.float32(e.logprob).view(np.uint32).item(),
                                 e.top_logprobs))
    return ev, sorted((f.req_id, f.reason, f.completion_tokens) for f in eng.finishes)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(k=st.integers(1, 4), seed=st.integers(0, 1000), n=st.integers(118, 300), cache=st.booleans(),
       rate=st.sampled_from([None, 0.5, 0.9]))
def test_speculation_on_the_device_changes_no_bit(model, rt, k, seed, n, cache, rate):
    from ds4ref.hip.backend import HipBackend
    V = model.config.vocab_size
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(2, V, m).tolist() for m in (n, n - 37, 130)]

    def reqs():
        return [Request(prompts[0], 24, ignore_eos=True, req_id=1000),
                Request(prompts[1], 20, req_id=1001,
                        sampling=Sampling(temperature=0.8, seed=seed, logprobs=2, repetition_penalty=1.1)),
                Request(prompts[2], 16, ignore_eos=True, req_id=1002, sampling=Sampling(logprobs=1))]
    ids = [1000, 1001, 1002]
    plain = Engine(model, 3, backend=NumpyBackend(model.reference), prefix_cache=False)
    plain.run(reqs())
    want = trace(plain, ids)
    truth = {i: [t for t, _, _ in want[0][i]] for i in ids}
    drafter = None if rate is None else OracleDrafter(truth, rate, V, seed)
    eng = Engine(model, 3, backend=HipBackend(model.config, model.weights, model.numerics, model.tables,
                                              runtime=rt, mtp=model.mtp_weights), prefix_cache=cache,
                 speculative_tokens=k, drafter=drafter, spec_min_rate=0.0)
    eng.run(reqs())
    assert trace(eng, ids) == want
    assert eng.scheduler.stats()["spec_rounds"] > 0


def test_preemption_and_cancellation_on_the_device(model, rt):
    """tests/test_speculative.py's preemption and cancellation case, the HIP backend speculating
    (MTP drafts on the device, and an oracle) against plain decoding on the reference: requests
    decoding past their reserved pages in a pool of 4 pages (a preemption), one cancelled while
    it decodes."""
    from ds4ref.hip.backend import HipBackend
    sampled = Sampling(temperature=0.8, seed=3, logprobs=2)
    shapes = ((100, 170), (90, 170), (40, 30), (30, 60))
    ids = [1000 + j for j in range(len(shapes))]

    def reqs():
        return [Request([(17 * i + 5 * j) % 500 + 2 for i in range(n)], m, ignore_eos=True, req_id=1000 + j,
                        sampling=sampled if j == 1 else Sampling()) for j, (n, m) in enumerate(shapes)]
    kw = dict(max_concurrency=3, kv_pool_tokens=4 * 128)
    plain = Engine(model, backend=NumpyBackend(model.reference), **kw)
    plain.run(reqs())
    want, want_fin = trace(plain, ids)
    truth = {i: [t for t, _, _ in want[i]] for i in ids}
    for drafter in (None, OracleDrafter(truth, 0.8, model.config.vocab_size, 1)):
        eng = Engine(model, backend=HipBackend(model.config, model.weights, model.numerics, model.tables,
                                               runtime=rt, mtp=model.mtp_weights), speculative_tokens=3,
                     drafter=drafter, spec_min_rate=0.0, **kw)
        sch, cancelled = eng.scheduler, False
        for r in reqs():
            sch.submit(r)
        while sch.stats()["running"] or sch.stats()["waiting"]:
            events = sch.step()
            eng.events += events  # trace() reads them
            if not cancelled and any(isinstance(e, TokenEvent) and e.req_id == 1003 for e in events):
                sch.cancel(1003)  # while it decodes, whichever pass that is here
                cancelled = True
        eng.finishes = [e for e in eng.events if isinstance(e, FinishEvent)]
        got, fin = trace(eng, ids)
        assert sch.stats()["preemptions"] > 0 and sch.stats()["spec_rounds"] > 0
        assert {f[0]: f[1] for f in fin}[1003] == "cancelled" and got[1003] == want[1003][:len(got[1003])]
        assert all(got[i] == want[i] for i in ids[:3]) and [f for f in fin if f[0] != 1003] == \
            [f for f in want_fin if f[0] != 1003]
