"""The model's DSML tool calls -> OpenAI `tool_calls`.

DeepSeek-V4 answers a tool request by ending its text with the block its chat
format describes (ds4ref.serve.chat.render_tool_calls writes the same block):

    \\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>
    ...
    </｜DSML｜invoke>
    ...
    </｜DSML｜tool_calls>

then end-of-sentence. `ToolCallStream` sits on the answer text: it passes text
through until the block may be starting, holds everything from there, and at
the end parses it. A well-formed block becomes tool calls; anything else
(cut short, extra text after it, a bad parameter) comes back as plain text, as
DeepSeek's own parser would refuse it.

Arguments are built as the official decoder builds them: a JSON object whose
string parameters are JSON-quoted and whose other parameters are the model's
JSON text as written; a block whose arguments are not valid JSON is malformed.
"""
from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass
from typing import Optional

from .chat import DSML, TOOL_CALLS_BLOCK

OPENER = f"\n\n<{DSML}{TOOL_CALLS_BLOCK}>\n"
CLOSER = f"\n</{DSML}{TOOL_CALLS_BLOCK}>"
INVOKE_END = f"</{DSML}invoke>"
PARAM_END = f"</{DSML}parameter>"
_INVOKE = re.compile(rf'<{DSML}invoke name="([^"\n]+)">\n(.*)\n', re.S)
_PARAM = re.compile(rf'<{DSML}parameter name="([^"\n]+)" string="(true|false)">(.*)', re.S)
_call_ids = itertools.count(1)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text
    fragments: tuple[str, ...] = ()  # the arguments in stream order: "{", one per parameter, "}"

    def openai(self, index: Optional[int] = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}

    def stream_deltas(self, index: int) -> list[dict]:
        """The call as OpenAI and vLLM stream it: a first delta with index, id, type, name and
        empty arguments, then the arguments in fragments (index and arguments only) whose
        concatenation is exactly `arguments`."""
        head = {"index": index, "id": self.id, "type": "function", "function": {"name": self.name, "arguments": ""}}
        return [head, *({"index": index, "function": {"arguments": f}} for f in self.fragments or (self.arguments,))]


def _arguments(params: str) -> Optional[tuple[str, ...]]:
    """The arguments' JSON object in fragments (their concatenation is the object), or None."""
    if not params:
        return ("{}",)
    if not params.endswith(PARAM_END):
        return None
    parts, seen = [], set()
    for p in params[:-len(PARAM_END)].split(PARAM_END + "\n"):
        m = _PARAM.fullmatch(p)
        if m is None or m.group(1) in seen:
            return None
        key, is_str, value = m.groups()
        seen.add(key)
        parts.append(f"{', ' if parts else ''}{json.dumps(key, ensure_ascii=False)}: "
                     f"{json.dumps(value, ensure_ascii=False) if is_str == 'true' else value}")
    fragments = ("{", *parts, "}")
    try:
        json.loads("".join(fragments))
    except ValueError:
        return None
    return fragments


def parse_tool_calls(text: str) -> Optional[list[ToolCall]]:
    """The calls of a complete block (`text` starts at OPENER), or None if it is malformed."""
    if not (text.startswith(OPENER) and text.endswith(CLOSER)):
        return None
    body = text[len(OPENER):-len(CLOSER)]
    if not body.endswith(INVOKE_END):
        return None
    calls = []
    for chunk in body[:-len(INVOKE_END)].split(INVOKE_END + "\n"):
        m = _INVOKE.fullmatch(chunk)
        args = None if m is None else _arguments(m.group(2))
        if args is None:
            return None
        calls.append(ToolCall(f"call_{next(_call_ids)}", m.group(1), "".join(args), args))
    return calls


def _may_start(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of OPENER."""
    for n in range(min(len(OPENER) - 1, len(text)), 0, -1):
        if OPENER.startswith(text[-n:]):
            return n
    return 0


class ToolCallStream:
    """Answer text in, answer text out, with a trailing DSML block taken out as tool calls.

    enabled=False passes text through (no tools in the request). `strip` are
    strings removed from released text (the DSML token when special tokens are
    skipped). `single` keeps only the first call (parallel_tool_calls: false).
    """

    def __init__(self, enabled: bool, strip: tuple[str, ...] = (), single: bool = False) -> None:
        self.enabled, self.strip, self.single = enabled, strip, single
        self._held = ""
        self._in_block = False
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> str:
        if not self.enabled:
            return self._clean(text)
        self._held += text
        if not self._in_block:
            at = self._held.find(OPENER)
            if at >= 0:
                self._in_block = True
                out, self._held = self._held[:at], self._held[at:]
                return self._clean(out)
            keep = _may_start(self._held)
            out, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
            return self._clean(out)
        return ""

    def finish(self) -> str:
        """The text still held; sets .calls when it was a well-formed block."""
        held, self._held = self._held, ""
        calls = parse_tool_calls(held) if self._in_block else None
        if calls:
            self.calls = calls[:1] if self.single else calls
            return ""
        return self._clean(held)

    def _clean(self, text: str) -> str:
        for s in self.strip:
            text = text.replace(s, "")
        return text
