"""`tool_choice: "required"` and a named function, as constrained decoding of DSML.

DeepSeek-V4 calls tools by ending its answer with a DSML block (serve/tools.py has the
format). With a forced tool_choice the whole answer is that block: llguidance is given a Lark
grammar of it, and the sampler masks every token that cannot continue it, as for
`response_format` (serve/structured.py). "required" allows one call or more of any given
tool (exactly one with `parallel_tool_calls: false`); a named function allows exactly one
call of that tool, as vLLM does. Each call's parameters follow its JSON schema:

* the schema's `properties` in their order, each written once: every `required` one, and
  the others optionally (so no extra key is ever written, which any `additionalProperties`
  allows); a required key without a property schema takes `additionalProperties`' schema;
* a property whose schema is a plain string (`type: "string"`, or an enum / const of strings,
  with at most `minLength`, `maxLength` and annotations besides) is written as DeepSeek's
  encoder writes strings, `string="true"` and the text as it is, of that many characters and
  without the markup's `｜DSML｜` in it; an enum or const is one of its values;
* any other property is `string="false"` and a JSON value that llguidance constrains to the
  property's schema (the top level's `$defs` / `definitions` go along, for `$ref`), written as
  `json.dumps` writes it (", " and ": ", no other whitespace), as the encoder writes them.

Top-level keywords that constrain more than this (`anyOf`, `minProperties`, ...) are refused
with a 400 naming the tool rather than half honoured. The prompt is the one "auto" gives: the
tools are rendered the same way, only the decoding changes. In thinking mode the constraint
starts after `</think>`.
"""
from __future__ import annotations

import json
import re
from typing import Any, Mapping, Optional, Sequence

from .chat import DSML, THINK_END, TOOL_CALLS_BLOCK
from .structured import GrammarConstraint, StructuredOutputError, _ll_tokenizer, _llguidance

OPEN_BLOCK = f"\n\n<{DSML}{TOOL_CALLS_BLOCK}>\n"
CLOSE_BLOCK = f"\n</{DSML}{TOOL_CALLS_BLOCK}>"
CLOSE_INVOKE = f"</{DSML}invoke>"
CLOSE_PARAMETER = f"</{DSML}parameter>"

# Keywords a parameters schema may carry at its top level: what the grammar honours, and
# annotations that constrain nothing.
TOP_LEVEL = {"type", "properties", "required", "additionalProperties", "$defs", "definitions", "$schema", "$id",
             "$comment", "title", "description", "default", "examples", "strict"}
# A property written as raw text (string="true") may carry only these.
PLAIN_STRING = {"type", "enum", "const", "minLength", "maxLength", "title", "description", "default", "examples",
                "$comment"}
# JSON values written as json.dumps writes them, the way the chat encoder writes non-string arguments
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ToolChoiceError(StructuredOutputError):
    """A forced tool_choice whose tools cannot be constrained: a 400 naming the field."""
    code = "invalid_tool_schema"


def lark_string(text: str) -> str:
    """A Lark string literal matching exactly `text`."""
    return json.dumps(text, ensure_ascii=False)


def _regex_literal(text: str) -> str:
    """`text` as a regex matching it exactly, inside Lark's /.../."""
    return re.sub(r"([\\.^$|?*+()\[\]{}/])", r"\\\1", text)


