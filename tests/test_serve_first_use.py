"""What a new user trying the server runs into: models by id, API keys, CORS, metrics, the
bench client, a busy port, --help, the GPU skip, and error messages without internals."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import httpx
import openai
import pytest

from ds4ref.serve import build_state
from serve_helpers import LiveServer

KEY = "sk-test-123"


@pytest.fixture(scope="module")
def locked():
    state = build_state(max_concurrency=2, max_context=256, api_key=KEY,
                        allowed_origins=("https://app.example",))
    with LiveServer(state=state) as s:
        yield s


def auth(key=KEY):
    return {"Authorization": f"Bearer {key}"}


def metric(server, line_start: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(line_start))


def test_api_key_is_required_on_the_api_with_an_openai_shaped_401(locked):
    for headers in ({}, auth("wrong")):
        r = httpx.get(locked.url + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(locked.url + "/health").status_code == 200  # probes need no key
    client = openai.OpenAI(base_url=locked.url + "/v1", api_key=KEY)
    assert client.models.retrieve("ds4-tiny").id == "ds4-tiny"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=locked.url + "/v1", api_key="nope").models.list()


def test_model_by_id(locked):
    r = httpx.get(locked.url + "/v1/models/ds4-tiny", headers=auth())
    assert r.status_code == 200 and r.json()["id"] == "ds4-tiny" and r.json()["object"] == "model"
    r = httpx.get(locked.url + "/v1/models/gpt-4", headers=auth())
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_cors_for_the_allowed_origin_only(locked):
    pre = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(locked.url + "/v1/chat/completions", headers=pre)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    r = httpx.options(locked.url + "/v1/chat/completions", headers=dict(pre, Origin="https://evil.example"))
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(locked.url + "/v1/models", headers=dict(auth(), Origin="https://app.example"))
    assert r.headers["access-control-allow-origin"] == "https://app.example"


def test_metrics_count_stop_strings_as_stop_and_errors_by_status(locked):
    full = httpx.post(locked.url + "/v1/completions", headers=auth(), timeout=60, json={
        "prompt": "Metrics", "max_tokens": 12, "temperature": 0, "ignore_eos": True}).json()["choices"][0]["text"]
    stop_before = metric(locked, 'ds4_requests_finished_total{reason="stop"}')
    r = httpx.post(locked.url + "/v1/completions", headers=auth(), timeout=60, json={
        "prompt": "Metrics", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stop": [full[3:5]]})
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert locked.wait_idle(5)
    assert metric(locked, 'ds4_requests_finished_total{reason="stop"}') == stop_before + 1
    e400, e401 = (metric(locked, f'ds4_http_errors_total{{status="{s}"}}') for s in (400, 401))
    httpx.post(locked.url + "/v1/completions", headers=auth(), json={"prompt": "x", "temperature": "hot"})
    httpx.get(locked.url + "/v1/models")
    assert metric(locked, 'ds4_http_errors_total{status="400"}') == e400 + 1
    assert metric(locked, 'ds4_http_errors_total{status="401"}') == e401 + 1


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": "x", "n": 2}, "n", "only n=1 is supported"),
    ({"prompt": "x", "echo": True}, "echo", "echo is not supported"),
    ({"messages": [{"role": "user", "content": "x"}], "audio": {"voice": "x"}}, "audio", "audio is not supported"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"messages": [{"role": "user", "content": "x"}], "store": True}, "store", "store is not supported"),
    ({"prompt": [5] * 300, "max_tokens": 1}, "prompt", "300 tokens; the context limit is 256 tokens"),
    ({"prompt": [5] * 255, "max_tokens": 2}, "max_tokens", "the prompt's 255 tokens"),
    ({"prompt": [5], "max_tokens": 256}, "max_tokens", "the prompt's 1 token exceeds"),
])
def test_errors_name_the_field_without_internals_and_with_right_plurals(locked, body, param, words):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(locked.url + path, headers=auth(), json=body, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and words in err["message"], err
    assert "Value error" not in err["message"] and "TextInputSequence" not in err["message"]


def test_lone_surrogate_prompt_is_a_plain_400(locked):
    raw = b'{"prompt": "a\\ud800b", "max_tokens": 2}'
    r = httpx.post(locked.url + "/v1/completions", headers=dict(auth(), **{"Content-Type": "application/json"}),
                   content=raw)
    err = r.json()["error"]
    assert r.status_code == 400 and "lone surrogate" in err["message"] and "TextInputSequence" not in err["message"]


def test_bench_accepts_the_openai_base_url(locked, capsys, monkeypatch):
    from ds4ref.cli import bench

    assert bench.base_url("http://h:1/v1/") == bench.base_url("http://h:1") == "http://h:1"
    with LiveServer(max_concurrency=2, max_context=256) as s:
        code = bench.main(["--url", s.url + "/v1", "--concurrency", "1", "--max-tokens", "3", "--warmup-tokens",
                           "0", "--json", "--no-progress"])
    assert code == 0 and '"concurrency": 1' in capsys.readouterr().out


def test_busy_port_is_one_line_and_exit_2_without_a_banner():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run([sys.executable, "-m", "ds4ref.serve", "--port", str(port)], capture_output=True,
                             text=True, timeout=120)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.strip().splitlines() == [f"ds4ref.serve: error: address 127.0.0.1:{port} is already in use"]


@pytest.mark.parametrize("module, default", [("ds4ref.serve", "(default: 8000)"),
                                             ("ds4ref.cli.generate", "(default: 32)"),
                                             ("ds4ref.cli.bench", "(default: http://127.0.0.1:8000)"),
                                             ("ds4ref.convert", "(default: f32)"),
                                             ("ds4ref.gguf.tiny", "(default: 0)")])
def test_every_cli_help_shows_defaults_and_its_python_m_name(module, default):
    run = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith(f"usage: python -m {module} ")
    assert default in " ".join(run.stdout.split())


def test_hip_golden_run_without_a_gpu_skips_with_the_reason():
    pytest.importorskip("ds4ref.hip.runtime")
    from ds4ref.hip.runtime import NoGpuError, get_runtime
    try:
        get_runtime()
        pytest.skip("a GPU is available here")
    except NoGpuError:
        pass
    env = dict(os.environ, DS4REF_BACKEND="hip")
    run = subprocess.run([sys.executable, "-m", "pytest", "-m", "golden", "-p", "no:xdist", "-q",
                          "tests/test_golden.py"], capture_output=True, text=True, timeout=300, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert run.returncode == 0, run.stdout[-2000:]
    assert "no GPU runtime (details at the end of the run)" in run.stdout
    # the run's own summary line, not the skip details (they quote each runtime's failure to load)
    summary = [line for line in run.stdout.splitlines() if re.match(r"\d+ (passed|skipped)", line.strip())]
    assert summary and not re.search(r"\d+ (failed|errors?)\b", summary[-1]), run.stdout[-2000:]
    assert re.search(r"\d+ skipped", summary[-1])

