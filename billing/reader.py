"""How a process other than the sink's reads the billing data.

``open_reader(settings)`` picks, for the configured DSN:

a. a ClickHouse server (``http(s)://``) or ``chdb://memory``: a client of its own;
b. ``chdb:///dir`` whose owner answers on the loopback query server: that server;
c. ``chdb:///dir`` with no owner answering: the directory itself. This holds the
   directory while the reader is open, so close readers promptly: a sink starting
   meanwhile cannot open it.

Results from (b) travel as JSON: datetimes arrive as ISO strings and Decimals as strings.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any, Protocol

import orjson
from clickhouse_connect.driver.exceptions import ClickHouseError

from billing.storage import ClickHouseStore, Row, chdb_path
from tokenbus.config import Settings


class QueryError(RuntimeError):
    """A query the database refused, or a database that could not be reached."""


class Reader(Protocol):
    def query(self, sql: str, parameters: Mapping[str, Any] | None = None) -> list[Row]: ...

    def close(self) -> None: ...


class StoreReader:
    """Reads through a ClickHouse client of its own (cases a and c)."""

    def __init__(self, store: ClickHouseStore) -> None:
        self._store = store

    def query(self, sql: str, parameters: Mapping[str, Any] | None = None) -> list[Row]:
        try:
            return self._store.query(sql, parameters)
        except ClickHouseError as exc:
            raise QueryError(str(exc)) from None

    def close(self) -> None:
        self._store.close()


class QueryServerReader:
    """Reads through the sink's loopback query server (case b)."""

    def __init__(self, base_url: str, *, timeout_s: float = 30.0) -> None:
        self.base_url = base_url
        self._timeout_s = timeout_s

    def query(self, sql: str, parameters: Mapping[str, Any] | None = None) -> list[Row]:
        body = orjson.dumps({"sql": sql, "parameters": dict(parameters or {})})
        request = urllib.request.Request(
            f"{self.base_url}/query",
            data=body,
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self._timeout_s) as response:
                rows: list[Row] = orjson.loads(response.read())["rows"]
                return rows
        except urllib.error.HTTPError as exc:
            raise QueryError(_error_message(exc)) from None
        except OSError as exc:
            raise QueryError(f"the billing query server at {self.base_url} failed: {exc}") from None

    def close(self) -> None:
        pass  # one connection per query: nothing held


def open_reader(
    settings: Settings, *, probe_timeout_s: float = 1.0, borrow_directory: bool = True
) -> Reader:
    """``borrow_directory=False``: never case c (a long-running service must not hold
    the sink's directory); a ``QueryError`` instead while its owner does not answer."""
    dsn = settings.clickhouse
    path = chdb_path(dsn)
    if path is None:
        # A server may hand readers a read-only user, so they never migrate it; the
        # embedded memory engine is this process's own, so it gets the schema.
        return _direct(dsn, migrate=dsn.startswith("chdb:"))
    server = QueryServerReader(f"http://127.0.0.1:{settings.billing_query_port}")
    if _owner_answers(server.base_url, path, probe_timeout_s):
        return server
    if not borrow_directory:
        raise QueryError(f"the billing sink that owns {path} does not answer on {server.base_url}")
    # Nobody serves the directory. Migrating it makes a never-used one answer with
    # empty tables rather than UNKNOWN_TABLE.
    return _direct(dsn, migrate=True)


def _direct(dsn: str, *, migrate: bool) -> StoreReader:
    try:
        return StoreReader(ClickHouseStore(dsn, migrate=migrate))
    except ClickHouseError as exc:
        # Typically another process owns the chdb directory and serves no queries.
        raise QueryError(f"cannot open {dsn}: {exc}") from None


def _owner_answers(base_url: str, path: str, timeout_s: float) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/healthz", timeout=timeout_s) as response:
            health = orjson.loads(response.read())
    except (OSError, orjson.JSONDecodeError):
        return False
    # Another stack's sink may hold the port; only the owner of this directory will do.
    owned = health.get("chdb_path") if isinstance(health, dict) else None
    return isinstance(owned, str) and owned == os.path.realpath(path)


def _error_message(exc: urllib.error.HTTPError) -> str:
    try:
        payload = orjson.loads(exc.read())
        if isinstance(payload, dict) and isinstance(payload.get("error"), str):
            return str(payload["error"])
    except (OSError, orjson.JSONDecodeError):
        pass
    return f"HTTP {exc.code} from the billing query server"
