"""--header-timeout: a slowloris that trickles its request headers is cut at the deadline,
and other clients are served meanwhile (a real server on 127.0.0.1, started by the CLI)."""
from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from serve_helpers import free_port

TIMEOUT_S = 1.0
TRICKLE_S = 0.1  # one header byte this often: well inside uvicorn's 5 s keep-alive timer


@pytest.fixture(scope="module")
def server():
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "ds4ref.serve", "--port", str(port), "--max-concurrency", "1",
                          "--header-timeout", str(TIMEOUT_S), "--log-level", "warning"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if p.poll() is not None:
                pytest.fail(f"server exited: {p.communicate()[1]}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        else:
            pytest.fail("server did not come up")
        yield port, url
    finally:
        p.kill()
        p.wait(10)


def trickle_until_closed(sock: socket.socket, first: bytes, limit_s: float) -> None:
    """Send `first`, then one header byte every TRICKLE_S, never ending the headers, until the
    server closes the connection or limit_s has passed."""
    sock.sendall(first)
    sock.settimeout(TRICKLE_S)
    filler = b"X-Slow: " + b"a" * 10_000
    for i in range(int(limit_s / TRICKLE_S)):
        try:
            if sock.recv(4096) == b"":
                return
        except socket.timeout:
            pass
        except ConnectionResetError:
            return
        try:
            sock.sendall(filler[i:i + 1])
        except (BrokenPipeError, ConnectionResetError):
            return


@pytest.mark.parametrize("first", [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", b"GET /hea"],
                         ids=["headers", "request-line"])
def test_a_slowloris_is_cut_at_the_header_deadline_while_others_are_served(server, first):
    port, url = server
    answers = []

    def other_client() -> None:
        with httpx.Client() as other:
            answers.append(other.get(url + "/health", timeout=5).status_code)
            r = other.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 0},
                           timeout=120)
            answers.append((r.status_code, r.json()["usage"]["completion_tokens"]))

    with socket.create_connection(("127.0.0.1", port)) as slow:
        t0 = time.monotonic()
        other = threading.Thread(target=other_client)
        other.start()
        trickle_until_closed(slow, first, limit_s=10 * TIMEOUT_S)
        closed_after = time.monotonic() - t0
        other.join(120)
    assert TIMEOUT_S * 0.9 <= closed_after <= TIMEOUT_S + 2.0, closed_after
    assert answers == [200, (200, 2)]


def test_a_keep_alive_connection_gets_a_fresh_deadline_per_request(server):
    """A client that sends whole requests slowly but within the bound is never cut."""
    _, url = server
    with httpx.Client() as c:
        for _ in range(3):
            assert c.get(url + "/health", timeout=5).status_code == 200
            time.sleep(TIMEOUT_S * 0.6)  # idle gaps that add up past the deadline
        assert c.get(url + "/health", timeout=5).status_code == 200
