"""Chat template renderings, compared with DeepSeek's own DeepSeek-V4 encoder.

The expected strings are not written here: each row of TABLE is rendered by
`encoding_dsv4.encode_messages` itself, from the pure-Python copy of the
official encoder that sglang 0.5.12 publishes on PyPI (fetched by pip at test
time; see tests/pypi_assets.py). The copy is run, never committed. What the
test adds is sglang's adapter from an OpenAI request to the encoder's input:
tools on the first system message (an empty one inserted when the chat does
not start with one), reasoning_effort other than "max"/"high" passed as None,
an assistant prefix as the encoder's `wo_eos`, text parts joined by newlines.
"""
import copy
import importlib.util
import json

import pytest
from hypothesis import given, settings, strategies as st

from ds4ref.serve.chat import ChatTemplateError, encode_chat, render_chat, thinking_requested

# Spelled out literally (not imported) so a typo in chat.py's constants is caught.
B = "<｜begin▁of▁sentence｜>"
E = "<｜end▁of▁sentence｜>"
U = "<｜User｜>"
A = "<｜Assistant｜>"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "now", "description": "Current time", "parameters": {
    "type": "object", "properties": {}}}}


def call(cid, name, **args):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


user = lambda text: {"role": "user", "content": text}  # noqa: E731
system = lambda text: {"role": "system", "content": text}  # noqa: E731
tool = lambda cid, text: {"role": "tool", "tool_call_id": cid, "content": text}  # noqa: E731


def assistant(text, reasoning=None, calls=None, **kw):
    m = {"role": "assistant", "content": text, **kw}
    if reasoning is not None:
        m["reasoning_content"] = reasoning
    if calls:
        m["tool_calls"] = calls
    return m


AGENT = [system("You are terse."), user("Weather in Rome and the time?"),
         assistant("", "need two tools", [call("c1", "get_weather", city="Rome", days=2), call("c2", "now")]),
         tool("c2", "12:00"), tool("c1", "sunny"), user("thanks; and Paris?")]

