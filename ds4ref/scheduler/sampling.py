"""Per-slot token sampling.

Order of operations on one row's logits (float64 copy, the model's logits are
never modified):

  0. logit_bias (OpenAI) is added, then a constraint's mask (structured output)
     sets every token it does not allow to -inf; both come first, as in
     llama.cpp's sampler chain and vLLM;
  1. repetition penalty (llama.cpp): every token seen in prompt + generated has
     its logit divided by the penalty if positive, multiplied if negative;
  2. presence / frequency penalties (OpenAI): logit -= presence * [count > 0]
     + frequency * count, counts over generated tokens;
  3. greedy (temperature 0): argmax, the lower index wins a tie;
  4. otherwise divide by temperature, then keep tokens through top-k, top-p and
     min-p in that order (each on the probabilities left by the previous one),
     then draw once from the slot's own Generator by inverse CDF.

Ranking ties are broken by the lower token index everywhere (top-k, top-p and
top logprobs), so every filter has one exact answer.

The Generator is seeded from Sampling.seed: seed 0 is a seed like any other
(the upstream bug gave seed 0 fresh entropy); only seed None draws fresh
entropy. A slot's history and Generator are built per request, so a reused
slot starts clean.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .request import Sampling


@dataclass(frozen=True)
class Choice:
    token: int
    logprob: Optional[float] = None
    top_logprobs: Optional[list[tuple[int, float]]] = None


def has_penalties(s: Sampling) -> bool:
    return s.repetition_penalty != 1.0 or s.presence_penalty != 0.0 or s.frequency_penalty != 0.0


def needs_logits(s: Sampling, constrained: bool = False) -> bool:
    """False when the backend's argmax alone decides the token."""
    return not s.greedy or has_penalties(s) or s.logprobs is not None or bool(s.logit_bias) or constrained


# ---- pure helpers (each one a direct statement of its definition) -------------

def rank_desc(x: np.ndarray) -> np.ndarray:
    """Indices by decreasing value, lower index first among equals."""
    return np.lexsort((np.arange(x.size), -x))


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    m = np.max(x)
    return x - m - np.log(np.sum(np.exp(x - m)))


def softmax_kept(x: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """Softmax over the kept entries; dropped entries get probability 0."""
    p = np.zeros(x.size, np.float64)
    k = x[keep]
    e = np.exp(k - np.max(k))
    p[keep] = e / e.sum()
    return p


def repetition_penalty(x: np.ndarray, seen: Sequence[int], penalty: float) -> np.ndarray:
    ids = np.unique(np.asarray(seen, np.int64))
    v = x[ids]
    x[ids] = np.where(v > 0, v / penalty, v * penalty)
    return x


def presence_frequency(x: np.ndarray, counts: Counter, presence: float, frequency: float) -> np.ndarray:
    if counts:
        ids = np.fromiter(counts.keys(), np.int64)
        c = np.fromiter(counts.values(), np.float64)
        x[ids] -= presence * (c > 0) + frequency * c
    return x


def top_k_keep(x: np.ndarray, k: int) -> np.ndarray:
    keep = np.zeros(x.size, bool)
    keep[rank_desc(x)[:k]] = True
    return keep


def top_p_keep(p: np.ndarray, top_p: float) -> np.ndarray:
    """Smallest set of most likely tokens whose mass reaches top_p (a token is kept
    when the mass ranked strictly before it is still below top_p)."""
    order = rank_desc(p)
    before = np.concatenate(([0.0], np.cumsum(p[order])[:-1]))
    keep = np.zeros(p.size, bool)
    keep[order[before < top_p]] = True
    return keep


def min_p_keep(p: np.ndarray, min_p: float) -> np.ndarray:
    return p >= min_p * p.max()


def draw(p: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse-CDF draw: one uniform number per token, so a seed fixes the stream."""
    c = np.cumsum(p)
    i = int(np.searchsorted(c, rng.random() * c[-1], side="right"))
    i = min(i, p.size - 1)
    while p[i] == 0.0:  # only reachable through rounding at the top end
        i -= 1
    return i


def filtered_probs(x: np.ndarray, s: Sampling) -> np.ndarray:
    """Probabilities after temperature, top-k, top-p, min-p (x already penalised)."""
    x = np.asarray(x, np.float64)
    with np.errstate(over="ignore"):
        scaled = x / s.temperature
    if np.isposinf(scaled).any():
        # A temperature so small that scaling overflows: its limit is greedy.
        p = np.zeros(x.size)
        p[rank_desc(np.where(np.isnan(x), -np.inf, x))[0]] = 1.0
        return p
    x = scaled
    keep = x > -np.inf  # drops -inf and NaN
    if not keep.any():
        raise ValueError("every logit is -inf or NaN; nothing to sample")
    if s.top_k > 0:
        keep &= top_k_keep(np.where(keep, x, -np.inf), s.top_k)
    p = softmax_kept(x, keep)
    if s.top_p < 1.0:
        keep &= top_p_keep(p, s.top_p)
        p = softmax_kept(x, keep)
    if s.min_p > 0.0:
        keep &= min_p_keep(p, s.min_p)
        p = softmax_kept(x, keep)
    return p


def logprob_report(logits: np.ndarray, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    lp = log_softmax(logits)
    top = rank_desc(lp)[:n]
    return float(lp[token]), [(int(t), float(lp[t])) for t in top]


# ---- the per-slot sampler --------------------------------------------------------

def apply_bias(x: np.ndarray, bias: Sequence[tuple[int, float]]) -> np.ndarray:
    for t, b in bias:
        x[t] += b
    return x


class SlotSampler:
    def __init__(self, sampling: Sampling, prompt_ids: Sequence[int], constraint=None):
        self.sampling = sampling
        self.constraint = constraint
        self.needs_logits = needs_logits(sampling, constraint is not None)
        # Negative seeds are legal in the OpenAI API; numpy wants them non-negative.
        seed = None if sampling.seed is None else sampling.seed % (1 << 64)
        self.rng = np.random.default_rng(seed)
        self.prompt = list(prompt_ids)
        self.generated: list[int] = []
        self.counts: Counter = Counter()

    def choose(self, logits: Optional[np.ndarray], argmax: int) -> Choice:
        """Pick the next token, record it in the history, report logprobs if asked."""
        s = self.sampling
        if self.needs_logits and logits is None:
            raise ValueError("this request samples from logits but the row returned none")
        if not self.needs_logits or (s.greedy and not has_penalties(s) and not s.logit_bias
                                     and self.constraint is None):
            token = int(argmax)
        else:
            x = np.array(logits, np.float64)
            apply_bias(x, s.logit_bias)
            self._mask(x)
            if s.repetition_penalty != 1.0:
                repetition_penalty(x, self.prompt + self.generated, s.repetition_penalty)
            presence_frequency(x, self.counts, s.presence_penalty, s.frequency_penalty)
            token = int(np.argmax(x)) if s.greedy else draw(filtered_probs(x, s), self.rng)
        self.generated.append(token)
        self.counts[token] += 1
        if self.constraint is not None:
            self.constraint.accept(token)
        if s.logprobs is None:
            return Choice(token)
        lp, top = logprob_report(logits, token, s.logprobs)
        return Choice(token, lp, top)

    def _mask(self, x: np.ndarray) -> None:
        allowed = None if self.constraint is None else self.constraint.allowed()
        if allowed is not None:
            x[~allowed] = -np.inf
