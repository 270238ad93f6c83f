"""SIGTERM/SIGINT under load (issue H.10): every client gets a clean end, the log
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
    """Two streaming and two non-streaming requests, each recording how it ended."""

    def __init__(self, url: str) -> None:
        self.url, self.ends = url, []
        self.threads = [threading.Thread(target=self._run, args=(i % 2 == 0,)) for i in range(4)]
        for t in self.threads:
            t.start()

    def _run(self, stream: bool) -> None:
        r = httpx.post(self.url + "/v1/completions", json=dict(BODY, stream=stream), timeout=60)
        self.ends.append((stream, r.status_code, r.headers.get("content-type", ""), r.text))

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


def running(url: str) -> int:
    return httpx.get(url + "/health", timeout=1).json()["running"]


def assert_clean_ends(ends: list) -> None:
    assert len(ends) == 4
    for stream, status, ctype, text in ends:
        if stream:
            blocks = [b[6:] for b in text.split("\n\n") if b.startswith("data: ")]
            assert blocks[-1] == "[DONE]", text[-300:]
            assert json.loads(blocks[-2])["error"]["message"] == "generation aborted: server shutting down"
        else:
            assert status == 500 and ctype == "application/json", (status, text)
            assert json.loads(text)["error"]["code"] == "aborted"


@contextlib.contextmanager
def four_requests_running(grace_s: float):
    """A server with four requests in flight; killed on the way out if it is still alive."""
    p, url = start_server(grace_s=grace_s)
    try:
        clients = Clients(url)
        wait_for(lambda: running(url) == 4, p)
        yield p, clients
    finally:
        if p.poll() is None:
            p.kill()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_under_load_ends_every_request_cleanly(sig):
    with four_requests_running(grace_s=0.5) as (p, clients):
        p.send_signal(sig)
        p.wait(timeout=30)
        ends = clients.join()
    err = p.stderr.read()
    assert p.returncode == -sig
    assert_clean_ends(ends)
    assert "Traceback" not in err and "CancelledError" not in err, err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_forces_the_exit(sig):
    with four_requests_running(grace_s=60) as (p, clients):
        p.send_signal(sig)
        time.sleep(0.5)
        assert p.poll() is None  # within its grace period: the requests could still finish
        t0 = time.monotonic()
        p.send_signal(sig)
        p.wait(timeout=30)
        forced_in = time.monotonic() - t0
        ends = clients.join()
    assert p.returncode == -sig
    assert forced_in < 10  # not the 60 s grace period
    assert_clean_ends(ends)
    assert "Traceback" not in p.stderr.read()
