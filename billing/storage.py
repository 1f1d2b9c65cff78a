"""Where usage rows go: the contract the sink writes through, and its ClickHouse version.

``UsageStore`` is the seam: the sink only knows this protocol, so tests inject fakes
that fail on purpose, and wrappers (metrics, fault injection) wrap it from outside.
"""

from __future__ import annotations

import decimal
import sys
import threading
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol
from urllib.parse import urlparse

import clickhouse_connect
from clickhouse_connect.datatypes.base import ClickHouseType
from clickhouse_connect.datatypes.numeric import BigDecimal

from billing.alert_rows import ALERT_COLUMNS, AlertKey
from billing.dedup import SUPERSEDED, Attempt, RequestKey, Stored, UsageKey
from billing.migrate import apply_migrations
from billing.native_writers import faster_writer
from billing.rows import USAGE_COLUMNS
from billing.traces import SPAN_COLUMNS
from tokenbus.pricing import PriceBook

Row = dict[str, Any]


@dataclass(frozen=True)
class StoredAttempts:
    attempts: list[Attempt]
    """Every stored attempt created at or after ``complete_from``."""
    complete_from: datetime | None
    """None: ``attempts`` are all the stored attempts."""


class Queryable(Protocol):
    def query(self, sql: str, parameters: Mapping[str, Any] | None = None) -> list[Row]:
        """Runs one statement; ``{name:Type}`` placeholders bind from ``parameters``."""
        ...


