"""The row path, kept as the tests' oracle for the sink's column path.

A ``usage_events`` row per event (``usage_row``), a plan of rows (``plan_insert``), and
rows written through clickhouse-connect's own row insert (``insert_rows``, its own
conversions of datetimes and Decimals): plainly what the sink's columns
(``billing.rows.usage_columns``, ``billing.dedup.plan_keyed_columns``) must equal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from billing.dedup import Attempt, UsageKey, dedup_token, usage_key
from billing.rows import USAGE_COLUMNS, check_storable
from billing.storage import ClickHouseStore
from billing.usage_codec import Usage
from tokenbus.pricing import Charge, Pricer


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
        event.status.value,
        event.finish_reason.value if event.finish_reason is not None else "",
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
        event.batch_id or "",
        _utc(event.created_at),
        _utc(event.finished_at),
    )


@dataclass(frozen=True)
class InsertPlan:
    rows: list[tuple[Any, ...]]
    dedup_token: str
    num_known: int
    attempts: list[Attempt] = field(default_factory=list)


def plan_insert(events: Sequence[Usage], existing: set[UsageKey], pricer: Pricer) -> InsertPlan:
    """Rows for the events whose key is not in ``existing`` (``events`` are first copies)."""
    return plan_keyed_insert([(usage_key(event), event) for event in events], existing, pricer)


def plan_keyed_insert(
    keyed: Sequence[tuple[UsageKey, Usage]], existing: set[UsageKey], pricer: Pricer
) -> InsertPlan:
    new = [(key, event) for key, event in keyed if key not in existing]
    rows = [usage_row(event, pricer.charge(event)) for _, event in new]
    attempts = [(key, event.created_at) for key, event in new]
    return InsertPlan(rows, dedup_token([key for key, _ in new]), len(keyed) - len(new), attempts)


def insert_rows(
    store: ClickHouseStore, rows: Sequence[tuple[Any, ...]], *, dedup_token: str
) -> None:
    """The rows as one block, through clickhouse-connect's row insert and its own
    conversions (the table's types, read from it), with the sink's deduplication."""
    with store._lock:
        store._client.insert(
            "usage_events",
            list(rows),
            column_names=USAGE_COLUMNS,
            settings={"insert_deduplicate": 1, "insert_deduplication_token": dedup_token},
        )


def ticks(at: datetime) -> int:
    """DateTime64(3) ticks, as clickhouse-connect computes them: milliseconds since the
    epoch, rounded down; a naive datetime is taken as UTC."""
    return ((at if at.tzinfo is not None else at.replace(tzinfo=UTC)) - _EPOCH) // _MILLISECOND


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MILLISECOND = timedelta(milliseconds=1)


def _utc(value: datetime) -> datetime:
    # clickhouse-connect reads a naive datetime in the host's zone; the bus speaks UTC.
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
