"""Running GenerateRequests for an HTTP handler: admit, read, release.

An HTTP request may ask for several completions (OpenAI's `n`, or several prompts):
each is one GenerateRequest admitted through scheduler_svc/admission.py, and all are
admitted or none (a refusal releases the ones already queued). `events` interleaves
their streams as (choice index, event) in arrival order.

Whoever admits must `release_all` when done, however it ends: that is how a client
that hangs up frees its requests' KV at the next step, as a cancelled gRPC call does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Iterable
from typing import TypeVar

from starlette.requests import Request as HttpRequest

from scheduler_svc.admission import Refused, admit, release
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.http_api.errors import ApiError
from scheduler_svc.http_api.front import http_refusal
from scheduler_svc.request_stream import RequestStream, StreamError
from scheduler_svc.step_loop import StepLoop
from swarmserve.scheduler.v1 import scheduler_pb2 as pb

T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


async def admit_all(
    loop: StepLoop,
    config: SchedulerConfig,
    msgs: list[pb.GenerateRequest],
    headers: Iterable[tuple[str, str]],
    prompt_field: str = "messages",
    max_tokens_field: str = "max_tokens",
    clamp_max_tokens: bool = False,
) -> list[RequestStream]:
    """Queue every request or none; a refusal is an ApiError with the matching HTTP status,
    naming the API's field as the client spelled it (`prompt_field` for the prompt,
    `max_tokens_field` for max_new_tokens) where intake named one. `clamp_max_tokens`: a
    max_tokens beyond what the prompt leaves is cut to fit (admission.admit)."""
    streams: list[RequestStream] = []
    try:
        for msg in msgs:
            streams.append(await admit(loop, config, msg, headers, clamp_max_new_tokens=clamp_max_tokens))
    except Refused as exc:
        release_all(loop, streams)
        message, param = http_refusal(exc.message, prompt_field, max_tokens_field)
        raise ApiError.from_grpc(exc.code, message, param) from None
    except BaseException:
        release_all(loop, streams)
        raise
    return streams


def release_all(loop: StepLoop, streams: list[RequestStream]) -> None:
    for stream in streams:
        release(loop, stream)


async def events(streams: list[RequestStream]) -> AsyncIterator[tuple[int, pb.TokenDelta | pb.GenerateFinal]]:
    """(index, delta or final) from all streams as they come, until each has its final;
    a stream that fails raises ApiError (the others are left to the caller's release)."""
    if len(streams) == 1:  # the common case, without a task per event
        while True:
            event = await streams[0].events.get()
            yield 0, _unwrap(event)
            if isinstance(event, pb.GenerateResponse) and event.HasField("final"):
                return
    pending = {asyncio.ensure_future(s.events.get()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                index = pending.pop(task)
                event = task.result()
                yield index, _unwrap(event)
                if not event.HasField("final"):
                    pending[asyncio.ensure_future(streams[index].events.get())] = index
    finally:
        for task in pending:
            task.cancel()


def _unwrap(event: pb.GenerateResponse | StreamError) -> pb.TokenDelta | pb.GenerateFinal:
    if isinstance(event, StreamError):
        raise ApiError.from_grpc(event.code, event.message)
    return event.final if event.HasField("final") else event.delta


async def collect_all(loop: StepLoop, request: HttpRequest, streams: list[RequestStream], outputs: list) -> None:
    """Each stream's events into its output (`outputs[i].add`) until all end, for a plain
    (non-streamed) response; the streams are released however it ends, and a client that
    hangs up first aborts them (ClientGone)."""

    async def collect() -> None:
        async for index, event in events(streams):
            outputs[index].add(event)

    try:
        await until_disconnected(request, collect())
    finally:
        release_all(loop, streams)


async def until_disconnected(request: HttpRequest, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientGone (with `work` cancelled) if the client hangs up first.

    Starlette cancels a streaming response when its client goes; a plain response is
    computed to the end unless someone listens, which this does.
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnect(request: HttpRequest) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