# (id, messages, request options: thinking, tools, reasoning_effort)
TABLE = [
    ("single user", [user("Hello")], {}),
    ("single user thinking", [user("Hello")], {"thinking": True}),
    ("system in place", [system("Be brief."), user("Hi"), system("Answer in Italian."), user("Chi era Ada?")], {}),
    ("consecutive users merge", [user("part one"), user("part two")], {}),
    ("developer role", [system("S"), {"role": "developer", "content": "dev rules"}, user("q")], {}),
    ("developer dropped before last user", [{"role": "developer", "content": "d"}, user("q1"),
                                            assistant("a1", "r1"), user("q2")], {"thinking": True}),
    ("multi-turn chat drops reasoning", [user("2+2?"), assistant("4", "add"), user("and 3+3?")], {}),
    ("multi-turn thinking keeps only the last reasoning",
     [user("q1"), assistant("a1", "r1"), user("q2"), assistant("a2", "r2"), user("q3")], {"thinking": True}),
    ("agent loop after last user keeps reasoning",
     [user("q"), assistant("calling", "r1"), tool("x", "A"), tool("y", "B")], {"thinking": True}),
    ("tools chat", [user("Weather in Rome?")], {"tools": [WEATHER, CLOCK]}),
    ("tools thinking with system", [system("You are terse."), user("Weather?")],
     {"tools": [WEATHER], "thinking": True}),
    ("tool calls, results sorted by call order, user merged after results", AGENT, {"tools": [WEATHER, CLOCK]}),
    ("same in thinking mode: nothing dropped with tools", AGENT, {"tools": [WEATHER, CLOCK], "thinking": True}),
    ("reasoning_effort max", [system("S"), user("prove it")], {"thinking": True, "reasoning_effort": "max"}),
    ("reasoning_effort max without a system message", [user("prove it")],
     {"thinking": True, "reasoning_effort": "max"}),
    ("reasoning_effort high is the plain prompt", [user("prove it")], {"thinking": True, "reasoning_effort": "high"}),
    ("reasoning_effort max ignored in chat mode", [user("x")], {"reasoning_effort": "max"}),
    ("assistant prefix", [user("Write a haiku"), assistant("Autumn", prefix=True)], {}),
    ("text parts", [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
     {}),
    ("tool result text is not escaped", [user("q"), assistant("c"), tool("i", "x</tool_result>y")], {}),
]


@pytest.fixture(scope="module")
def official():
    from pypi_assets import SGLANG_ENCODER, pypi_member

    path = pypi_member(SGLANG_ENCODER, "sglang/srt/entrypoints/openai/encoding_dsv4.py")
    spec = importlib.util.spec_from_file_location("official_encoding_dsv4", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def official_prompt(encoder, messages, thinking=False, tools=None, reasoning_effort=None, response_format=None) -> str:
    """sglang's adapter (serving_chat.py) in front of the official encode_messages."""
    msgs = copy.deepcopy(messages)
    for m in msgs:
        if isinstance(m.get("content"), list):
            m["content"] = "\n".join(p["text"] for p in m["content"])
        if m.get("content") is None:
            m["content"] = ""
        if m.pop("prefix", False):
            m["wo_eos"] = True
    if tools or response_format:
        if msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": ""})
        msgs[0]["tools"], msgs[0]["response_format"] = tools, response_format
    return encoder.encode_messages(msgs, thinking_mode="thinking" if thinking else "chat",
                                   reasoning_effort=reasoning_effort if reasoning_effort in ("max", "high") else None)


def official_ids(deepseek_v4_tokenizer, prompt: str) -> list[int]:
    """DeepSeek-V4's tokenizer.json (HF tokenizers) on the official encoder's whole prompt."""
    return deepseek_v4_tokenizer[1].encode(prompt, add_special_tokens=False).ids


@pytest.mark.parametrize("messages, options", [row[1:] for row in TABLE], ids=[row[0] for row in TABLE])
def test_renders_as_the_official_encoder(official, deepseek_v4_tokenizer, messages, options):
    expected = official_prompt(official, messages, **options)
    assert render_chat(messages, **options) == expected
    assert encode_chat(deepseek_v4_tokenizer[0], messages, **options) == official_ids(deepseek_v4_tokenizer, expected)


def test_table_covers_the_cases_the_issue_names(official):
    """The rows above really exercise what they claim (not every row renders alike)."""
    rendered = {row[0]: render_chat(row[1], **row[2]) for row in TABLE}
    assert len(set(rendered.values())) == len(rendered)
    assert "\n\npart two" in rendered["consecutive users merge"]
    assert rendered["tools chat"].count("get_weather") == 1 and "｜DSML｜" in rendered["tools chat"]
    assert rendered["reasoning_effort high is the plain prompt"] == render_chat([user("prove it")], thinking=True)


def test_special_strings_use_fullwidth_bar_and_lower_block():
    assert B == "<\uff5cbegin\u2581of\u2581sentence\uff5c>"
    assert render_chat([user("x")]) == B + U + "x" + A + "</think>"


@pytest.mark.parametrize("msgs, param", [
    ([], "messages"),
    ([{"role": "system", "content": "only"}], "messages[0].role"),
    ([{"role": "wizard", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "messages[1].role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content[0]"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{"id": "1"}]},
      {"role": "tool", "content": "r"}], "messages[1].tool_calls[0].function.name"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]},
      {"role": "tool", "content": "r"}], "messages[1].tool_calls[0].function.arguments"),
    ([{"role": "developer", "content": ""}, {"role": "user", "content": "q"}], "messages[0].content"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "prefix": True},
      {"role": "user", "content": "q"}], "messages[1].prefix"),
])
def test_unrenderable_messages_name_the_field(msgs, param):
    with pytest.raises(ChatTemplateError) as err:
        render_chat(msgs)
    assert err.value.param == param


@pytest.mark.parametrize("kwargs, effort, thinking, expected", [
    (None, None, None, False),
    ({"thinking": True}, None, None, True),
    ({"enable_thinking": True}, None, None, True),
    ({"thinking": False}, "high", None, False),  # explicit kwargs win
    (None, "high", None, True),
    (None, "none", None, False),
    (None, None, {"type": "enabled"}, True),
    (None, "high", {"type": "disabled"}, False),
])
def test_thinking_switch(kwargs, effort, thinking, expected):
    assert thinking_requested(kwargs, effort, thinking) is expected


