"""structlog, configured once: JSON lines to stdout with stable event names and bound fields."""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog

_configured = False


def configure(service: str, level: str = "info", json: bool = True) -> structlog.stdlib.BoundLogger:
    """Configure logging for this process (idempotent) and return a logger bound to `service`."""
    global _configured
    if not _configured:
        renderer: Any = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
        structlog.configure(
            processors=[
                structlog.contextvars.merge_contextvars,
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                structlog.processors.format_exc_info,
                renderer,
            ],
            wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
            logger_factory=structlog.PrintLoggerFactory(file=sys.stdout),
            cache_logger_on_first_use=True,
        )
        _configured = True
    return get(service)


def get(service: str, **fields: Any) -> structlog.stdlib.BoundLogger:
    logger: structlog.stdlib.BoundLogger = structlog.get_logger().bind(service=service, **fields)
    return logger


def to_stream(stream: TextIO, service: str, level: str = "warning") -> structlog.stdlib.BoundLogger:
    """A logger of its own, apart from `configure`: plain `event key=value` lines at `level` and above to `stream`
    (a command-line tool's stderr, whose stdout holds its output)."""
    logger: structlog.stdlib.BoundLogger = structlog.wrap_logger(
        structlog.PrintLogger(file=stream),
        processors=[structlog.processors.add_log_level, structlog.dev.ConsoleRenderer(colors=False)],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
    ).bind(service=service)
    return logger
