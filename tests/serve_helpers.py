"""A real ds4ref server on a loopback port, run by uvicorn in a thread."""
from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
import uvicorn

from ds4ref.serve import build_state, create_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, state_overrides: dict | None = None, **state_kwargs) -> None:
        self.state = build_state(**state_kwargs)
        for name, value in (state_overrides or {}).items():  # e.g. a small body limit
            setattr(self.state, name, value)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(create_app(self.state), host="127.0.0.1", port=self.port,
                                log_level="warning", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            time.sleep(0.05)
        raise RuntimeError("server did not come up")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    @property
    def runner(self):
        return self.state.runner

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """True once no request is running or waiting."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.runner.stats
            if s.get("running", 0) == 0 and s.get("waiting", 0) == 0 and not self.runner.scheduler.has_work():
                return True
            time.sleep(0.02)
        return False
