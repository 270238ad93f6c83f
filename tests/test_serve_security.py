"""Nothing secret leaks: a wrong or malformed Authorization header is answered without quoting
the configured key or the one sent, in the response or in the logs; at the default log level
(info) no prompt text reaches the logs, whatever the request does."""
from __future__ import annotations

import contextlib
import json
import logging

import httpx
import pytest

from ds4ref.serve import build_state
from serve_helpers import LiveServer

KEY = "sk-configured-5f1e2d3c4b5a69788796a5b4"
WRONG = "sk-wrong-a1b2c3d4e5f60718293a4b5c6d7e"
PROMPT = "zebra-quokka-4417 my private prompt"
LOGGERS = ("", "uvicorn", "uvicorn.error", "uvicorn.access", "ds4ref")  # uvicorn's do not propagate


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))  # with any traceback

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def of(self, logger: str) -> str:
        return "\n".join(line for line in self.lines if line.startswith(logger + " "))


@contextlib.contextmanager
def server_logs(**state_kwargs):
    """A live server at uvicorn's and ds4ref's default level (info), every log line captured."""
    handler = Captured()
    root = logging.getLogger()
    level = root.level
    with LiveServer(state=build_state(max_concurrency=2, max_context=256, **state_kwargs),
                    log_level="info") as s:
        for name in LOGGERS:  # after uvicorn configured its loggers
            logging.getLogger(name).addHandler(handler)
        root.setLevel(logging.INFO)
        try:
            yield s, handler
        finally:
            s.wait_idle()
            for name in LOGGERS:
                logging.getLogger(name).removeHandler(handler)
            root.setLevel(level)


@pytest.mark.parametrize("authorization", [
    f"Bearer {WRONG}".encode(),
    f"Bearer {KEY}x".encode(),
    f"bearer {KEY}".encode(),           # the key itself, under a scheme spelled otherwise
    KEY.encode(),                       # no scheme
    f"Basic {WRONG}".encode(),
    f"Bearer  {WRONG}".encode(),
    b"Bearer \xff\xfe" + WRONG.encode(),  # not UTF-8
    b"",
])
def test_a_refused_key_is_not_echoed(authorization):
    with server_logs(api_key=KEY) as (s, logs):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize")):
            r = httpx.request(method, s.url + path, headers=[(b"Authorization", authorization)],
                              json={"messages": [{"role": "user", "content": "x"}]}, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            answer = r.text + repr(r.headers)
            assert KEY not in answer and WRONG not in answer
    assert '"GET /v1/models HTTP/1.1" 401' in logs.of("uvicorn.access")  # the server's log saw them
    assert KEY not in logs.text and WRONG not in logs.text


def test_logs_at_the_default_level_carry_no_prompt_text():
    with server_logs() as (s, logs):
        chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3}
        bodies = [("/v1/completions", {"prompt": PROMPT, "max_tokens": 3}),
                  ("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "stream": True}),
                  ("/v1/chat/completions", chat),
                  ("/v1/chat/completions", dict(chat, stream=True)),
                  ("/v1/chat/completions", dict(chat, temperature="hot")),      # refused by validation
                  ("/v1/completions", {"prompt": PROMPT + "\ud800"}),             # untokenizable
                  ("/v1/completions", {"prompt": PROMPT * 40, "max_tokens": 3}),  # over the context
                  ("/tokenize", {"prompt": PROMPT}),
                  ("/tokenize", chat)]
        for path, body in bodies:
            # json.dumps escapes the lone surrogate, which httpx's own encoder refuses
            r = httpx.post(s.url + path, content=json.dumps(body), headers={"Content-Type": "application/json"},
                           timeout=60)
            assert r.status_code in (200, 400), r.text
    access = logs.of("uvicorn.access")
    assert '"POST /v1/chat/completions HTTP/1.1" 400' in access and '"POST /tokenize HTTP/1.1" 200' in access
    assert "zebra-quokka" not in logs.text
