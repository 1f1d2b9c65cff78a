"""BudgetAlert --> a ``budget_alerts`` row (migration 004). Pure."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from schemas.budgets import BudgetAlert

ALERT_COLUMNS: tuple[str, ...] = (
    "tenant_id",
    "alert_id",
    "budget_id",
    "entity",
    "period_start",
    "period_end",
    "threshold",
    "limit_units",
    "spent_units",
    "enforce",
    "reason",
    "fired_at",
)
"""Every column the sink writes; ``inserted_at`` is left to its DEFAULT."""

AlertKey = tuple[str, str]
"""(tenant_id, alert_id): the table's sort key."""


def alert_key(alert: BudgetAlert) -> AlertKey:
    return (alert.tenant_id, alert.alert_id)


def alert_row(alert: BudgetAlert) -> tuple[Any, ...]:
    return (
        alert.tenant_id,
        alert.alert_id,
        alert.budget_id,
        alert.entity,
        _utc(alert.period_start),
        _utc(alert.period_end),
        alert.threshold,
        Decimal(alert.limit_units),
        Decimal(alert.spent_units),
        alert.enforce,
        alert.reason,
        _utc(alert.fired_at),
    )


def _utc(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
