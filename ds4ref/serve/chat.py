"""DS4 chat template: OpenAI-style messages -> prompt text -> token ids.

Renders chats as DeepSeek's own DeepSeek-V4 encoder (`encoding_dsv4.py`,
shipped with the model and copied by vLLM and sglang) does; the tests compare
against that encoder run from a published package. Its rules:

* the prompt is BOS, then each message in order; there are no role markers
  for system messages, which are rendered where they stand;
* tool results become `<tool_result>...</tool_result>` blocks of a user turn,
  and consecutive user turns (and tool results) merge into one
  `<｜User｜>` turn, their parts joined by a blank line; the results are put
  in the order of the calls of the assistant message before them;
* a `developer` message is a user turn (`<｜User｜>` + its text);
* after a user/developer turn that an assistant message (or the generation)
  follows: `<｜Assistant｜>` then `<think>` (thinking) or `</think>`;
* assistant: [reasoning + `</think>`] + text + [DSML tool calls] + EOS. In
  thinking mode earlier turns lose their reasoning and their `developer`
  messages: only what follows the last user turn keeps `reasoning + </think>`
  and gets `<think>` after its user turn. With tools present nothing is
  dropped and every user turn opens `<think>`;
* tools are described (DSML instructions + JSON schemas) in the first system
  message, inserted empty if the chat has none first (sglang's adapter);
* in thinking mode, reasoning effort puts a fixed instruction before everything
  else: the original's template has one, for `max`; DeepSeek-V4-Flash-0731's gives
  that text to `high` and a new, stronger one to `max` (EFFORT_PROMPTS; the model's
  version, gguf.version.chat_version, picks the table). Other efforts add nothing.

Control tokens come only from the template. The rendering is a list of
segments, each the template's own text (structure: BOS, role markers, end of
turn, thinking tags, DSML and tool-result markup, the fixed instructions) or
text from the request (data: content, names, tool definitions, tool-call
arguments, tool results, reasoning, the response schema). `encode_chat`
tokenises structure with special-token parsing and data without, so a message
containing `<｜User｜>` is those characters, never the token. Where the data
holds no added-token string the ids are exactly the tokenizer's ids of the
whole rendered text (Tokenizer.encode_parts says why).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple, Optional, Sequence

from ..gguf.version import ORIGINAL, V0731, VERSIONS

BOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>"
EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"
USER = "<\uff5cUser\uff5c>"
ASSISTANT = "<\uff5cAssistant\uff5c>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "\uff5cDSML\uff5c"

TOOL_CALLS_BLOCK = "tool_calls"
TOOL_RESULT_OPEN, TOOL_RESULT_CLOSE = "<tool_result>", "</tool_result>"

SYSTEM_ROLES = ("system",)
USER_ROLES = ("user", "developer")
TOOL_ROLES = ("tool", "function")
ROLES = SYSTEM_ROLES + USER_ROLES + TOOL_ROLES + ("assistant",)

# The exact text the model was trained to read (DeepSeek-V4's encoder and templates); a
# paraphrase would change the prompt, so these are data, not prose.
REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n")
REASONING_EFFORT_MAX_0731 = (
    "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
    "decompose the problem into its most fundamental components, trace every causal chain to its root, and "
    "resolve the underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are "
    "certain that no assumption remains unchecked and no error remains undiscovered.\n\n")
# reasoning_effort -> the instruction it puts first in thinking mode, per model version
EFFORT_PROMPTS: dict[str, dict[str, str]] = {
    ORIGINAL: {"max": REASONING_EFFORT_MAX},
    V0731: {"high": REASONING_EFFORT_MAX, "max": REASONING_EFFORT_MAX_0731},
}
TOOLS_PROMPT = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{D}tool_calls>" block like the following:

<{D}tool_calls>
<{D}invoke name="$TOOL_NAME">
<{D}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{D}parameter>
...
</{D}invoke>
<{D}invoke name="$TOOL_NAME2">
...
</{D}invoke>
</{D}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{SCHEMAS}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""
RESPONSE_FORMAT_PROMPT = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"


class ChatTemplateError(ValueError):
    """The messages cannot be rendered; `param` names the offending field."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


def to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


# ---- reading OpenAI messages ------------------------------------------------------------

