"""A budget alert: what the job writes to ``budget-alerts`` when spend reaches a threshold."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from schemas.messages import Message


class BudgetAlert(Message):
    """One threshold of one budget in one period; fired once (``alert_id`` says which,
    so a receiver can drop a repeat after a crash between sending and committing)."""

    alert_id: str
    """``budget_id|bucket|threshold``."""
    budget_id: str
    entity: str
    """``tenant:acme``, ``key:<sha256>``, ``model:m`` or ``tenant_model:acme/m``."""
    tenant_id: str
    """The tenant whose request brought spend to the threshold."""
    period_start: datetime
    period_end: datetime
    threshold: int
    """Percent of the limit."""
    limit_units: str
    """Decimal strings, in the price table's cost units, exact to nine places."""
    spent_units: str
    enforce: Literal["hard", "soft"]
    reason: Literal["threshold", "refused"] = "threshold"
    """``refused``: a hard budget refused its first request of the period."""
    fired_at: datetime
