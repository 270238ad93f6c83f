"""tool_choice "required" and a named function: the answer is constrained to DSML tool calls.

The grammar (serve/tool_grammar.py) is checked against the chat encoder's own rendering of
calls: every call the encoder writes for arguments that follow the schema is a path through
it, to the end of the block and nothing after; arguments that break the schema are not. Then
the embedded tiny model, which writes nonsense when free, answers through the openai client
with calls whose arguments follow their schemas, streamed and not: on the NumPy backend, and on
the HIP backend's host side over a stand-in for the device (serve_helpers.stand_in_hip_state;
the GPU's own run is tests/gpu/test_serve_hip.py).
"""
from __future__ import annotations

import json

import httpx
import numpy as np
import openai
import pytest
from hypothesis import given, settings, strategies as st

import ds4ref
from ds4ref.serve.chat import DSML, render_tool_calls
from ds4ref.serve.structured import _ll_tokenizer
from ds4ref.serve.tool_grammar import ToolChoiceError, dsml_grammar
from serve_helpers import LiveServer, stand_in_hip_state

TOK = ds4ref.load().tokenizer
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "hourly": {"type": "boolean"}},
    "required": ["city", "days"], "additionalProperties": False}}}
ZONE = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "JST"]}}}}}
PING = {"type": "function", "function": {"name": "ping"}}
TOOLS = [WEATHER, ZONE, PING]
ASK = [{"role": "user", "content": "What is the weather in Rome, and the time?"}]


def matcher(tools, single=False):
    import llguidance as llg
    return llg.LLMatcher(_ll_tokenizer(TOK), llg.LLMatcher.grammar_from_lark(dsml_grammar(tools, single)))


def accepts(tools, calls, single=False) -> bool:
    """Whether the encoder's block for `calls` is a whole answer of the grammar: every token
    taken, and then only end-of-sentence allowed."""
    m = matcher(tools, single)
    if not all(m.consume_token(t) for t in TOK.encode(render_tool_calls(calls))):
        return False
    allowed = np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8), bitorder="little")[:TOK.vocab_size]
    return m.is_accepting() and np.flatnonzero(allowed).tolist() == [TOK.eos_id]


def check_weather(args: dict) -> None:
    """The arguments follow WEATHER's schema."""
    assert set(args) <= {"city", "days", "unit", "hourly"} and {"city", "days"} <= set(args)
    assert isinstance(args["city"], str) and len(args["city"]) <= 12 and DSML not in args["city"]
    assert type(args["days"]) is int and 1 <= args["days"] <= 7
    assert args.get("unit", "celsius") in ("celsius", "fahrenheit")
    assert type(args.get("hourly", False)) is bool


CHECKS = {"get_weather": check_weather, "get_time": lambda a: a in ({}, {"zone": "UTC"}, {"zone": "CET"},
                                                                       {"zone": "JST"}) or pytest.fail(str(a)),
          "ping": lambda a: a == {} or pytest.fail(str(a))}

# ---- the grammar against the encoder -------------------------------------------------------

cities = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12).filter(lambda s: DSML not in s)
weather_args = st.fixed_dictionaries(
    {"city": cities, "days": st.integers(1, 7)},
    optional={"unit": st.sampled_from(["celsius", "fahrenheit"]), "hourly": st.booleans()}).map(
    lambda d: {k: d[k] for k in ("city", "days", "unit", "hourly") if k in d})  # the schema's order
one_call = st.one_of(st.tuples(st.just("get_weather"), weather_args),
                     st.tuples(st.just("get_time"), st.one_of(st.just({}), st.sampled_from(
                         [{"zone": z} for z in ("UTC", "CET", "JST")]))),
                     st.tuples(st.just("ping"), st.just({})))


@settings(max_examples=40, deadline=None)
@given(st.lists(one_call, min_size=1, max_size=3))
def test_every_call_the_encoder_writes_for_valid_arguments_is_accepted(calls):
    assert accepts(TOOLS, calls)
    assert accepts(TOOLS, calls[:1], single=True)
    assert accepts(TOOLS, calls, single=True) == (len(calls) == 1)


@pytest.mark.parametrize("call", [
    ("get_weather", {"days": 2}),                                    # a required parameter missing
    ("get_weather", {"city": "Rome", "days": 8}),                     # days above its maximum
    ("get_weather", {"city": "Rome", "days": "2"}),                   # a string where an integer goes
    ("get_weather", {"city": "Rome and the rest of it", "days": 2}),  # past maxLength
    ("get_weather", {"city": "Rome", "days": 2, "wind": True}),       # a key the schema does not have
    ("get_weather", {"days": 2, "city": "Rome"}),                     # out of the schema's order
    ("get_weather", {"city": "Ro" + DSML + "me", "days": 2}),         # the markup inside a value
    ("get_time", {"zone": "PST"}),                                    # not in the enum
    ("get_date", {}),                                                 # not a tool
])
def test_calls_that_break_the_schema_are_not(call):
    assert not accepts(TOOLS, [call])


def test_a_named_function_admits_only_its_calls():
    assert accepts([ZONE], [("get_time", {"zone": "CET"})], single=True)
    assert not accepts([ZONE], [("ping", {})], single=True)


