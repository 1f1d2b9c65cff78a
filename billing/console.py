"""``tokenbus billing report`` and ``tokenbus billing query``: results as rich tables."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Any

from rich.console import Console
from rich.table import Table

from billing.queries import QueryParamError, dashboard_queries, dashboard_query
from billing.reader import QueryError, open_reader
from billing.report import SessionTotals, TenantTotals, fetch
from billing.storage import Row
from tokenbus.config import Settings

# Decimals come back as text through the query server (JSON keeps every digit).
_DECIMAL_TEXT = re.compile(r"^-?\d+\.\d+$")

_COUNTS = (
    ("num_requests", "requests"),
    ("num_attempts", "attempts"),
    ("num_failed", "failed"),
    ("num_prompt_tokens", "prompt tokens"),
    ("num_completion_tokens", "completion tokens"),
    ("num_cached_tokens", "cached tokens"),
)


def billing_report(
    settings: Settings, console: Console, *, tenant: str | None = None, limit: int = 1000
) -> None:
    """Prints per-tenant and per-session totals; exits with status 1 if it cannot read."""
    try:
        reader = open_reader(settings)
        try:
            tenants = fetch(reader, TenantTotals(tenant_id=tenant))
            sessions = fetch(reader, SessionTotals(tenant_id=tenant, limit=limit))
        finally:
            reader.close()
    except QueryError as exc:
        console.print(f"[red]error:[/red] cannot read billing data: {exc}")
        raise SystemExit(1) from None
    console.print(_table("Usage per tenant", ("tenant_id",), tenants))
    title = "Usage per session" + (f" (first {limit})" if len(sessions) >= limit else "")
    console.print(_table(title, ("tenant_id", "session_id"), sessions))


def _table(title: str, keys: Sequence[str], rows: list[Row]) -> Table:
    table = Table(title=title)
    for key in keys:
        table.add_column(key.removesuffix("_id"))
    for _, header in _COUNTS:
        table.add_column(header, justify="right")
    for row in rows:
        table.add_row(
            *(str(row[key]) for key in keys), *(f"{int(row[name]):,}" for name, _ in _COUNTS)
        )
    if not rows:
        table.caption = "no usage recorded yet"
    return table


def billing_query(
    settings: Settings, console: Console, name: str, params: Mapping[str, str]
) -> None:
    """Runs one dashboard query and prints its rows; exits with status 1 on an error."""
    try:
        query = dashboard_query(name)
        sql, values = query.to_sql(params)
        reader = open_reader(settings)
        try:
            rows = reader.query(sql, values)
        finally:
            reader.close()
    except (QueryParamError, QueryError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise SystemExit(1) from None
    shown = ", ".join(f"{key}={value!r}" for key, value in values.items())
    if not rows:
        console.print(f"{query.title}: no rows ({shown})")
        return
    table = Table(title=query.title, caption=shown)
    columns = list(rows[0])
    for column in columns:
        numeric = isinstance(rows[0][column], int | float | Decimal) or bool(
            _DECIMAL_TEXT.match(str(rows[0][column]))
        )
        table.add_column(column, justify="right" if numeric else "left")
    for row in rows:
        table.add_row(*(_cell(row[column]) for column in columns))
    console.print(table)


def list_queries(console: Console) -> None:
    table = Table(title="Dashboard queries (tokenbus billing query NAME --param key=value)")
    table.add_column("name")
    table.add_column("question")
    table.add_column("parameters (default)")
    for query in dashboard_queries().values():
        params = ", ".join(f"{p.name}={p.default!r}" for p in query.params)
        table.add_row(query.name, query.title, params)
    console.print(table)


def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.6g}"
    if isinstance(value, Decimal) or _DECIMAL_TEXT.match(str(value)):
        # Nine decimals of zeros say nothing; the digits that are there all stay.
        text = format(Decimal(str(value)), "f")
        return text.rstrip("0").rstrip(".") if "." in text else text
    return str(value)
