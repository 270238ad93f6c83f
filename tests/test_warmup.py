"""First use after an install: the server compiles every Numba kernel a request can reach before
it listens, printing a line per kernel, and no request then compiles (or loads) another."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import json

import httpx
import numba
import numpy as np

from ds4ref.reference.warmup import report_compiles, stop_reporting
from serve_helpers import free_port


def test_every_compile_is_reported_with_its_time():
    @numba.njit
    def twice(x):
        return 2 * x

    lines = []
    report = report_compiles(lines.append)
    try:
        assert twice(np.float32(1.5)) == 3.0
        twice(np.float32(2.0))  # compiled already: no line
    finally:
        stop_reporting(report)
    assert lines[0].startswith("numba: compiling the NumPy reference's kernels")
    assert len(lines) == 2 and lines[1].startswith("numba: compiled test_warmup.twice in ")
    assert [name for name, _ in report.compiled] == ["test_warmup.twice"]


def test_a_cold_start_compiles_before_listening_and_the_first_request_compiles_nothing(tmp_path):
    port = free_port()
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))  # an empty cache: a fresh install
    # passes of at most 16 rows: the threaded kernels are out of any request's reach, so neither the
    # warm-up nor the request compiles them (test_after_the_warm_up... covers them, from the cache)
    p = subprocess.Popen([sys.executable, "-m", "ds4ref.serve", "--port", str(port), "--max-concurrency", "1",
                          "--max-batched-rows", "16", "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env)
    try:
        lines = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = p.stdout.readline()
            assert line, f"server exited: {p.communicate()[1][-2000:]}"
            lines.append(line.rstrip("\n"))
            if "listening on" in line:
                break
        compiled = [ln for ln in lines if ln.startswith("numba: compiled ")]
        assert lines[0].startswith("numba: compiling the NumPy reference's kernels"), lines
        assert len(compiled) >= 5 and "canon._attention_rows" in " ".join(compiled), lines
        assert lines[len(compiled) + 1].startswith(f"numba: {len(compiled)} kernels ready in "), lines
        while time.monotonic() < deadline:  # the banner comes just before uvicorn accepts
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        # 48 positions: the tiny model's indexer (top_k 8) picks from position 35, in a prompt chunk and decoding
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                       json={"prompt": [2 + i for i in range(44)], "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        p.terminate()
        out, _ = p.communicate(timeout=30)
    assert "numba: compiled" not in out  # the warm-up covered the first request, its indexer included


# A fresh interpreter (a worker of this suite has compiled the kernels already), the tiny model's
# server state with speculation on, its warm-up, then requests over the app: a prompt whose first
# pass holds PARALLEL_ROWS rows past the indexer's threshold (positions 35.. for top_k 8), its
# decode rows and drafts, and a JSON-mode chat request. A Numba dispatcher gains a signature at
# each compile or load from the cache, so their counts before and after the requests say whether
# any request reached a kernel the warm-up did not.
NO_NEW_SIGNATURES = r"""
import json, sys
from numba.core.dispatcher import Dispatcher
from starlette.testclient import TestClient
from ds4ref.numerics.canon import PARALLEL_ROWS
from ds4ref.serve import build_state, create_app
from ds4ref.serve.__main__ import _warm_up

def signatures():
    return {f"{name}.{k}": len(v.signatures) for name, mod in list(sys.modules.items()) if name.startswith("ds4ref")
            for k, v in vars(mod).items() if isinstance(v, Dispatcher)}

state = build_state(None, "numpy", max_concurrency=2, speculative_tokens=2)
engine = state.runner.scheduler.engine
top_k = engine.config.indexer_top_k
_warm_up(state, "numpy")
before, ll_tokenizer = signatures(), getattr(state.tokenizer, "_llguidance", None)
prompt = [2 + i % 100 for i in range(4 * (top_k + 1) - 1 + PARALLEL_ROWS + 8)]
with TestClient(create_app(state)) as client:
    long = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0}).json()
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 6, "temperature": 0, "response_format": {"type": "json_object"}}).json()
after = signatures()
print(json.dumps({"new": {k: [before.get(k, 0), n] for k, n in after.items() if n != before.get(k, 0)},
                  "warmed": sorted(k for k, n in before.items() if n),
                  "same_ll_tokenizer": state.tokenizer._llguidance is ll_tokenizer is not None,
                  "usage": [long["usage"], chat["usage"]], "spec_rounds": engine.spec_totals["spec_rounds"],
                  "one_pass": state.runner.scheduler.max_batched_rows >= len(prompt)}))
"""


def test_after_the_warm_up_no_request_reaches_a_kernel_it_did_not():
    p = subprocess.run([sys.executable, "-c", NO_NEW_SIGNATURES], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.splitlines()[-1])
    assert out["new"] == {}, out["new"]  # e.g. {"ds4ref.numerics.canon._indexer_scores": [0, 1]} without it
    # what the requests reach: the indexer in a threaded pass and in decode rows, drafts, a grammar
    assert out["one_pass"]  # the long prompt is one pass, PARALLEL_ROWS + 8 of its rows picking
    assert {"ds4ref.numerics.canon._indexer_scores", "ds4ref.numerics.canon._indexer_scores_par",
            "ds4ref.numerics.canon._matmul_par"} <= set(out["warmed"]), out["warmed"]
    assert out["usage"][0]["completion_tokens"] == 8 and out["usage"][1]["completion_tokens"] > 0
    assert out["spec_rounds"] > 0  # speculative rounds ran: the drafts' MTP passes were reached
    assert out["same_ll_tokenizer"]  # llguidance's tokenizer was built by the warm-up, not by the request
