"""Logging for every tokenbus service: INFO everywhere, DEBUG for the loggers named in
``Settings.debug_loggers`` (``TOKENBUS_DEBUG_LOGGERS='["workers.replies"]'``).

``TOKENBUS_LOG_FORMAT=json`` writes one JSON object per line (``JsonFormatter``). A line
logged while a request is handled carries that request's fields: the service enters
``request_context(...)`` around the work, and every line logged inside it, in any
module, gets ``tenant``, ``request_id``, ``session_id`` and ``attempt`` (and
``trace_id`` once the request's trace is known) without passing them around.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

import orjson

from tokenbus.config import Settings

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

CONTEXT_FIELDS = ("tenant", "request_id", "session_id", "attempt", "trace_id", "batch_id")
"""What a request's log lines carry, in this order, when known."""

_NONE: Mapping[str, object] = MappingProxyType({})
_context: ContextVar[Mapping[str, object]] = ContextVar("tokenbus_log_context", default=_NONE)


def _merged(fields: Mapping[str, object]) -> Mapping[str, object]:
    unknown = set(fields) - set(CONTEXT_FIELDS)
    if unknown:
        raise ValueError(f"not a log context field: {', '.join(sorted(unknown))}")
    return {**_context.get(), **{k: v for k, v in fields.items() if v is not None}}


@contextmanager
def request_context(**fields: object) -> Iterator[None]:
    """Lines logged inside carry ``fields`` (None values are left out); nests, the inner
    fields winning. Context variables follow tasks, so a task started inside keeps them."""
    token = _context.set(_merged(fields))
    try:
        yield
    finally:
        _context.reset(token)


def bind_request(**fields: object) -> None:
    """``request_context`` for the rest of the current task: where the work outlives a
    ``with`` block, as an HTTP handler's streamed response does (each HTTP request runs
    in a task, and so in a context, of its own)."""
    _context.set(_merged(fields))


def current_context() -> Mapping[str, object]:
    return _context.get()


_RECORD_ATTRS = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``ts`` (UTC, ISO 8601), ``level``, ``logger``,
    ``message``, the request context, then any ``extra=`` fields, and ``exc`` with the
    traceback when there is one. Values JSON cannot hold are written as their ``str``."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update(_context.get())
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRS and not key.startswith("_"):
                line.setdefault(key, value)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return orjson.dumps(line, default=str).decode()


def formatter(settings: Settings) -> logging.Formatter:
    return JsonFormatter() if settings.log_format == "json" else logging.Formatter(FORMAT)


def logging_config(settings: Settings) -> dict[str, Any]:
    """A ``logging.config.dictConfig`` for frameworks that set the handlers up themselves
    (Faust's worker takes it as ``logging_config``)."""
    fmt: dict[str, Any] = (
        {"()": f"{JsonFormatter.__module__}.{JsonFormatter.__qualname__}"}
        if settings.log_format == "json"
        else {"format": FORMAT}
    )
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"tokenbus": fmt},
        "handlers": {"default": {"class": "logging.StreamHandler", "formatter": "tokenbus"}},
        "root": {"level": "INFO", "handlers": ["default"]},
    }


def setup_logging(settings: Settings, *, configure_root: bool = True) -> None:
    """``configure_root=False`` where a framework (Faust) sets the handlers up itself
    (from ``logging_config(settings)``)."""
    if configure_root:
        handler = logging.StreamHandler()
        handler.setFormatter(formatter(settings))
        logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    if settings.log_format == "json":
        logging.captureWarnings(True)  # Python's warnings become log records, so JSON
    for name in settings.debug_loggers:
        logging.getLogger(name).setLevel(logging.DEBUG)
