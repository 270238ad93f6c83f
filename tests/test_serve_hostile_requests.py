"""Hostile requests: chunked bodies over the cap, bodies that never arrive,
stop strings that would starve the loop, and failures inside a generation."""
from __future__ import annotations

import json
import select
import socket
import threading
import time

import httpx
import pytest

from ds4ref.serve.protocol import MAX_STOP, MAX_STOP_CHARS
from serve_helpers import LiveServer

BODY_CAP = 1 << 20  # small limits so the tests send little and wait little
BODY_TIMEOUT = 0.5
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    with LiveServer(state_overrides={"max_body_bytes": BODY_CAP, "body_timeout_s": BODY_TIMEOUT},
                    max_concurrency=16, max_context=512) as s:
        yield s


def sse_events(text: str) -> list:
    return [b[6:] if b[6:] == "[DONE]" else json.loads(b[6:]) for b in text.split("\n\n") if b.startswith("data: ")]


def read_response(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection."""
    sock.settimeout(timeout)
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


# ---- 1. the body cap counts chunked bodies too ------------------------------------------------

def send_chunked(port: int, total: int, chunk: int = 64 << 10) -> bytes:
    """POST `total` bytes with Transfer-Encoding: chunked; stop sending once the server answers."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(HEAD + b"Transfer-Encoding: chunked\r\n\r\n")
        sent = 0
        while sent < total and not select.select([sock], [], [], 0)[0]:
            try:
                sock.sendall(b"%x\r\n%s\r\n" % (chunk, b" " * chunk))
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += chunk
        if sent >= total:
            sock.sendall(b"0\r\n\r\n")
        return read_response(sock)


def test_chunked_body_over_the_cap_is_413(server):
    reply = send_chunked(server.port, 2 * BODY_CAP)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "body_too_large"


def test_chunked_body_under_the_cap_is_served(server):
    body = json.dumps(dict(GREEDY, prompt="chunked", max_tokens=2)).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(HEAD + b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                     + b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:5], body[5:]))
                     + b"0\r\n\r\n")
        reply = read_response(sock)
    assert reply.startswith(b"HTTP/1.1 200"), reply[:300]


# ---- 3. a body that never arrives ---------------------------------------------------------------

def test_body_that_never_arrives_is_408_and_the_connection_closed(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(HEAD + b"Content-Length: 100\r\n\r\n" + b'{"prompt": ')  # 11 of 100 bytes
        reply = read_response(sock)  # returns only because the server closes the connection
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "body_timeout"


# ---- 2. long stop strings ---------------------------------------------------------------------------

def test_stop_strings_over_the_total_limit_are_400(server):
    """16 stop strings of 50,000 characters."""
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   json=dict(GREEDY, prompt="x", max_tokens=16, stop=["z" * 50_000] * 16))
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "stop" and str(MAX_STOP_CHARS) in err["message"]


def test_health_answers_within_100ms_while_long_stop_strings_run(server):
    """Eight requests (streamed and not) with stop strings at the limit, each never
    matching: /health must still answer at once, and the requests finish. The same eight
    requests run once first, briefly: Numba compiles the reference's kernels for a pass's row
    count at its first use, holding the interpreter, and a cold start is not what this measures."""
    width = MAX_STOP_CHARS // MAX_STOP
    stops = ["\u00a7" * (width - 1) + chr(0x41 + i) for i in range(MAX_STOP)]
    results: list = []

    def run(stream: bool, max_tokens: int = 150) -> None:
        body = dict(GREEDY, prompt="health under load", max_tokens=max_tokens, stop=stops, stream=stream)
        results.append(httpx.post(server.url + "/v1/completions", json=body, timeout=120).status_code)

    warm = [threading.Thread(target=run, args=(i % 2 == 0, 2)) for i in range(8)]
    for t in warm:
        t.start()
    for t in warm:
        t.join(120)
    assert results == [200] * 8 and server.wait_idle()
    results.clear()
    clients = [threading.Thread(target=run, args=(i % 2 == 0,)) for i in range(8)]
    for t in clients:
        t.start()
    try:
        deadline = time.monotonic() + 30
        while server.runner.stats.get("running", 0) < 8 and time.monotonic() < deadline:
            time.sleep(0.02)
        latencies = []
        with httpx.Client(base_url=server.url) as c:
            for _ in range(10):
                t0 = time.perf_counter()
                assert c.get("/health").status_code == 200
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.05)
        assert server.runner.stats["running"] >= 1  # the probes ran under load
    finally:
        for t in clients:
            t.join(120)
    assert max(latencies) < 0.1, latencies
    assert results == [200] * 8


# ---- 8. a failure inside a generation reaches its client ----------------------------------------------

class FailingTokenizer:
    """The real tokenizer, except that decoding the third generated token raises."""

    def __init__(self, real) -> None:
        self.real, self.calls = real, 0

    def __getattr__(self, name):
        return getattr(self.real, name)

    def decode_bytes(self, ids):
        self.calls += 1
        if self.calls == 3:
            raise ValueError("token id 4242 out of range")
        return self.real.decode_bytes(ids)


@pytest.mark.parametrize("stream", [False, True])
def test_error_inside_a_generation_is_openai_shaped(server, monkeypatch, stream):
    monkeypatch.setattr(server.state, "tokenizer", FailingTokenizer(server.state.tokenizer))
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   json=dict(GREEDY, prompt="fail", max_tokens=8, stream=stream))
    if stream:
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        err = events[-2]["error"]
    else:
        assert r.status_code == 500 and r.headers["content-type"] == "application/json"
        err = r.json()["error"]
    assert err["code"] == "internal_error" and "4242" in err["message"]
    assert server.wait_idle(5)