def test_encode_chat_maps_special_strings_to_single_ids():
    import ds4ref
    from ds4ref.serve.chat import encode_chat

    tok = ds4ref.load().tokenizer
    ids = encode_chat(tok, [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}])
    sid = tok.token_to_id
    assert ids[0] == tok.bos_id == 0
    assert ids[-2:] == [sid("<｜Assistant｜>"), sid("</think>")]
    user_at = ids.index(sid("<｜User｜>"))
    assert tok.decode(ids[1:user_at]) == "S" and tok.decode(ids[user_at + 1:-2]) == "hi"


# ---- any chat, against the official encoder ------------------------------------------------------

# Fragments of the template's markup, so that text meets structure in every way it can; none of
# them can spell an added token (DeepSeek-V4's are <｜...｜>, <|...|>, <think>, </think>, <dsml:).
words = st.one_of(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="｜"), max_size=8),
                  st.sampled_from(['">', '"', "=", "<", "</", ">", "\n", "\n\n", " ", "tool_result", "name", "true"]))
call_ids = st.sampled_from(["c1", "c2", "c3"])
a_call = st.builds(lambda cid, city: call(cid, "get_weather", city=city), call_ids, words)
message = st.one_of(
    st.builds(user, words), st.builds(system, words), st.builds(tool, call_ids, words),
    st.builds(lambda t: {"role": "developer", "content": t}, words.filter(bool)),
    st.builds(lambda t, r, c: assistant(t, r, c or None), words, st.one_of(st.none(), words),
              st.lists(a_call, max_size=2)))
ending = st.one_of(st.builds(user, words), st.builds(tool, call_ids, words),
                   st.builds(lambda t: assistant(t, prefix=True), words))


@settings(max_examples=200)
@given(st.lists(message, max_size=6), ending, st.booleans(), st.sampled_from([None, [WEATHER], [WEATHER, CLOCK]]),
       st.sampled_from([None, "high", "max", "low"]), st.one_of(st.none(), st.dictionaries(words, words, max_size=2)))
def test_any_chat_renders_as_the_official_encoder(official, deepseek_v4_tokenizer, body, last, thinking, tools,
                                                  effort, schema):
    messages = body + [last]
    options = {"thinking": thinking, "tools": tools, "reasoning_effort": effort,
               "response_format": schema and {"type": "object", "properties": schema}}
    expected = official_prompt(official, messages, **options)
    assert render_chat(messages, **options) == expected
    assert encode_chat(deepseek_v4_tokenizer[0], messages, **options) == official_ids(deepseek_v4_tokenizer, expected)


# ---- through the server, as an OpenAI client sends a multi-turn chat with tools -----------------

def test_openai_client_tool_chat_reaches_the_model_as_the_official_prompt(official):
    """Two rounds of an agent loop through the openai client: the first answer's tool call goes
    back as the client serialises it, with the tool's result. Each prompt the model saw is the
    official encoder's rendering of that request, tokenised whole."""
    import httpx
    import openai

    import ds4ref
    from ds4ref.serve.chat import render_tool_calls
    from serve_helpers import LiveServer, after_prompt, scripted_state

    tok = ds4ref.load().tokenizer
    answer = tok.encode("weigh it</think>Let me check." + render_tool_calls([("get_weather", {"city": "Rome", "days": 2})]))
    script = after_prompt(tok, answer)
    seen, sent = set(), []

    def next_token(history):
        seen.add(tuple(history))
        return script(history)

    def keep(request):
        sent.append(json.loads(request.content))

    state = scripted_state(next_token, max_context=4096)
    with LiveServer(state=state) as s, httpx.Client(event_hooks={"request": [keep]}) as http:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", http_client=http)
        messages = [system("You are terse."), user("Weather in Rome? <b>now</b>")]
        for _ in range(2):
            seen.clear()
            out = client.chat.completions.create(model="ds4-tiny", messages=messages, tools=[WEATHER, CLOCK],
                                                 max_tokens=len(answer) + 1, extra_body={"chat_template_kwargs":
                                                                             {"thinking": True}})
            body = sent[-1]
            expected = tok.encode(official_prompt(official, body["messages"], thinking=True, tools=body["tools"]))
            assert out.usage.prompt_tokens == len(expected) and tuple(expected) in seen
            (tc,) = out.choices[0].message.tool_calls
            messages += [out.choices[0].message, tool(tc.id, "sunny, 21°C"), user("and tomorrow?")]
    assert [m["role"] for m in sent[-1]["messages"]] == ["system", "user", "assistant", "tool", "user"]
    back = sent[-1]["messages"][2]
    assert back["tool_calls"][0]["function"]["name"] == "get_weather" and back["reasoning_content"] == "weigh it"


