"""Server-sent events, and a streaming response that always runs its cleanup.

`EventStream.on_close` runs once the response ends however it ends (done, the
client hung up, the server stopping), even if the body generator never started:
that is where a stream's requests are released.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


def sse(data: dict | str, event: str | None = None) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


def openai_chunks(object_name: str, response_id: str, model: str, include_usage: bool) -> Callable[..., str]:
    """The SSE writer of an OpenAI stream (chat.completion.chunk / text_completion): each chunk
    carries the stream's id, object, created time and model; with include_usage every chunk
    has `usage` (null until the last, which passes it)."""
    created = int(time.time())

    def chunk(choices: list[dict], **extra) -> str:
        data = {"id": response_id, "object": object_name, "created": created, "model": model, "choices": choices}
        if include_usage:
            data["usage"] = None
        data.update(extra)
        return sse(data)

    return chunk


class EventStream(StreamingResponse):
    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(body, media_type="text/event-stream", headers={"cache-control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            self._on_close()
