"""Admitting a Generate request: the one intake path every front door shares.

The gRPC servicer and the HTTP front (scheduler_svc/http_api) both turn a
`GenerateRequest` into a queued `RequestStream` here, so validation, limits, the
queue cap, the executor's state and telemetry are the same whichever door a request
came through. A refusal is a `Refused` carrying the gRPC status code; each front
door maps it to its own error shape (gRPC status, HTTP status and JSON body).

The caller reads `stream.events` and must call `release` when it stops reading,
however it stops: that is what frees an abandoned request's KV at the next step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import grpc
import structlog

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.intake import intake
from scheduler_svc.request_stream import RequestStream
from scheduler_svc.step_loop import StepLoop
from service_common.errors import InvalidRequestError
from swarmserve.scheduler.v1 import scheduler_pb2 as pb

log = structlog.get_logger()

CONNECT_GRACE_S = 2.0  # a request arriving mid-reconnect waits this long before UNAVAILABLE


class Refused(Exception):
    """The request was not queued; `code` says why in gRPC terms."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def refusal_unless_serving(loop: StepLoop, config: SchedulerConfig) -> Refused | None:
    if loop.stopped_reason:
        return Refused(grpc.StatusCode.UNAVAILABLE, f"{loop.stopped_reason}; this scheduler takes no requests")
    if loop.is_draining:
        return Refused(
            grpc.StatusCode.UNAVAILABLE, "the scheduler is shutting down (draining requests in flight); retry elsewhere"
        )
    if not loop.is_connected:
        return Refused(
            grpc.StatusCode.UNAVAILABLE,
            f"the executor at {config.executor} is unreachable or refuses this scheduler "
            f"({loop.last_connect_error or 'connecting'}); the scheduler keeps retrying",
        )
    return None


def _raise_unless_serving(loop: StepLoop, config: SchedulerConfig) -> None:
    refusal = refusal_unless_serving(loop, config)
    if refusal is not None:
        raise refusal


async def admit(
    loop: StepLoop,
    config: SchedulerConfig,
    msg: pb.GenerateRequest,
    metadata: Iterable[tuple[str, str]] = (),
    clamp_max_new_tokens: bool = False,
) -> RequestStream:
    """Validate `msg`, queue it and return its stream; raises Refused.

    `metadata` (gRPC metadata or HTTP headers as pairs) may carry a trace context.
    `clamp_max_new_tokens`: a max_new_tokens beyond what the prompt leaves of the context (or of
    what the KV cache can ever hold for one request) is cut to fit, not refused (see intake).
    """
    if not loop.is_connected:
        # After a crash, as long as the streams in flight wait for the executor to return.
        await loop.wait_connected(loop.connect_wait_s(CONNECT_GRACE_S))
    _raise_unless_serving(loop, config)
    view = loop.view
    limits = view.limits
    try:
        # Off the event loop: tokenizing a long prompt takes seconds (see intake).
        clamp_to = view.max_request_tokens if clamp_max_new_tokens else None
        accepted = await asyncio.to_thread(intake, msg, limits, config, clamp_to)
    except InvalidRequestError as exc:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
    _raise_unless_serving(loop, config)  # the executor may have gone meanwhile
    if view.limits is not limits:
        raise Refused(
            grpc.StatusCode.UNAVAILABLE, "the executor was replaced while the prompt was tokenized; retry the request"
        )
    request = accepted.request
    conflict = loop.request_id_conflict(request.request_id)
    if conflict is not None:
        raise Refused(grpc.StatusCode.ALREADY_EXISTS, conflict)
    if not view.can_ever_fit(request.num_prompt_tokens + 1):
        raise Refused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the prompt ({request.num_prompt_tokens} tokens) does not fit in the executor's KV cache "
            f"({view.num_kv_blocks} blocks of {view.block_size} tokens)",
        )
    if view.num_queued >= config.max_queued_requests:
        raise Refused(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"the queue is full ({view.num_queued} requests waiting for a place in the batch, "
            f"max_queued_requests={config.max_queued_requests}); retry later",
        )
    stream = RequestStream(request, limits.tokenizer, accepted.stop_strings, accepted.include_special_tokens)
    loop.telemetry.request_started(request, metadata)
    loop.submit(stream)
    log.debug(
        "request_queued",
        request_id=request.request_id,
        prompt_tokens=request.num_prompt_tokens,
        executor_request_id=request.executor_request_id,
    )
    return stream


def release(loop: StepLoop, stream: RequestStream) -> None:
    """The caller stopped reading `stream`: if the request still runs (cancelled, deadline
    passed, the client went away), free it at the next step; close its telemetry."""
    if not stream.is_closed or stream.request_id in loop.streams:
        loop.abort(stream.request_id)
    loop.telemetry.request_ended(stream)
