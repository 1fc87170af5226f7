"""A minimal OTLP/gRPC trace receiver on loopback: keeps every span it is sent.

For `bench tracing` (somewhere real to export to, without a collector) and the
tests that check what crosses the wire. It implements the collector's TraceService
from opentelemetry-proto and nothing else.
"""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    service_name: str
    span: object  # opentelemetry.proto.trace.v1.trace_pb2.Span

    @property
    def name(self) -> str:
        return self.span.name

    @property
    def trace_id(self) -> str:
        return self.span.trace_id.hex()

    @property
    def span_id(self) -> str:
        return self.span.span_id.hex()

    @property
    def parent_span_id(self) -> str:
        return self.span.parent_span_id.hex()

    def attribute(self, key: str):
        for kv in self.span.attributes:
            if kv.key == key:
                value = kv.value
                return getattr(value, value.WhichOneof("value"))
        return None


class OtlpSink(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []

    def Export(self, request, context):
        received = []
        for resource_spans in request.resource_spans:
            service = next(
                (kv.value.string_value for kv in resource_spans.resource.attributes if kv.key == "service.name"), ""
            )
            for scope_spans in resource_spans.scope_spans:
                received += [ReceivedSpan(service, span) for span in scope_spans.spans]
        with self._lock:
            self._spans += received
        return trace_service_pb2.ExportTraceServiceResponse()

    @property
    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)


class OtlpSinkServer:
    """`with OtlpSinkServer() as sink_server:` ... `sink_server.endpoint` is what to export to."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.sink = OtlpSink()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self.sink, self._server)
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        self.endpoint = f"http://{host}:{self.port}"

    def __enter__(self) -> "OtlpSinkServer":
        self._server.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop(grace=None)
