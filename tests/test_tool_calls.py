"""Tool calls and reasoning as OpenAI clients see them, and the fields that steer sampling.

The parser is driven by forced token streams. A static `logit_bias` can force one
token at every step (used below for the special-token and malformed cases); it cannot
force an ordered sequence, so whole DSML blocks are forced by a scripted stand-in
model (serve_helpers.scripted_state) behind the real scheduler, runner and HTTP API.
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from hypothesis import given, strategies as st

import ds4ref
from ds4ref.serve.chat import DSML, render_tool_calls
from ds4ref.serve.text import CONTENT, TextAssembler
from ds4ref.serve.tools import ToolCallStream, parse_tool_calls
from serve_helpers import LiveServer, after_prompt, scripted_state

TOK = ds4ref.load().tokenizer
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
ASK = [{"role": "user", "content": "Weather in Rome?"}]
BLOCK = render_tool_calls([("get_weather", {"city": "Rome", "days": 2})])


def ids(text: str) -> list[int]:
    return TOK.encode(text)


def run_stream(token_ids, parse=True, skip=True):
    """Feed a token stream through the server's text pipeline; (answer text, calls)."""
    skip_ids = frozenset(i for i in TOK.added.values() if i != TOK.token_to_id(DSML)) if skip else frozenset()
    text, tools = TextAssembler(TOK, skip_ids=skip_ids), ToolCallStream(parse, (DSML,) if skip else ())
    out = "".join(tools.feed(d.text) for t in token_ids for d in text.push(t) if d.channel == CONTENT)
    out += "".join(tools.feed(d.text) for d in text.finish()) + tools.finish()
    return out, tools.calls


# ---- the parser on token streams ------------------------------------------------------------

names = st.from_regex(r"[a-z_][a-z0-9_]{0,11}", fullmatch=True)
values = st.one_of(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="｜<>"), max_size=12),
                   st.integers(-10**6, 10**6), st.booleans(), st.none(),
                   st.lists(st.integers(0, 9), max_size=3), st.dictionaries(names, st.integers(0, 9), max_size=2))
calls = st.lists(st.tuples(names, st.dictionaries(names, values, max_size=3)), min_size=1, max_size=3)


@given(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="｜"), max_size=20), calls)
def test_rendered_calls_parse_back_token_by_token(prefix, chosen):
    text, got = run_stream(ids(prefix + render_tool_calls(chosen)))
    assert text == prefix
    assert [(c.name, json.loads(c.arguments)) for c in got] == [(n, a) for n, a in chosen]


@pytest.mark.parametrize("tail", [
    BLOCK[:-5],                                          # cut short (length)
    BLOCK + " and more",                                 # text after the block
    BLOCK.replace('string="false">2', 'string="false">two'),  # not JSON
    BLOCK.replace("invoke name", "invoke nome"),         # bad markup
    f"\n\n<{DSML}tool_calls>\n</{DSML}tool_calls>",      # no call at all
])
def test_malformed_blocks_come_back_as_text(tail):
    text, got = run_stream(ids("Sure." + tail))
    assert got == [] and text == "Sure." + tail.replace(DSML, "")
    raw, _ = run_stream(ids("Sure." + tail), skip=False)
    assert raw == "Sure." + tail


def test_without_tools_dsml_is_plain_text_and_special_tokens_are_dropped():
    stream = ids(f"a<｜User｜>b{BLOCK}") + [TOK.bos_id]
    assert run_stream(stream, parse=False) == ("ab" + BLOCK.replace(DSML, ""), [])
    assert run_stream(stream, parse=False, skip=False) == (f"a<｜User｜>b{BLOCK}<｜begin▁of▁sentence｜>", [])


# ---- through the server --------------------------------------------------------------------

@pytest.fixture(scope="module")
def scripted():
    """A server whose model answers 'Let me check.' + a get_weather call."""
    with LiveServer(state=scripted_state(after_prompt(TOK, ids("Let me check." + BLOCK)))) as s:
        yield s