def message_text(content: Any, param: str) -> str:
    """The text of a message's content: a string, None, or a list of text parts
    (joined with a newline, as vLLM and sglang flatten them for this encoder)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatTemplateError("only text content parts ({'type': 'text', 'text': ...}) are supported",
                                        f"{param}[{i}]")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ChatTemplateError("content must be a string or a list of text parts", param)


def _field(msg: Any, name: str) -> Any:
    """Read a field from a dict or an attribute-style message model."""
    if isinstance(msg, Mapping):
        return msg.get(name)
    return getattr(msg, name, None)


@dataclass
class Turn:
    """One message as the encoder sees it (after tool results are merged into user turns)."""
    role: str
    text: str = ""
    reasoning: str = ""
    calls: list[tuple[str, dict]] = field(default_factory=list)   # (name, arguments object)
    call_ids: list[str] = field(default_factory=list)
    blocks: list[tuple[str, str]] = field(default_factory=list)   # user: ("text" | "tool", text)
    result_ids: list[str] = field(default_factory=list)           # tool_call_id per "tool" block
    prefix: bool = False
    tools: Optional[list] = None
    response_format: Any = None


def _reasoning(msg: Any) -> str:
    # DeepSeek's API calls it reasoning_content; some clients send `reasoning`.
    r = _field(msg, "reasoning_content")
    if r is None:
        r = _field(msg, "reasoning")
    return r if isinstance(r, str) else ""


def _tool_calls(calls: Any, param: str) -> tuple[list[tuple[str, dict]], list[str]]:
    out, ids = [], []
    for i, c in enumerate(calls or []):
        fn = _field(c, "function")
        name, args = _field(fn, "name"), _field(fn, "arguments")
        if not isinstance(name, str) or not name:
            raise ChatTemplateError("a tool call needs function.name", f"{param}[{i}].function.name")
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise ChatTemplateError("function.arguments must be a JSON object (as a string)",
                                    f"{param}[{i}].function.arguments")
        out.append((name, parsed))
        ids.append(_field(c, "id") or "")
    return out, ids


def read_messages(messages: Sequence[Any]) -> list[Turn]:
    """Check roles and fields and turn OpenAI messages into Turns, tool messages merged."""
    if not messages:
        raise ChatTemplateError("messages must contain at least one message", "messages")
    turns: list[Turn] = []
    for i, m in enumerate(messages):
        role, where = _field(m, "role"), f"messages[{i}]"
        if role not in ROLES:
            raise ChatTemplateError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}", f"{where}.role")
        text = message_text(_field(m, "content"), f"{where}.content")
        if _field(m, "prefix") and (role != "assistant" or i != len(messages) - 1):
            raise ChatTemplateError("only the last message may be an assistant prefix", f"{where}.prefix")
        if role in TOOL_ROLES or role == "user":
            _merge_user(turns, "tool" if role in TOOL_ROLES else "text", text, _field(m, "tool_call_id") or "")
        elif role == "developer":
            if not text:  # the encoder asserts this
                raise ChatTemplateError("a developer message needs non-empty content", f"{where}.content")
            turns.append(Turn("developer", text))
        elif role == "assistant":
            calls, ids = _tool_calls(_field(m, "tool_calls"), f"{where}.tool_calls")
            turns.append(Turn("assistant", text, _reasoning(m), calls, ids, prefix=bool(_field(m, "prefix"))))
        else:
            turns.append(Turn("system", text))
    return turns


def _merge_user(turns: list[Turn], kind: str, text: str, call_id: str) -> None:
    if not (turns and turns[-1].role == "user"):
        turns.append(Turn("user"))
    turns[-1].blocks.append((kind, text))
    if kind == "tool":
        turns[-1].result_ids.append(call_id)


def _order_results(turns: list[Turn]) -> None:
    """Tool results in the order of the calls that asked for them (unknown ids count as first)."""
    order: dict[str, int] = {}
    for t in turns:
        if t.role == "assistant" and t.calls:
            order = {cid: k for k, cid in enumerate(t.call_ids) if cid}
        elif t.role == "user" and len(t.result_ids) > 1 and order:
            tools = sorted(zip(t.result_ids, (b for b in t.blocks if b[0] == "tool")),
                           key=lambda rb: order.get(rb[0], 0))
            it = iter(tools)
            t.blocks = [next(it)[1] if b[0] == "tool" else b for b in t.blocks]
            t.result_ids = [r for r, _ in tools]


# ---- rendering ----------------------------------------------------------------------------

class Segment(NamedTuple):
    text: str
    data: bool  # from the request: its added-token strings stay text


def S(text: str) -> list[Segment]:
    """The template's own text."""
    return [Segment(text, False)]


