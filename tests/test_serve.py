"""The HTTP server end to end: a real uvicorn on loopback, real clients (httpx, openai)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from ds4ref.scheduler.pass_cost import DEFAULT_MAX_ITL_MS, LONG_PASS_ROWS
from ds4ref.scheduler.request import FinishEvent, TokenEvent
from ds4ref.serve.runner import Runner, StreamAborted
from serve_helpers import LiveServer, free_port

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    with LiveServer(max_concurrency=16, max_context=512) as s:
        yield s


def post(server, path, body, timeout=60):
    return httpx.post(server.url + path, json=body, timeout=timeout)


def sse_events(text: str) -> list:
    """Parsed `data:` payloads of an SSE body; '[DONE]' kept as a string."""
    out = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def completion_text(server, prompt, n, **extra) -> str:
    r = post(server, "/v1/completions", dict(GREEDY, prompt=prompt, max_tokens=n, **extra))
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


async def stream_completion(client: httpx.AsyncClient, url: str, prompt: str, n: int) -> tuple[str, str]:
    body = dict(GREEDY, prompt=prompt, max_tokens=n, stream=True)
    text, finish = "", None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                finish = choice["finish_reason"] or finish
    return text, finish


# ---- basic endpoints ----------------------------------------------------------------------

def test_health_models_metrics(server):
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    models = httpx.get(server.url + "/v1/models").json()
    assert models["data"][0]["id"] == "ds4-tiny"
    completion_text(server, "metrics", 3)
    text = httpx.get(server.url + "/metrics").text
    for name in ("ds4_requests_running", "ds4_requests_waiting", "ds4_kv_pages_used", "ds4_kv_pages_free",
                 "ds4_tokens_generated_total", "ds4_step_seconds_bucket"):
        assert name in text
    generated = [l for l in text.splitlines() if l.startswith("ds4_tokens_generated_total ")]
    assert float(generated[0].split()[1]) >= 3


def test_completion_counts_tokens_and_matches_stream(server):
    r = post(server, "/v1/completions", dict(GREEDY, prompt="Once upon a time", max_tokens=12))
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 12
    s = post(server, "/v1/completions", dict(GREEDY, prompt="Once upon a time", max_tokens=12, stream=True,
                                              stream_options={"include_usage": True}))
    events = sse_events(s.text)
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"]["completion_tokens"] == 12 and events[-2]["choices"] == []
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == body["choices"][0]["text"]


def test_token_id_prompt_equals_text_prompt(server):
    tok = server.state.tokenizer
    ids = [tok.bos_id] + tok.encode("The cat")
    assert completion_text(server, ids, 6) == completion_text(server, "The cat", 6)


def test_openai_client_chat_streaming_and_not(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    extra = {"ignore_eos": True}
    full = client.chat.completions.create(model="ds4-tiny", messages=msgs, max_tokens=10, temperature=0,
                                          extra_body=extra)
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 10
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="ds4-tiny", messages=msgs, max_tokens=10, temperature=0, stream=True, extra_body=extra)
        if c.choices]
    assert "".join(parts) == full.choices[0].message.content


def test_openai_client_completion_logprobs(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    out = client.completions.create(model="ds4-tiny", prompt="abc", max_tokens=4, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == 4 and all(len(t) >= 1 for t in lp.top_logprobs)
    # greedy: the chosen token is the most likely one; both numbers are the same float32 of one
    # log-softmax, written to JSON the same way, so they are equal
    assert all(chosen == max(top.values()) for chosen, top in zip(lp.token_logprobs, lp.top_logprobs))
    assert all(top[tok] == chosen for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))


def test_thinking_mode_splits_reasoning(server):
    tok = server.state.tokenizer
    think_end = tok.token_to_id("</think>")
    body = dict(GREEDY, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                chat_template_kwargs={"thinking": True}, stop=[think_end])
    # With </think> as a stop id the whole output is reasoning and the answer is empty.
    msg = post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert msg["content"] == "" and isinstance(msg["reasoning_content"], str)


def test_stop_string_trims_output_and_frees_the_slot(server):
    full = completion_text(server, "Stop test", 24)
    # pick a stop string from the middle of the greedy output (clean printable text)
    cut = next(i for i in range(4, len(full) - 2) if full[i:i + 2].isprintable() and full[i:i + 2] not in full[:i])
    stop = full[cut:cut + 2]
    r = post(server, "/v1/completions", dict(GREEDY, prompt="Stop test", max_tokens=24, stop=[stop])).json()
    assert r["choices"][0]["text"] == full[:cut]
    assert r["choices"][0]["finish_reason"] == "stop"
    assert server.wait_idle(60)


def test_stop_token_id_ends_generation_without_emitting_it(server):
    tok = server.state.tokenizer
    r = post(server, "/v1/completions", dict(GREEDY, prompt="Stop id", max_tokens=24, logprobs=0)).json()
    pieces, offsets = r["choices"][0]["logprobs"]["tokens"], r["choices"][0]["logprobs"]["text_offset"]
    # a later token whose text is plain ASCII, maps back to exactly one id, and has not appeared before
    k, stop_id = next((k, tok.encode(p)[0]) for k, p in enumerate(pieces)
                      if k >= 2 and p.isascii() and p.isprintable() and len(tok.encode(p)) == 1
                      and p not in pieces[:k])
    out = post(server, "/v1/completions", dict(GREEDY, prompt="Stop id", max_tokens=24, stop=[stop_id])).json()
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["choices"][0]["text"] == r["choices"][0]["text"][:offsets[k]]
    assert out["usage"]["completion_tokens"] == k + 1  # the stop token is counted, as vLLM does


# ---- concurrency -----------------------------------------------------------------------------

PROMPTS = [f"Request number {i}: " + "lorem ipsum " * (i % 5) for i in range(16)]


def test_sixteen_concurrent_streams_match_their_solo_greedy_text(server):
    solo = [completion_text(server, p, 16) for p in PROMPTS]  # one at a time

    async def main():
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(*(stream_completion(c, server.url, p, 16) for p in PROMPTS))

    results = asyncio.run(main())
    assert all(finish == "length" for _, finish in results)
    assert [text for text, _ in results] == solo
    assert server.wait_idle(60)


def test_client_disconnect_cancels_its_request(server):
    cancelled = server.runner.metrics.finished.value("cancelled")
    body = dict(GREEDY, prompt="disconnect me", max_tokens=400, stream=True)
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", server.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            got = [l for _, l in zip(range(6), lines)]
            assert any(l.startswith("data: ") for l in got)
            assert server.runner.stats["running"] >= 1
    # the request ends cancelled (freeing its slot), not at its 400 tokens
    assert server.wait_idle(60)
    assert server.runner.metrics.finished.value("cancelled") == cancelled + 1


def test_non_streaming_disconnect_cancels(server):
    before = server.runner.metrics.finished.value("cancelled")
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/v1/completions", dict(GREEDY, prompt="slow", max_tokens=450), timeout=0.5)
    assert server.wait_idle(60)
    assert server.runner.metrics.finished.value("cancelled") == before + 1


def test_a_client_that_never_reads_does_not_slow_the_others():
    """One raw-socket client sends a long streaming request and never reads a byte; fifteen
    others finish, with the texts they get alone, while its request is still streaming (its
    events go to buffers nobody reads): the runner never waits on a client. Nothing here gives
    up on the silent client (no stall timeout, no bound on unread events), so a runner that
    waited on it would serve nobody."""
    with LiveServer(max_concurrency=16, max_context=1024, stall_timeout=0, max_pending=1 << 20) as server:
        async def fifteen():
            async with httpx.AsyncClient(timeout=120) as c:
                return await asyncio.gather(*(stream_completion(c, server.url, p, 24) for p in PROMPTS[1:]))

        alone = asyncio.run(fifteen())
        body = json.dumps(dict(GREEDY, prompt="never read", max_tokens=960, stream=True)).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        try:
            streams = server.runner._streams
            deadline = time.monotonic() + 60  # a hang guard
            while not streams and time.monotonic() < deadline:
                time.sleep(0.01)
            (silent,) = streams.values()
            loaded = asyncio.run(fifteen())
            assert all(f == "length" for _, f in loaded) and loaded == alone
            # still streaming to nobody (its first events may sit in the server's socket buffers
            # rather than the stream's queue, so the queue's length proves nothing)
            assert silent.aborted is None and silent.req_id in streams
            assert server.runner.metrics.slow_client_cancels.value() == 0
        finally:
            sock.close()
        assert server.wait_idle(60)


def test_client_blocked_in_send_is_cancelled_and_its_lane_freed():
    """Drive the ASGI app directly with a client that stops reading after the
    first chunk (its `send` never returns, as with a full TCP window): the
    runner must cancel the request once 8 events are unread, while the
    response task is still stuck."""
    from ds4ref.serve import build_state, create_app

    state = build_state(max_concurrency=2, max_context=512, max_pending=8)
    app = create_app(state)
    body = json.dumps(dict(GREEDY, prompt="stuck", max_tokens=400, stream=True)).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json"),
                                                                (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}

    async def main():
        forever = asyncio.Event()
        sent = []
        delivered = False

        async def receive():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await forever.wait()  # connected, silent

        async def send(message):
            sent.append(message)
            if message["type"] == "http.response.body":
                await forever.wait()  # stopped reading

        state.runner.start()
        task = asyncio.ensure_future(app(scope, receive, send))
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and state.runner.metrics.slow_client_cancels.value() == 0:
                await asyncio.sleep(0.05)
            assert state.runner.metrics.slow_client_cancels.value() == 1
            while time.monotonic() < deadline and state.runner.stats.get("running", 1):
                await asyncio.sleep(0.05)
            assert state.runner.stats["running"] == 0
            assert not task.done()  # the response is still stuck on its client
            assert state.runner.stats["tokens_generated"] < 400
        finally:
            task.cancel()
            state.runner.stop()
        return sent

    sent = asyncio.run(main())
    assert sent[0]["status"] == 200


# ---- the runner gives up on a stalled consumer (no HTTP, exact control) ---------------------

class CountingScheduler:
    """Emits one token per live request per step; records cancels."""

    def __init__(self):
        self.live: dict[int, list] = {}
        self.cancelled: list[int] = []

    def submit(self, r):
        self.live[r.req_id] = [r, 0]
        return r.req_id

    def cancel(self, req_id):
        self.cancelled.append(req_id)
        return self.live.pop(req_id, None) is not None

    def has_work(self):
        return bool(self.live)

    def stats(self):
        return {"running": len(self.live), "waiting": 0}

    def step(self):
        time.sleep(0.001)
        events = []
        for rid, entry in list(self.live.items()):
            entry[1] += 1
            events.append(TokenEvent(rid, 7))
            if entry[1] >= entry[0].max_new_tokens:
                events.append(FinishEvent(rid, "length", 1, entry[1]))
                del self.live[rid]
        return events


def test_runner_cancels_a_consumer_that_falls_behind():
    from ds4ref.scheduler.request import Request

    async def main():
        sched = CountingScheduler()
        runner = Runner(sched, max_pending=4, stall_timeout=0)
        runner.start()
        try:
            fast_req, slow_req = Request([1], 200), Request([1], 200)
            fast = await runner.submit(fast_req)
            slow = await runner.submit(slow_req)
            n = 0
            while True:
                evs = await fast.next_events()
                n += sum(isinstance(e, TokenEvent) for e in evs)
                if any(isinstance(e, FinishEvent) for e in evs):
                    break
            with pytest.raises(StreamAborted, match="behind"):
                while True:
                    await slow.next_events()
            return n, sched.cancelled, slow_req.req_id
        finally:
            runner.stop()

    n, cancelled, slow_id = asyncio.run(main())
    assert n == 200
    assert cancelled == [slow_id]


def test_runner_cancels_a_stalled_consumer():
    from ds4ref.scheduler.request import Request

    async def main():
        sched = CountingScheduler()
        runner = Runner(sched, max_pending=10_000, stall_timeout=0.2)
        runner.start()
        try:
            req = Request([1], 100_000)
            stream = await runner.submit(req)
            await asyncio.sleep(0.6)  # read nothing
            with pytest.raises(StreamAborted, match="read nothing"):
                while True:
                    await stream.next_events()
            return sched.cancelled, req.req_id
        finally:
            runner.stop()

    cancelled, rid = asyncio.run(main())
    assert cancelled == [rid]


# ---- bad requests ----------------------------------------------------------------------------------

@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": 2}, "n"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "x", "logprobs": 99}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": [1, 100000]}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 600}, "max_tokens"),
    ("/v1/completions", {"prompt": "x " * 600}, "prompt"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"},
                                            {"role": "assistant", "content": "y"}]}, "messages[1].role"),
    # a lone surrogate: valid JSON, not encodable text
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
])
def test_bad_request_is_400_naming_the_field(server, path, body, param):
    if isinstance(body, str):
        r = httpx.post(server.url + path, content=body.encode(), headers={"Content-Type": "application/json"})
    else:
        r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert err["message"]


def test_body_that_is_not_json_is_400(server):
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(server.url + "/v1/chat/completions", json=[1, 2])
    assert r.status_code == 400


def test_oversized_body_is_413_before_it_is_read(server):
    from ds4ref.serve.app import MAX_BODY_BYTES

    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % (MAX_BODY_BYTES + 1))
        head = sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 413")


def test_unknown_model_is_404(server):
    r = post(server, "/v1/completions", {"prompt": "x", "model": "gpt-9"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


# ---- admission limits (their own small server) -------------------------------------------------------

def test_queue_full_is_503_and_pool_refusal_is_400():
    with LiveServer(max_concurrency=2, kv_pool_tokens=256, max_queue=0, max_context=512) as s:
        # 120 tokens fit each request in one page, so both lanes run at once
        long = dict(GREEDY, prompt="hold a lane", max_tokens=120, stream=True)
        with httpx.Client(timeout=30) as c, c.stream("POST", s.url + "/v1/completions", json=long) as r1, \
                c.stream("POST", s.url + "/v1/completions", json=long) as r2:
            # keep the line iterators alive: dropping one closes its response
            lines1, lines2 = r1.iter_lines(), r2.iter_lines()
            next(lines1), next(lines2)
            r3 = c.post(s.url + "/v1/completions", json=dict(GREEDY, prompt="one more", max_tokens=2))
            assert r3.status_code == 503, r3.text
            assert r3.headers["Retry-After"] == "1"
            assert r3.json()["error"]["code"] == "queue_full"
        # 300 prompt tokens need 3 pages of 128; the whole pool has 2
        r = httpx.post(s.url + "/v1/completions", json={"prompt": [0] * 300, "max_tokens": 2}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert "pool" in r.json()["error"]["message"]


# ---- the command line ---------------------------------------------------------------------------------

def _serve(*args):
    return subprocess.Popen([sys.executable, "-m", "ds4ref.serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("args, needle", [
    (["--max-concurrency", "0"], "1..16"),
    (["--max-concurrency", "17"], "1..16"),
    (["--max-concurrency", "1", "--kv-pool-tokens", "512"], "--kv-pool-tokens"),
    (["--max-context", "999999999"], "--max-context"),
    (["--dry-run", "--max-batched-rows", "8"], "--max-concurrency"),  # 16 decoders need 16 rows a pass
    (["--dry-run", "--backend", "hip", "--max-batched-rows", "8192"], "must be at most 4096"),  # LARGEST_PASS
    (["--dry-run", "--max-itl-ms", "-5"], "--max-itl-ms"),
])
def test_bad_flags_exit_nonzero_with_a_message(args, needle):
    p = _serve(*args)
    _, err = p.communicate(timeout=60)
    assert p.returncode != 0 and needle in err


def test_hip_backend_without_a_gpu_exits_naming_what_is_missing():
    """Status 2 and ds4ref.serve's error naming the runtimes it tried, no traceback, no server."""
    p = _serve("--backend", "hip", "--port", str(free_port()))
    try:
        out, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # a GPU is present and the server is up
        p.kill()
        pytest.skip("a GPU is available here")
    assert p.returncode == 2 and err.startswith("ds4ref.serve: error: no usable GPU runtime"), err
    assert "Traceback" not in err and "listening" not in out


