"""Generated token ids -> text deltas, with stop strings and the thinking split.

Tokens are turned into bytes and fed through an incremental UTF-8 decoder, so
a character split across tokens is emitted once it is complete. Text that
might be the start of a stop string is held back until it is known not to be;
a matched stop string and everything after it are never emitted.

In thinking mode the text before the `</think>` token is reasoning and is
reported on its own channel; stop strings are matched in the answer only.
"""
from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from .chat import THINK_END

REASONING = "reasoning"
CONTENT = "content"


@dataclass
class TokenInfo:
    """One generated token, for logprobs."""
    token: int
    text: str
    logprob: Optional[float]
    top: list[tuple[int, str, float]] = field(default_factory=list)  # (id, text, logprob)
    offset: int = 0  # characters of answer text before this token
    raw: bytes = b""  # the token's own bytes (its text may be a partial character)


@dataclass
class Delta:
    channel: str
    text: str


def _held_prefix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class TextAssembler:
    def __init__(self, tokenizer: Any, stop_strings: Sequence[str] = (), thinking: bool = False,
                 skip_ids: frozenset = frozenset()) -> None:
        self.tokenizer = tokenizer
        self.skip_ids = skip_ids  # tokens that produce no text (skip_special_tokens)
        self.stops = [s for s in stop_strings if s]
        self.channel = REASONING if thinking else CONTENT
        self.think_end = tokenizer.token_to_id(THINK_END) if thinking else None
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.answer = ""     # answer text decoded so far, held-back part included
        self.reasoning = ""
        self._sent = 0       # characters of `answer` already released
        self.stopped = False  # a stop string was matched

    def push(self, token: int) -> list[Delta]:
        """Deltas released by one more generated token (none after a stop string)."""
        if self.stopped:
            return []
        if self.channel == REASONING and token == self.think_end:
            tail = self._utf8.decode(b"", final=True)
            self._utf8.reset()
            self.reasoning += tail
            self.channel = CONTENT
            return [Delta(REASONING, tail)] if tail else []
        if token in self.skip_ids:
            return []
        piece = self._utf8.decode(self.tokenizer.decode_bytes([token]))
        if self.channel == REASONING:
            self.reasoning += piece
            return [Delta(REASONING, piece)] if piece else []
        self.answer += piece
        return self._release(final=False)

    def finish(self) -> list[Delta]:
        """Release what was held back once generation has ended."""
        if self.stopped:
            return []
        tail = self._utf8.decode(b"", final=True)
        if self.channel == REASONING:
            self.reasoning += tail
            return [Delta(REASONING, tail)] if tail else []
        self.answer += tail
        return self._release(final=True)

    def _release(self, final: bool) -> list[Delta]:
        # A stop string cannot start before _sent: its start would have been held back.
        hits = [i for i in (self.answer.find(s, self._sent) for s in self.stops) if i >= 0]
        if hits:
            self.answer = self.answer[:min(hits)]
            self.stopped = True
            end = len(self.answer)
        else:
            end = len(self.answer) - (0 if final else _held_prefix(self.answer, self.stops))
        out = self.answer[self._sent:end]
        self._sent = max(self._sent, end)
        return [Delta(CONTENT, out)] if out else []

    @property
    def released_answer(self) -> str:
        return self.answer[:self._sent]
