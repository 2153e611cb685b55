"""Structured logging (structlog). Every record of a shard's work carries ``model``,
``version``, ``replica`` and ``shard`` fields; :func:`configure` picks console or JSON output.

Nothing is configured at import time: a process that never calls :func:`configure` gets
structlog's defaults (or the application's own configuration).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

__all__ = ["configure", "get_logger"]


def configure(fmt: str | None = None, level: str | None = None) -> None:
    """Configure structlog for this process.

    Args:
        fmt: ``"console"`` (default) or ``"json"``; ``$TENSORHUB_LOG_FORMAT`` if None.
        level: a logging level name; ``$TENSORHUB_LOG_LEVEL`` if None, else ``info``.
    """
    fmt = fmt or os.environ.get("TENSORHUB_LOG_FORMAT", "console")
    level = (level or os.environ.get("TENSORHUB_LOG_LEVEL", "info")).upper()
    if fmt not in ("console", "json"):
        raise ValueError(f"log format must be 'console' or 'json', got {fmt!r}")
    if level not in logging._nameToLevel:
        raise ValueError(f"unknown log level {level!r}")
    renderer: Any = structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging._nameToLevel[level]),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(**fields: Any) -> Any:
    """A bound logger carrying ``fields`` (e.g. model, replica, shard). If nobody configured
    structlog, the first call configures it (console, ``$TENSORHUB_LOG_LEVEL`` or warnings)."""
    if not structlog.is_configured():
        configure(level=os.environ.get("TENSORHUB_LOG_LEVEL", "warning"))
    return structlog.get_logger("tensorhub").bind(**fields)