def D(text: str) -> list[Segment]:
    """Text from the request."""
    return [Segment(text, True)]


def joined(sep: str, items: Sequence[list[Segment]]) -> list[Segment]:
    out: list[Segment] = []
    for k, item in enumerate(items):
        out += (S(sep) if k else []) + item
    return out


def text_of(segments: Sequence[Segment]) -> str:
    return "".join(seg.text for seg in segments)


def render_tools(tools: Sequence[Mapping]) -> list[Segment]:
    head, tail = TOOLS_PROMPT.replace("{D}", DSML).split("{SCHEMAS}")
    return S(head) + joined("\n", [D(to_json(t["function"])) for t in tools]) + S(tail)


def _extras(t: Turn) -> list[Segment]:
    out: list[Segment] = []
    if t.tools:
        out += S("\n\n") + render_tools(t.tools)
    if t.response_format:
        out += S("\n\n" + RESPONSE_FORMAT_PROMPT) + D(to_json(t.response_format))
    return out


def tool_call_segments(calls: Sequence[tuple[str, Mapping]]) -> list[Segment]:
    """The DSML block the model writes for these calls (string values verbatim, others as JSON)."""
    invokes = []
    for name, args in calls:
        params = [S(f'<{DSML}parameter name="') + D(k) + S(f'" string="{"true" if isinstance(v, str) else "false"}">')
                  + D(v if isinstance(v, str) else to_json(v)) + S(f"</{DSML}parameter>") for k, v in args.items()]
        invokes.append(S(f'<{DSML}invoke name="') + D(name) + S('">\n') + joined("\n", params)
                       + S(f"\n</{DSML}invoke>"))
    return (S(f"\n\n<{DSML}{TOOL_CALLS_BLOCK}>\n") + joined("\n", invokes)
            + S(f"\n</{DSML}{TOOL_CALLS_BLOCK}>"))


def render_tool_calls(calls: Sequence[tuple[str, Mapping]]) -> str:
    return text_of(tool_call_segments(calls))


def _last_user(turns: Sequence[Turn]) -> int:
    return max((i for i, t in enumerate(turns) if t.role in USER_ROLES), default=-1)


def _drop_earlier_thinking(turns: list[Turn]) -> list[Turn]:
    """Before the last user turn: assistants lose their reasoning, developer messages go."""
    last = _last_user(turns)
    out = []
    for i, t in enumerate(turns):
        if i >= last or t.role in ("user", "system"):
            out.append(t)
        elif t.role == "assistant":
            out.append(Turn(**{**t.__dict__, "reasoning": ""}))
    return out


def _render_turn(t: Turn, thinking: bool, keep_reasoning: bool) -> list[Segment]:
    if t.role == "system":
        return D(t.text) + _extras(t)
    if t.role == "developer":
        return S(USER) + D(t.text) + _extras(t)
    if t.role == "user":
        return S(USER) + joined("\n\n", [S(TOOL_RESULT_OPEN) + D(x) + S(TOOL_RESULT_CLOSE) if kind == "tool"
                                          else D(x) for kind, x in t.blocks])
    reasoning = D(t.reasoning) + S(THINK_END) if thinking and keep_reasoning else []
    calls = tool_call_segments(t.calls) if t.calls else []
    return reasoning + D(t.text) + calls + ([] if t.prefix else S(EOS))


def effort_prompt(reasoning_effort: Optional[str], version: str = ORIGINAL) -> str:
    """The instruction `reasoning_effort` puts first in thinking mode for a model of `version`."""
    if version not in EFFORT_PROMPTS:
        raise ValueError(f"model version {version!r} is not one of {VERSIONS}")
    return EFFORT_PROMPTS[version].get(reasoning_effort, "") if reasoning_effort else ""


