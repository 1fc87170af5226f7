"""structlog configuration: JSON lines by default, a console renderer for a terminal.

Library code logs through `structlog.get_logger()` with bound ids
(`request_id`, `step_id`); this module only decides how lines are rendered.
"""

from __future__ import annotations

import logging
import sys

import structlog

LOG_FORMATS = ("json", "console")


def configure_logging(fmt: str = "json", level: str = "info") -> None:
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {fmt!r}")
    numeric_level = logging.getLevelName(level.upper())
    if not isinstance(numeric_level, int):
        raise ValueError(f"unknown log level {level!r}")
    renderer = structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
