"""The scheduler's one place to report to: request and step spans, metrics, log context.

The servicer calls `request_started` / `request_ended` around each Generate; the
step loop calls `begin_step`, runs the Step RPC inside the returned scope, then
`end_step`. Either of tracing (an OpenTelemetry tracer) and metrics may be absent;
with neither, a step costs a few attribute checks and binding `step_id` to the log
context (~3 us, measured by `swarmserve bench tracing`).

Spans:
- `request` (kind SERVER): arrival to end, a child of the client's own trace when its
  Generate call carried a `traceparent`; its ids are bound to the Generate handler's log
  lines. Events mark the first scheduled step and the first token.
- `step` (kind CLIENT, a root): the Step RPC, plan sent to result back, *linked* to the
  request spans it served (a step serves many requests, a request spans many steps,
  so neither is the other's parent). It is current while the RPC is made, so the
  executor's spans (propagated in the metadata) become its children, in one trace.
  Each request that verified drafts in the step adds a `draft` event: its drafts'
  nodes, depth, leaves (a chain: depth = nodes, one leaf) and accepted length. On the
  step rather than the request span: a request's steps are many, and a span keeps
  only so many events (128 by default), while a step's drafting requests are a batch.
"""

from __future__ import annotations

import time

import grpc
import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from service_common.observability.rpc_errors import RpcErrorsInterceptor
from service_common.observability.trace_context import TraceContextClientInterceptor, extract_context

log = structlog.get_logger()


def _epoch_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading as the wall-clock nanoseconds spans use."""
    return time.time_ns() - time.monotonic_ns() + int(monotonic_s * 1e9)


def step_attributes(record) -> dict:
    return {
        "swarmserve.step_id": record.step_id,
        "swarmserve.batch_size": record.num_requests,
        "swarmserve.num_new_requests": record.num_new_requests,
        "swarmserve.num_preempted": record.num_preempted,
        "swarmserve.num_prefill_tokens": record.num_prefill_tokens,
        "swarmserve.num_decode_tokens": record.num_decode_tokens,
        "swarmserve.draft_tokens.allocated": record.num_draft_tokens,
        "swarmserve.draft_tokens.drafted": record.num_drafted_tokens,
        "swarmserve.draft_tokens.accepted": record.num_accepted_tokens,
        "swarmserve.draft_tree.depth": record.draft_depth,
        "swarmserve.draft_tree.leaves": record.num_draft_leaves,
        "swarmserve.free_token_budget": record.num_free_tokens,
        "swarmserve.step_time.predicted_s": record.predicted_step_s,
        "swarmserve.step_time.actual_s": record.wall_s,
        "swarmserve.step_time.executor_s": record.executor_total_s,
        "swarmserve.kv_blocks.free": record.num_free_kv_blocks,
    }  # the requests served are the span's links (an id list attribute would cost more than the rest)


def draft_event_attributes(request_record) -> dict:
    """A request's drafts in one step (a StepRequestRecord): the `draft` event on the step span."""
    return {
        "swarmserve.request_id": request_record.request_id,
        "swarmserve.draft_tree.nodes": request_record.num_drafted_tokens,
        "swarmserve.draft_tree.depth": request_record.draft_depth,
        "swarmserve.draft_tree.leaves": request_record.num_draft_leaves,
        "swarmserve.draft_tree.accepted": request_record.num_accepted_tokens,
    }


def request_attributes(request, finish_reason: str) -> dict:
    attributes = {
        "swarmserve.num_prompt_tokens": request.num_prompt_tokens,
        "swarmserve.num_completion_tokens": len(request.output_token_ids),
        "swarmserve.num_cached_tokens": request.num_cached_tokens,
        "swarmserve.draft_tokens.drafted": request.num_drafted_tokens,
        "swarmserve.draft_tokens.accepted": request.num_accepted_tokens,
        "swarmserve.num_preemptions": request.num_preemptions,
        "swarmserve.finish_reason": finish_reason,
    }
    if request.first_scheduled_time is not None:
        attributes["swarmserve.queue_time_s"] = request.first_scheduled_time - request.arrival_time
    if request.first_token_time is not None:
        attributes["swarmserve.ttft_s"] = request.first_token_time - request.arrival_time
    return attributes


def _exemplar(span) -> dict | None:
    """A metric exemplar naming the span's trace, if that trace is recorded."""
    context = span.get_span_context()
    return {"trace_id": format(context.trace_id, "032x")} if context.trace_flags.sampled else None


def _log_step(record) -> None:
    log.debug(
        "step_done",
        batch_size=record.num_requests,
        prefill_tokens=record.num_prefill_tokens,
        decode_tokens=record.num_decode_tokens,
        accepted_draft_tokens=record.num_accepted_tokens,
        step_ms=round(record.wall_s * 1e3, 3),
    )


class StepScope:
    """The step span (None when tracing is off) made current for the RPC; `with` it around the call."""

    __slots__ = ("span", "end_ns", "_log_tokens", "_context_token")

    def __init__(self, span, log_tokens) -> None:
        self.span = span
        self.end_ns = 0
        self._log_tokens = log_tokens
        self._context_token = None

    def __enter__(self) -> "StepScope":
        if self.span is not None:
            self._context_token = otel_context.attach(trace.set_span_in_context(self.span))
        return self

    def __exit__(self, *exc) -> None:
        if self.span is not None:
            self.end_ns = time.time_ns()
            otel_context.detach(self._context_token)

    def close(self) -> None:
        if self._log_tokens is not None:  # once: a step that fails after end_step closes it again
            structlog.contextvars.reset_contextvars(**self._log_tokens)
            self._log_tokens = None