def render_turns(turns: list[Turn], thinking: bool, reasoning_effort: Optional[str] = None,
                 version: str = ORIGINAL) -> list[Segment]:
    drop = not any(t.tools for t in turns)  # with tools, earlier reasoning is kept
    if thinking and drop:
        turns = _drop_earlier_thinking(turns)
    last_user = _last_user(turns)
    out = S(BOS)
    effort = effort_prompt(reasoning_effort, version)
    if thinking and effort:
        out += S(effort)
    for i, t in enumerate(turns):
        out += _render_turn(t, thinking, keep_reasoning=not drop or i > last_user)
        followed_by_answer = i + 1 == len(turns) or turns[i + 1].role == "assistant"
        if t.role in USER_ROLES and followed_by_answer:
            opens = thinking and (not drop or i >= last_user)
            out += S(ASSISTANT + (THINK_START if opens else THINK_END))
    return out


def render_segments(messages: Sequence[Any], thinking: bool = False, tools: Optional[Sequence[Mapping]] = None,
                    reasoning_effort: Optional[str] = None, response_format: Any = None,
                    version: str = ORIGINAL) -> list[Segment]:
    """Render messages to DS4 prompt segments (structure and data, see the module's docstring)
    for a model of `version` ("original" or "0731": what reasoning_effort puts first).

    The last message must be a user, developer or tool turn (a generation
    prompt follows), or an assistant message marked `prefix: true`, whose text
    the model then continues (no end-of-sentence after it). `tools` are
    OpenAI tool definitions ({"type": "function", "function": {...}});
    `response_format` a JSON schema the system prompt asks the answer to follow.
    """
    turns = read_messages(messages)
    _order_results(turns)
    if tools or response_format:
        if turns[0].role != "system":
            turns.insert(0, Turn("system"))
        turns[0].tools, turns[0].response_format = (list(tools) if tools else None), response_format
    last = turns[-1]
    if last.role == "system" or (last.role == "assistant" and not last.prefix):
        raise ChatTemplateError("the last message must be a user or tool message "
                                "(or an assistant message with prefix: true to continue it)",
                                f"messages[{len(messages) - 1}].role")
    return render_turns(turns, thinking, reasoning_effort, version)


def render_chat(messages: Sequence[Any], thinking: bool = False, **kw) -> str:
    """The prompt text of `render_segments` (special tokens as their strings)."""
    return text_of(render_segments(messages, thinking, **kw))


def encode_chat(tokenizer: Any, messages: Sequence[Any], thinking: bool = False, **kw) -> list[int]:
    """Render and tokenise: the template's added-token strings become ids, the request's stay text."""
    return list(tokenizer.encode_parts((seg.text, not seg.data) for seg in render_segments(messages, thinking, **kw)))


def encode_prompt(tokenizer: Any, text: str, parse_special: bool = True, add_bos: bool = True) -> list[int]:
    """A raw prompt's ids, BOS first. With parse_special (the caller's own text, as llama.cpp's
    server does) added-token strings become ids and a prompt that already starts with BOS's
    string gets no second one; without, the whole text is plain text."""
    ids = list(tokenizer.encode(text, special=parse_special))
    starts_with_bos = parse_special and text.startswith(BOS)
    return ([tokenizer.bos_id] if add_bos and not starts_with_bos else []) + ids


# ---- the per-request thinking switch ------------------------------------------

REASONING_EFFORTS_ON = ("low", "medium", "high", "max")
REASONING_EFFORTS_OFF = ("none", "minimal")


def thinking_requested(chat_template_kwargs: Mapping[str, Any] | None,
                       reasoning_effort: str | None,
                       thinking: Mapping[str, Any] | None = None) -> bool:
    """Whether a chat request turns `<think>` on (default off).

    Sources, first one present wins:
      chat_template_kwargs {"thinking": bool} or {"enable_thinking": bool}
      thinking {"type": "enabled" | "disabled"}   (DeepSeek API style)
      reasoning_effort "none"/"minimal" -> off, "low"/"medium"/"high"/"max" -> on
    Values are validated by the protocol models before they reach here.
    """
    for key in ("thinking", "enable_thinking"):
        if chat_template_kwargs and key in chat_template_kwargs:
            return bool(chat_template_kwargs[key])
    if thinking is not None:
        return thinking.get("type") == "enabled"
    if reasoning_effort is not None:
        return reasoning_effort in REASONING_EFFORTS_ON
    return False
