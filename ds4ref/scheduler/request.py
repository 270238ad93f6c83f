"""What a client asks for (Request, Sampling) and what the scheduler reports back (events).

The server, the synchronous Engine and the tests all speak these types.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

_ids = itertools.count(1)


@dataclass(frozen=True)
class Sampling:
    """OpenAI / llama.cpp sampling parameters. temperature 0 = greedy."""
    temperature: float = 0.0
    top_k: int = 0            # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: Optional[int] = None  # None = fresh entropy; 0 is a seed like any other
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: Optional[int] = None  # number of top logprobs to report per token (0 = only the chosen token)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit) before anything else

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class Request:
    prompt_ids: Sequence[int]
    max_new_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    stop_ids: Sequence[int] = ()
    ignore_eos: bool = False
    req_id: int = field(default_factory=lambda: next(_ids))
    # Optional token constraint (e.g. a JSON-schema matcher): .allowed() -> bool mask over the
    # vocabulary or None (anything), .accept(token) after each choice. See serve/structured.py.
    constraint: Optional[object] = None


@dataclass(frozen=True)
class TokenEvent:
    req_id: int
    token: int
    logprob: Optional[float] = None                       # of the chosen token, when asked for
    top_logprobs: Optional[list[tuple[int, float]]] = None


@dataclass(frozen=True)
class FinishEvent:
    req_id: int
    reason: str  # "length" | "stop" | "cancelled" | "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    message: str = ""
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    draft_tokens: int = 0     # speculative decoding: drafts its rounds proposed
    accepted_drafts: int = 0  # ... and how many of them the model's own choices confirmed
    error_code: str = ""      # reason "error": what went wrong, as an OpenAI error code ("" = the engine failed)


# FinishEvent.error_code of a request whose own values stopped being finite (backend.StepResult.non_finite)
NON_FINITE_VALUES = "non_finite_values"


Event = Union[TokenEvent, FinishEvent]


class Refused(ValueError):
    """A request that can never be served (e.g. its prompt can never fit the page pool)."""
