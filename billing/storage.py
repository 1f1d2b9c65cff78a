"""Where usage rows go: the contract the sink writes through, and its ClickHouse version.

``UsageStore`` is the seam: the sink only knows this protocol, so tests inject fakes
that fail on purpose, and wrappers (metrics, fault injection) wrap it from outside.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol
from urllib.parse import urlparse

import clickhouse_connect

from billing.migrate import apply_migrations
from billing.rows import USAGE_COLUMNS, usage_row
from schemas import UsageEvent

Row = dict[str, Any]


class Queryable(Protocol):
    def query(self, sql: str, parameters: Mapping[str, Any] | None = None) -> list[Row]:
        """Runs one statement; ``{name:Type}`` placeholders bind from ``parameters``."""
        ...


class UsageStore(Queryable, Protocol):
    def insert_usage(self, events: Sequence[UsageEvent]) -> None:
        """Writes one row per event, durably, before it returns.

        The sink commits the batch's Kafka offsets right after this returns, so a return
        must mean the rows survive a crash. The sink calls it again with the same events
        after any exception, and Kafka redelivers events after a crash, so the same event
        may arrive any number of times, even after a partial write: rows must collapse
        by (tenant_id, session_id, request_id, attempt).
        """
        ...


class ClickHouseStore:
    """clickhouse-connect over any DSN: ``chdb:///dir``, ``chdb://memory`` or ``http(s)://``.

    The code is the same for all three; clickhouse-connect picks the embedded engine or
    the HTTP transport from the scheme.
    """

    def __init__(self, dsn: str, *, migrate: bool = True, read_only: bool = False) -> None:
        self.dsn = dsn
        # readonly=1 binds every statement the client sends, so it is the real guard for
        # SQL that comes from outside (the query server's client).
        settings = {"readonly": 1} if read_only else {}
        # "aware": DateTime64('UTC') values come back as UTC datetimes, not naive ones.
        self._client = clickhouse_connect.get_client(dsn=dsn, tz_mode="aware", settings=settings)
        # One client serves one call at a time: over HTTP, calls share a session id that
        # the server locks; on chdb, a handle with an open result stream answers nothing.
        self._lock = threading.Lock()
        try:
            if migrate:
                apply_migrations(self._client)
        except BaseException:
            self._client.close()
            raise

    def insert_usage(self, events: Sequence[UsageEvent]) -> None:
        if not events:
            return
        rows = [usage_row(event) for event in events]
        with self._lock:
            self._client.insert("usage_events", rows, column_names=USAGE_COLUMNS)

    def query(self, sql: str, parameters: Mapping[str, Any] | None = None) -> list[Row]:
        with self._lock:
            result = self._client.query(sql, parameters=dict(parameters or {}))
            return list(result.named_results())

    def close(self) -> None:
        with self._lock:
            self._client.close()

    def __enter__(self) -> ClickHouseStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def chdb_path(dsn: str) -> str | None:
    """The data directory of a ``chdb:///dir`` DSN; None for memory and server DSNs."""
    parsed = urlparse(dsn)
    if parsed.scheme != "chdb":
        return None
    location = parsed.netloc.rpartition("@")[2] if parsed.netloc else parsed.path
    if location in ("", "memory", ":memory:"):
        return None
    return location
