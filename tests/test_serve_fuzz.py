"""Fuzz the generation endpoints with hypothesis: nothing a client sends may
produce a 5xx (or an error event inside a stream), and the server must still
answer /health afterwards. The server's context is 64 tokens so every request
that happens to be valid finishes quickly."""
from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from serve_helpers import LiveServer

FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "seed", "stop", "stop_token_ids", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "logprobs", "top_logprobs", "n", "ignore_eos", "stream", "stream_options",
          "chat_template_kwargs", "reasoning_effort", "thinking", "echo", "best_of", "suffix", "tools", "user",
          "tool_choice", "parallel_tool_calls", "logit_bias", "response_format", "skip_special_tokens", "audio",
          "modalities", "store", "service_tier", "metadata"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(1 << 70), max_value=1 << 70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
                    st.sampled_from(["", "ds4-tiny", "user", "assistant", "system", "tool", "text", "high",
                                     "none", "enabled", "\u0000", "<｜User｜>", "</think>", "\ud800"]))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(FIELDS + ["role", "content", "type", "text",
                                                                          "include_usage", "thinking"]),
                                                 inner, max_size=4)), max_leaves=12)
small_ints = st.integers(min_value=-3, max_value=70)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "x"])},
    optional={"content": st.one_of(st.text(max_size=30), json_values), "reasoning_content": st.text(max_size=10),
              "prefix": st.booleans()}), max_size=4)
nearly_valid = st.fixed_dictionaries({}, optional={
    "prompt": st.one_of(st.text(max_size=40), st.lists(small_ints, max_size=8), json_values),
    "messages": st.one_of(messages, json_values),
    "max_tokens": st.one_of(small_ints, json_values),
    "temperature": st.one_of(st.floats(-1, 3), json_values),
    "top_p": st.floats(-0.5, 1.5), "top_k": small_ints, "min_p": st.floats(-0.5, 1.5),
    "seed": st.one_of(st.integers(-(1 << 64), 1 << 65), json_values),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.one_of(st.text(max_size=3), small_ints), max_size=3)),
    "presence_penalty": st.floats(-3, 3), "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(-1, 3), "logprobs": st.one_of(st.booleans(), small_ints),
    "top_logprobs": small_ints, "n": small_ints, "ignore_eos": st.booleans(), "stream": st.booleans(),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), json_values),
    "chat_template_kwargs": st.one_of(st.fixed_dictionaries({"thinking": st.booleans()}), json_values),
    "reasoning_effort": st.one_of(st.sampled_from(["none", "low", "high", "max"]), json_values),
})
# valid for both endpoints (each ignores the other's prompt field), so generation paths run too
valid = st.fixed_dictionaries({
    "prompt": st.one_of(st.text(min_size=1, max_size=40), st.lists(st.integers(0, 511), min_size=1, max_size=8)),
    "messages": st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=30)}),
                         min_size=1, max_size=2),
    "max_tokens": st.integers(1, 6),
}, optional={
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1), "seed": st.integers(-(1 << 63), (1 << 64) - 1),
    "stop": st.lists(st.one_of(st.text(min_size=1, max_size=2), st.integers(0, 511)), max_size=3),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.1, 3), "ignore_eos": st.booleans(), "stream": st.booleans(),
    "chat_template_kwargs": st.fixed_dictionaries({"thinking": st.booleans()}),
})
bodies = st.one_of(valid, nearly_valid, json_values)


@pytest.fixture(scope="module")
def server():
    with LiveServer(max_concurrency=4, max_context=64) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _check(client: httpx.Client, path: str, raw: bytes) -> None:
    r = client.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code < 500, (raw, r.status_code, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and err["type"]
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.endswith("data: [DONE]\n\n"), r.text
        assert "server_error" not in r.text, r.text


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(body=bodies, chat=st.booleans())
def test_fuzzed_json_bodies_never_5xx(client, body, chat):
    raw = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
    _check(client, "/v1/chat/completions" if chat else "/v1/completions", raw)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=64), chat=st.booleans())
def test_fuzzed_raw_bytes_never_5xx(client, raw, chat):
    _check(client, "/v1/chat/completions" if chat else "/v1/completions", raw)


def test_server_still_healthy_after_fuzzing(server, client):
    assert client.get("/health").json()["status"] == "ok"
    assert server.wait_idle(10)
