"""`--backend hip` serves the openai client: the same greedy text as the NumPy server, for the
embedded model and for the tiny file in the published q2 policy (IQ2_XXS / Q2_K experts).

Runs only where a GPU runtime opens (marker gpu); elsewhere skipped with the reason.
"""
import asyncio
import sys
from pathlib import Path

import pytest

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