class Telemetry:
    def __init__(self, tracer=None, metrics=None) -> None:
        self.tracer = tracer
        self.metrics = metrics  # SchedulerMetrics
        self._request_spans: dict = {}  # executor request id (unique per submission) -> its live span

    @property
    def client_interceptors(self) -> list:
        """For the executor channel: carry the current span's context in each call's metadata."""
        return [TraceContextClientInterceptor()] if self.tracer is not None else []

    @property
    def server_interceptors(self) -> list:
        return [RpcErrorsInterceptor(self.metrics.rpc_errors)] if self.metrics is not None else []

    # -------------------------------------------------------------- requests

    def request_started(self, request, invocation_metadata=()) -> None:
        """Open the request's span; bind its ids for the Generate handler's log lines.

        The span is not attached as the handler's current OpenTelemetry context: a
        Generate stream may be finalised outside the handler's context, where a detach
        would fail; log context (like `request_id`) is bound instead.
        """
        if self.tracer is None:
            return
        span = self.tracer.start_span(
            "request",
            context=extract_context(invocation_metadata) or otel_context.Context(),
            kind=SpanKind.SERVER,
            start_time=_epoch_ns(request.arrival_time),
            attributes={
                "swarmserve.request_id": request.request_id,
                "swarmserve.max_new_tokens": request.max_new_tokens,
            },
        )
        self._request_spans[request.executor_request_id] = span
        context = span.get_span_context()
        if context.is_valid:
            structlog.contextvars.bind_contextvars(
                trace_id=format(context.trace_id, "032x"), span_id=format(context.span_id, "016x")
            )

    def request_ended(self, stream) -> None:
        """The Generate call is over (finished, failed or abandoned): close the span, log, count."""
        request = stream.request
        reason = stream.finish_reason or ("error" if stream.error_code is not None else "aborted")
        if self.metrics is not None:
            self.metrics.observe_request_end(request, reason)
        span = self._request_spans.pop(request.executor_request_id, None)
        if span is not None and span.is_recording():
            span.set_attributes(request_attributes(request, reason))
            if request.first_scheduled_time is not None:
                span.add_event("scheduled", timestamp=_epoch_ns(request.first_scheduled_time))
            if request.first_token_time is not None:
                span.add_event("first_token", timestamp=_epoch_ns(request.first_token_time))
            if stream.error_code is not None:
                span.set_status(Status(StatusCode.ERROR, f"{stream.error_code.name}: {stream.error_message}"))
        log.info(
            "request_finished",
            finish_reason=reason,
            prompt_tokens=request.num_prompt_tokens,
            completion_tokens=len(request.output_token_ids),
            ttft_s=None
            if request.first_token_time is None
            else round(request.first_token_time - request.arrival_time, 6),
        )
        if span is not None:
            span.end(end_time=_epoch_ns(request.finish_time) if request.finish_time is not None else None)
            structlog.contextvars.unbind_contextvars("trace_id", "span_id")

    def _request_exemplar(self, request_id: str) -> dict | None:
        span = self._request_spans.get(request_id)
        return _exemplar(span) if span is not None else None

    # ----------------------------------------------------------------- steps

    def begin_step(self, plan) -> StepScope:
        log_tokens = structlog.contextvars.bind_contextvars(step_id=plan.step_id)
        if self.tracer is None:
            return StepScope(None, log_tokens)
        links = []
        for scheduled in plan.scheduled:
            request_span = self._request_spans.get(scheduled.request_id)
            if request_span is not None:
                links.append(Link(request_span.get_span_context()))
        span = self.tracer.start_span(
            "step",
            context=otel_context.Context(),  # a root: each step is its own trace, linked to its requests
            kind=SpanKind.CLIENT,
            links=links,
            attributes={"swarmserve.step_id": plan.step_id},
        )
        return StepScope(span, log_tokens)

    def end_step(self, scope: StepScope, record, updates) -> None:
        span = scope.span
        if self.metrics is not None:
            if span is None:
                self.metrics.observe_step(record, updates)
            else:
                self.metrics.observe_step(record, updates, _exemplar(span), self._request_exemplar)
        if span is None:
            _log_step(record)
        else:
            if span.is_recording():
                span.set_attributes(step_attributes(record))
                for request_record in record.requests:
                    if request_record.num_drafted_tokens:
                        span.add_event("draft", draft_event_attributes(request_record))
            with trace.use_span(span):  # so the step's log line carries its ids
                _log_step(record)
            span.end(end_time=scope.end_ns or None)
        scope.close()

    def step_failed(self, scope: StepScope, error: Exception) -> None:
        if scope.span is not None:
            if isinstance(error, grpc.aio.AioRpcError):
                description = f"{error.code().name}: {error.details()}"
            else:
                description = f"{type(error).__name__}: {error}"
            scope.span.set_status(Status(StatusCode.ERROR, description))
            scope.span.end(end_time=scope.end_ns or None)
        scope.close()