class UsageStore(Queryable, Protocol):
    """What the sink writes through. Calls come from one thread at a time."""

    def look_up(self, keys: Sequence[UsageKey]) -> Stored:
        """The keys among ``keys`` that ``usage_events`` already holds, and their requests
        that have a billed run there (``billing.dedup.Stored``)."""
        ...

    def recent_attempts(self, limit: int, window_s: float) -> StoredAttempts:
        """The stored attempts created at most ``window_s`` before the newest one, at most
        ``limit`` of them (the newest), and the instant from which that list is complete."""
        ...

    def insert_columns(self, columns: Sequence[Sequence[Any]], *, dedup_token: str) -> None:
        """Writes the columns (``USAGE_COLUMNS`` order, as ``billing.rows.usage_columns``
        makes them: timestamps as DateTime64(3) ticks, costs in integer nano-units)
        durably, as one block, before returning. A block holds each attempt (key) once,
        as the sink's plans do.

        The sink commits the batch's offsets right after this returns, so a return must
        mean the rows survive a crash. After an exception the sink calls it again with
        the same columns and token: a store must drop the repeat of a block that did land
        (ClickHouse does, by ``insert_deduplication_token``), rollups included.
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
        self._usage_types: list[ClickHouseType] | None = None
        """The insert types of ``USAGE_COLUMNS``, read once from the table."""
        self._span_types: list[ClickHouseType] | None = None
        """The insert types of ``SPAN_COLUMNS``, read once: no ``DESCRIBE`` per insert."""
        try:
            if migrate:
                apply_migrations(self._client)
        except BaseException:
            self._client.close()
            raise

    def look_up(self, keys: Sequence[UsageKey]) -> Stored:
        wanted = set(keys)
        requests = {key[:3] for key in wanted}
        found: set[UsageKey] = set()
        billed: set[RequestKey] = set()
        ordered = sorted(wanted)
        for start in range(0, len(ordered), _KEYS_PER_LOOKUP):
            chunk = ordered[start : start + _KEYS_PER_LOOKUP]
            # Three IN sets on the leading sort-key columns: the primary index narrows
            # the read to the granules these tenants, sessions and requests can be in.
            # The sets match a few extra combinations; the exact keys are picked below.
            parameters = {
                "tenants": sorted({k[0] for k in chunk}),
                "sessions": sorted({k[1] for k in chunk}),
                "requests": sorted({k[2] for k in chunk}),
                "superseded": SUPERSEDED,
            }
            with self._lock:
                result = self._client.query(_LOOK_UP_SQL, parameters=parameters)
            for row in result.result_rows:
                key = _key(row)
                if key in wanted:
                    found.add(key)
                if row[4] and key[:3] in requests:
                    billed.add(key[:3])
        return Stored(found, billed)

    def recent_attempts(self, limit: int, window_s: float) -> StoredAttempts:
        with self._lock:
            [(num_rows, newest)] = self._client.query(_NEWEST_SQL).result_rows
            if not num_rows:
                return StoredAttempts([], None)
            since = newest - timedelta(seconds=window_s)
            result = self._client.query(
                _RECENT_SQL, parameters={"since": since, "limit": max(0, limit) + 1}
            )
        attempts = [(_key(row), row[4]) for row in result.result_rows]
        if len(attempts) <= limit:
            return StoredAttempts(attempts, since)
        # More than `limit` in the window: complete only after the instant that cut it.
        cutoff = attempts[limit][1]
        kept = [attempt for attempt in attempts[:limit] if attempt[1] > cutoff]
        return StoredAttempts(kept, cutoff + timedelta(milliseconds=1))

    def _insert_types(self) -> list[ClickHouseType]:
        with self._lock:
            if self._usage_types is None:
                self._usage_types = _usage_insert_types(self._client)
            return self._usage_types

    def insert_columns(self, columns: Sequence[Sequence[Any]], *, dedup_token: str) -> None:
        if not columns or not columns[0]:
            return
        column_types = self._insert_types()
        # clickhouse-connect's insert context keeps its data in a reference cycle (it
        # holds a bound method of itself), which only the cycle collector frees: given a
        # list of our own, emptied afterwards, it keeps no column alive, so the columns
        # go with their last reference and the collection after a batch walks none.
        data = list(columns)
        try:
            with self._lock:
                self._client.insert(
                    "usage_events",
                    data,
                    column_names=USAGE_COLUMNS,
                    column_types=column_types,
                    column_oriented=True,
                    settings={**_USAGE_INSERT_SETTINGS, "insert_deduplication_token": dedup_token},
                )
        finally:
            data.clear()

    def existing_alert_keys(self, keys: Sequence[AlertKey]) -> set[AlertKey]:
        """The (tenant, alert id) keys among ``keys`` that ``budget_alerts`` holds."""
        if not keys:
            return set()
        parameters = {
            "tenants": sorted({k[0] for k in keys}),
            "alerts": sorted({k[1] for k in keys}),
        }
        with self._lock:
            result = self._client.query(_EXISTING_ALERTS_SQL, parameters=parameters)
        wanted = set(keys)
        return {(row[0], row[1]) for row in result.result_rows} & wanted

    def insert_alerts(self, rows: Sequence[tuple[Any, ...]], *, dedup_token: str) -> None:
        """Writes alert rows (``ALERT_COLUMNS`` order) as one block; a repeat of a block
        that landed, with the same token, is dropped."""
        if not rows:
            return
        with self._lock:
            self._client.insert(
                "budget_alerts",
                list(rows),
                column_names=ALERT_COLUMNS,
                settings={**_DEDUP_SETTINGS, "insert_deduplication_token": dedup_token},
            )

    def insert_spans(self, rows: Sequence[tuple[Any, ...]]) -> None:
        """Writes span rows (``SPAN_COLUMNS`` order); a repeat is merged away by the
        table's key (``ReplacingMergeTree``), so no dedup token is needed."""
        if not rows:
            return
        with self._lock:
            if self._span_types is None:
                context = self._client.create_insert_context("spans", column_names=SPAN_COLUMNS)
                # name, service and status are LowCardinality: C loops for their dictionaries
                self._span_types = [faster_writer(t) for t in context.column_types]
            data = list(rows)  # emptied after: see ``insert_columns``
            try:
                self._client.insert(
                    "spans",
                    data,
                    column_names=SPAN_COLUMNS,
                    column_types=self._span_types,
                    settings=_SPAN_INSERT_SETTINGS,
                )
            finally:
                data.clear()

    def sync_prices(self, book: PriceBook) -> int:
        """Copies the book into ``prices``; returns how many versions were new.

        A version is immutable once stored: the same (model, version) with other amounts
        or another start raises ``PriceConflict`` rather than re-pricing history.
        """
        with self._lock:
            stored = {
                (row[0], row[1]): row[2:]
                for row in self._client.query(_STORED_PRICES_SQL).result_rows
            }
        new = []
        for price in book.prices:
            values = (
                price.effective_from,
                price.input_per_1k,
                price.output_per_1k,
                price.cached_input_per_1k,
            )
            known = stored.get((price.model, price.version))
            if known is None:
                new.append((price.model, price.version, *values))
            elif tuple(known) != values:
                raise PriceConflict(
                    f"price version {price.version} of model {price.model!r} is stored as "
                    f"{known}, the price file says {values}: add a new version instead"
                )
        if new:
            with self._lock:
                self._client.insert("prices", new, column_names=_PRICE_COLUMNS)
        return len(new)

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


