"""A request whose values overflow at run time fails alone, with an OpenAI-shaped error.

The model is the embedded tiny model with token POISON's embedding row set to 3e38: finite
(the file passes the load-time check), and every product with it overflows float32. A
request that feeds POISON computes NaN from there on; the others must not notice: their
tokens are bitwise those of a run without it, its lane and pages are freed, nothing of it is
cached, and later requests are served as before. Both numerics of the NumPy backend are run:
official numerics meet the NaN when writing a compact KV row (whose grid has none), plain
numerics in the logits. The HIP backend's host side runs here too, over a stand-in for the
device (serve_helpers.stand_in_hip_state); its argmax kernel's answer for such a row is
tests/test_hip_program.py (recorded) and tests/gpu/test_serve_hip.py (on the GPU).
"""
from __future__ import annotations

import asyncio

import numpy as np
import openai
import pytest

import ds4ref
from ds4ref.gguf.file import write_gguf
from ds4ref.gguf.tiny import random_tensors, tiny_config, tiny_dtypes
from ds4ref.gguf.tokenizer import tiny_tokenizer_meta
from ds4ref.scheduler.engine import Engine
from ds4ref.scheduler.request import NON_FINITE_VALUES, Request, Sampling
from serve_helpers import LiveServer, stand_in_hip_state

POISON = 300
A, B, C = [0, 10, 11, 12, 13], [0, 20, 21, 22], [0, 40, 41]
BAD = [0, 30, POISON, 31, 32]  # POISON mid-prompt: the request fails before its first token
NEW = 10


def write_overflow_model(path) -> str:
    """The embedded tiny model's weights (without its MTP block), POISON's embedding row 3e38."""
    cfg = tiny_config()
    tensors = random_tensors(cfg, 0)
    embedding = tensors["token_embd.weight"].copy()
    embedding[POISON] = 3e38
    tensors["token_embd.weight"] = embedding
    write_gguf(path, cfg, tensors, tokenizer_meta=tiny_tokenizer_meta(cfg.vocab_size),
               dtypes={**tiny_dtypes(cfg), "token_embd.weight": "f32"})  # f16 cannot hold 3e38
    return str(path)


@pytest.fixture(scope="module")
def overflow_model(tmp_path_factory) -> str:
    return write_overflow_model(tmp_path_factory.mktemp("overflow") / "overflow.gguf")


def greedy(prompt, **kw) -> Request:
    return Request(list(prompt), NEW, Sampling(temperature=0.0, **kw), ignore_eos=True)


def forced_poison() -> Request:
    """A clean prompt whose first generated token is forced to POISON: it fails at the pass
    that feeds that token, after streaming it."""
    return greedy(C, logit_bias=((POISON, 100.0),))


@pytest.mark.parametrize("numerics", ["official", "plain"])
def test_the_overflowing_request_fails_and_no_other_is_touched(overflow_model, numerics):
    model = ds4ref.load(overflow_model, numerics=numerics)
    without = Engine(model, max_concurrency=4).run([greedy(A), greedy(B)])
    eng = Engine(model, max_concurrency=4)
    # A, BAD, the forced one and B share their passes from the first; a later request takes a freed lane
    reqs = [greedy(A), greedy(BAD), forced_poison(), greedy(B), greedy(A)]
    out = eng.run(reqs, arrivals={4: 6})
    assert out[0] == without[0] and out[3] == without[1] and out[4] == without[0]
    assert [f.reason for f in eng.finishes] == ["length", "error", "error", "length", "length"]
    for f in eng.finishes[1:3]:
        assert f.error_code == NON_FINITE_VALUES and "NaN or an infinity" in f.message
    assert out[1] == [] and out[2] == [POISON]  # the forced token came out before its row overflowed
    stats = eng.seq_engine.stats()
    # every lane and page is back: the pages still used are the cache's (the finished requests' tails)
    assert stats["live"] == 0 and stats["pages_used"] == stats["prefix_cached_pages"]


@pytest.mark.parametrize("numerics", ["official", "plain"])
def test_the_prefix_cache_keeps_only_what_came_before_the_failing_pass(overflow_model, numerics):
    """A long prompt runs its first page in one pass (a chunk ends where a snapshot is wanted),
    then POISON near its end: the first page and its snapshot are cached as for any prompt,
    nothing of the failing pass is (no tail), and a clean prompt sharing that page resumes from it
    with the tokens it has alone."""
    model = ds4ref.load(overflow_model, numerics=numerics)
    head = [0] + [5] * 199
    bad, good = greedy(head + [POISON, 31, 32]), greedy(head + [33, 31, 32])
    eng = Engine(model, max_concurrency=2)
    eng.run([bad])
    assert eng.finishes[0].error_code == NON_FINITE_VALUES
    stats = eng.seq_engine.stats()
    assert (stats["prefix_cached_pages"], stats["prefix_snapshots"], stats["prefix_tails"]) == (1, 1, 0)
    assert stats["live"] == 0 and stats["pages_used"] == 1
    out = eng.run([good])
    assert eng.finishes[0].cached_tokens == 128
    assert out == Engine(model, max_concurrency=2, prefix_cache=False).run([greedy(head + [33, 31, 32])])


