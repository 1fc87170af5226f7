"""Serving the HTTP API from the scheduler's own event loop.

uvicorn runs as one more task beside the gRPC server and the step loop, so a route
reaches the step loop by a function call: no second process, no gRPC hop to itself.
The socket is bound here, before anything is served, so a taken port fails at start
up with an OSError (uvicorn would exit the process); uvicorn's own signal handling
is off, since the scheduler's SIGTERM drain stops this server in its turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import uvicorn

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.http_api.app import build_app
from scheduler_svc.step_loop import StepLoop


class _EmbeddedServer(uvicorn.Server):
    def capture_signals(self):  # the scheduler handles its signals
        return contextlib.nullcontext()


def listening_socket(address: str) -> socket.socket:
    """A TCP socket bound to `address` (host:port, [v6]:port) and listening: connections queue from
    now on, before uvicorn starts accepting; a taken port is an OSError naming the address."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not the default 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on
    # accepted sockets that say TCP, and an accepted socket says what this one says. With Nagle
    # on, a response's second small write (the body after the headers, each streamed event after
    # the first) waited for the client's delayed ACK: ~40 ms on every request of a kept-alive
    # connection (17 ms requests took 44-75 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, int(port)))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot serve HTTP on {address}: {exc.strerror}") from None
    sock.listen(2048)
    return sock


class HttpServer:
    def __init__(self, config: SchedulerConfig, loop: StepLoop, metrics=None) -> None:
        self._socket = listening_socket(config.http_listen)
        self.port = self._socket.getsockname()[1]
        uvicorn_config = uvicorn.Config(
            build_app(config, loop, metrics),
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=1,
        )
        self._server = _EmbeddedServer(uvicorn_config)
        self._task: asyncio.Task | None = None

    def start(self) -> asyncio.Task:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]), name="http")
        return self._task

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        self._socket.close()
