"""structlog setup shared by the kvrail processes: JSON lines when stderr is not a terminal
(containers, log shippers), readable console lines on a terminal; level from the settings.

The standard-library loggers (the engine's `kvrail.engine`, uvicorn) are rendered by the same
processors, so every line has one format. Bind per-request context with
`log.bind(request_id=...)`.
"""

from __future__ import annotations

import logging
import sys

import structlog

from service.settings import Settings


def configure_logging(settings: Settings) -> None:
    """Configure structlog and the root logger once per process (idempotent)."""
    as_json = settings.log_json
    if as_json is None:
        as_json = not sys.stderr.isatty()
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer = structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            # The console renderer prints tracebacks itself; JSON needs them as a field.
            *([structlog.processors.format_exc_info] if as_json else []),
            renderer,
        ],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.logging_level)
