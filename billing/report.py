"""The billing reports, each a value whose ``to_sql()`` is checked without a database.

Every query reads ``usage_events FINAL``, so an attempt delivered twice counts once
whether or not ClickHouse has merged its copies yet. Tenant comes first in every
predicate, GROUP BY and ORDER BY, matching the table's sort key.

Counts: ``num_requests`` counts distinct requests, ``num_attempts`` counts rows (a
request dispatched again after a worker loss has several). Tokens sum over attempts.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from billing.storage import Queryable, Row
from schemas import UsageStatus

_TOTALS = f"""\
    uniqExact(request_id) AS num_requests,
    count() AS num_attempts,
    countIf(status = '{UsageStatus.FAILED.value}') AS num_failed,
    sum(prompt_tokens) AS num_prompt_tokens,
    sum(completion_tokens) AS num_completion_tokens,
    sum(cached_tokens) AS num_cached_tokens"""


@dataclass(frozen=True)
class TenantTotals:
    """One row per tenant."""

    tenant_id: str | None = None
    since: datetime | None = None
    """Attempts created at or after this instant."""
    until: datetime | None = None
    """Attempts created before this instant."""

    def to_sql(self) -> tuple[str, dict[str, Any]]:
        where, parameters = _where(self.tenant_id, None, self.since, self.until)
        sql = (
            f"SELECT\n    tenant_id,\n{_TOTALS}\nFROM usage_events FINAL\n{where}"
            "GROUP BY tenant_id\nORDER BY tenant_id"
        )
        return sql, parameters


@dataclass(frozen=True)
class SessionTotals:
    """One row per (tenant, session), oldest session first (session IDs are ULIDs)."""

    tenant_id: str | None = None
    session_id: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    limit: int | None = 1000

    def to_sql(self) -> tuple[str, dict[str, Any]]:
        where, parameters = _where(self.tenant_id, self.session_id, self.since, self.until)
        sql = (
            f"SELECT\n    tenant_id,\n    session_id,\n{_TOTALS},\n"
            "    min(created_at) AS first_created_at,\n"
            "    max(finished_at) AS last_finished_at\n"
            f"FROM usage_events FINAL\n{where}"
            "GROUP BY tenant_id, session_id\nORDER BY tenant_id, session_id"
        )
        if self.limit is not None:
            sql += "\nLIMIT {limit:UInt64}"
            parameters["limit"] = self.limit
        return sql, parameters


@dataclass(frozen=True)
class BatchTotals:
    """One row per (tenant, batch job) of the batch lines (``batch_id`` set), with their
    cost: what a batch's output usage is checked against, and spend per batch."""

    tenant_id: str | None = None
    batch_id: str | None = None
    since: datetime | None = None
    until: datetime | None = None

    def to_sql(self) -> tuple[str, dict[str, Any]]:
        where, parameters = _where(self.tenant_id, None, self.since, self.until)
        if self.batch_id is not None:
            parameters["batch_id"] = self.batch_id
            batch = "batch_id = {batch_id:String}"
        else:
            batch = "batch_id != ''"
        where = f"{where}  AND {batch}\n" if where else f"WHERE {batch}\n"
        sql = (
            f"SELECT\n    tenant_id,\n    batch_id,\n{_TOTALS},\n"
            "    sum(cost_units) AS cost_units,\n"
            "    sum(billed_units) AS billed_units\n"
            f"FROM usage_events FINAL\n{where}"
            "GROUP BY tenant_id, batch_id\nORDER BY tenant_id, batch_id"
        )
        return sql, parameters


def fetch(source: Queryable, query: TenantTotals | SessionTotals | BatchTotals) -> list[Row]:
    sql, parameters = query.to_sql()
    return source.query(sql, parameters)


def _where(
    tenant_id: str | None, session_id: str | None, since: datetime | None, until: datetime | None
) -> tuple[str, dict[str, Any]]:
    # Values go as server-side {name:Type} parameters, never into the SQL text. They are
    # plain strings so they survive the JSON trip to the query server unchanged.
    predicates: list[str] = []
    parameters: dict[str, Any] = {}
    if tenant_id is not None:
        predicates.append("tenant_id = {tenant_id:String}")
        parameters["tenant_id"] = tenant_id
    if session_id is not None:
        predicates.append("session_id = {session_id:String}")
        parameters["session_id"] = session_id
    if since is not None:
        predicates.append("created_at >= {since:DateTime64(3, 'UTC')}")
        parameters["since"] = _clickhouse_time(since)
    if until is not None:
        predicates.append("created_at < {until:DateTime64(3, 'UTC')}")
        parameters["until"] = _clickhouse_time(until)
    if not predicates:
        return "", parameters
    return "WHERE " + "\n  AND ".join(predicates) + "\n", parameters


def _clickhouse_time(value: datetime) -> str:
    """'YYYY-MM-DD hh:mm:ss.mmm' in UTC: what a DateTime64(3) parameter parses (ISO does not)."""
    if value.tzinfo is None:
        raise ValueError(f"report bounds must be timezone-aware, got naive {value!r}")
    utc = value.astimezone(UTC)
    return utc.strftime("%Y-%m-%d %H:%M:%S.") + f"{utc.microsecond // 1000:03d}"