@pytest.mark.parametrize("parameters, words", [
    ({"type": "object", "anyOf": [{"required": ["a"]}]}, "keyword 'anyOf'"),
    ({"type": "array"}, "of type object"),
    ({"type": "object", "required": ["a"], "additionalProperties": False}, "'a' is required"),
    ({"type": "object", "properties": {'say "hi"': {"type": "string"}}}, "cannot be written"),
    ({"type": "object", "properties": {"n": {"type": "nope"}}}, "parameter 'n'"),
])
def test_schemas_it_cannot_follow_are_refused_naming_the_tool(parameters, words):
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    with pytest.raises(ToolChoiceError) as err:
        dsml_grammar([PING, tool], single=False)
    assert words in str(err.value) and err.value.param.startswith("tools[1].function.parameters")


# ---- through the server, with the openai client ----------------------------------------------

@pytest.fixture(scope="module")
def server():
    with LiveServer(max_concurrency=2, max_context=2048) as s:  # room for the tools prompt
        yield s


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def ask(server, tool_choice, stream=False, **kw):
    return client(server).chat.completions.create(model="ds4-tiny", messages=ASK, tools=TOOLS,
                                                  tool_choice=tool_choice, max_tokens=400, temperature=0,
                                                  stream=stream, **kw)


def streamed(server, tool_choice, **kw):
    from openai.lib.streaming.chat import ChatCompletionStreamState
    state = ChatCompletionStreamState()
    for chunk in ask(server, tool_choice, stream=True, **kw):
        state.handle_chunk(chunk)
    return state.get_final_completion()


def calls_of(completion) -> list[tuple[str, dict]]:
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    out = []
    for call in choice.message.tool_calls:
        args = json.loads(call.function.arguments)
        CHECKS[call.function.name](args)
        out.append((call.function.name, args))
    return out


def test_the_free_tiny_model_writes_no_call(server):
    """What the constraint is for: left to itself the model answers text, not a call."""
    choice = client(server).chat.completions.create(model="ds4-tiny", messages=ASK, tools=TOOLS, max_tokens=60,
                                                    temperature=0).choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls


# Greedy, the tiny model goes on calling tools until max_tokens; a bias towards "/" (the close
# of the block, "\n</", against the next call's "\n<｜DSML｜") lets it stop after a few.
CLOSE_SOONER = {str(TOK.encode("/")[0]): 9}


@pytest.mark.parametrize("parallel", [None, False])
def test_required_answers_tool_calls_streamed_and_not(server, parallel):
    extra = {"logit_bias": CLOSE_SOONER} | ({} if parallel is None else {"parallel_tool_calls": parallel})
    whole = calls_of(ask(server, "required", **extra))
    # several calls where parallel calls are allowed; without them the block closes after one
    assert len(whole) >= 2 if parallel is None else len(whole) == 1
    assert calls_of(streamed(server, "required", **extra)) == whole  # greedy: the same calls


@pytest.mark.parametrize("name", ["get_time", "ping", "get_weather"])
def test_a_named_function_is_the_one_called_streamed_and_not(server, name):
    choice = {"type": "function", "function": {"name": name}}
    whole = calls_of(ask(server, choice))
    assert [n for n, _ in whole] == [name]
    assert calls_of(streamed(server, choice)) == whole


def stand_in_logits(token: int, position: int):
    """What the stand-in device answers for a row: fixed noise per (token, position)."""
    return (3 * np.random.default_rng([token, position]).standard_normal(TOK.vocab_size)).astype(np.float32)


@pytest.fixture(scope="module")
def hip_server():
    with LiveServer(state=stand_in_hip_state(stand_in_logits, max_context=2048)) as s:
        yield s


@pytest.mark.parametrize("tool_choice, extra", [
    ("required", {"logit_bias": CLOSE_SOONER}), ("required", {"parallel_tool_calls": False}),
    ({"type": "function", "function": {"name": "get_weather"}}, {}),
    ({"type": "function", "function": {"name": "get_time"}}, {})])
def test_the_hip_backends_host_side_serves_forced_calls_streamed_and_not(hip_server, tool_choice, extra):
    """The constraint needs each row's logits: the HIP backend fetches them for its constrained
    rows, head row by head row, and the answers are calls that follow their schemas."""
    whole = calls_of(ask(hip_server, tool_choice, **extra))
    assert whole and (len(whole) == 1 if "parallel_tool_calls" in extra or "function" in tool_choice else True)
    if isinstance(tool_choice, dict):
        assert [n for n, _ in whole] == [tool_choice["function"]["name"]]
    assert calls_of(streamed(hip_server, tool_choice, **extra)) == whole


@pytest.mark.parametrize("body, param, words", [
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [PING], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "not among the tools"),
    ({"tools": [PING], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "response_format"),
    ({"tools": [PING, {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "oneOf": []}}}],
      "tool_choice": "required"}, "tools[1].function.parameters", "keyword 'oneOf'"),
])
def test_forced_choices_that_cannot_be_honoured_are_a_400(server, body, param, words):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 8, **body}, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and words in err["message"], err
