"""`serve --speculative-tokens`: through the openai client, streaming and not, a speculating
server answers exactly what a plain one does, reports its drafts in usage and /metrics, and
refuses to start without an MTP block."""
from __future__ import annotations

import httpx
import openai
import pytest

from ds4ref.gguf.tiny import write_tiny
from ds4ref.serve import build_state
from serve_helpers import LiveServer


@pytest.fixture(scope="module")
def servers():
    with LiveServer(max_concurrency=2, max_context=256) as plain, \
            LiveServer(max_concurrency=2, max_context=256, speculative_tokens=2) as spec:
        spec.state.runner.scheduler.engine.spec_min_rate = 0.0  # the tiny MTP is random: keep drafting
        yield plain, spec


def ask(server, **kw):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    msgs = [{"role": "user", "content": "Tell me about cats"}]
    full = client.chat.completions.create(model="ds4-tiny", messages=msgs, max_tokens=12, **kw)
    stream = client.chat.completions.create(model="ds4-tiny", messages=msgs, max_tokens=12, stream=True, **kw)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    done = client.completions.create(model="ds4-tiny", prompt="The cat sat", max_tokens=8, logprobs=2, **kw)
    return full, streamed, done


@pytest.mark.parametrize("kw", [dict(temperature=0, extra_body={"ignore_eos": True}),
                                dict(temperature=0.9, seed=3, stop=["e"])])
def test_speculating_server_answers_exactly_as_a_plain_one(servers, kw):
    plain, spec = servers
    (fa, sa, ca), (fb, sb, cb) = ask(plain, **kw), ask(spec, **kw)
    assert fa.choices[0].message.content == fb.choices[0].message.content == sa == sb
    assert fa.choices[0].finish_reason == fb.choices[0].finish_reason
    assert ca.choices[0].text == cb.choices[0].text
    assert ca.choices[0].logprobs.token_logprobs == cb.choices[0].logprobs.token_logprobs
    if fb.choices[0].finish_reason == "length":
        details = fb.usage.completion_tokens_details
        assert details is not None and details.rejected_prediction_tokens + details.accepted_prediction_tokens > 0
    metrics = httpx.get(spec.url + "/metrics").text
    assert "spec_draft_tokens_total" in metrics and "spec_rounds_total" in metrics


def test_speculation_needs_an_mtp_block(tmp_path):
    path = tmp_path / "no-mtp.gguf"
    write_tiny(path)
    with pytest.raises(ValueError, match="needs an MTP block"):
        build_state(str(path), max_concurrency=1, max_context=256, speculative_tokens=2)
