"""Chat prompts per model version, compared with the chat templates llama.cpp publishes for the two
releases: `deepseek-ai-DeepSeek-V4.jinja` (the original) and `deepseek-ai-DeepSeek-V4-Flash-0731.jinja`,
from llama-cpp-python 0.3.36's source distribution (fetched by pip at test time, tests/pypi_assets.py;
run, never committed), rendered here with jinja2.

The templates are llama.cpp's transcription of DeepSeek's encoder (tests/test_chat.py compares
ds4ref with the encoder itself for the original). They follow it on the chats generated here and
differ from it elsewhere, where the encoder wins: they gather every system message at the top,
merge a developer message into the user turn, keep reasoning once any tool result is in the chat
even without tools, and never sort tool results by their calls. What changed in 0731 is the
reasoning effort's instruction, which these chats exercise for every effort, both versions and
thinking on and off."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from ds4ref.gguf.version import ORIGINAL, V0731, chat_version, template_version
from ds4ref.serve.chat import EFFORT_PROMPTS, render_chat

B = "<｜begin▁of▁sentence｜>"
TEMPLATES = {ORIGINAL: "deepseek-ai-DeepSeek-V4.jinja", V0731: "deepseek-ai-DeepSeek-V4-Flash-0731.jinja"}
EFFORTS = [None, "none", "minimal", "low", "medium", "high", "max"]


@pytest.fixture(scope="module")
def templates() -> dict[str, str]:
    from pypi_assets import LLAMA_CPP_SDIST, pypi_sdist_file
    return {v: pypi_sdist_file(LLAMA_CPP_SDIST, f"vendor/llama.cpp/models/templates/{name}").read_text(encoding="utf-8")
            for v, name in TEMPLATES.items()}


@pytest.fixture(scope="module")
def jinja(templates):
    jinja2 = pytest.importorskip("jinja2", reason="the templates are rendered with jinja2 (pip install -e '.[test]')")
    env = jinja2.Environment()
    # llama.cpp's template engine: tojson as JSON with ", " / ": " and non-ASCII kept (what the
    # encoder writes; jinja2's own escapes HTML and sorts keys), from_json to read arguments
    env.filters["tojson"] = lambda v: json.dumps(v, ensure_ascii=False)
    env.filters["from_json"] = json.loads
    compiled = {v: env.from_string(t) for v, t in templates.items()}

    def render(version, messages, thinking, tools, effort, schema):
        kw = {"tools": tools} if tools else {}
        if effort is not None:
            kw["reasoning_effort"] = effort
        if schema is not None:
            kw["response_format"] = schema
        return compiled[version].render(messages=messages, bos_token=B, add_generation_prompt=True,
                                        thinking=thinking, **kw)
    return render


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
CLOCK = {"type": "function", "function": {"name": "now", "description": "Current time é", "parameters": {
    "type": "object", "properties": {}}}}

text = st.one_of(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="｜"), max_size=8),
                 st.sampled_from(['">', "<", "</", "\n", "\n\n", "tool_result", "ü"]))
args = st.one_of(st.builds(lambda c: {"city": c}, text), st.builds(lambda c, d: {"city": c, "days": d}, text,
                                                                   st.integers(0, 9)), st.just({}))


@st.composite
def chats(draw):
    """(messages, tools, schema) on which the templates and the encoder agree (module docstring):
    at most one system message, first; user turns (one or more messages) and assistant replies
    alternate; an assistant's tool calls are followed by all their results, in call order; the
    chat ends with a user message or results; tools are given whenever tool results are present,
    and a system message whenever tools or a response schema are."""
    messages, any_calls, n = [], False, 0
    for _ in range(draw(st.integers(0, 3))):
        messages += [{"role": "user", "content": draw(text)} for _ in range(draw(st.integers(1, 2)))]
        reply = {"role": "assistant", "content": draw(text)}
        if draw(st.booleans()):
            reply["reasoning_content"] = draw(text)
        calls = draw(st.lists(st.tuples(st.sampled_from(["get_weather", "now"]), args), max_size=2))
        if calls:
            any_calls = True
            reply["tool_calls"] = [{"id": f"c{n + k}", "type": "function",
                                    "function": {"name": f, "arguments": draw(st.sampled_from([json.dumps(a), a]))}}
                                   for k, (f, a) in enumerate(calls)]
        messages.append(reply)
        messages += [{"role": "tool", "tool_call_id": f"c{n + k}", "content": draw(text)} for k in range(len(calls))]
        n += len(calls)
        if calls and draw(st.booleans()):
            continue  # the next turn's user message merges with these results
    if not messages or messages[-1]["role"] == "assistant" or draw(st.booleans()):
        messages.append({"role": "user", "content": draw(text)})
    tools = [WEATHER, CLOCK] if any_calls else draw(st.sampled_from([None, [WEATHER], [WEATHER, CLOCK]]))
    schema = draw(st.one_of(st.none(), st.builds(lambda k: {"type": "object", "properties": {k: {"type": "string"}}},
                                                 text)))
    system = draw(text.filter(bool)) if tools or schema else draw(st.one_of(st.none(), text))
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    return messages, tools, schema


@settings(max_examples=150, deadline=None)
@given(chats(), st.booleans(), st.sampled_from(EFFORTS), st.sampled_from([ORIGINAL, V0731]))
def test_renders_as_the_versions_template(jinja, chat, thinking, effort, version):
    messages, tools, schema = chat
    expected = jinja(version, messages, thinking, tools, effort, schema)
    assert render_chat(messages, thinking, tools=tools, reasoning_effort=effort, response_format=schema,
                       version=version) == expected


@pytest.mark.parametrize("effort", EFFORTS)
def test_effort_instructions_per_version(jinja, effort):
    """What each effort puts first, per template: the original's `max` is 0731's `high`; 0731's
    `max` is new; nothing else adds text; in chat mode no effort does."""
    chat = [{"role": "user", "content": "prove it"}]
    rendered = {v: jinja(v, chat, True, None, effort, None) for v in TEMPLATES}
    plain = jinja(ORIGINAL, chat, True, None, None, None)
    for v in TEMPLATES:
        assert rendered[v] == B + EFFORT_PROMPTS[v].get(effort, "") + plain[len(B):]
        assert jinja(v, chat, False, None, effort, None) == render_chat(chat)
    if effort == "high":
        assert rendered[V0731] == jinja(ORIGINAL, chat, True, None, "max", None) != rendered[ORIGINAL]
    if effort == "max":
        assert len({rendered[ORIGINAL], rendered[V0731], plain}) == 3


def test_the_templates_say_their_version(templates):
    assert {v: template_version(t) for v, t in templates.items()} == {ORIGINAL: ORIGINAL, V0731: V0731}
    # a file's template decides its chat rules, whatever else the file says
    assert chat_version({"general.name": "DeepSeek V4 Flash 0731", "tokenizer.chat_template": templates[ORIGINAL]}) \
        == ORIGINAL
    assert chat_version({"general.name": "x", "tokenizer.chat_template": templates[V0731]}) == V0731
    assert chat_version({"general.name": "DeepSeek V4 Flash 0731"}) == V0731
    assert chat_version({"general.name": "DeepSeek V4 Flash"}) == ORIGINAL