def test_tool_call_message(scripted):
    client = openai.OpenAI(base_url=scripted.url + "/v1", api_key="unused")
    out = client.chat.completions.create(model="ds4-tiny", messages=ASK, tools=[WEATHER], max_tokens=200)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Rome", "days": 2}
    assert out.usage.completion_tokens == len(ids("Let me check." + BLOCK)) + 1  # EOS counted


def test_tool_call_stream(scripted):
    """Streamed as OpenAI and vLLM stream calls: a first delta with index, id, type, name and
    empty arguments, then argument fragments; the openai client's accumulation gives the
    non-streaming call, arguments byte for byte."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    client = openai.OpenAI(base_url=scripted.url + "/v1", api_key="unused")
    whole = client.chat.completions.create(model="ds4-tiny", messages=ASK, tools=[WEATHER], max_tokens=200)
    state, deltas = ChatCompletionStreamState(), []
    for chunk in client.chat.completions.create(model="ds4-tiny", messages=ASK, tools=[WEATHER], max_tokens=200,
                                                stream=True):
        state.handle_chunk(chunk)
        delta = chunk.choices[0].delta if chunk.choices else None
        deltas += [tc.model_dump(exclude_none=True) for tc in (delta.tool_calls or [])] if delta else []
        assert DSML not in ((delta.content if delta else None) or "")
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content == "Let me check."
    (call,), (expected,) = final.message.tool_calls, whole.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == expected.function.arguments
    assert json.loads(call.function.arguments) == {"city": "Rome", "days": 2}
    head, *rest = deltas
    assert head == {"index": 0, "id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    assert len(rest) == 4 and all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} and
                                  d["index"] == 0 for d in rest)
    assert "".join(d["function"]["arguments"] for d in rest) == expected.function.arguments


def test_tool_choice_none_leaves_tools_out(scripted):
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 200}
    r = httpx.post(scripted.url + "/v1/chat/completions", json=body, timeout=60).json()
    assert r["choices"][0]["finish_reason"] == "stop" and "tool_calls" not in r["choices"][0]["message"]
    assert r["choices"][0]["message"]["content"] == "Let me check." + BLOCK.replace(DSML, "")


def test_parallel_tool_calls_false_keeps_the_first():
    two = render_tool_calls([("get_weather", {"city": "Rome"}), ("get_weather", {"city": "Oslo"})])
    with LiveServer(state=scripted_state(after_prompt(TOK, ids(two)))) as s:
        body = {"messages": ASK, "tools": [WEATHER], "max_tokens": 200}
        both = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
        one = httpx.post(s.url + "/v1/chat/completions", json=dict(body, parallel_tool_calls=False),
                         timeout=60).json()["choices"][0]["message"]
    assert [json.loads(c["function"]["arguments"])["city"] for c in both["tool_calls"]] == ["Rome", "Oslo"]
    assert [json.loads(c["function"]["arguments"])["city"] for c in one["tool_calls"]] == ["Rome"]


def test_reasoning_goes_to_reasoning_content_and_specials_never_to_content():
    script = ids("weigh it") + [TOK.token_to_id("</think>")] + ids("Rome<｜User｜> is sunny") + [TOK.bos_id]
    with LiveServer(state=scripted_state(after_prompt(TOK, script))) as s:
        body = {"messages": ASK, "max_tokens": 200, "chat_template_kwargs": {"thinking": True}}
        msg = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
        raw = httpx.post(s.url + "/v1/chat/completions", json=dict(body, skip_special_tokens=False),
                         timeout=60).json()["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("weigh it", "Rome is sunny")
    assert raw["content"] == "Rome<｜User｜> is sunny<｜begin▁of▁sentence｜>"


# ---- logit_bias, with the real tiny model ----------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    with LiveServer(max_concurrency=2, max_context=1024) as s:  # room for the tools prompt
        yield s


def complete(server, **body):
    r = httpx.post(server.url + "/v1/completions", json=dict({"prompt": "The cat", "max_tokens": 6,
                                                              "temperature": 0, "ignore_eos": True}, **body),
                   timeout=60)
    return r


def test_logit_bias_forces_and_forbids(tiny):
    free = complete(tiny, logprobs=0).json()["choices"][0]["logprobs"]["tokens"]
    forced_id = TOK.encode(" dog")[0]
    forced = complete(tiny, logit_bias={str(forced_id): 100}).json()["choices"][0]["text"]
    assert forced == TOK.decode([forced_id] * 6)
    first = TOK.encode(free[0])[0]
    banned = complete(tiny, logit_bias={str(first): -100}, logprobs=0).json()["choices"][0]["logprobs"]["tokens"]
    assert banned[0] != free[0]


def test_logit_bias_forcing_dsml_with_tools_is_text_not_an_error(tiny):
    body = {"messages": ASK, "tools": [WEATHER], "max_tokens": 5, "temperature": 0,
            "logit_bias": {str(TOK.token_to_id(DSML)): 100}}
    r = httpx.post(tiny.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == ""
    raw = httpx.post(tiny.url + "/v1/chat/completions", json=dict(body, skip_special_tokens=False), timeout=60)
    assert raw.json()["choices"][0]["message"]["content"] == DSML * 5


@pytest.mark.parametrize("bias, message", [({"512": 1}, "outside the vocabulary"),
                                            ({"abc": 1}, "decimal strings"), ({"5": 101}, "less than or equal")])
def test_bad_logit_bias_is_a_400_naming_it(tiny, bias, message):
    r = complete(tiny, logit_bias=bias)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"].startswith("logit_bias") and message in err["message"]
    assert "Value error" not in err["message"]


# ---- logprobs ---------------------------------------------------------------------------------

def test_chat_top_logprobs_carry_each_alternatives_bytes(tiny):
    body = {"messages": ASK, "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 5}
    content = httpx.post(tiny.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0][
        "logprobs"]["content"]
    for entry in content:
        for alt in entry["top_logprobs"]:
            tid = TOK.encode(alt["token"], special=False) if "\ufffd" not in alt["token"] else None
            if tid is not None and len(tid) == 1:
                assert bytes(alt["bytes"]) == TOK.decode_bytes(tid)
        assert len({bytes(a["bytes"]) for a in entry["top_logprobs"]}) == len(entry["top_logprobs"])


def test_completion_top_logprobs_keys_are_distinct_and_hold_the_chosen_token(tiny):
    lp = complete(tiny, prompt="日本語のテキスト", logprobs=20, max_tokens=8).json()["choices"][0]["logprobs"]
    for token, chosen, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert len(top) >= 20 and top[token] == chosen


# ---- response_format (llguidance) ------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}, "n": {"type": "integer",
                                                                                        "minimum": 0, "maximum": 9}},
          "required": ["color", "n"], "additionalProperties": False}


@pytest.mark.parametrize("thinking", [False, True])
def test_json_schema_output_follows_the_schema(tiny, thinking):
    body = {"messages": [{"role": "user", "content": "A color?"}], "max_tokens": 120, "temperature": 0.7,
            "seed": 3, "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
            "chat_template_kwargs": {"thinking": thinking},
            "logit_bias": {str(TOK.token_to_id("</think>")): 30}}  # let the tiny model end its reasoning
    choice = httpx.post(tiny.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    value = json.loads(choice["message"]["content"])
    assert choice["finish_reason"] == "stop"
    assert set(value) == {"color", "n"} and value["color"] in ("red", "green") and 0 <= value["n"] <= 9


def test_json_object_mode_and_bad_schema(tiny):
    body = {"messages": [{"role": "user", "content": "JSON?"}], "max_tokens": 60, "temperature": 0,
            "response_format": {"type": "json_object"}}
    choice = httpx.post(tiny.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:  # an unfinished object is still a prefix of one
        assert choice["message"]["content"].startswith("{")
    bad = dict(body, response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                             "schema": {"type": "nope"}}})
    r = httpx.post(tiny.url + "/v1/chat/completions", json=bad, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema.schema"
