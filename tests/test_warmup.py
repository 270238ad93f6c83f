"""First use after an install: the server compiles the decode path's Numba kernels before it
listens, printing a line per kernel, and a first short request then compiles nothing more."""
from __future__ import annotations

import os
import subprocess
import sys
import time

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
    p = subprocess.Popen([sys.executable, "-m", "ds4ref.serve", "--port", str(port), "--max-concurrency", "1",
                          "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
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
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                       json={"prompt": "hello", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        p.terminate()
        out, _ = p.communicate(timeout=30)
    assert "numba: compiled" not in out  # the warm-up covered the first short request
