"""Refuse an oversized request body with 413 before anything parses it.

Pure ASGI: a Content-Length over the limit is refused from the headers alone; a body
without one (chunked) is read up to the limit and refused as soon as it passes it.
A body within the limit is handed on unchanged.

Before answering 413, the rest of an oversized body (up to DRAIN_MAX_BYTES) is read and
dropped, unparsed: a client still uploading would otherwise have its connection reset
under it and never see the 413 (a race the SDK tests hit). Bigger uploads are answered
at once and cut off.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from scheduler_svc.http_api.errors import ApiError

DRAIN_MAX_BYTES = 64 << 20


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, error_body: Callable[[str, ApiError], dict]) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.error_body = error_body  # (path, error) -> the JSON body in the route's API shape

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            if int(declared) <= DRAIN_MAX_BYTES and not await self._drain(receive, 0):
                return
            await self._refuse(scope, send, f"{int(declared)} bytes")
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                if message.get("more_body", False) and not await self._drain(receive, size):
                    return
                await self._refuse(scope, send, f"over {self.max_bytes} bytes")
                return
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect

        await self.app(scope, replay, send)

    @staticmethod
    async def _drain(receive: Receive, size: int) -> bool:
        """Read and drop the body's remaining chunks (up to DRAIN_MAX_BYTES in all); False if
        the client went away meanwhile."""
        while size <= DRAIN_MAX_BYTES:
            message = await receive()
            if message["type"] == "http.disconnect":
                return False
            size += len(message.get("body", b""))
            if not message.get("more_body", False):
                return True
        return True

    async def _refuse(self, scope: Scope, send: Send, size: str) -> None:
        error = ApiError(413, f"the request body is {size}; the limit is {self.max_bytes} bytes (--max-message-bytes)")
        payload = json.dumps(self.error_body(scope["path"], error)).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": payload})
