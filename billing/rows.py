"""UsageEvent + its Charge --> a ``usage_events`` row. Pure: the only encoding step."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from billing.pricing import Charge
from billing.usage_codec import Usage
from schemas import FinishReason, UsageStatus

USAGE_COLUMNS: tuple[str, ...] = (
    "tenant_id",
    "session_id",
    "request_id",
    "attempt",
    "model",
    "adapter",
    "worker_id",
    "priority",
    "status",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "queue_ms",
    "ttft_ms",
    "total_ms",
    "error_code",
    "overload_tier",
    "precision",
    "flags",
    "cost_weight",
    "cost_units",
    "billed_units",
    "price_version",
    "key_sha256",
    "created_at",
    "finished_at",
)
"""Every column the sink writes; ``inserted_at`` is left to its DEFAULT."""

_UNSIGNED_FIELDS = ("attempt", "num_prompt_tokens", "num_completion_tokens", "num_cached_tokens")


class UnstorableEvent(ValueError):
    """An event that decoded but cannot be a row; the sink dead-letters it.

    Retrying would never help, and one such event must not hold up the whole batch.
    """


def check_storable(event: Usage) -> None:
    """Raises UnstorableEvent for an event no row can hold (a negative count)."""
    if (
        event.attempt >= 0
        and event.num_prompt_tokens >= 0
        and event.num_completion_tokens >= 0
        and event.num_cached_tokens >= 0
    ):
        return  # every field of _UNSIGNED_FIELDS: the common case, without getattr
    for name in _UNSIGNED_FIELDS:
        if getattr(event, name) < 0:
            raise UnstorableEvent(f"{name} must not be negative, got {getattr(event, name)}")


def usage_row(event: Usage, charge: Charge) -> tuple[Any, ...]:
    check_storable(event)
    return (
        event.tenant_id,
        event.session_id,
        event.request_id,
        event.attempt,
        event.model,
        event.adapter or "",
        event.worker_id or "",
        event.priority,
        _VALUES[event.status],
        _VALUES[event.finish_reason] if event.finish_reason is not None else "",
        event.num_prompt_tokens,
        event.num_completion_tokens,
        event.num_cached_tokens,
        event.queue_ms,
        event.ttft_ms,
        event.total_ms,
        event.error_code or "",
        event.overload_tier,
        event.precision,
        event.flags,
        charge.cost_weight,
        charge.cost_units,
        charge.billed_units,
        charge.price_version,
        event.key_sha256 or "",
        _utc(event.created_at),
        _utc(event.finished_at),
    )


_VALUES: dict[UsageStatus | FinishReason, str] = {
    member: member.value for enum in (UsageStatus, FinishReason) for member in enum
}
"""Each status and finish reason --> its text: a lookup, not an enum property per row."""


def _utc(value: datetime) -> datetime:
    # clickhouse-connect turns a naive datetime into epoch seconds with the *host's* local
    # zone; the bus speaks UTC, so a naive timestamp from a producer is taken as UTC.
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