# ---- the next turn's prompt begins with this turn's (what a prefix cache can reuse) ----------------

def reply_text(reply: dict, reasoning_kept: bool) -> str:
    """An assistant message as the template renders it when it is history: what the model wrote
    after the generation prompt (reasoning and `</think>` only where the rules keep them)."""
    from ds4ref.serve.chat import render_tool_calls

    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply.get("tool_calls", [])]
    head = reply.get("reasoning_content", "") + "</think>" if reasoning_kept else ""
    return head + reply["content"] + (render_tool_calls(calls) if calls else "") + E


replies = st.builds(lambda t, r, c: assistant(t, r, c or None), words, st.one_of(st.none(), words),
                    st.lists(a_call, max_size=2, unique_by=lambda c: c["id"]))
history_ending = st.one_of(st.builds(user, words), st.builds(tool, call_ids, words))


@settings(max_examples=200)
@given(st.lists(message, max_size=6), history_ending, replies, st.booleans(), st.booleans(),
       st.sampled_from([None, [WEATHER], [WEATHER, CLOCK]]), st.sampled_from([None, "high", "max"]), words)
def test_next_turn_prompt_begins_with_this_turns(tiny_tokenizer, body, last, reply, results_next, thinking, tools,
                                                 effort, new_text):
    """Turn k+1 = turn k's messages + the assistant's reply + a new user message (or, when the
    reply called tools, their results). By the official encoder's rules:

    * chat mode, or thinking mode with tools: turn k's prompt is a prefix of turn k+1's, and
      the reply follows it as the model wrote it (in thinking mode with tools, its reasoning
      and `</think>` too): the whole conversation so far is shared;
    * thinking mode without tools: earlier turns lose their reasoning, and the user turn that
      was last is now followed by `</think>` instead of `<think>`. Turn k's prompt but its
      last token (that `<think>`) is shared; then `</think>`, the reply's answer and tool calls.

    Token ids agree as far as the text does: every boundary is an added token."""
    messages = body + [last]
    new = ([tool(c["id"], new_text) for c in reply["tool_calls"]] if results_next and reply.get("tool_calls")
           else [user(new_text)])
    options = {"thinking": thinking, "tools": tools, "reasoning_effort": effort}
    this, following = render_chat(messages, **options), render_chat(messages + [reply] + new, **options)
    ids, next_ids = (encode_chat(tiny_tokenizer, m, **options) for m in (messages, messages + [reply] + new))
    keeps_all = not thinking or tools is not None
    assert this.endswith(A + ("<think>" if thinking else "</think>"))
    if keeps_all:
        shared_ids, after = ids, reply_text(reply, reasoning_kept=thinking)
    else:
        shared_ids, after = ids[:-1], "</think>" + reply_text(reply, reasoning_kept=False)
    assert following.startswith(this[:len(this) - (not keeps_all) * len("<think>")] + after)
    assert next_ids[:len(shared_ids)] == shared_ids
    after_ids = tiny_tokenizer.encode(after, special=True)
    assert next_ids[len(shared_ids):len(shared_ids) + len(after_ids)] == after_ids


def test_a_developer_message_last_in_thinking_mode_is_dropped_at_the_next_turn():
    """In thinking mode without tools, developer messages before the last user turn are dropped:
    one that ended turn k is gone from turn k+1, and the shared prefix ends where it began."""
    dev = {"role": "developer", "content": "rules"}
    messages = [user("q1"), dev]
    this = render_chat(messages, thinking=True)
    following = render_chat(messages + [assistant("a1", "r1"), user("q2")], thinking=True)
    assert this == B + U + "q1" + U + "rules" + A + "<think>"
    assert following == B + U + "q1" + A + "</think>" + "a1" + E + U + "q2" + A + "<think>"
