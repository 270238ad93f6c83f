"""SIGTERM/SIGINT under load: every client gets a clean end, the log
has no tracebacks, the process dies by the signal, and a second signal forces it."""
from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from serve_helpers import free_port

BODY = {"prompt": "shutdown", "max_tokens": 3000, "temperature": 0, "ignore_eos": True}


class Clients:
    """Streaming and non-streaming requests (alternating), each recording how it ended."""

    def __init__(self, url: str, n: int = 4) -> None:
        self.url, self.ends = url, []
        self.threads = [threading.Thread(target=self._run, args=(i % 2 == 0,)) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, stream: bool) -> None:
        r = httpx.post(self.url + "/v1/completions", json=dict(BODY, stream=stream), timeout=60)
        self.ends.append((stream, r.status_code, r.headers.get("content-type", ""), r.headers.get("retry-after"),
                          r.text))

    def join(self) -> list:
        for t in self.threads:
            t.join(60)
        return self.ends


def start_server(grace_s: float):
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "ds4ref.serve", "--port", str(port), "--max-concurrency", "4",
                          "--shutdown-timeout", str(grace_s)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: httpx.get(url + "/health", timeout=1).status_code == 200, p)
    return p, url


def wait_for(cond, p, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.poll() is not None:
            pytest.fail(f"server exited early: {p.communicate()[1]}")
        try:
            if cond():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    pytest.fail("timed out")


def running(url: str, key: str = "running") -> int:
    return httpx.get(url + "/health", timeout=1).json()[key]


def assert_retryable(status, ctype, retry_after, text) -> None:
    """503, Retry-After and OpenAI's error shape: a client may retry the request."""
    assert status == 503 and ctype == "application/json" and retry_after == "1", (status, retry_after, text)
    error = json.loads(text)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "server_shutting_down" and error["type"] == "server_error"
    assert error["message"] == "generation aborted: server shutting down"


def assert_clean_ends(running_ends: list, queued_ends: list) -> None:
    """Streams that had started end with an error event and [DONE]; every other request
    (non-streaming, or a stream still queued) gets a retryable 503."""
    assert len(running_ends) == 4 and len(queued_ends) == 2
    for stream, status, ctype, retry_after, text in running_ends:
        if stream:
            assert status == 200, (status, text)
            blocks = [b[6:] for b in text.split("\n\n") if b.startswith("data: ")]
            assert blocks[-1] == "[DONE]", text[-300:]
            error = json.loads(blocks[-2])["error"]
            assert error["message"] == "generation aborted: server shutting down"
            assert error["code"] == "server_shutting_down"
        else:
            assert_retryable(status, ctype, retry_after, text)
    assert sorted(stream for stream, *_ in queued_ends) == [False, True]
    for _, *end in queued_ends:
        assert_retryable(*end)


@contextlib.contextmanager
def four_requests_running(grace_s: float):
    """A server with four requests in flight and two queued for a lane; killed on the way
    out if it is still alive."""
    p, url = start_server(grace_s=grace_s)
    try:
        clients = Clients(url)
        wait_for(lambda: running(url) == 4, p)
        queued = Clients(url, 2)
        wait_for(lambda: running(url, "waiting") == 2, p)
        yield p, clients, queued
    finally:
        if p.poll() is None:
            p.kill()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_under_load_ends_every_request_cleanly(sig):
    with four_requests_running(grace_s=0.5) as (p, clients, queued):
        p.send_signal(sig)
        p.wait(timeout=30)
        ends, queued_ends = clients.join(), queued.join()
    err = p.stderr.read()
    assert p.returncode == -sig
    assert_clean_ends(ends, queued_ends)
    assert "Traceback" not in err and "CancelledError" not in err, err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_forces_the_exit(sig):
    """A grace period no test outlasts: after the first signal the server waits for its
    requests, so only the second can end it before they finish, and then every request ends
    as the shutdown ends it (aborted streams, 503s), none with its 3000 tokens."""
    with four_requests_running(grace_s=3600) as (p, clients, queued):
        p.send_signal(sig)
        time.sleep(0.5)
        assert p.poll() is None  # within its grace period: the requests could still finish
        p.send_signal(sig)
        p.wait(timeout=120)  # a hang guard: without the forced exit it would be the hour's grace
        ends, queued_ends = clients.join(), queued.join()
    assert p.returncode == -sig
    assert_clean_ends(ends, queued_ends)
    assert "Traceback" not in p.stderr.read()
