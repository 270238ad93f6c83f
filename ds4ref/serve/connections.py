"""A deadline on each request's line and headers (slowloris), which uvicorn and h11 lack.

uvicorn times only the idle gap between keep-alive requests (`timeout_keep_alive`), and every
byte received cancels that timer; h11 bounds the headers' size (`max_incomplete_event_size`),
not their time. So a client that sends a partial request line or trickles header bytes would
hold its connection for as long as it likes. Here each request's line and headers must be
complete within `header_timeout` seconds of the connection opening (or of the previous
response ending, on a keep-alive connection), else the connection is closed. The deadline is
not moved by the bytes that arrive; the body has its own bound (app.BodyLimit).
"""
from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("ds4ref.serve")

HEADER_TIMEOUT_S = 10.0


class HeaderDeadlineH11Protocol(H11Protocol):
    header_timeout: float = HEADER_TIMEOUT_S
    _header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the request line and headers are in
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start the next cycle and read pipelined headers
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_deadline = self.loop.call_later(self.header_timeout, self._headers_too_late)

    def _disarm(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_too_late(self) -> None:
        self._header_deadline = None
        if not self.transport.is_closing():
            log.debug("%s: request headers incomplete after %g s, connection closed",
                      "%s:%d" % self.client if self.client else "client", self.header_timeout)
            self.transport.close()


def header_deadline_protocol(header_timeout: float) -> type[H11Protocol]:
    """uvicorn's `http=` protocol class: h11 with this header deadline (0: none, plain h11)."""
    if header_timeout <= 0:
        return H11Protocol
    return type("HeaderDeadlineH11Protocol", (HeaderDeadlineH11Protocol,), {"header_timeout": float(header_timeout)})
