"""--header-timeout: a slowloris that trickles its request headers is cut at the deadline,
and other clients are served meanwhile (a real server on 127.0.0.1, started by the CLI)."""
from __future__ import annotations

import re
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


# The CLI's main, with ds4ref.serve's own log at debug (it names each connection the deadline
# closes) and everything else at warning, as --log-level warning would have it.
SERVE = ("import logging, sys; logging.basicConfig(level=logging.WARNING); "
         "logging.getLogger('ds4ref.serve').setLevel(logging.DEBUG); "
         "from ds4ref.serve.__main__ import main; sys.exit(main(sys.argv[1:]))")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("header-timeout") / "server.log"
    with open(log, "w") as out:
        p = subprocess.Popen([sys.executable, "-c", SERVE, "--port", str(port), "--max-concurrency", "1",
                              "--header-timeout", str(TIMEOUT_S), "--log-level", "warning"],
                             stdout=out, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if p.poll() is not None:
                pytest.fail(f"server exited: {log.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        else:
            pytest.fail("server did not come up")
        yield port, url, log
    finally:
        p.kill()
        p.wait(10)


def cut_clients(log) -> list[int]:
    """Client ports of the connections the header deadline closed, from the server's log."""
    return [int(m) for m in re.findall(r"127\.0\.0\.1:(\d+): request headers incomplete after", log.read_text())]


def trickle_until_closed(sock: socket.socket, first: bytes, limit_s: float) -> bool:
    """Send `first`, then one header byte every TRICKLE_S, never ending the headers, until the
    server closes the connection (True) or limit_s has passed (False)."""
    sock.sendall(first)
    sock.settimeout(TRICKLE_S)
    filler = b"X-Slow: " + b"a" * 10_000
    for i in range(int(limit_s / TRICKLE_S)):
        try:
            if sock.recv(4096) == b"":
                return True
        except socket.timeout:
            pass
        except ConnectionResetError:
            return True
        try:
            sock.sendall(filler[i:i + 1])
        except (BrokenPipeError, ConnectionResetError):
            return True
    return False


@pytest.mark.parametrize("first", [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", b"GET /hea"],
                         ids=["headers", "request-line"])
def test_a_slowloris_is_cut_at_the_header_deadline_while_others_are_served(server, first):
    """The server, not the client, closes the trickling connection, its log names that client
    and no other as cut by the header deadline, and another client's requests are answered."""
    port, url, log = server
    answers = []

    def other_client() -> None:
        with httpx.Client() as other:
            r = other.get(url + "/health", timeout=5)
            answers.append(r.status_code)
            r = other.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 0},
                           timeout=120)
            answers.append((r.status_code, r.json()["usage"]["completion_tokens"]))

    before = cut_clients(log)
    with socket.create_connection(("127.0.0.1", port)) as slow:
        slow_port = slow.getsockname()[1]
        other = threading.Thread(target=other_client)
        other.start()
        # a bound on the test, not on the server: without a deadline the trickle goes on
        closed_by_server = trickle_until_closed(slow, first, limit_s=30 * TIMEOUT_S)
        other.join(120)
    assert closed_by_server
    assert answers == [200, (200, 2)]
    cut = cut_clients(log)[len(before):]
    assert cut == [slow_port], (cut, slow_port)  # that connection, and no other


def test_a_keep_alive_connection_gets_a_fresh_deadline_per_request(server):
    """A client that sends whole requests slowly but within the bound is never cut."""
    _, url, log = server
    before = cut_clients(log)
    with httpx.Client() as c:
        for _ in range(3):
            assert c.get(url + "/health", timeout=5).status_code == 200
            time.sleep(TIMEOUT_S * 0.6)  # idle gaps that add up past the deadline
        assert c.get(url + "/health", timeout=5).status_code == 200
    assert cut_clients(log) == before
