"""A structlog processor that adds the current OpenTelemetry span's ids to a log line.

`trace_id` / `span_id` in the same hex form a trace UI shows, so a log line leads to
its trace and back. Lines logged outside a span (or with tracing off) get neither.
"""

from __future__ import annotations

from opentelemetry import trace


def add_trace_ids(logger, method_name: str, event_dict: dict) -> dict:
    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        event_dict["trace_id"] = format(context.trace_id, "032x")
        event_dict["span_id"] = format(context.span_id, "016x")
    return event_dict
