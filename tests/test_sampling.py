"""Sampling: each filter and penalty against a direct computation of its definition."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from ds4ref.scheduler.request import Sampling
from ds4ref.scheduler.sampling import (SlotSampler, draw, filtered_probs, log_softmax, min_p_keep,
                                       needs_logits, top_k_keep, top_p_keep)

# Few distinct values so ties are common: every tie-break is exercised.
LOGITS = hnp.arrays(np.float64, st.integers(2, 24), elements=st.sampled_from([-3.0, -1.0, 0.0, 0.5, 2.0, 4.0]))
FAST = settings(max_examples=80, deadline=None)


def ranked_before(x: np.ndarray, i: int) -> list[int]:
    """Tokens that outrank i: larger value, or equal value and lower index."""
    return [j for j in range(x.size) if x[j] > x[i] or (x[j] == x[i] and j < i)]


def probs_of(x):
    e = np.exp(x - x.max())
    return e / e.sum()


@FAST
@given(LOGITS, st.integers(1, 30))
def test_top_k_keeps_the_k_best_lower_index_on_ties(x, k):
    want = [len(ranked_before(x, i)) < k for i in range(x.size)]
    assert top_k_keep(x, k).tolist() == want


@FAST
@given(LOGITS, st.floats(0.01, 1.0))
def test_top_p_keeps_tokens_until_mass_reaches_p(x, p):
    pr = probs_of(x)
    want = [sum(pr[j] for j in ranked_before(pr, i)) < p for i in range(x.size)]
    assert top_p_keep(pr, p).tolist() == want


@FAST
@given(LOGITS, st.floats(0.0, 1.0))
def test_min_p_keeps_tokens_within_factor_of_the_best(x, m):
    pr = probs_of(x)
    assert min_p_keep(pr, m).tolist() == [pr[i] >= m * pr.max() for i in range(x.size)]


@FAST
@given(LOGITS, st.floats(0.2, 3.0), st.integers(0, 6), st.floats(0.05, 1.0), st.floats(0.0, 0.9))
def test_filter_chain_is_temperature_then_top_k_then_top_p_then_min_p(x, t, k, p, m):
    s = Sampling(temperature=t, top_k=k, top_p=p, min_p=m)
    y = x / t
    keep = np.ones(x.size, bool)
    if k:
        keep &= [len(ranked_before(y, i)) < k for i in range(x.size)]
    def renorm(keep):
        q = np.where(keep, np.exp(y - y[keep].max()), 0.0)
        return q / q.sum()
    q = renorm(keep)
    keep &= [sum(q[j] for j in ranked_before(q, i)) < p for i in range(x.size)]
    q = renorm(keep)
    keep &= q >= m * q.max()
    np.testing.assert_allclose(filtered_probs(x, s), renorm(keep), rtol=1e-12, atol=1e-15)


@FAST
@given(LOGITS, st.integers(0, 2**32))
def test_draw_never_picks_a_dropped_token(x, seed):
    s = Sampling(temperature=0.7, top_k=3, top_p=0.8)
    p = filtered_probs(x, s)
    rng = np.random.default_rng(seed)
    assert all(p[draw(p, rng)] > 0 for _ in range(20))


def test_draws_follow_the_distribution():
    p = np.array([0.1, 0.0, 0.6, 0.3])
    rng = np.random.default_rng(123)
    counts = np.bincount([draw(p, rng) for _ in range(20000)], minlength=4) / 20000
    np.testing.assert_allclose(counts, p, atol=0.015)
    assert counts[1] == 0


def run_sampler(sampling, steps=40, vocab=16, prompt=(1, 2, 3), logits_seed=5):
    """Feed a fixed sequence of logits through a fresh sampler; return its tokens."""
    lg = np.random.default_rng(logits_seed).standard_normal((steps, vocab)).astype(np.float32)
    sp = SlotSampler(sampling, list(prompt))
    return [sp.choose(row, int(np.argmax(row))).token for row in lg]


@pytest.mark.parametrize("seed", [0, 1, 2**40, -5])
def test_a_seed_reproduces_including_zero(seed):
    s = Sampling(temperature=1.0, seed=seed)
    assert run_sampler(s) == run_sampler(s)


def test_different_seeds_differ_and_no_seed_is_fresh_entropy():
    outs = {tuple(run_sampler(Sampling(temperature=1.5, seed=sd))) for sd in (0, 1, 2, 3)}
    assert len(outs) == 4
    assert run_sampler(Sampling(temperature=1.5)) != run_sampler(Sampling(temperature=1.5))


def test_seed_zero_matches_numpy_seed_zero_stream():
    # seed 0 must seed the Generator with 0 itself (the upstream bug used fresh entropy)
    x = np.array([0.0, 1.0, 0.5, -1.0])
    s = Sampling(temperature=1.0, seed=0)
    p = filtered_probs(x, s)
    rng = np.random.default_rng(0)
    want = [draw(p, rng) for _ in range(30)]
    sp = SlotSampler(s, [0])
    assert [sp.choose(x, 1).token for _ in range(30)] == want


def test_greedy_ties_go_to_the_lower_index():
    x = np.array([1.0, 3.0, 3.0, 2.0], np.float32)
    assert SlotSampler(Sampling(repetition_penalty=1.0001), [0]).choose(x, 1).token == 1
    assert SlotSampler(Sampling(presence_penalty=0.5), [0]).choose(x, 1).token == 1


@FAST
@given(LOGITS, st.lists(st.integers(0, 23), max_size=8), st.lists(st.integers(0, 23), max_size=8),
       st.floats(0.5, 2.0), st.floats(-1.0, 1.0), st.floats(-1.0, 1.0))
def test_penalties_match_their_definitions(x, prompt, generated, rep, pres, freq):
    generated = [g % x.size for g in generated]
    prompt = [t % x.size for t in prompt] or [0]
    s = Sampling(repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq)
    y = x.copy()
    for t in set(prompt + generated):  # llama.cpp: divide positive logits, multiply negative ones
        y[t] = y[t] / rep if y[t] > 0 else y[t] * rep
    for t in set(generated):           # OpenAI: over generated tokens only
        y[t] -= pres + freq * generated.count(t)
    sp = SlotSampler(s, prompt)
    for g in generated:                # replay the history as if the sampler had chosen it
        sp.generated.append(g)
        sp.counts[g] += 1
    assert sp.choose(x, int(np.argmax(x))).token == int(np.argmax(y))


def test_frequency_penalty_changes_greedy_output_and_history_is_per_request():
    x = np.array([2.0, 1.9, 0.0])
    sp = SlotSampler(Sampling(frequency_penalty=0.2), [2])
    assert [sp.choose(x, 0).token for _ in range(3)] == [0, 1, 0]
    fresh = SlotSampler(Sampling(frequency_penalty=0.2), [2])  # a reused slot gets a new sampler
    assert fresh.choose(x, 0).token == 0


@FAST
@given(LOGITS, st.integers(0, 5))
def test_logprobs_are_log_softmax_of_raw_logits(x, n):
    s = Sampling(temperature=0.0, repetition_penalty=1.3, logprobs=n)
    c = SlotSampler(s, [0]).choose(x.astype(np.float32), int(np.argmax(x)))
    direct = np.log(probs_of(x))
    assert c.logprob == pytest.approx(direct[c.token], abs=1e-9)
    order = sorted(range(x.size), key=lambda i: (-x[i], i))[:n]
    assert [t for t, _ in c.top_logprobs] == order
    np.testing.assert_allclose([v for _, v in c.top_logprobs], direct[order], atol=1e-9)
    np.testing.assert_allclose(log_softmax(x), direct, atol=1e-9)


def test_which_requests_need_logits():
    assert not needs_logits(Sampling())
    assert needs_logits(Sampling(temperature=0.5))
    assert needs_logits(Sampling(logprobs=0))
    assert needs_logits(Sampling(repetition_penalty=1.1))
    assert needs_logits(Sampling(presence_penalty=0.1))
    assert needs_logits(Sampling(frequency_penalty=-0.1))
    with pytest.raises(ValueError, match="logits"):
        SlotSampler(Sampling(temperature=1.0), [0]).choose(None, 0)


@given(st.floats(min_value=5e-324, max_value=1e-300), st.floats(0.0, 1.0), st.integers(0, 10**6))
def test_vanishing_temperature_is_greedy(temperature, min_p, seed):
    """Found by the server fuzzer: a subnormal temperature overflowed the scaled logits
    and the filters were left with nothing. The T -> 0 limit is greedy."""
    x = np.random.default_rng(seed).normal(size=50).astype(np.float32)
    p = filtered_probs(x, Sampling(temperature=temperature, min_p=min_p, seed=0))
    assert p[int(np.argmax(x))] == 1.0 and p.sum() == 1.0