def test_sigterm_shuts_down_gracefully():
    port = free_port()
    p = _serve("--port", str(port), "--log-level", "info")
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            pytest.fail("server did not start")
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=20)
        # the process dies by the signal after its graceful shutdown
        assert p.returncode == -signal.SIGTERM
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
    out, err = p.stdout.read(), p.stderr.read()
    assert "ds4-tiny" in out and "16 lanes" in out and "context 4096" in out
    assert (f"passes of up to {LONG_PASS_ROWS} rows (prompt chunks of up to {LONG_PASS_ROWS}; beside decoders, "
            f"sized to a {DEFAULT_MAX_ITL_MS:g} ms inter-token budget)") in out
    assert "prefix cache on" in out
    assert "runner stopped" in err


def test_bench_reports_every_level_as_json(server, capsys):
    from ds4ref.cli import bench

    rc = bench.main(["--url", server.url, "--concurrency", "1,3", "--max-tokens", "5", "--json", "--no-progress",
                     "--warmup-tokens", "2"])
    rows = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert [r["concurrency"] for r in rows] == [1, 3]
    assert [r["tokens"] for r in rows] == [5, 15]
    assert all(r["errors"] == 0 and r["tok_per_s"] > 0 and r["ttft_p50"] > 0 for r in rows)


