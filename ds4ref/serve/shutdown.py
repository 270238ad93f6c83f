"""Shutdown on SIGTERM/SIGINT: every open request gets a clean end, then the process
dies by the signal it received.

uvicorn alone stops accepting, waits up to its graceful timeout, then *cancels* the
handler tasks, and only afterwards runs the lifespan shutdown that stops the runner.
Cancelled handlers give a plain-text 500 or a stream cut mid-body, and log one
CancelledError traceback each. Here the runner is stopped first, when the grace
period ends: every stream it feeds is aborted, so each handler ends by itself with
an OpenAI-shaped error (a JSON body, or an error event plus [DONE]). uvicorn's own
cancellation comes FLUSH_S later and only meets handlers whose client stopped
reading.

Signals: the first SIGTERM or SIGINT starts this; a second of either forces the
exit (uvicorn forces only on a second SIGINT). After the server has stopped, the
process re-raises the first signal with its default action, so the exit status is
the signal's for both (uvicorn's own re-raise leaves SIGINT at status 0).
"""
from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import threading

import uvicorn

from .connections import HEADER_TIMEOUT_S, header_deadline_protocol

SIGNALS = (signal.SIGINT, signal.SIGTERM)
FLUSH_S = 2.0        # after the runner is stopped: time for handlers to write their last bytes
FORCED_FLUSH_S = 0.5  # the same after a second signal
POLL_S = 0.05


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, runner, grace_s: float) -> None:
        config.timeout_graceful_shutdown = grace_s + FLUSH_S
        super().__init__(config)
        self.runner, self.grace_s = runner, grace_s
        self.signals: list[int] = []  # received, in order

    def handle_exit(self, sig: int, frame) -> None:
        # Runs between bytecodes of the main thread: only set flags (the runner's
        # locks may be held by the very code it interrupted).
        self.signals.append(sig)
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's, without its re-raise (serve() does that once the loop is gone)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets=None) -> None:
        stopper = asyncio.ensure_future(self._stop_runner_after_grace())
        try:
            await super().shutdown(sockets)
            if self.force_exit:  # uvicorn skipped the waits and the lifespan shutdown
                await stopper  # a forced exit still aborts every stream first
                await self._wait_for_handlers(FORCED_FLUSH_S)
                # left for asyncio.run to cancel, the lifespan task would log a CancelledError
                await self.lifespan.shutdown()
        finally:
            stopper.cancel()

    async def _stop_runner_after_grace(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.grace_s
        while self.server_state.tasks and not self.force_exit and loop.time() < deadline:
            await asyncio.sleep(POLL_S)
        self.runner.stop(timeout=0)  # the runner thread aborts every stream as it exits

    async def _wait_for_handlers(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.server_state.tasks and loop.time() < deadline:
            await asyncio.sleep(POLL_S)


def serve(app, runner, sock, log_level: str, grace_s: float, header_timeout: float = HEADER_TIMEOUT_S) -> None:
    """Serve on the bound socket until SIGTERM/SIGINT; then end every request cleanly and die
    by that signal. A connection whose request headers take over header_timeout s is closed."""
    config = uvicorn.Config(app, log_level=log_level, http=header_deadline_protocol(header_timeout))
    server = GracefulServer(config, runner, grace_s)
    server.run(sockets=[sock])
    if server.signals:
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(server.signals[0], signal.SIG_DFL)
        signal.raise_signal(server.signals[0])
