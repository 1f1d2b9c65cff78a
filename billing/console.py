"""``tokenbus billing report``: the two reports as rich tables."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from billing.reader import QueryError, open_reader
from billing.report import SessionTotals, TenantTotals, fetch
from billing.storage import Row
from tokenbus.config import Settings

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