def test_bench_percentile_is_nearest_rank():
    from ds4ref.cli.bench import percentile

    values = [float(i) for i in range(1, 101)]
    assert percentile(values, 50) == 50.0 and percentile(values, 99) == 99.0 and percentile([3.0], 99) == 3.0
    assert percentile([], 50) is None


# ---- page pressure ----------------------------------------------------------------------------

def test_page_pressure_preempts_instead_of_truncating():
    """Page pressure, scaled down: a 512-token pool (4 pages), three concurrent requests of
    300 tokens (3 pages each; two are admitted on 2 pages each and then both need a third). Every one comes back whole and equal to its solo run; a request
    that cannot fit even alone is refused naming the pool."""
    with LiveServer(max_concurrency=4, kv_pool_tokens=512, max_context=1024) as s:
        prompts = [f"Pressure {i}: once upon a time" for i in range(3)]
        solo = [completion_text(s, p, 300) for p in prompts]

        async def main():
            async with httpx.AsyncClient(timeout=120) as c:
                return await asyncio.gather(*(stream_completion(c, s.url, p, 300) for p in prompts))

        results = asyncio.run(main())
        assert [text for text, _ in results] == solo and all(f == "length" for _, f in results)
        assert s.runner.scheduler.stats()["preemptions"] >= 1
        r = post(s, "/v1/completions", dict(GREEDY, prompt="too long", max_tokens=600))
        assert r.status_code == 400 and "kv_pool_tokens" in r.json()["error"]["message"]
        default = post(s, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                   "temperature": 0, "ignore_eos": True, "max_tokens": None})
        assert default.status_code == 200  # an unset max_tokens is clamped to what the pool holds
        assert s.wait_idle(10)
        stats = s.runner.scheduler.stats()
        assert stats["pages_used"] == stats["prefix_cached_pages"] and stats["pages_reserved"] == 0


