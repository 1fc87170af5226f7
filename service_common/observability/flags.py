"""The observability flags both services take (logs, traces, metrics), and the configs built from them."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from service_common.observability.logs import LOG_FORMATS
from service_common.observability.tracing import TracingConfig


def _sample_ratio(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"must be a port number (0: off), got {text}")
    return value


def add_log_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-format",
        default="auto",
        choices=LOG_FORMATS,
        help="auto: console on a terminal, else JSON lines (default %(default)s)",
    )
    parser.add_argument("--log-level", default="info")


def add_observability_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--otlp-endpoint",
        default=None,
        metavar="URL",
        help="send traces over OTLP/gRPC here, e.g. http://localhost:4317 "
        "(default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or $OTEL_EXPORTER_OTLP_ENDPOINT; neither: tracing off)",
    )
    parser.add_argument(
        "--trace-sample-ratio",
        type=_sample_ratio,
        default=None,
        metavar="R",
        help="share of traces recorded, parent-based (default: $OTEL_TRACES_SAMPLER_ARG or 1)",
    )
    parser.add_argument(
        "--metrics-port",
        type=_port,
        default=0,
        metavar="PORT",
        help="serve Prometheus metrics on this port, on the --listen host (default 0: off)",
    )


def tracing_config(
    args: argparse.Namespace, default_service_name: str, environ: Mapping[str, str] = os.environ
) -> TracingConfig:
    return TracingConfig.resolve(args.otlp_endpoint, args.trace_sample_ratio, default_service_name, environ)
