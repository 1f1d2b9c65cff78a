"""UsageEvent + its Charge --> a ``usage_events`` row. Pure: the only encoding step."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from itertools import repeat
from operator import attrgetter, floordiv, sub
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


def usage_columns(events: Sequence[Usage], charges: Sequence[Charge]) -> list[Sequence[Any]]:
    """``usage_row`` of each event and its charge, by column (``USAGE_COLUMNS`` order),
    with ``created_at`` and ``finished_at`` as DateTime64(3) ticks (``millis``).

    The same values the rows hold, read straight into columns: the sink's insert is
    column-oriented, and a tuple per row, taken apart again, was work for nothing.
    """
    if not events:
        return [[] for _ in USAGE_COLUMNS]
    (
        tenant,
        session,
        request,
        attempt,
        model,
        adapter,
        worker,
        priority,
        status,
        finish_reason,
        prompt,
        completion,
        cached,
        queue_ms,
        ttft_ms,
        total_ms,
        error_code,
        overload_tier,
        precision,
        flags,
        key_sha256,
        created_at,
        finished_at,
    ) = zip(*map(_EVENT_FIELDS, events), strict=True)
    if min(attempt) < 0 or min(prompt) < 0 or min(completion) < 0 or min(cached) < 0:
        for event in events:
            check_storable(event)  # raises, naming the field
    cost_weight, cost_units, billed_units, price_version = zip(*charges, strict=True)
    if len(cost_weight) != len(events):
        raise ValueError(f"{len(events)} events but {len(cost_weight)} charges")
    return [
        tenant,
        session,
        request,
        attempt,
        model,
        _or_empty(adapter),
        _or_empty(worker),
        priority,
        list(map(_VALUES.__getitem__, status)),
        list(map(_FINISH_VALUES.__getitem__, finish_reason)),
        prompt,
        completion,
        cached,
        queue_ms,
        ttft_ms,
        total_ms,
        _or_empty(error_code),
        overload_tier,
        precision,
        flags,
        cost_weight,
        cost_units,
        billed_units,
        price_version,
        _or_empty(key_sha256),
        millis(created_at),
        millis(finished_at),
    ]


def millis(column: Sequence[datetime]) -> list[int]:
    """DateTime64(3) ticks of each instant, as clickhouse-connect computes them:
    milliseconds since the epoch, rounded down; a naive instant is taken as UTC."""
    try:
        # In C, for the aware instants producers send: the difference, then the division.
        return list(map(floordiv, map(sub, column, repeat(_EPOCH)), repeat(_MILLISECOND)))
    except TypeError:  # a naive one among them
        return [
            ((at if at.tzinfo is not None else at.replace(tzinfo=UTC)) - _EPOCH) // _MILLISECOND
            for at in column
        ]


def _or_empty(column: Sequence[str | None]) -> Sequence[str]:
    if None not in column:
        return column  # type: ignore[return-value]
    return [value or "" for value in column]


_EVENT_FIELDS = attrgetter(
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
    "num_prompt_tokens",
    "num_completion_tokens",
    "num_cached_tokens",
    "queue_ms",
    "ttft_ms",
    "total_ms",
    "error_code",
    "overload_tier",
    "precision",
    "flags",
    "key_sha256",
    "created_at",
    "finished_at",
)
"""The event's fields ``usage_columns`` reads, in one C call per event."""
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MILLISECOND = timedelta(milliseconds=1)

_VALUES: dict[UsageStatus | FinishReason, str] = {
    member: member.value for enum in (UsageStatus, FinishReason) for member in enum
}
"""Each status and finish reason --> its text: a lookup, not an enum property per row."""
_FINISH_VALUES: dict[FinishReason | None, str] = {
    None: "",
    **{member: member.value for member in FinishReason},
}


def _utc(value: datetime) -> datetime:
    # clickhouse-connect turns a naive datetime into epoch seconds with the *host's* local
    # zone; the bus speaks UTC, so a naive timestamp from a producer is taken as UTC.
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