def test_bench_turns_replays_a_chat_and_reports_each_turn(server, capsys):
    from ds4ref.cli import bench

    rc = bench.main(["--url", server.url, "--turns", "2", "--conversations", "1", "--first-turn-tokens", "150",
                     "--turn-tokens", "20", "--max-tokens", "3", "--json"])
    out = json.loads(capsys.readouterr().out)["turns"]
    assert rc == 0 and [t["turn"] for t in out] == [1, 2] and all(t["errors"] == 0 for t in out)
    assert 140 <= out[0]["prompt_tokens_p50"] < out[1]["prompt_tokens_p50"]
    assert out[0]["cached_tokens_p50"] == 0 < out[1]["cached_tokens_p50"]  # the first page of turn 1 is reused
    assert all(t["ttft_p50"] > 0 for t in out)


def test_bench_turns_compares_two_servers_it_starts(capsys):
    from ds4ref.cli import bench

    rc = bench.main(["--turns", "2", "--conversations", "1", "--first-turn-tokens", "150", "--turn-tokens", "20",
                     "--max-tokens", "2", "--compare-prefix-cache", "--json",
                     "--serve-args", "--max-context 1024 --max-concurrency 1"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    on, off = out["prefix_cache_on"], out["prefix_cache_off"]
    assert [t["prompt_tokens_p50"] for t in on] == [t["prompt_tokens_p50"] for t in off]
    assert on[1]["cached_tokens_p50"] > 0 and off[1]["cached_tokens_p50"] == 0


@pytest.mark.parametrize("args, needle", [
    (["--turns", "2", "--repeats", "3"], "--repeats belong to the load test"),
    (["--compare-prefix-cache"], "need --turns"),
    (["--turns", "2", "--compare-prefix-cache", "--serve-args", "--host 0.0.0.0"], "must not set --host"),
    (["--turns", "2", "--serve-args", "--max-context 1024"], "needs --compare-prefix-cache"),
])
def test_bench_turns_refuses_flags_that_do_not_apply(args, needle, capsys):
    from ds4ref.cli import bench

    with pytest.raises(SystemExit) as exit_:
        bench.main(args)
    assert exit_.value.code == 2 and needle in capsys.readouterr().err
