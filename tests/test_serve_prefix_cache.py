"""The exact prefix cache through the real server: a prompt that extends an earlier one by
whole KV pages is served partly from the cache (usage.prompt_tokens_details.cached_tokens,
/metrics), and its tokens and logprobs are those of a server without the cache."""
from __future__ import annotations

import json
import random

import httpx
import pytest

from serve_helpers import LiveServer

PAGE = 128


@pytest.fixture(scope="module")
def servers():
    """(with the cache, without it): the same model and flags otherwise."""
    with LiveServer(max_concurrency=2, max_context=1024) as cached, \
            LiveServer(max_concurrency=2, max_context=1024, prefix_cache=False) as plain:
        yield cached, plain


def post(server, path, body):
    r = httpx.post(server.url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 500) for _ in range(n)]


def cached_tokens(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def first_then_longer(server, first: list[int], longer: list[int], **sampling) -> tuple[dict, dict]:
    body = {"max_tokens": 8, "ignore_eos": True, "logprobs": 3, **sampling}
    return (post(server, "/v1/completions", dict(body, prompt=first)),
            post(server, "/v1/completions", dict(body, prompt=longer)))


def answer(body: dict) -> tuple:
    lp = body["choices"][0]["logprobs"]
    return body["choices"][0]["text"], lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "top_p": 0.9, "seed": 7}],
                         ids=["greedy", "seeded"])
def test_a_longer_prompt_reuses_the_cache_and_answers_as_without_it(servers, sampling):
    cached, plain = servers
    seed = 1 if sampling["temperature"] == 0 else 2  # each case its own prefix: no hit from the other
    first = ids(PAGE + 70, seed)
    longer = first + ids(PAGE + 30, seed + 10)  # more than a page beyond the first prompt
    one, two = first_then_longer(cached, first, longer, **sampling)
    assert cached_tokens(one) == 0
    hit = cached_tokens(two)
    assert hit == len(first), hit  # the first prompt ended mid-page: its prompt tail
    assert two["usage"]["prompt_tokens"] == len(longer)
    one_plain, two_plain = first_then_longer(plain, first, longer, **sampling)
    assert cached_tokens(one_plain) == cached_tokens(two_plain) == 0
    assert answer(one) == answer(one_plain) and answer(two) == answer(two_plain)


def test_chat_turns_report_cached_tokens_streamed_and_not(servers):
    cached, plain = servers
    words = "river stone lantern orbit maple copper signal harbor meadow thunder".split()
    rng = random.Random(3)
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": " ".join(rng.choice(words) for _ in range(80))}]
    body = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
    turn1 = post(cached, "/v1/chat/completions", dict(body, messages=messages))
    messages += [turn1["choices"][0]["message"], {"role": "user", "content": "and then?"}]
    streamed = httpx.post(cached.url + "/v1/chat/completions", timeout=120, json=dict(
        body, messages=messages, stream=True, stream_options={"include_usage": True}))
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] // PAGE * PAGE - PAGE > 0
    again = post(cached, "/v1/chat/completions", dict(body, messages=messages))
    assert cached_tokens(again) >= usage["prompt_tokens_details"]["cached_tokens"]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == again["choices"][0]["message"]["content"]
    assert cached_tokens(post(plain, "/v1/chat/completions", dict(body, messages=messages))) == 0


def test_a_stop_string_answer_still_reports_its_cached_tokens(servers):
    cached, _ = servers
    prompt = ids(2 * PAGE + 10, 4)
    body = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    full = post(cached, "/v1/completions", dict(body, prompt=prompt))["choices"][0]["text"]
    cut = next(i for i in range(2, len(full) - 1) if full[i].isprintable() and full[i] not in full[:i])
    stopped = post(cached, "/v1/completions", dict(body, prompt=prompt, stop=[full[cut]]))
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["choices"][0]["text"] == full[:cut]
    assert cached_tokens(stopped) == 2 * PAGE
    assert cached.wait_idle(5)


def test_metrics_count_hits_misses_cached_pages_and_tails(servers):
    cached, plain = servers
    post(cached, "/v1/completions", {"prompt": ids(PAGE + 5, 5), "max_tokens": 1})
    post(cached, "/v1/completions", {"prompt": ids(PAGE + 5, 5) + [7], "max_tokens": 1})
    text = httpx.get(cached.url + "/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("ds4_prefix_cache")}
    assert values["ds4_prefix_cache_hits_total"] >= 1 and values["ds4_prefix_cache_misses_total"] >= 1
    assert values["ds4_prefix_cache_cached_tokens_total"] >= PAGE
    assert values["ds4_prefix_cache_pages"] >= 1
    assert "ds4_prefix_cache_evictions_total" in values and values["ds4_prefix_cache_snapshots"] >= 1
    # the first request fed its 133 prompt tokens and left page 1's 5 as a tail; the second continues it
    assert values["ds4_prefix_cache_tails"] >= 1 and values["ds4_prefix_cache_tail_hits_total"] >= 1
    plain_text = httpx.get(plain.url + "/metrics").text
    assert "ds4_prefix_cache_hits_total 0" in plain_text
