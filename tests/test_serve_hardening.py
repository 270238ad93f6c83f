"""Hostile requests (issue H): chunked bodies over the cap, bodies that never arrive,
stop strings that would starve the loop, and failures inside a generation."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from ds4ref.serve.protocol import MAX_STOP, MAX_STOP_CHARS
from serve_helpers import LiveServer

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    with LiveServer(max_concurrency=16, max_context=512) as s:
        yield s


# ---- 2. long stop strings ---------------------------------------------------------------------------

def test_stop_strings_over_the_total_limit_are_400(server):
    """The issue's request: 16 stop strings of 50,000 characters."""
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   json=dict(GREEDY, prompt="x", max_tokens=16, stop=["z" * 50_000] * 16))
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "stop" and str(MAX_STOP_CHARS) in err["message"]


def test_health_answers_within_100ms_while_long_stop_strings_run(server):
    """Eight requests (streamed and not) with stop strings at the limit, each never
    matching: /health must still answer at once, and the requests finish."""
    width = MAX_STOP_CHARS // MAX_STOP
    stops = ["\u00a7" * (width - 1) + chr(0x41 + i) for i in range(MAX_STOP)]
    results: list = []

    def run(stream: bool) -> None:
        body = dict(GREEDY, prompt="health under load", max_tokens=150, stop=stops, stream=stream)
        results.append(httpx.post(server.url + "/v1/completions", json=body, timeout=120).status_code)

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