class _Grammar:
    """Rules and terminals of one DSML grammar, named as they are added."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.texts: dict[tuple[int, Optional[int]], str] = {}

    def rule(self, name: str, body: str) -> str:
        self.lines.append(f"{name}: {body}")
        return name

    def text_value(self, least: int, most: Optional[int]) -> str:
        """The rule of a raw string value of least..most characters and its closing tag. It is
        lazy, so the first closing tag ends it: llguidance's lexer takes the longest match, and
        a value rule followed by a separate closing tag would swallow the tag's "</". The value
        holds no ｜DSML｜ (exactly one in all: the tag's), as the reply's parser splits on them."""
        key = (least, most)
        if key not in self.texts:
            n = len(self.texts)
            bound = f"{{{least},{'' if most is None else most}}}"
            dsml = _regex_literal(DSML)
            self.lines.append(f"TEXT_{n}: /(?s:.{bound}){_regex_literal(CLOSE_PARAMETER)}/ & "
                              f"~/(?s:.*){dsml}(?s:.*){dsml}(?s:.*)/")
            self.lines.append(f"text_{n}[lazy]: TEXT_{n}")
            self.texts[key] = f"text_{n}"
        return self.texts[key]

    def text(self) -> str:
        return "%llguidance {}\n" + "\n".join(self.lines) + "\n"


def _length(schema: Mapping, key: str) -> bool:
    value = schema.get(key, 0)
    return type(value) is int and value >= 0


def _plain_string(schema: Mapping) -> bool:
    """Whether a property's values are strings the raw form can hold: `type: "string"`, or an
    enum / const of strings (the encoder writes any str value raw, string="true"). Anything
    else, a malformed keyword included, goes to llguidance's JSON schema compiler, which judges it."""
    enum = schema.get("enum", [])
    if not isinstance(enum, list) or not _length(schema, "minLength") or not _length(schema, "maxLength"):
        return False
    if schema.get("minLength", 0) > schema.get("maxLength", float("inf")):
        return False
    values = enum + ([schema["const"]] if "const" in schema else [])
    typed = schema.get("type", "string" if values else None) == "string"
    return typed and set(schema) <= PLAIN_STRING and all(isinstance(v, str) and DSML not in v for v in values)


def _parameter(g: _Grammar, name: str, key: str, schema: Any, defs: Mapping, where: str) -> str:
    """The rule of one `<｜DSML｜parameter ...>value</｜DSML｜parameter>` of the schema."""
    if isinstance(schema, Mapping) and _plain_string(schema):
        head = lark_string(f'<{DSML}parameter name="{key}" string="true">')
        values = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
        if values is not None:
            choices = " | ".join(lark_string(v) for v in values)
            return g.rule(name, f"{head} ({choices}) {lark_string(CLOSE_PARAMETER)}")
        return g.rule(name, f"{head} {g.text_value(int(schema.get('minLength', 0)), schema.get('maxLength'))}")
    sub = dict(schema) if isinstance(schema, Mapping) else ({} if schema is True else {"not": {}})
    sub.update({k: v for k, v in defs.items() if k not in sub})
    sub["x-guidance"] = {**sub.get("x-guidance", {}), **JSON_FORMAT}
    llg = _llguidance()
    error = llg.LLMatcher.validate_grammar(llg.LLMatcher.grammar_from_json_schema(sub))
    if error:
        raise ToolChoiceError(f"the schema of parameter {key!r} cannot be used to constrain a call: {error}", where)
    value = g.rule(f"{name}_json", f"%json {json.dumps(sub, ensure_ascii=False)}")
    head = lark_string(f'<{DSML}parameter name="{key}" string="false">')
    return g.rule(name, f"{head} {value} {lark_string(CLOSE_PARAMETER)}")


def _parameters(function: Mapping, where: str) -> tuple[list[tuple[str, Any, bool]], dict]:
    """(key, schema, required) of each parameter a call writes, in order; and the $defs."""
    schema = function.get("parameters") or {}
    if not isinstance(schema, Mapping):
        raise ToolChoiceError("parameters must be a JSON schema object", where)
    extra = sorted(set(schema) - TOP_LEVEL)
    if extra:
        raise ToolChoiceError(f"a forced tool call cannot follow the keyword {extra[0]!r} at the top of a "
                              f"parameters schema (it honours type, properties, required, "
                              f"additionalProperties, $defs)", where)
    if schema.get("type", "object") != "object":
        raise ToolChoiceError(f"parameters must be of type object, not {schema['type']!r}", where)
    properties, required = schema.get("properties") or {}, schema.get("required") or []
    additional = schema.get("additionalProperties", True)
    if not isinstance(properties, Mapping) or not all(isinstance(p, (Mapping, bool)) for p in properties.values()):
        raise ToolChoiceError("properties must map each name to a schema", where)
    if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
        raise ToolChoiceError("required must be a list of parameter names", where)
    if not isinstance(additional, (Mapping, bool)):
        raise ToolChoiceError("additionalProperties must be a schema or a boolean", where)
    properties = dict(properties)
    for key in required:
        if key not in properties:
            if additional is False:
                raise ToolChoiceError(f"parameter {key!r} is required, but neither a property nor allowed by "
                                      f"additionalProperties", where)
            properties[key] = additional
    for key in properties:
        if not key or '"' in key or "\n" in key:
            raise ToolChoiceError(f"parameter name {key!r} cannot be written in a DSML call (no quote or "
                                  f"newline, not empty)", where)
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    return [(key, sub, key in required) for key, sub in properties.items()], defs


def _invoke(g: _Grammar, i: int, function: Mapping, where: str) -> str:
    """The rule of one `<｜DSML｜invoke name=...>` ... `</｜DSML｜invoke>` of the tool."""
    params, defs = _parameters(function, f"{where}.parameters")
    items = [(_parameter(g, f"param_{i}_{k}", key, sub, defs, f"{where}.parameters.properties.{key}"), needed)
             for k, (key, sub, needed) in enumerate(params)]
    # the block's layout (chat.tool_call_segments): the head's newline, each parameter on its own
    # line, then the closing tag on the next; no parameter at all leaves an empty line
    lines = [f'{item} "\\n"' if needed else f'({item} "\\n")?' for item, needed in items]
    if any(needed for _, needed in items):
        body = " ".join(lines)
    else:  # all optional: none written, or a first one then any of those after it
        firsts = [f'{item} "\\n" {" ".join(lines[k + 1:])}'.rstrip() for k, (item, _) in enumerate(items)]
        body = " | ".join(['"\\n"', *firsts])
    g.rule(f"invoke_{i}_body", f"({body}) {lark_string(CLOSE_INVOKE)}")
    head = f'<{DSML}invoke name="{function["name"]}">\n'
    # A later call's separating newline is part of its head: llguidance's lexer takes the longest
    # match, so a lone "\n" lexeme would lose to the block's closing "\n</..." and not come back.
    later_head = lark_string("\n" + head)
    g.rule(f"next_invoke_{i}", f"{later_head} invoke_{i}_body")
    return g.rule(f"invoke_{i}", f"{lark_string(head)} invoke_{i}_body")


def dsml_grammar(tools: Sequence[Mapping], single: bool, indices: Optional[Sequence[int]] = None) -> str:
    """The Lark grammar of an answer that is one DSML block of calls of `tools` (OpenAI tool
    definitions; errors name `tools[i]`, i from `indices`, default 0, 1, ...): one call when
    `single`, else one or more."""
    g = _Grammar()
    indices = range(len(tools)) if indices is None else indices
    invokes = [_invoke(g, k, t["function"], f"tools[{i}].function") for k, (i, t) in enumerate(zip(indices, tools))]
    call = g.rule("call", " | ".join(invokes))
    calls = call if single else f"{call} {g.rule('next_call', ' | '.join('next_' + i for i in invokes))}*"
    g.lines.insert(0, f"start: {lark_string(OPEN_BLOCK)} {calls} {lark_string(CLOSE_BLOCK)}")
    return g.text()


def forced_tool_calls(tokenizer: Any, tools: Optional[Sequence[Mapping]], tool_choice: Any, parallel: bool,
                      thinking: bool = False) -> Optional[GrammarConstraint]:
    """The constraint of a forced tool_choice ("required", or {"type": "function", "function":
    {"name": ...}}, either as the request's model or a dict), or None for "auto" and "none"."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    tools = list(tools or [])
    if tool_choice == "required":
        grammar = dsml_grammar(tools, single=not parallel)
    else:
        function = tool_choice["function"] if isinstance(tool_choice, Mapping) else tool_choice.function
        name = function["name"] if isinstance(function, Mapping) else function.name
        i = next(i for i, t in enumerate(tools) if t["function"]["name"] == name)  # the request checked it is there
        grammar = dsml_grammar([tools[i]], single=True, indices=[i])
    llg = _llguidance()
    error = llg.LLMatcher.validate_grammar(llg.LLMatcher.grammar_from_lark(grammar))
    if error:  # the parts were each checked; this would be a bug in the grammar above
        raise ToolChoiceError(f"cannot constrain the tool call: {error}", "tool_choice")
    matcher = llg.LLMatcher(_ll_tokenizer(tokenizer), llg.LLMatcher.grammar_from_lark(grammar))
    start = tokenizer.token_to_id(THINK_END) if thinking else None
    return GrammarConstraint(matcher, tokenizer.vocab_size, start)
