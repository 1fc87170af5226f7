"""structlog configuration: a console renderer for a terminal, JSON lines otherwise.

`auto` (the default) picks by where the log goes: a person at a terminal reads the
console renderer; files, pipes and containers (no TTY) get one JSON object per line.

Library code logs through `structlog.get_logger()` with bound ids
(`request_id`, `step_id`); this module only decides how lines are rendered, and
adds the current span's `trace_id` / `span_id` where there is one.
"""

from __future__ import annotations

import logging
import sys

import structlog

from service_common.observability.log_trace_ids import add_trace_ids

LOG_FORMATS = ("auto", "json", "console")


def resolve_log_format(fmt: str, stream=None) -> str:
    """`auto` -> "console" when `stream` (stderr by default) is a terminal, else "json"."""
    if fmt != "auto":
        return fmt
    return "console" if (stream or sys.stderr).isatty() else "json"


def configure_logging(fmt: str = "auto", level: str = "info") -> None:
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {fmt!r}")
    fmt = resolve_log_format(fmt)
    numeric_level = logging.getLevelName(level.upper())
    if not isinstance(numeric_level, int):
        raise ValueError(f"unknown log level {level!r}")
    renderer = structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            add_trace_ids,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    route_stdlib_logging(renderer, numeric_level)


def route_stdlib_logging(renderer, level: int) -> None:
    """Libraries' own log records (the OTLP exporter's retries, grpc's warnings) come out
    rendered like ours, so a JSON log stays JSON on every line. Their warnings and up only."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            foreign_pre_chain=[
                structlog.contextvars.merge_contextvars,
                add_trace_ids,
                structlog.stdlib.add_logger_name,
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                structlog.processors.format_exc_info,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(level, logging.WARNING))
