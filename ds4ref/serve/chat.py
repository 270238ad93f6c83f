"""DS4 chat template: OpenAI-style messages -> prompt text -> token ids (spec §6.3).

The rendering follows DS4C's multi-turn server rules:

    BOS + system block + turns + generation prompt

* system block: every system (or developer) message's text, joined by a blank
  line, with no role marker; it may be empty.
* user: `<｜User｜>` + text.
* tool results: one `<｜User｜>` per run of consecutive tool messages, each
  result wrapped in `<tool_result>` ... `</tool_result>`.
* assistant: when it answers a user/tool turn, `<｜Assistant｜>` first, then the
  thinking part: `<think>` + reasoning + `</think>` in thinking mode for
  messages after the last user turn, otherwise just `</think>`. Then the text
  and `<｜end▁of▁sentence｜>`.
* generation prompt after a user/tool turn: `<｜Assistant｜>` + `<think>`
  (thinking) or `</think>` (non-thinking).

Special-token strings are turned into ids by the tokenizer, exactly as DS4C
does by splitting the rendered text on them; a message that contains such a
string therefore injects that token (DS4C behaves the same way).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

BOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>"
EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"
USER = "<\uff5cUser\uff5c>"
ASSISTANT = "<\uff5cAssistant\uff5c>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "\uff5cDSML\uff5c"

TOOL_RESULT_OPEN = "<tool_result>"
TOOL_RESULT_CLOSE = "</tool_result>"
# A result must not be able to close its own wrapper early; DS4C escapes only
# this sentinel. Our escape (a backslash before the slash) is our own choice.
TOOL_RESULT_CLOSE_ESCAPED = "<\\/tool_result>"

SYSTEM_ROLES = ("system", "developer")
TOOL_ROLES = ("tool", "function")
ROLES = SYSTEM_ROLES + TOOL_ROLES + ("user", "assistant")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered; `param` names the offending field."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


def message_text(content: Any, param: str) -> str:
    """The text of a message's content: a string, None, or a list of text parts.

    Text parts are joined with a newline (the usual OpenAI-server convention).
    """
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


def _check_roles(messages: Sequence[Any]) -> None:
    if not messages:
        raise ChatTemplateError("messages must contain at least one message", "messages")
    for i, m in enumerate(messages):
        role = _field(m, "role")
        if role not in ROLES:
            raise ChatTemplateError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}",
                                    f"messages[{i}].role")
        if role == "assistant" and _field(m, "tool_calls"):
            raise ChatTemplateError("assistant tool_calls are not supported by this server",
                                    f"messages[{i}].tool_calls")
        if role == "assistant" and _field(m, "prefix") and i != len(messages) - 1:
            raise ChatTemplateError("only the last message may be an assistant prefix",
                                    f"messages[{i}].prefix")


def _reasoning(msg: Any) -> str:
    # DeepSeek's API calls it reasoning_content; some clients send `reasoning`.
    r = _field(msg, "reasoning_content")
    if r is None:
        r = _field(msg, "reasoning")
    return r if isinstance(r, str) else ""


def render_chat(messages: Sequence[Any], thinking: bool = False) -> str:
    """Render messages to DS4 prompt text (special tokens as their strings).

    The last non-system message must be a user or tool turn (a generation
    prompt follows), or an assistant message marked `prefix: true`, whose text
    the model then continues (no end-of-sentence after it).
    """
    _check_roles(messages)
    system = [message_text(_field(m, "content"), f"messages[{i}].content")
              for i, m in enumerate(messages) if _field(m, "role") in SYSTEM_ROLES]
    turns = [(i, m) for i, m in enumerate(messages) if _field(m, "role") not in SYSTEM_ROLES]
    if not turns:
        raise ChatTemplateError("messages must contain a user message, not only system messages", "messages")
    last_user = max((i for i, m in turns if _field(m, "role") == "user"), default=-1)

    out = [BOS, "\n\n".join(system)]
    prev = None  # role of the previous non-system turn
    for i, m in turns:
        role = _field(m, "role")
        text = message_text(_field(m, "content"), f"messages[{i}].content")
        if role == "user":
            out += [USER, text]
        elif role in TOOL_ROLES:
            if prev not in TOOL_ROLES:
                out.append(USER)
            out += [TOOL_RESULT_OPEN, text.replace(TOOL_RESULT_CLOSE, TOOL_RESULT_CLOSE_ESCAPED), TOOL_RESULT_CLOSE]
        else:  # assistant
            if prev == "user" or prev in TOOL_ROLES:
                out.append(ASSISTANT)
                if thinking and i > last_user:
                    out += [THINK_START, _reasoning(m), THINK_END]
                else:
                    out.append(THINK_END)
            out.append(text)
            if not _field(m, "prefix"):
                out.append(EOS)
        prev = role

    if prev == "user" or prev in TOOL_ROLES:
        out += [ASSISTANT, THINK_START if thinking else THINK_END]
    elif not _field(turns[-1][1], "prefix"):
        raise ChatTemplateError("the last message must be a user or tool message "
                                "(or an assistant message with prefix: true to continue it)",
                                f"messages[{turns[-1][0]}].role")
    return "".join(out)


def encode_chat(tokenizer: Any, messages: Sequence[Any], thinking: bool = False) -> list[int]:
    """Render and tokenise; the tokenizer maps special-token strings to their ids."""
    return list(tokenizer.encode(render_chat(messages, thinking)))


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