class PriceConflict(RuntimeError):
    """The price file changes a price version ClickHouse already holds."""


_KEYS_PER_LOOKUP = 5_000
"""Keys per lookup query: over HTTP the parameters travel in the URL, which has limits."""
_LOOK_UP_SQL = """\
SELECT tenant_id, session_id, request_id, attempt,
       status != 'rejected' AND NOT has(flags, {superseded:String}) AS billed
FROM usage_events
WHERE tenant_id IN {tenants:Array(String)}
  AND session_id IN {sessions:Array(String)}
  AND request_id IN {requests:Array(String)}"""
_NEWEST_SQL = "SELECT count(), max(created_at) FROM usage_events"
_RECENT_SQL = """\
SELECT tenant_id, session_id, request_id, attempt, created_at
FROM usage_events
WHERE created_at >= {since:DateTime64(3, 'UTC')}
ORDER BY created_at DESC
LIMIT {limit:UInt64}"""
_EXISTING_ALERTS_SQL = """\
SELECT tenant_id, alert_id
FROM budget_alerts
WHERE tenant_id IN {tenants:Array(String)}
  AND alert_id IN {alerts:Array(String)}"""
_DEDUP_SETTINGS: dict[str, Any] = {
    # The default, said out loud: the sink's retries rely on it.
    "insert_deduplicate": 1,
}
_ANY_PARTITIONS: dict[str, Any] = {
    # A block whose rows fall in more than ``max_partitions_per_insert_block`` (100)
    # partitions (usage by month, spans by day: old or far-future timestamps) is written,
    # with a warning in ClickHouse's log, rather than refused: refused, the sink would
    # retry the same block forever and every tenant's writes would stop behind it.
    "throw_on_max_partitions_per_insert_block": 0,
}
_USAGE_INSERT_SETTINGS: dict[str, Any] = {
    **_DEDUP_SETTINGS,
    **_ANY_PARTITIONS,
    # A block of the sink's holds each attempt once (``billing.dedup.keyed_first_copies``),
    # so the ReplacingMergeTree merge that ClickHouse runs on each inserted block by
    # default would find nothing to collapse: it was a third of the insert's CPU.
    "optimize_on_insert": 0,
}
_SPAN_INSERT_SETTINGS: dict[str, Any] = {
    **_ANY_PARTITIONS,
    # Readers of ``spans`` use FINAL, so a span written twice is read once whether or not
    # the insert collapsed it; the collapse on insert was a tenth of the insert's CPU.
    "optimize_on_insert": 0,
}
_PRICE_COLUMNS = [
    "model",
    "version",
    "effective_from",
    "input_per_1k",
    "output_per_1k",
    "cached_input_per_1k",
]
_STORED_PRICES_SQL = f"SELECT {', '.join(_PRICE_COLUMNS)} FROM prices FINAL"


