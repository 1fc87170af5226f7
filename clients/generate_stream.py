"""One Generate call as an async iterator of events that can be stopped at any point.

Stopping is the point of this class: a request abandoned by its caller must be freed on
the server (its KV blocks and its batch slot), and the server learns that only when the
RPC is cancelled. So every way out of an unfinished stream cancels the call:

- `break` out of `async for`, or drop the stream: gRPC cancels a call that is garbage
  collected unfinished; `async with` / `aclose()` / `cancel()` do it deterministically;
- cancelling the task that awaits the next event (asyncio.CancelledError), or
  KeyboardInterrupt: caught in `__anext__`, the call is cancelled, the error re-raised.

The call starts at the first `__anext__`, not at construction, so building a stream
(and validating its request) needs no event loop, and a stream never iterated sends nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from clients.errors import SwarmServeError
from clients.events import FinishEvent, GenerateEvent, event_from_pb


class GenerateStream:
    def __init__(self, open_call: Callable[[], grpc.aio.UnaryStreamCall], request_id: str | None = None) -> None:
        self._open_call = open_call
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._request_id = request_id
        self._is_finished = False  # a FinishEvent arrived
        self._is_closed = False  # no more events will be read

    @property
    def request_id(self) -> str | None:
        """The caller's request id, or the server-assigned one once the first event arrived."""
        return self._request_id

    @property
    def is_finished(self) -> bool:
        return self._is_finished

    def cancel(self) -> bool:
        """Stop the stream; if the RPC is still open, cancel it so the server frees the request.

        Returns whether an open RPC was cancelled. Must run on the stream's event loop.
        """
        self._is_closed = True
        if self._call is None or self._call.done():
            return False
        return self._call.cancel()

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self) -> GenerateStream:
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.cancel()

    def __aiter__(self) -> GenerateStream:
        return self

    async def __anext__(self) -> GenerateEvent:
        while True:
            if self._is_closed:
                raise StopAsyncIteration
            if self._call is None:
                self._call = self._open_call()
            try:
                response = await self._call.read()
            except grpc.aio.AioRpcError as error:
                self._is_closed = True
                raise SwarmServeError.from_rpc_error(error) from error
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    self.cancel()
                    raise
                # Not our task being cancelled: the call was cancelled under us (client closed).
                self._is_closed = True
                raise SwarmServeError(grpc.StatusCode.CANCELLED, "the call was cancelled by this client") from None
            except BaseException:
                self.cancel()
                raise
            if response is grpc.aio.EOF:
                self._is_closed = True
                if not self._is_finished:
                    raise SwarmServeError(grpc.StatusCode.INTERNAL, "the stream ended without a final message")
                raise StopAsyncIteration
            if response.request_id:
                self._request_id = response.request_id
            event = event_from_pb(response)
            if event is None:
                continue  # an event kind newer than this client
            if isinstance(event, FinishEvent):
                self._is_finished = True
            return event
