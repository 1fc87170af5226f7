"""Observe every Step call from outside the servicer: its span, its phases, its metrics.

The scheduler's step span arrives as W3C trace context in the call's metadata; the
executor's `executor.step` span (kind SERVER) is its child and is current while the
servicer runs, so the servicer's log lines carry its ids. The engine's hot loop knows
nothing of tracing: it measures prepare / forward / sample(+verify) anyway
(StepTimings, returned in the response), and the phases become child spans with
explicit start and end times, laid end to end so that the last ends when the
servicer returned (off only by the time it took to build the response).

Installed only when tracing or metrics are on (see `executor_interceptors`).
"""

from __future__ import annotations

import time
from functools import partial

import grpc
import structlog
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from service_common.observability.rpc_errors import RpcErrorsInterceptor
from service_common.observability.trace_context import extract_context

log = structlog.get_logger()

STEP_METHOD = "/swarmserve.executor.v1.ExecutorService/Step"
PHASE_SPANS = (("executor.prepare", "prepare_s"), ("executor.forward", "forward_s"), ("executor.sample", "sample_s"))


def executor_interceptors(tracer=None, metrics=None) -> list[grpc.aio.ServerInterceptor]:
    """The executor server's interceptors: none at all when tracing and metrics are off."""
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if metrics is not None:
        interceptors.append(RpcErrorsInterceptor(metrics.rpc_errors))
    if tracer is not None or metrics is not None:
        interceptors.append(StepInterceptor(tracer, metrics))
    return interceptors


def _step_attributes(request, response) -> dict:
    t = response.timings
    drafted = accepted = generated = 0
    for result in response.results:
        drafted += result.num_drafted_tokens
        accepted += result.num_accepted_tokens
        generated += len(result.new_token_ids)
    return {
        "swarmserve.batch_size": len(request.scheduled),
        "swarmserve.num_runs": response.num_runs,
        "swarmserve.num_new_requests": len(request.new_requests),
        "swarmserve.num_released": len(request.released),
        "swarmserve.num_preempted": len(request.preempted),
        "swarmserve.num_computed_tokens": response.num_computed_tokens,
        "swarmserve.num_attention_pairs": response.num_attention_pairs,
        "swarmserve.num_generated_tokens": generated,
        "swarmserve.draft_tokens.allocated": sum(s.draft_budget for s in request.scheduled),
        "swarmserve.draft_tokens.drafted": drafted,
        "swarmserve.draft_tokens.accepted": accepted,
        "swarmserve.kv_blocks.free": response.num_free_kv_blocks,
        "swarmserve.kv_blocks.total": response.num_total_kv_blocks,
        "swarmserve.executor.prepare_s": t.prepare_s,
        "swarmserve.executor.forward_s": t.forward_s,
        "swarmserve.executor.sample_s": t.sample_s,
    }


def _log_step(response) -> None:
    t = response.timings
    log.debug(
        "step_executed",
        computed_tokens=response.num_computed_tokens,
        forward_ms=round(t.forward_s * 1e3, 3),
        free_kv_blocks=response.num_free_kv_blocks,
    )


class StepInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, tracer=None, metrics=None) -> None:
        self._tracer = tracer
        self._metrics = metrics

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method != STEP_METHOD:
            return handler
        observe = partial(self._observe, handler.unary_unary, handler_call_details.invocation_metadata)
        return handler._replace(unary_unary=observe)

    async def _observe(self, behavior, metadata, request, context):
        span = None
        if self._tracer is not None:
            span = self._tracer.start_span(
                "executor.step",
                context=extract_context(metadata),
                kind=SpanKind.SERVER,
                attributes={"swarmserve.step_id": request.step_id},
            )
        log_tokens = structlog.contextvars.bind_contextvars(step_id=request.step_id)
        try:
            if span is None:
                response = await behavior(request, context)
                _log_step(response)
            else:
                with trace.use_span(span, record_exception=False, set_status_on_exception=False):
                    response = await behavior(request, context)
                    _log_step(response)
        except BaseException:
            if span is not None:
                code = context.code()
                span.set_status(Status(StatusCode.ERROR, f"{getattr(code, 'name', code)}: {context.details() or ''}"))
                span.end()
            raise
        finally:
            structlog.contextvars.reset_contextvars(**log_tokens)
        if span is not None:
            self._end_span(span, request, response, time.time_ns())
        if self._metrics is not None:
            self._metrics.observe_step(request, response)
        return response

    def _end_span(self, span, request, response, end_ns: int) -> None:
        if span.is_recording():
            span.set_attributes(_step_attributes(request, response))
            timings = response.timings
            durations = [int(getattr(timings, field) * 1e9) for _, field in PHASE_SPANS]
            parent = trace.set_span_in_context(span)
            start_ns = end_ns - sum(durations)
            for (name, _), duration_ns in zip(PHASE_SPANS, durations):
                phase = self._tracer.start_span(name, context=parent, start_time=start_ns)
                start_ns += duration_ns
                phase.end(end_time=start_ns)
        span.end(end_time=end_ns)
