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


class StopMatcher:
    """Aho-Corasick automaton over the stop strings, fed the answer one character at a time.

    Its state is the longest suffix of the text fed so far that is a prefix of some
    stop string, which is exactly what must be held back, and a terminal state (or one
    on its failure chain) is a match. So each character costs O(1) amortised, whatever
    the number and length of the stop strings; rescanning the tail for every stop
    string cost O(len(stop)^2) per token and starved the event loop.

    Written here rather than taken from pyahocorasick: its iterator does not expose the
    automaton's current depth (the held-back length), which is what streaming needs.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._next: list[dict[str, int]] = [{}]  # trie edges, node 0 is the root
        self._depth = [0]
        self._fail = [0]
        self._match = [0]  # length of the longest stop string ending at this node, 0 = none
        for s in stops:
            self._insert(s)
        self._link()
        self._state = 0
        self._fed = 0  # characters fed so far

    def _insert(self, s: str) -> None:
        node = 0
        for ch in s:
            child = self._next[node].get(ch)
            if child is None:
                child = len(self._next)
                self._next[node][ch] = child
                self._next.append({})
                self._depth.append(self._depth[node] + 1)
                self._fail.append(0)
                self._match.append(0)
            node = child
        self._match[node] = len(s)

    def _link(self) -> None:
        """Failure links, breadth first: a node's link is the longest proper suffix that is in the trie."""
        queue = list(self._next[0].values())
        for node in queue:  # the list grows as we go: a breadth-first walk
            for ch, child in self._next[node].items():
                f = self._fail[node]
                while f and ch not in self._next[f]:
                    f = self._fail[f]
                self._fail[child] = self._next[f].get(ch, 0)  # shallower than child: never itself
                # the node itself is the deepest on its chain, so its own match is the longest
                self._match[child] = self._match[child] or self._match[self._fail[child]]
                queue.append(child)

    def feed(self, text: str) -> Optional[int]:
        """Advance over `text`; the stream offset where the earliest-starting match found
        in it begins, or None. The whole text is scanned: a match that ends later may
        start earlier (stops "abcd" and "bc" in "abcd")."""
        first = None
        for ch in text:
            node = self._state
            while node and ch not in self._next[node]:
                node = self._fail[node]
            self._state = self._next[node].get(ch, 0)
            self._fed += 1
            n = self._match[self._state]
            if n and (first is None or self._fed - n < first):
                first = self._fed - n
        return first

    @property
    def held(self) -> int:
        """Characters at the end of the fed text that may still start a stop string."""
        return self._depth[self._state]


class TextAssembler:
    def __init__(self, tokenizer: Any, stop_strings: Sequence[str] = (), thinking: bool = False,
                 skip_ids: frozenset = frozenset()) -> None:
        self.tokenizer = tokenizer
        self.skip_ids = skip_ids  # tokens that produce no text (skip_special_tokens)
        self.stops = [s for s in stop_strings if s]
        self._matcher = StopMatcher(self.stops)
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
        return self._release(piece, final=False)

    def finish(self) -> list[Delta]:
        """Release what was held back once generation has ended."""
        if self.stopped:
            return []
        tail = self._utf8.decode(b"", final=True)
        if self.channel == REASONING:
            self.reasoning += tail
            return [Delta(REASONING, tail)] if tail else []
        return self._release(tail, final=True)

    def _release(self, piece: str, final: bool) -> list[Delta]:
        """Add `piece` to the answer and release what can no longer be part of a stop string."""
        self.answer += piece
        # A stop string cannot start before _sent: its start would have been held back.
        hit = self._matcher.feed(piece)
        if hit is not None:
            self.answer = self.answer[:hit]
            self.stopped = True
            end = len(self.answer)
        else:
            end = len(self.answer) - (0 if final else self._matcher.held)
        out = self.answer[self._sent:end]
        self._sent = max(self._sent, end)
        return [Delta(CONTENT, out)] if out else []

    @property
    def released_answer(self) -> str:
        return self.answer[:self._sent]
