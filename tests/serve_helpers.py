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
    def __init__(self, state=None, state_overrides: dict | None = None, log_level: str = "warning",
                 **state_kwargs) -> None:
        self.state = state if state is not None else build_state(**state_kwargs)
        for name, value in (state_overrides or {}).items():  # e.g. a small body limit
            setattr(self.state, name, value)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(create_app(self.state), host="127.0.0.1", port=self.port,
                                log_level=log_level, timeout_graceful_shutdown=2)
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


def scripted_state(next_token, max_concurrency: int = 2, max_context: int = 1024):
    """A server over the tiny model's tokenizer whose 'model' emits what `next_token(history)`
    says: a forced token stream through the real scheduler, runner and HTTP layers."""
    import numpy as np

    import ds4ref
    from ds4ref.backend import StepResult
    from ds4ref.scheduler.hash_backend import HashBackend
    from ds4ref.scheduler.scheduler import Scheduler
    from ds4ref.scheduler.seq_engine import SeqEngine
    from ds4ref.serve.app import ServerState
    from ds4ref.serve.metrics import Metrics
    from ds4ref.serve.runner import Runner

    class Scripted(HashBackend):
        """HashBackend's paging and protocol checks, the script's logits: each row's from the
        history through it, read through the slot's pages (cached ones included)."""
        def step(self, plan):
            super().step(plan)  # writes the rows, checks the protocol
            logits, argmax = [], []
            for r in plan.rows():
                lg = self.scripted(self.history(r.slot)[:r.position + 1]) if r.want_logits or r.emit else None
                logits.append(lg if r.want_logits else None)
                argmax.append(int(np.argmax(lg)) if r.emit else -1)
            return StepResult(logits, np.asarray(argmax, np.int32))

        def scripted(self, history):
            out = np.zeros(self.vocab_size, np.float32)
            out[next_token([int(t) for t in history])] = 100.0  # certain even at temperature 1
            return out

    model = ds4ref.load()
    engine = SeqEngine(Scripted(model.config.vocab_size), model.config, max_concurrency=max_concurrency,
                       max_context=max_context)
    runner = Runner(Scheduler(engine), metrics=Metrics())
    return ServerState(runner=runner, tokenizer=model.tokenizer, model_name="ds4-tiny", max_context=max_context,
                       vocab_size=model.config.vocab_size)


def after_prompt(tokenizer, script):
    """next_token for scripted_state: `script` (token ids) after the last <｜Assistant｜> and the
    think token that follows it, then end-of-sentence."""
    assistant = tokenizer.token_to_id("<｜Assistant｜>")

    def next_token(history):
        if assistant not in history:  # a prompt row that emits nothing
            return tokenizer.eos_id
        start = len(history) - 1 - history[::-1].index(assistant) + 2
        k = len(history) - start
        return script[k] if k < len(script) else tokenizer.eos_id
    return next_token