class ScaledDecimal(BigDecimal, registered=False):  # type: ignore[misc]
    """A wide ``Decimal(P, S)`` column written as clickhouse-connect writes it, in fewer steps.

    clickhouse-connect turns each value into text and back (``int(Decimal(str(x)) * 10**S)``);
    moving the decimal point (``scaleb``) gives the same integer, rounded down towards
    zero alike, without the text: that was most of the cost of writing a cost column.
    """

    def _write_column_binary(self, column: Sequence[Any], dest: bytearray, _ctx: Any) -> None:
        self._write_scaled(self.scaled(column), dest)

    def scaled(self, column: Sequence[Any]) -> list[int]:
        """The values as the integers the column holds: each times ``10**S``, cut
        towards zero (a null as 0, its mask is written apart)."""
        with decimal.localcontext() as ctx:
            ctx.prec = self.prec
            scale = self.scale
            # Decimal(str(x)) is x itself for a Decimal; a float or text is read as
            # clickhouse-connect reads it. int() rounds towards zero, as it does.
            return [
                0
                if self.nullable and not x
                else int(
                    (x if type(x) is decimal.Decimal else decimal.Decimal(str(x))).scaleb(scale)
                )
                for x in column
            ]

    def _write_scaled(self, ints: Sequence[int], dest: bytearray) -> None:
        if _LITTLE and self.byte_size == 16 and ints and min(ints) >= _INT64_MIN:
            if max(ints) <= _INT64_MAX:
                # Little-endian Int128 from int64 halves: the value, then its sign
                # extension (zeros already, unless a value is negative).
                words = array("q", bytes(16 * len(ints)))
                words[0::2] = array("q", ints)
                if min(ints) < 0:
                    words[1::2] = array("q", [v >> 63 for v in ints])
                dest += words.tobytes()
                return
        for v in ints:
            dest += v.to_bytes(self.byte_size, "little", signed=True)


class ScaledIntegers(ScaledDecimal, registered=False):  # type: ignore[misc]
    """``ScaledDecimal`` given the integers the column holds (``ScaledDecimal.scaled``):
    nano-units for a cost column, as ``Pricer.charge_nanos`` computes them, so no
    ``Decimal`` is made and taken apart again. A null is written as 0 under its mask."""

    def _write_column_binary(self, column: Sequence[Any], dest: bytearray, _ctx: Any) -> None:
        if self.nullable and None in column:
            column = [0 if x is None else x for x in column]
        self._write_scaled(column, dest)


_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
_LITTLE = sys.byteorder == "little"
"""array("q") writes native order; the Native format is little-endian."""


def _usage_insert_types(client: Any) -> list[ClickHouseType]:
    """The table's types for ``USAGE_COLUMNS``, the wide Decimals as ``ScaledIntegers``
    (``insert_columns`` is given their values scaled), the low-cardinality and array
    columns by ``billing.native_writers``.

    Given to each insert, they also spare it a ``DESCRIBE`` of the table.
    """
    context = client.create_insert_context("usage_events", column_names=list(USAGE_COLUMNS))
    return [faster_writer(_scaled_decimal(t, ScaledIntegers)) for t in context.column_types]


def _scaled_decimal(
    column_type: ClickHouseType, as_type: type[ScaledDecimal] = ScaledDecimal
) -> ClickHouseType:
    if type(column_type) is not BigDecimal:
        return column_type
    size = column_type.byte_size * 8
    return as_type(column_type.type_def, column_type.prec, size, column_type.scale)


def _key(row: Sequence[Any]) -> UsageKey:
    return (row[0], row[1], row[2], int(row[3]))


def chdb_path(dsn: str) -> str | None:
    """The data directory of a ``chdb:///dir`` DSN; None for memory and server DSNs."""
    parsed = urlparse(dsn)
    if parsed.scheme != "chdb":
        return None
    location = parsed.netloc.rpartition("@")[2] if parsed.netloc else parsed.path
    if location in ("", "memory", ":memory:"):
        return None
    return location
