"""OpenTelemetry tracing for both services, on only when somewhere to send spans is configured.

The flags (`--otlp-endpoint`, `--trace-sample-ratio`) win; otherwise the standard
OTEL_* variables apply (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT,
OTEL_TRACES_SAMPLER_ARG, OTEL_SERVICE_NAME, OTEL_SDK_DISABLED, OTEL_TRACES_EXPORTER=none),
read once at start-up into a frozen `TracingConfig`. The exporter itself still reads its
own standard variables (headers, certificates, timeout, compression).

Off means no tracer at all: callers hold `None` and skip every span, so a server
without a collector pays nothing, not even the SDK's import.

Sampling is ParentBased(TraceIdRatio): the scheduler decides per trace (a request, a
step), and the executor follows the sampled flag it receives, so a sampled step is
sampled on both sides and a busy server can send the collector a fraction of its steps.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class TracingConfig:
    otlp_endpoint: str | None = None  # OTLP/gRPC collector, e.g. http://collector:4317; None: tracing off
    sample_ratio: float = 1.0  # share of traces (requests, steps) recorded
    service_name: str = "swarmserve"

    def __post_init__(self) -> None:
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ValueError(f"trace sample ratio must be in [0, 1], got {self.sample_ratio}")
        if self.otlp_endpoint is not None and not self.otlp_endpoint:
            raise ValueError("otlp_endpoint must not be empty (leave it unset to turn tracing off)")

    @property
    def is_enabled(self) -> bool:
        return self.otlp_endpoint is not None

    @classmethod
    def resolve(
        cls,
        otlp_endpoint: str | None,
        sample_ratio: float | None,
        default_service_name: str,
        environ: Mapping[str, str] = os.environ,
    ) -> "TracingConfig":
        """Flags first, then the standard OTEL_* variables, then off."""
        endpoint = otlp_endpoint or None
        if endpoint is None:
            disabled = environ.get("OTEL_SDK_DISABLED", "").lower() in _TRUE
            no_exporter = environ.get("OTEL_TRACES_EXPORTER", "").lower() == "none"
            if not (disabled or no_exporter):
                endpoint = (
                    environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                    or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                    or None
                )
        if sample_ratio is None:
            text = environ.get("OTEL_TRACES_SAMPLER_ARG", "")
            try:
                sample_ratio = float(text) if text else 1.0
            except ValueError:
                raise ValueError(f"OTEL_TRACES_SAMPLER_ARG must be a number in [0, 1], got {text!r}") from None
        return cls(
            otlp_endpoint=endpoint,
            sample_ratio=sample_ratio,
            service_name=environ.get("OTEL_SERVICE_NAME") or default_service_name,
        )


def build_tracer_provider(config: TracingConfig, span_processor=None):
    """A TracerProvider exporting over OTLP/gRPC (batched), or None when tracing is off.

    `span_processor` replaces the OTLP exporter (tests pass an in-memory one), and
    turns tracing on by itself. The provider is not installed globally: each service
    passes its tracer to what needs it, so two services can share a test process.
    """
    if not config.is_enabled and span_processor is None:
        return None
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    provider = TracerProvider(
        sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
        resource=Resource.create({SERVICE_NAME: config.service_name}),
        shutdown_on_exit=False,  # the service shuts it down (flushing) when it stops
    )
    if span_processor is None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        span_processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=config.otlp_endpoint))
    provider.add_span_processor(span_processor)
    return provider
