"""UsageEvents + their charges --> ``usage_events`` columns. Pure: the only encoding step."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from billing.usage_codec import MAX_COUNT, Usage
from schemas import FinishReason, UsageStatus
from tokenbus.pricing import NanoCharge

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
    "batch_id",
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
    """Raises UnstorableEvent for an event no row can hold: a count that is negative or
    past its UInt32 column (ClickHouse would refuse the whole insert, every retry)."""
    if (
        0 <= event.attempt <= MAX_COUNT
        and 0 <= event.num_prompt_tokens <= MAX_COUNT
        and 0 <= event.num_completion_tokens <= MAX_COUNT
        and 0 <= event.num_cached_tokens <= MAX_COUNT
    ):
        return  # every field of _UNSIGNED_FIELDS: the common case, without getattr
    for name in _UNSIGNED_FIELDS:
        value = getattr(event, name)
        if value < 0:
            raise UnstorableEvent(f"{name} must not be negative, got {value}")
        if value > MAX_COUNT:
            raise UnstorableEvent(f"{name} must be at most {MAX_COUNT}, got {value}")


def usage_columns(events: Sequence[Usage], charges: Sequence[NanoCharge]) -> list[Sequence[Any]]:
    """The ``usage_events`` values of each event and its charge, by column
    (``USAGE_COLUMNS`` order), with ``created_at`` and ``finished_at`` as DateTime64(3)
    ticks (``millis``, UTC: a naive instant is taken as UTC, as the bus speaks UTC), the
    costs in integer nano-units (``Pricer.charge_nanos``), as the table holds them, and
    the statuses and finish reasons as their texts.

    By column because the sink's insert is column-oriented. One comprehension per
    column: an attribute read there is cheaper than through ``attrgetter``, or than a
    tuple per event transposed.
    """
    if len(charges) != len(events):
        raise ValueError(f"{len(events)} events but {len(charges)} charges")
    if not events:
        return [[] for _ in USAGE_COLUMNS]
    attempt = [e.attempt for e in events]
    prompt = [e.num_prompt_tokens for e in events]
    completion = [e.num_completion_tokens for e in events]
    cached = [e.num_cached_tokens for e in events]
    counts = (attempt, prompt, completion, cached)
    if any(min(column) < 0 or max(column) > MAX_COUNT for column in counts):
        for event in events:
            check_storable(event)  # raises, naming the field
    values = _VALUES
    return [
        [e.tenant_id for e in events],
        [e.session_id for e in events],
        [e.request_id for e in events],
        attempt,
        [e.model for e in events],
        [e.adapter or "" for e in events],
        [e.worker_id or "" for e in events],
        [e.priority for e in events],
        [values[e.status] for e in events],
        [values[e.finish_reason] if e.finish_reason is not None else "" for e in events],
        prompt,
        completion,
        cached,
        [e.queue_ms for e in events],
        [e.ttft_ms for e in events],
        [e.total_ms for e in events],
        [e.error_code or "" for e in events],
        [e.overload_tier for e in events],
        [e.precision for e in events],
        [e.flags for e in events],
        [c[0] for c in charges],
        [c[1] for c in charges],
        [c[2] for c in charges],
        [c[3] for c in charges],
        [e.key_sha256 or "" for e in events],
        [e.batch_id or "" for e in events],
        millis([e.created_at for e in events]),
        millis([e.finished_at for e in events]),
    ]


def millis(column: Sequence[datetime]) -> list[int]:
    """DateTime64(3) ticks of each instant, as clickhouse-connect computes them:
    milliseconds since the epoch, rounded down; a naive instant is taken as UTC."""
    epoch, millisecond = _EPOCH, _MILLISECOND
    try:
        return [(at - epoch) // millisecond for at in column]  # aware, as producers send
    except TypeError:  # a naive one among them
        return [
            ((at if at.tzinfo is not None else at.replace(tzinfo=UTC)) - epoch) // millisecond
            for at in column
        ]


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MILLISECOND = timedelta(milliseconds=1)

_VALUES: dict[UsageStatus | FinishReason, str] = {
    member: member.value for enum in (UsageStatus, FinishReason) for member in enum
}
"""Each status and finish reason --> its text: a lookup, not an enum property per row."""
