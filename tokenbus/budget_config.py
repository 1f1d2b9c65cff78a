"""Spend budgets as configured: in the tenants file, on the budgets topic, on the CLI.

A budget caps what one entity may cost over a period, in the price table's cost units:

    [[tenants.acme.budgets]]        # the tenant (a tenant x model pair with ``model``)
    limit = "500"
    period = "month"                # day | week | month | rolling:24h
    tz = "Europe/Berlin"            # calendar periods; default: Settings.budget_tz
    enforce = "hard"                # hard: refuse; soft: alert only
    thresholds = [50, 80, 95, 100]  # percent; each alerts once per period

    [[tenants.acme.budgets]]        # one API key of the tenant, by its SHA-256
    key_sha256 = "9f86d0..."
    limit = "20"
    period = "day"

    [[budgets]]                     # a model (or adapter) across every tenant
    model = "tiny-llama"
    limit = "10000"
    period = "month"

``entity`` names what a budget caps, ``tenant:acme``, ``key:<sha256>``,
``model:tiny-llama`` or ``tenant_model:acme/tiny-llama``; with its period it names the
budget (``BudgetConfig.budget_id``), which is also its key on the budgets topic.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from schemas import TENANT_ID_PATTERN

PERIOD_PATTERN = r"^(day|week|month|rolling:[1-9][0-9]{0,3}h)$"
MODEL_NAME_PATTERN = r"^[^|@\s\x00-\x1f\x7f]{1,256}$"
SCOPES = ("tenant", "key", "model", "tenant_model")
DEFAULT_THRESHOLDS = (50, 80, 95, 100)


class BudgetConfig(BaseModel):
    """One budget. In the tenants file ``tenant`` comes from the table it sits in."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    limit: Annotated[Decimal, Field(ge=0, decimal_places=9)]
    period: Annotated[str, Field(pattern=PERIOD_PATTERN)] = "month"
    tz: str | None = None
    enforce: Literal["hard", "soft"] = "hard"
    thresholds: tuple[int, ...] = DEFAULT_THRESHOLDS
    tenant: Annotated[str, Field(pattern=TENANT_ID_PATTERN)] | None = None
    model: Annotated[str, Field(pattern=MODEL_NAME_PATTERN)] | None = None
    """No ``|``, ``@``, whitespace or control character: the budget's id joins its parts
    with them (``budget_id``), and the job's spend keys with a tab."""
    key_sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = None

    @field_validator("thresholds")
    @classmethod
    def _percentages(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(not 0 < t <= 100 for t in value):
            raise ValueError("thresholds are percentages in 1..100")
        return tuple(sorted(set(value)))

    @field_validator("tz")
    @classmethod
    def _zone(cls, value: str | None) -> str | None:
        if value is not None:
            from zoneinfo import ZoneInfo

            ZoneInfo(value)  # an unknown zone fails here, where the budget is read
        return value

    @property
    def scope(self) -> str:
        if self.key_sha256 is not None:
            return "key"
        if self.tenant is not None:
            return "tenant_model" if self.model is not None else "tenant"
        if self.model is not None:
            return "model"
        raise ValueError("a budget names a tenant, a key or a model")

    @property
    def entity(self) -> str:
        scope = self.scope
        if scope == "key":
            return f"key:{self.key_sha256}"
        if scope == "tenant":
            return f"tenant:{self.tenant}"
        if scope == "model":
            return f"model:{self.model}"
        return f"tenant_model:{self.tenant}/{self.model}"

    def budget_id(self, default_tz: str) -> str:
        """``entity|period``: calendar periods carry their zone (one entity may have a
        monthly and a daily budget, or months in two zones)."""
        zone = "" if self.period.startswith("rolling") else f"@{self.tz or default_tz}"
        return f"{self.entity}|{self.period}{zone}"


def parse_budget_id(budget_id: str) -> tuple[str, str, str | None]:
    """``entity|period[@tz]`` --> (entity, period, tz)."""
    match = re.fullmatch(r"([a-z_]+:[^|]+)\|([a-z0-9:]+)(?:@(.+))?", budget_id)
    if match is None:
        raise ValueError(f"not a budget id: {budget_id!r}")
    return match.group(1), match.group(2), match.group(3)
