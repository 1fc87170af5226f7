"""The synchronous client: the async client running on a private event loop in its own thread.

A private loop (rather than `asyncio.run` per call) keeps one channel open across calls,
and works the same whether or not the caller is itself inside a running event loop --
the caller only blocks on a concurrent.futures.Future.

Cancellation crosses the thread boundary two ways. If the caller is interrupted while
waiting (KeyboardInterrupt), the pending future is cancelled, which cancels the task
awaiting the next event, which cancels the RPC. If the caller stops iterating (`break`,
`close()`, the iterator garbage collected), the stream's `cancel()` is scheduled on the loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from clients.client import DEFAULT_SCHEDULER_ADDRESS, AsyncSwarmClient
from clients.completion import Completion, collect_completion
from clients.events import GenerateEvent
from clients.generate_stream import GenerateStream
from clients.server_info import ServerInfo

T = TypeVar("T")

_END = object()  # what `_next_event` returns instead of raising StopAsyncIteration across threads


async def _next_event(stream: GenerateStream) -> Any:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return _END


class SyncGenerateStream:
    """A GenerateStream as a regular iterator: `for event in client.generate(...)`."""

    def __init__(self, client: SwarmClient, stream: GenerateStream) -> None:
        self._client = client
        self._stream = stream
        self._is_closed = False

    @property
    def request_id(self) -> str | None:
        return self._stream.request_id

    def __iter__(self) -> SyncGenerateStream:
        return self

    def __next__(self) -> GenerateEvent:
        if self._is_closed:
            raise StopIteration
        try:
            event = self._client._run(_next_event(self._stream))
        except BaseException:
            self.close()
            raise
        if event is _END:
            self._is_closed = True
            raise StopIteration
        return event

    def close(self) -> None:
        """Cancel the RPC if it is still open. Does not wait; safe from any thread, and twice."""
        if self._is_closed:
            return
        self._is_closed = True
        self._client._call_soon(self._stream.cancel)

    def __enter__(self) -> SyncGenerateStream:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


class SwarmClient:
    """Blocking twin of AsyncSwarmClient: same methods, same arguments, same errors."""

    def __init__(
        self,
        address: str = DEFAULT_SCHEDULER_ADDRESS,
        *,
        timeout: float | None = None,
        api_key: str | None = None,
        tls_ca: str | None = None,
    ) -> None:
        self._async = AsyncSwarmClient(address, timeout=timeout, api_key=api_key, tls_ca=tls_ca)
        self._loop = asyncio.new_event_loop()
        # Daemon: a client never closed must not keep the interpreter from exiting.
        self._thread = threading.Thread(target=self._loop.run_forever, name="swarmserve-client", daemon=True)
        self._thread.start()
        self._is_closed = False

    @property
    def address(self) -> str:
        return self._async.address

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the client's loop and wait; interrupting the wait cancels it."""
        if self._is_closed:
            coro.close()
            raise RuntimeError("the client is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def _call_soon(self, fn) -> None:
        if self._is_closed:
            return  # closing the channel already cancelled every call
        try:
            self._loop.call_soon_threadsafe(fn)
        except RuntimeError:
            pass  # the loop closed between the check and the call

    def generate(self, prompt: str | None = None, **kwargs: Any) -> SyncGenerateStream:
        """AsyncSwarmClient.generate's arguments, a blocking iterator of its events.

        ValueError (or TypeError for an unknown argument) for a malformed request is raised here.
        """
        return SyncGenerateStream(self, self._async.generate(prompt, **kwargs))

    def chat(self, messages: Sequence[Mapping[str, str]], **kwargs: Any) -> SyncGenerateStream:
        return self.generate(messages=messages, **kwargs)

    def complete(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        with self.generate(prompt, **kwargs) as stream:
            events = list(stream)
        return collect_completion(stream.request_id or "", events)

    def abort(self, request_id: str, *, timeout: float | None = None) -> bool:
        return self._run(self._async.abort(request_id, timeout=timeout))

    def server_info(self, *, timeout: float | None = None) -> ServerInfo:
        return self._run(self._async.server_info(timeout=timeout))

    def wait_ready(self, timeout: float = 30.0, *, service: str = "") -> None:
        self._run(self._async.wait_ready(timeout, service=service))

    def close(self) -> None:
        """Close the channel (cancelling open streams), stop the loop, join its thread."""
        if self._is_closed:
            return
        try:
            self._run(self._shutdown())
        finally:
            self._is_closed = True
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    async def _shutdown(self) -> None:
        await self._async.close()
        # Whatever an interrupted caller left behind ends here, not as "Task was destroyed" noise.
        current = asyncio.current_task()
        leftovers = [task for task in asyncio.all_tasks() if task is not current]
        for task in leftovers:
            task.cancel()
        await asyncio.gather(*leftovers, return_exceptions=True)

    def __enter__(self) -> SwarmClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
