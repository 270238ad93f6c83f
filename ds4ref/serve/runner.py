"""The runner thread: the only thread that touches the Scheduler.

HTTP handlers (on the asyncio loop) never call the scheduler directly. They
put submissions and cancellations in the runner's inbox; between steps the
runner applies them, steps the scheduler, and fans the events out to one
bounded `RequestStream` per request.

The runner never waits on a client. A push onto a stream is a deque append
plus a non-blocking wake-up of the loop. A stream whose consumer has fallen
`max_pending` events behind, or has left events unread for `stall_timeout`
seconds, is given up: its request is cancelled (slot freed at the next step),
the stream is told why, and a warning is logged.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Optional

from ..console import plural
from ..scheduler.request import Event, FinishEvent, Request
from ..scheduler.scheduler import CohortFailed
from .metrics import Metrics

log = logging.getLogger("ds4ref.serve")

IDLE_POLL_S = 0.25  # how often an idle runner re-checks stalls and stop


class StreamAborted(Exception):
    """The runner gave up on this stream (client too slow, or the engine failed)."""


class ServerShuttingDown(StreamAborted):
    """The runner stopped for a server shutdown: the request may be retried elsewhere."""


class RequestStream:
    """Events of one request, from the runner thread to one asyncio consumer."""

    def __init__(self, req_id: int, loop: asyncio.AbstractEventLoop, max_pending: int) -> None:
        self.req_id = req_id
        self.loop = loop
        self.max_pending = max_pending
        self._items: collections.deque[Event] = collections.deque()
        self._lock = threading.Lock()
        self._wakeup = asyncio.Event()
        self.last_take = time.monotonic()
        self.aborted: Optional[str] = None  # why the runner gave up, once it has
        self._abort_as: type[StreamAborted] = StreamAborted
        self._parked = False  # the consumer is waiting in next_events

    # ---- runner side ------------------------------------------------------
    def push(self, event: Event) -> bool:
        """Queue an event; False (and nothing queued) when the consumer is max_pending behind."""
        with self._lock:
            if len(self._items) >= self.max_pending:
                return False
            self._items.append(event)
        self._wake()
        return True

    def abort(self, reason: str, error: type[StreamAborted] = StreamAborted) -> None:
        self._abort_as = error
        self.aborted = reason
        self._wake()

    def stalled_for(self, now: float) -> float:
        """Seconds the consumer has left queued events unread. 0 when nothing is
        queued or the consumer is parked in next_events: then only a busy event
        loop is late to wake it, and that is not the client's fault."""
        with self._lock:
            return now - self.last_take if self._items and not self._parked else 0.0

    def _wake(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self._wakeup.set)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    # ---- consumer side (on the loop) -------------------------------------------
    async def next_events(self) -> list[Event]:
        """Every queued event, waiting for at least one. Raises StreamAborted."""
        while True:
            with self._lock:
                items = list(self._items)
                self._items.clear()
                self.last_take = time.monotonic()
            if items:
                return items
            if self.aborted is not None:
                raise self._abort_as(self.aborted)
            self._wakeup.clear()
            self._parked = True
            try:
                await self._wakeup.wait()
            finally:
                self._parked = False


@dataclasses.dataclass
class _Submit:
    request: Request
    done: Callable[[Optional[BaseException]], None]


