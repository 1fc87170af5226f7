"""The HTTP API's listening socket (scheduler_svc/http_api/server.py): the connections it accepts
send small writes at once (TCP_NODELAY). Without it a kept-alive connection's response body, or a
stream's next event, waited ~40 ms for the client's delayed ACK."""

from __future__ import annotations

import asyncio
import socket

import pytest

from scheduler_svc.http_api.server import listening_socket


def test_connections_accepted_from_it_have_nagle_off():
    async def accepted_nodelay() -> int:
        sock = listening_socket("127.0.0.1:0")
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted = writer.get_extra_info("socket")
            seen.set_result(accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connection, sock=sock)  # as uvicorn serves it: asyncio accepts
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            value = await asyncio.wait_for(seen, 10)
            writer.close()
        return value

    assert asyncio.run(accepted_nodelay()) != 0


def test_a_taken_port_is_an_error_naming_the_address():
    first = listening_socket("127.0.0.1:0")
    port = first.getsockname()[1]
    try:
        with pytest.raises(OSError, match=f"cannot serve HTTP on 127.0.0.1:{port}"):
            listening_socket(f"127.0.0.1:{port}")
    finally:
        first.close()
