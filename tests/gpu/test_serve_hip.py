"""`--backend hip` serves the openai client: the same greedy text as the NumPy server, for the
embedded model and for the tiny file in the published q2 policy (IQ2_XXS / Q2_K experts); the
same forced tool calls; and a request whose values overflow fails alone, as on the NumPy server.

Runs only where a GPU runtime opens (marker gpu); elsewhere skipped with the reason.
"""
import asyncio
import sys
from pathlib import Path

import pytest

import ds4ref

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from serve_helpers import LiveServer  # noqa: E402

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.gpu

PROMPTS = [f"Client {i} asks about pages and lanes" + "." * i for i in range(16)]


@pytest.fixture(scope="module", params=["embedded", "q2"])
def servers(rt, request):
    from tests.golden.make_golden import policy_model
    path = None if request.param == "embedded" else str(policy_model(request.param))
    name = "ds4-tiny"
    with LiveServer(model_path=path, backend="hip", max_concurrency=16, max_context=512,
                    served_model_name=name) as hip, \
            LiveServer(model_path=path, backend="numpy", max_concurrency=16, max_context=512,
                       served_model_name=name) as ref:
        yield hip, ref


def greedy(url: str, prompt: str, n: int = 24) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    r = client.completions.create(model="ds4-tiny", prompt=prompt, max_tokens=n, temperature=0,
                                  extra_body={"ignore_eos": True})
    return r.choices[0].text


def test_chat_streaming_with_the_openai_client(servers):
    hip, _ = servers
    client = openai.OpenAI(base_url=hip.url + "/v1", api_key="unused")
    chunks = list(client.chat.completions.create(model="ds4-tiny", stream=True, max_tokens=16, temperature=0,
                                                 messages=[{"role": "user", "content": "Hello"}]))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    full = client.chat.completions.create(model="ds4-tiny", max_tokens=16, temperature=0,
                                          messages=[{"role": "user", "content": "Hello"}])
    assert text == full.choices[0].message.content and text


def test_sixteen_concurrent_clients_get_the_reference_text(servers):
    hip, ref = servers
    want = [greedy(ref.url, p) for p in PROMPTS]

    async def main():
        client = openai.AsyncOpenAI(base_url=hip.url + "/v1", api_key="unused")
        rs = await asyncio.gather(*(client.completions.create(
            model="ds4-tiny", prompt=p, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
            for p in PROMPTS))
        return [r.choices[0].text for r in rs]

    got = asyncio.run(main())
    differ = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
    assert not differ, f"prompts {differ} differ between the hip and numpy servers"


# ---- a request whose values overflow (tests/test_non_finite_values.py has the NumPy side) ------

def test_argmax_answers_non_finite_rows_apart(rt):
    """ds4_argmax: a row holding a NaN or an infinity answers NON_FINITE_ROW, the others their
    argmax as NumPy's (the lower index on ties)."""
    import numpy as np
    from ds4ref.hip import launch as K
    from ds4ref.harness import twins as g
    x = np.random.default_rng(0).standard_normal((6, 129280)).astype(np.float32)
    x[1, 77] = np.nan
    x[2, 129279] = np.inf
    x[3, :] = -np.inf
    x[4, 5] = x[4].max()  # a tie: the lower index wins
    x[4, 9] = x[4, 5]
    want = np.argmax(x, axis=1)
    want[1:4] = K.NON_FINITE_ROW
    assert g.argmax(x, rt).tolist() == want.tolist()


@pytest.fixture(scope="module")
def overflow_servers(rt, tmp_path_factory):
    from test_non_finite_values import write_overflow_model
    path = write_overflow_model(tmp_path_factory.mktemp("overflow") / "overflow.gguf")
    with LiveServer(model_path=path, backend="hip", max_concurrency=4, max_context=256,
                    served_model_name="ds4-tiny") as hip, \
            LiveServer(model_path=path, backend="numpy", max_concurrency=4, max_context=256,
                       served_model_name="ds4-tiny") as ref:
        yield hip, ref


def test_the_overflowing_request_fails_alone_on_the_gpu(overflow_servers):
    """The request that feeds POISON gets the 500 non_finite_values, streamed after the token it
    had or before any; the requests beside it get the NumPy server's text, alone."""
    from test_non_finite_values import A, B, NEW, POISON, poisoned_stream, together
    hip, ref = overflow_servers
    want = [greedy(ref.url, p, NEW) for p in (A, B)]
    a, bad, b = together(hip.url)
    assert isinstance(bad, openai.InternalServerError) and bad.body["code"] == "non_finite_values"
    assert [a.choices[0].text, b.choices[0].text] == want
    text, err = poisoned_stream(hip.url)
    assert err.value.code == "non_finite_values"
    assert text == ds4ref.load().tokenizer.decode([POISON])  # the token before the overflow
    assert hip.wait_idle(30) and hip.runner.stats["live"] == 0
    assert greedy(hip.url, A, NEW) == want[0]


# ---- tool_choice: the constraint on the GPU's logits (tests/test_tool_choice.py: the NumPy side) ----

@pytest.fixture(scope="module")
def tool_servers(rt):
    with LiveServer(backend="hip", max_concurrency=2, max_context=2048, served_model_name="ds4-tiny") as hip, \
            LiveServer(backend="numpy", max_concurrency=2, max_context=2048, served_model_name="ds4-tiny") as ref:
        yield hip, ref  # room for the tools' prompt


def test_forced_tool_calls_are_the_numpy_servers(tool_servers):
    """Forced tool calls through the openai client, streamed and not: the same calls as the
    NumPy server's (greedy over bitwise equal logits, so the same constrained tokens)."""
    from test_tool_choice import ASK, CLOSE_SOONER, TOOLS, calls_of
    from openai.lib.streaming.chat import ChatCompletionStreamState
    hip, ref = tool_servers

    def ask(url, tool_choice, stream=False, **kw):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        return client.chat.completions.create(model="ds4-tiny", messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                                              max_tokens=400, temperature=0, stream=stream, **kw)

    for tool_choice, kw in (("required", {"logit_bias": CLOSE_SOONER}),
                            ("required", {"parallel_tool_calls": False}),
                            ({"type": "function", "function": {"name": "get_weather"}}, {})):
        want = calls_of(ask(ref.url, tool_choice, **kw))
        assert calls_of(ask(hip.url, tool_choice, **kw)) == want
        state = ChatCompletionStreamState()
        for chunk in ask(hip.url, tool_choice, stream=True, **kw):
            state.handle_chunk(chunk)
        assert calls_of(state.get_final_completion()) == want
