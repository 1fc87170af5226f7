"""What one service process runs for observability, started from its flags and stopped on exit.

Tracing (a TracerProvider exporting over OTLP) and metrics (a registry and its HTTP
endpoint) are each on only when configured; `tracer` and `metrics` are None otherwise
and the service installs nothing for them. `stop()` flushes the spans still batched.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from service_common.observability.flags import tracing_config
from service_common.observability.metrics_server import MetricsServer, metrics_host, start_metrics_server
from service_common.observability.tracing import TracingConfig, build_tracer_provider

log = structlog.get_logger()


@dataclass
class ServiceTelemetry:
    tracer: object | None = None  # an OpenTelemetry Tracer
    metrics: object | None = None  # the service's metrics object (it has a `.registry`)
    tracer_provider: object | None = None
    metrics_server: MetricsServer | None = None

    def stop(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.stop()
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()  # exports what is still batched


def start_service_telemetry(
    args: argparse.Namespace, service_name: str, make_metrics: Callable[[], object], instrumentation_name: str
) -> ServiceTelemetry:
    """From the observability flags (and the standard OTEL_* variables): tracing, then metrics."""
    config: TracingConfig = tracing_config(args, service_name)
    telemetry = ServiceTelemetry()
    telemetry.tracer_provider = build_tracer_provider(config)
    if telemetry.tracer_provider is not None:
        telemetry.tracer = telemetry.tracer_provider.get_tracer(instrumentation_name)
        log.info(
            "tracing_on",
            otlp_endpoint=config.otlp_endpoint,
            sample_ratio=config.sample_ratio,
            service_name=config.service_name,
        )
    if args.metrics_port:
        telemetry.metrics = make_metrics()
        host = metrics_host(args.listen)
        telemetry.metrics_server = start_metrics_server(host, args.metrics_port, telemetry.metrics.registry)
        log.info("metrics_listening", address=f"{host}:{telemetry.metrics_server.port}")
    return telemetry