# ---- through the server, with the openai client -------------------------------------------------

@pytest.fixture(scope="module")
def server(overflow_model):
    with LiveServer(model_path=overflow_model, max_concurrency=4, max_context=256) as s:
        yield s


def completion(client, prompt, **kw):
    return client.completions.create(model="ds4-tiny", prompt=prompt, max_tokens=NEW, temperature=0,
                                     extra_body={"ignore_eos": True}, **kw)


def together(url):
    """A, BAD and B sent at once: their answers (BAD's an exception), in that order."""
    async def send():
        aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        return await asyncio.gather(*(aclient.completions.create(
            model="ds4-tiny", prompt=p, max_tokens=NEW, temperature=0, extra_body={"ignore_eos": True})
            for p in (A, BAD, B)), return_exceptions=True)
    return asyncio.run(send())


def test_the_client_gets_a_500_in_openais_shape_and_the_others_their_text(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    solo = [completion(client, p).choices[0].text for p in (A, B)]
    a, bad, b = together(server.url)
    assert isinstance(bad, openai.InternalServerError) and bad.status_code == 500
    assert bad.body["code"] == NON_FINITE_VALUES and bad.body["type"] == "server_error"
    assert bad.body["param"] is None and "NaN or an infinity" in bad.body["message"]
    assert [a.choices[0].text, b.choices[0].text] == solo
    assert server.wait_idle(30)
    assert completion(client, A).choices[0].text == solo[0]


def poisoned_stream(url):
    """(the text streamed, the APIError that ended it) of C streamed with POISON forced."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    texts = []
    with pytest.raises(openai.APIError) as err:
        for chunk in client.completions.create(model="ds4-tiny", prompt=C, max_tokens=NEW, temperature=0,
                                               stream=True, logit_bias={str(POISON): 100},
                                               extra_body={"ignore_eos": True}):
            texts.append(chunk.choices[0].text)
    return "".join(texts), err


def test_a_stream_ends_with_the_error_event_after_the_tokens_it_had(server):
    text, err = poisoned_stream(server.url)
    assert err.value.code == NON_FINITE_VALUES and "NaN or an infinity" in err.value.message
    tok = ds4ref.load().tokenizer
    assert text == tok.decode([POISON])  # the token before the overflow was delivered
    # before any token, a stream is refused with the status and body of a plain request
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.InternalServerError) as err:
        list(client.completions.create(model="ds4-tiny", prompt=BAD, max_tokens=NEW, stream=True))
    assert err.value.body["code"] == NON_FINITE_VALUES


# ---- the HIP backend's host side, over a stand-in for the device ----------------------------------

def stand_in_logits(token: int, position: int):
    """The stand-in device's answer for a row: fixed noise per (token, position), NaN for a row
    that feeds POISON (the device's argmax then answers NON_FINITE_ROW for it)."""
    if token == POISON:
        return np.full(512, np.nan, np.float32)
    return (3 * np.random.default_rng([token, position]).standard_normal(512)).astype(np.float32)


def test_the_hip_backend_ends_the_slot_its_argmax_finds_not_finite():
    """Among the lanes of shared passes, the head row the kernel answers NON_FINITE_ROW for
    ends its own request (before its first token, or after the tokens it had), and the others
    get what they get without it."""
    bad_last = [0, 30, 31, POISON]  # POISON feeds the emitting row: no token before the error
    with LiveServer(state=stand_in_hip_state(stand_in_logits, max_concurrency=4, max_context=256)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        without = [completion(client, p).choices[0].text for p in (A, B)]

        async def together():
            aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
            bodies = [dict(prompt=A), dict(prompt=bad_last), dict(prompt=C, logit_bias={str(POISON): 100}),
                      dict(prompt=B)]
            return await asyncio.gather(*(aclient.completions.create(
                model="ds4-tiny", max_tokens=NEW, temperature=0, extra_body={"ignore_eos": True}, **body)
                for body in bodies), return_exceptions=True)

        a, bad, forced, b = asyncio.run(together())
        for failed in (bad, forced):
            assert isinstance(failed, openai.InternalServerError) and failed.body["code"] == NON_FINITE_VALUES
        assert [a.choices[0].text, b.choices[0].text] == without
        assert server.wait_idle(30)
        stats = server.runner.stats
        assert stats["live"] == 0 and stats["pages_used"] == stats["prefix_cached_pages"]
        assert completion(client, A).choices[0].text == without[0]