class Runner:
    def __init__(self, scheduler: Any, *, max_pending: int = 1024, stall_timeout: float = 30.0,
                 metrics: Optional[Metrics] = None) -> None:
        if max_pending < 1:
            raise ValueError("max_pending must be >= 1")
        self.scheduler = scheduler
        self.max_pending = max_pending
        self.stall_timeout = stall_timeout
        self.metrics = metrics or Metrics()
        self._streams: dict[int, RequestStream] = {}
        self._inbox: list[Any] = []  # _Submit or an int req_id to cancel, in arrival order
        self._inbox_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.stats: dict = {}
        self._finish_as: dict[int, str] = {}  # req_id -> reason to count its "cancelled" finish as
        self.error: Optional[str] = None  # set if the runner thread died

    # ---- lifecycle ----------------------------------------------------------------
    def start(self) -> None:
        self._refresh_stats()
        self._thread = threading.Thread(target=self._run, name="ds4ref-runner", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- called from the event loop --------------------------------------------------
    async def submit(self, request: Request) -> RequestStream:
        """Hand a request to the scheduler; raises what Scheduler.submit raises
        (Refused, queue full). The stream exists before the request runs, so no
        event is lost."""
        loop = asyncio.get_running_loop()
        stream = RequestStream(request.req_id, loop, self.max_pending)
        accepted: asyncio.Future = loop.create_future()

        def done(exc: Optional[BaseException]) -> None:  # runs on the loop
            if accepted.done():
                return
            if exc is None:
                accepted.set_result(None)
            else:
                accepted.set_exception(exc)

        def done_threadsafe(exc: Optional[BaseException]) -> None:
            try:
                loop.call_soon_threadsafe(done, exc)
            except RuntimeError:
                pass

        if not self.alive:
            raise StreamAborted(self.error or "the runner is not running")
        with self._inbox_lock:
            self._streams[request.req_id] = stream
            self._inbox.append(_Submit(request, done_threadsafe))
        self._wake.set()
        try:
            await accepted
        except BaseException:
            self.cancel(request.req_id)
            raise
        return stream

    def cancel(self, req_id: int, count_as: str = "cancelled") -> None:
        """Cancel a request (client gone, stop string seen). Safe from any thread, never blocks.
        count_as: the finish reason the metrics record ("stop" for a stop string). A request
        ended by its own client's stop string keeps its stream until its FinishEvent, which
        carries its usage (cached tokens); an abandoned one's events are dropped at once."""
        with self._inbox_lock:
            if count_as != "cancelled":
                self._finish_as[req_id] = count_as
            else:
                self._streams.pop(req_id, None)
            self._inbox.append(req_id)
        self._wake.set()

    # ---- the runner thread ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._apply_inbox()
                if self.scheduler.has_work():
                    self._step()
                else:
                    self._wake.wait(IDLE_POLL_S)
                    self._wake.clear()
                self._drop_stalled()
                self._refresh_stats()
        except BaseException as exc:  # noqa: BLE001 - the thread must report any death
            self.error = f"runner thread died: {exc!r}"
            log.exception("runner thread died")
            self._abort_all(self.error)
        finally:
            self._abort_all("server shutting down", ServerShuttingDown)

    def _apply_inbox(self) -> None:
        with self._inbox_lock:
            inbox, self._inbox = self._inbox, []
        for item in inbox:
            if isinstance(item, _Submit):
                try:
                    self.scheduler.submit(item.request)
                except Exception as exc:  # Refused, queue full: the handler maps them to HTTP
                    with self._inbox_lock:
                        self._streams.pop(item.request.req_id, None)
                    item.done(exc)
                else:
                    item.done(None)
            else:
                self._cancel_in_scheduler(item)

    def _cancel_in_scheduler(self, req_id: int) -> None:
        try:
            self.scheduler.cancel(req_id)
        except (KeyError, ValueError, LookupError):
            pass  # already finished: nothing to free

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            events = self.scheduler.step()
        except CohortFailed as exc:
            # the scheduler already finished the failed pass's requests with "error";
            # deliver those events, the other requests go on
            log.error("scheduler step failed: %s", exc)
            self.metrics.step_failures.inc()
            events = exc.events
        except Exception as exc:  # noqa: BLE001 - one bad step must not kill the server
            log.exception("scheduler step failed")
            self.metrics.step_failures.inc()
            self._fail_running(f"engine step failed: {exc!r}")
            return
        self.metrics.step_seconds.observe(time.perf_counter() - t0)
        for ev in events:
            self._dispatch(ev)

    def _dispatch(self, ev: Event) -> None:
        with self._inbox_lock:
            stream = self._streams.get(ev.req_id)
            if stream is not None and isinstance(ev, FinishEvent):
                del self._streams[ev.req_id]
        if isinstance(ev, FinishEvent):
            with self._inbox_lock:
                reason = self._finish_as.pop(ev.req_id, ev.reason)
            self.metrics.finished.inc(reason if ev.reason == "cancelled" else ev.reason)
            log.debug("request %d finished: %s %s", ev.req_id, ev.reason, ev.message)
        else:
            self.metrics.tokens_generated.inc()
        if stream is None:
            return  # its consumer has gone; the request was or will be cancelled
        if not stream.push(ev):
            self._give_up(stream, f"client fell {plural(stream.max_pending, 'event')} behind")

    def _drop_stalled(self) -> None:
        if self.stall_timeout <= 0:
            return
        now = time.monotonic()
        with self._inbox_lock:
            streams = list(self._streams.values())
        for s in streams:
            if s.stalled_for(now) > self.stall_timeout:
                self._give_up(s, f"client read nothing for {self.stall_timeout:g} s")

    def _give_up(self, stream: RequestStream, why: str) -> None:
        log.warning("request %d cancelled: %s", stream.req_id, why)
        self.metrics.slow_client_cancels.inc()
        with self._inbox_lock:
            self._streams.pop(stream.req_id, None)
        self._cancel_in_scheduler(stream.req_id)
        stream.abort(why)

    def _fail_running(self, why: str) -> None:
        """After a failed step the engine state of every running request is suspect: end them all."""
        with self._inbox_lock:
            streams, self._streams = list(self._streams.values()), {}
        for s in streams:
            self._cancel_in_scheduler(s.req_id)
            s.abort(why)

    def _abort_all(self, why: str, error: type[StreamAborted] = StreamAborted) -> None:
        with self._inbox_lock:
            streams, self._streams = list(self._streams.values()), {}
            inbox, self._inbox = self._inbox, []
        for item in inbox:
            if isinstance(item, _Submit):
                item.done(error(why))
        for s in streams:
            s.abort(why, error)

    def _refresh_stats(self) -> None:
        stats = self.scheduler.stats()
        self.stats = dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else dict(stats)
