"""The listening socket `python -m ds4ref.serve` binds (serve.__main__.bind)."""
from __future__ import annotations

import asyncio
import socket

from ds4ref.serve.__main__ import bind


def test_connections_on_the_bound_socket_send_small_writes_at_once():
    """uvicorn serves on our socket through asyncio, which turns Nagle off only on sockets that
    say they are TCP; with Nagle on, an SSE stream's second chunk waits for the client's delayed
    ACK (~40 ms), and so did every streamed answer's first text."""
    async def accepted_nodelay() -> int:
        got: asyncio.Future = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport) -> None:
                sock = transport.get_extra_info("socket")
                got.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        listening = bind("127.0.0.1", 0)
        server = await asyncio.get_running_loop().create_server(Probe, sock=listening)
        async with server:
            _, writer = await asyncio.open_connection(*listening.getsockname())
            value = await asyncio.wait_for(got, 10)
            writer.close()
        return value

    assert asyncio.run(accepted_nodelay())
