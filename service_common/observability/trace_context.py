"""W3C trace context (`traceparent`, `tracestate`) carried in gRPC metadata.

The scheduler's executor channel gets `TraceContextClientInterceptor`, which adds the
current span's context to every unary call, so the Step RPC made while a step span is
current carries it; the executor reads it back with `extract_context`. Installed only
when tracing is on.
"""

from __future__ import annotations

import grpc
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()


def extract_context(invocation_metadata) -> Context | None:
    """The remote parent a call's metadata names, or None when it names none."""
    carrier = {key: value for key, value in invocation_metadata or () if key in _PROPAGATOR.fields}
    return _PROPAGATOR.extract(carrier) if carrier else None


class TraceContextClientInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier)
        if carrier:
            client_call_details = grpc.aio.ClientCallDetails(
                client_call_details.method,
                client_call_details.timeout,
                grpc.aio.Metadata(*(client_call_details.metadata or ()), *carrier.items()),
                client_call_details.credentials,
                client_call_details.wait_for_ready,
            )
        return await continuation(client_call_details, request)
