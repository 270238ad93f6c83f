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


def stand_in_hip_state(logits_of, max_concurrency: int = 2, max_context: int = 1024):
    """A server whose backend is the HIP backend's host side (HipBackend: lanes, buckets, the
    head rows' argmax and logits fetched for the right rows) on the recorded runtime of
    tests/test_hip_program.py, which checks every launch and runs nothing. What the device
    would compute comes from a stand-in: an emitting row's logits are `logits_of(token, position)`
    of the token it feeds, and its argmax the kernel's (launch.NON_FINITE_ROW for a row holding a
    NaN or an infinity)."""
    import numpy as np

    import ds4ref
    from ds4ref.hip import launch as K
    from ds4ref.hip.backend import HipBackend
    from ds4ref.hip.buffers import DeviceBuffer
    from ds4ref.hip.device_state import LANE_FIELDS
    from ds4ref.scheduler.scheduler import Scheduler
    from ds4ref.scheduler.seq_engine import SeqEngine
    from ds4ref.serve.app import ServerState
    from ds4ref.serve.metrics import Metrics
    from ds4ref.serve.runner import Runner
    from test_hip_program import RecordingRuntime

    token_at, position_at, head_source = (LANE_FIELDS.index(f) for f in ("tok", "pos", "hsrc"))

    class StandInDevice(RecordingRuntime):
        def __init__(self):
            super().__init__()
            self.next_address = 1 << 20  # distinct addresses, so a view tells which buffer it is of
            self.backend, self.lanes = None, None

        def malloc(self, n):
            self.allocated += n
            buf = DeviceBuffer(self, self.next_address, n)
            self.next_address += -(-n // 256) * 256 + 256
            return buf

        def free(self, buf):
            pass

        def h2d(self, buf, arr):
            super().h2d(buf, arr)
            if self.backend is not None and buf is self.backend.state.lanes:
                self.lanes = np.array(arr).reshape(-1, self.backend.state.n_lanes)

        def head_logits(self, e: int):
            lane = self.lanes[head_source, e]
            return logits_of(int(self.lanes[token_at, lane]), int(self.lanes[position_at, lane]))

        def download(self, buf, shape, dtype):
            b = self.backend
            if b is None:
                return super().download(buf, shape, dtype)
            if buf is b._ws["amax"]:
                out = np.zeros(shape, np.int32)
                for e in range(int(np.sum(self.lanes[head_source] >= 0))):
                    lg = self.head_logits(e)
                    out[e] = int(np.argmax(lg)) if np.isfinite(lg).all() else K.NON_FINITE_ROW
                return out
            logits, V = b._ws["logits"], b.cfg.vocab_size
            if logits.ptr <= buf.ptr < logits.ptr + logits.nbytes:
                return self.head_logits((buf.ptr - logits.ptr) // (4 * V)).astype(dtype).reshape(shape)
            return super().download(buf, shape, dtype)

    model = ds4ref.load()
    rt = StandInDevice()
    backend = HipBackend(model.config, model.weights, model.numerics, model.tables, runtime=rt)
    engine = SeqEngine(backend, model.config, max_concurrency=max_concurrency, max_context=max_context)
    rt.backend = backend  # configured: its lane and head buffers are the ones the passes use
    runner = Runner(Scheduler(engine), metrics=Metrics())
    return ServerState(runner=runner, tokenizer=model.tokenizer, model_name="ds4-tiny", max_context=max_context,
                       vocab_size=model.config.vocab_size)
